"""``step_vouch`` and ``step_apply`` (native/kvcore_scan.c) against the scheduler's Python
step checks and per-request loop.

Goal: ``build_step`` skips its per-request Python checks whenever the C pass vouches for
the step, so a C pass that vouches for one bad request lets it change the state (a
block id past the pool, a null or a repeated FULL block, a hash of another length, too
few blocks for the computed tokens), and one that never vouches silently costs every
step its Python checks again. On hook-built steps the two must agree exactly: the C
pass vouches if and only if the Python checks accept, with the same hash length. On
objects of any other type (a subclass, a list where a tuple was built, a bool id set
behind the frozen dataclass's back) it must decline, so the Python path reads them.

Mutants these kill: ``v > limit`` for ``v >= limit``; the FULL group's null test or
its distinct test dropped; ``<=`` for ``<`` in the block count; the preempted request's
early accept dropped or taken before its ids are read; the finished test dropped; the
hash length compared with nothing, or the hash count left out; any exact-type test
loosened to its subclass-accepting form; and the scheduler ignoring the answer.

``step_apply`` then applies the vouched step's blocks and, with checks off, moves the
cursors of the requests whose store step is quiet; the Python store path runs for the
rest. Each of these mutants of it was tried and fails a test below: a window placement
skipped, a resumed request's tables extended instead of rebuilt, a request with a load in
flight or with its own cap taken as quiet, a scheduled-and-preempted request stored, a
quiet cursor not written, the draft cap off by one, a kept offset missed at a span's
edge, the segment short cut taken for a partial segment. (Packing every table extend,
or none, changes no table: equivalent.)
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from bad_input_layout import CFG, hashes
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcore._scan import quiet_step
from kvcore.manager import CPUOffloadManager
from kvcore.presets import PRESETS, preset
from kvcore.scheduler import scheduler as scheduler_module
from kvcore.scheduler._rules import quiet_cursors
from kvcore.scheduler.scheduler import OffloadScheduler
from kvcore.sim import SimOptions, Simulator
from kvcore.sim._lockstep import plain
from kvcore.sim._snapshot import snapshot
from kvcore.spec.errors import BlockIdError, KVCoreError
from kvcore.spec.hooks import RequestInfo, ScheduledRequest, StepInput, WorkerReport
from kvcore.spec.types import GroupKind, GroupSpec, KeptOffsets, OffloadConfig

A, B, F = hashes(8), hashes(8, seed=1), hashes(8, seed=2)
LIMIT = CFG.num_gpu_blocks


def history() -> OffloadScheduler:
    """'a' holds 4 blocks a group and 4 hashes; 'b' was added with 2 hashes and holds
    nothing; 'f' stored and finished with its store in flight, so it is still tracked
    (finished) and every hook must refuse it."""
    s = OffloadScheduler(CFG, CPUOffloadManager(CFG.num_cpu_blocks))
    s.add_request(RequestInfo("a", 16, A[:4]))
    s.add_request(RequestInfo("b", 8, B[:2]))
    s.add_request(RequestInfo("f", 8, F[:2]))
    for rid, tokens in (("a", 16), ("b", 8), ("f", 8)):
        s.lookup(rid, 0, tokens)
    first = StepInput((ScheduledRequest("a", 16, 0, 16, ((1, 2, 3, 4), (5, 6, 7, 8))),
                       ScheduledRequest("f", 8, 0, 8, ((11, 12), (13, 14)))),
                      (), frozenset({1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14}))
    assert s.build_step(first).stores
    s.request_finished("f")
    assert s._reqs["f"].finished
    return s


def vouch(s: OffloadScheduler, step: StepInput) -> int:
    return scheduler_module.step_vouch(step.requests, s._reqs, step.preempted,
                                       s._vouch_layout, s._hash_len or 0)


def python_checks(s: OffloadScheduler, step: StepInput) -> int | type[Exception] | None:
    """What ``_validate_step`` answers with the C pass declining: the hash length, or
    the class of the error it raises."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(scheduler_module, "step_vouch", lambda *a: -1)
        try:
            return s._validate_step(step)[0]
        except KVCoreError as e:
            return type(e)


# Ids around every edge the checks draw: the null block, the last real block, the first
# past the pool, and repeats (few values, so a table often holds one twice).
IDS = st.lists(st.sampled_from([0, 1, 31, 32, LIMIT - 1, LIMIT, LIMIT + 1]),
               max_size=3).map(tuple)
# Per request, a step the checks accept ('a' decodes one block, 'b' prefills two, 'f'
# is finished): each field is kept or redrawn, so most examples change one or two things.
BASE = {"a": (4, 16, 20, 1), "b": (8, 0, 8, 2), "f": (4, 8, 12, 1), "gone": (4, 0, 4, 1)}


@st.composite
def scheduled(draw: Any, rid: str) -> ScheduledRequest:
    scheduled_tokens, computed, num_tokens, blocks = BASE[rid]
    def kept(value: Any, other: st.SearchStrategy[Any]) -> Any:
        return value if draw(st.integers(0, 3)) else draw(other)
    fresh = tuple(tuple(range(10 * g + 40, 10 * g + 40 + blocks)) for g in range(2))
    new_ids = kept(fresh, st.sampled_from([0, 1, 2, 3]).flatmap(
        lambda n: st.tuples(*[IDS] * n)))
    size = kept(8, st.just(16))
    source = {"a": A, "b": B, "f": F}.get(rid, A)
    count = kept(1 if rid != "b" else 0, st.integers(0, 3))
    new_hashes = tuple(h * (size // 8) for h in source[4:4 + count])
    return ScheduledRequest(rid, kept(scheduled_tokens, st.integers(0, 12)),
                            kept(computed, st.integers(0, 24)),
                            kept(num_tokens, st.integers(0, 36)), new_ids, new_hashes,
                            kept(False, st.just(True)))


@st.composite
def steps(draw: Any) -> StepInput:
    rids = draw(st.lists(st.sampled_from(["a", "b", "a", "b", "f", "gone"]), unique=True,
                         min_size=1, max_size=4))
    requests = tuple(draw(scheduled(rid)) for rid in rids)
    preempted = draw(st.sets(st.sampled_from([r for r in rids if r in "ab"] or ["a"])))
    return StepInput(requests, tuple(preempted), frozenset())


def one(rid: str = "a", new_ids: Any = ((31,), (32,)), **kw: Any) -> StepInput:
    scheduled_tokens, computed, num_tokens, _ = BASE[rid]
    fields = {"scheduled_tokens": scheduled_tokens, "computed_tokens": computed,
              "num_tokens": num_tokens, "new_hashes": A[4:5], **kw}
    return StepInput((ScheduledRequest(rid, new_block_ids=new_ids, **fields),), (),
                     frozenset())


@settings(max_examples=400, deadline=None)
@given(step=steps())
@example(step=one(new_ids=((LIMIT - 1,), (LIMIT - 1,))))  # the last real block
@example(step=one(new_ids=((31,), (LIMIT,))))  # past the pool, in a window group
@example(step=one(new_ids=((31, 31), (32,))))  # a FULL block twice
@example(step=one(new_ids=((31,), (32, 32))))  # a window block twice: fine
@example(step=one(new_ids=((0,), (32,))))  # the null block in a FULL group
@example(step=one(new_ids=((31,), (0,))))  # ... in a window group: fine
def test_the_c_pass_vouches_exactly_when_the_python_checks_accept(step: StepInput) -> None:
    s = history()
    python = python_checks(s, step)
    answer = vouch(s, step)
    if isinstance(python, type):
        assert answer == -1, f"vouched for a step the Python checks refuse ({python})"
    else:
        assert answer >= 0, "declined a step the Python checks accept"
        assert (answer or None) == python


def decode(rid: str = "a", **kw: Any) -> ScheduledRequest:
    fields: dict[str, Any] = {"scheduled_tokens": 4, "computed_tokens": 16,
                              "num_tokens": 20, "new_block_ids": ((31,), (32,)),
                              "new_hashes": A[4:5], **kw}
    return ScheduledRequest(rid, **fields)


def test_a_decode_step_is_vouched_for_and_the_scheduler_takes_the_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = history()
    step = StepInput((decode(),), (), frozenset({31, 32}))
    assert vouch(s, step) == 8
    calls: list[object] = []
    original = OffloadScheduler._validate_scheduled

    def counted(self: OffloadScheduler, *a: Any) -> Any:
        calls.append(a)
        return original(self, *a)

    monkeypatch.setattr(OffloadScheduler, "_validate_scheduled", counted)
    s.build_step(step)
    assert calls == [], "the Python checks ran although the C pass vouched"
    assert s._hash_len == 8


class SubRequest(ScheduledRequest):
    pass


class SubDict(dict):  # type: ignore[type-arg]
    pass


def hostile(case: str, s: OffloadScheduler) -> tuple[Any, Any, Any]:
    """(requests, states, preempted) with one object not of its exact type."""
    sr = decode()
    states: Any = s._reqs
    if case == "request subclass":
        sr = SubRequest(**{f: getattr(sr, f) for f in sr.__dataclass_fields__})
    elif case == "ids as lists":
        object.__setattr__(sr, "new_block_ids", [[31], [32]])
    elif case == "a bool id":
        object.__setattr__(sr, "new_block_ids", ((True,), (32,)))
    elif case == "a negative id":
        object.__setattr__(sr, "new_block_ids", ((-1,), (32,)))
    elif case == "an id past 2**63":
        object.__setattr__(sr, "new_block_ids", ((2**64 + 5,), (32,)))
    elif case == "a bytearray hash":
        object.__setattr__(sr, "new_hashes", (bytearray(A[4]),))
    elif case == "hashes as a list":
        object.__setattr__(sr, "new_hashes", [A[4]])
    elif case == "tokens as a float":
        object.__setattr__(sr, "num_tokens", 20.0)
    elif case == "resumed as 1":
        object.__setattr__(sr, "resumed", 1)
    elif case == "ids as a list of tuples":
        object.__setattr__(sr, "new_block_ids", ((31,), [32]))
    elif case == "tokens summing past 2**63":
        # Each below 2**63, as no hook would build them: computed + scheduled overflows
        # a C long long, and a wrapped (negative) frontier would pass every block count.
        object.__setattr__(sr, "computed_tokens", 2**62)
        object.__setattr__(sr, "scheduled_tokens", 2**62)
    elif case == "requests a list":
        return [sr], states, ()
    elif case == "a request id subclass":
        object.__setattr__(sr, "request_id", type("S", (str,), {})("a"))
    elif case == "states a dict subclass":
        states = SubDict(s._reqs)
    elif case == "tables a tuple":
        s._reqs["a"].tables = tuple(s._reqs["a"].tables)  # type: ignore[assignment]
    elif case == "a table a list":
        s._reqs["a"].tables[0] = list(s._reqs["a"].tables[0])  # type: ignore[call-overload]
    elif case == "a table an array subclass":
        s._reqs["a"].tables[0] = type("A", (array,), {})("i", s._reqs["a"].tables[0])
    elif case == "hash size a bool":
        s._reqs["a"].hashes.size = True
    elif case == "finished as 0":
        s._reqs["a"].finished = 0  # type: ignore[assignment]
    elif case == "preempted a frozenset":
        return (sr,), states, frozenset({"b"})
    elif case == "a preempted id a str subclass":
        return (sr,), states, (type("S", (str,), {})("b"),)
    return (sr,), states, ()


HOSTILE = ["request subclass", "ids as lists", "ids as a list of tuples",
           "tokens summing past 2**63", "requests a list", "a bool id", "a negative id",
           "an id past 2**63", "a bytearray hash", "hashes as a list", "tokens as a float",
           "resumed as 1", "a request id subclass", "states a dict subclass",
           "tables a tuple", "a table a list", "a table an array subclass",
           "hash size a bool", "finished as 0", "preempted a frozenset",
           "a preempted id a str subclass"]


@pytest.mark.parametrize("case", HOSTILE)
def test_the_c_pass_declines_what_is_not_of_its_exact_type(case: str) -> None:
    s = history()
    assert scheduler_module.step_vouch((decode(),), s._reqs, ("b",), s._vouch_layout,
                                       0) == 8, "the plain request is vouched for"
    requests, states, preempted = hostile(case, s)
    assert scheduler_module.step_vouch(requests, states, preempted, s._vouch_layout,
                                       0) == -1


@pytest.mark.parametrize("layout", [
    (), "x", (ScheduledRequest,) * 8,
    lambda lay: (*lay[:4], 0, *lay[5:]),
    lambda lay: (*lay[:6], (4, 0), *lay[7:]),
    lambda lay: (*lay[:6], (4,), *lay[7:]),
    lambda lay: (*lay[:7], (1, 0)),
])
def test_a_malformed_layout_is_a_value_error(layout: Any) -> None:
    s = history()
    if callable(layout):
        layout = layout(s._vouch_layout)
    with pytest.raises(ValueError, match="step_vouch: layout"):
        scheduler_module.step_vouch((), s._reqs, (), layout, 0)


def test_a_hostile_request_still_gets_the_python_checks_error() -> None:
    """Declining is not accepting: the Python path then raises the kvcore error, and the
    request before the bad one is not applied."""
    s = history()
    bad = decode()
    object.__setattr__(bad, "new_block_ids", [(LIMIT,), (32,)])
    fine = decode("b", computed_tokens=0, scheduled_tokens=8, num_tokens=8,
                  new_block_ids=((40, 41), (42, 43)), new_hashes=())
    with pytest.raises(BlockIdError, match=r"new_block_ids\[0\]\[0\]"):
        s.build_step(StepInput((fine, bad), (), frozenset()))
    assert len(s._reqs["b"].tables[0]) == 0


# -- step_apply: the rest of the per-request loop ----------------------------------------


class Recording(OffloadScheduler):
    """Keeps every step's plan and every request's state after it, as plain data (the
    state, not only the plans: a quiet cursor left behind is offered the same skipped
    chunks again later, so the plans alone would not show it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plans: list[Any] = []

    def build_step(self, step: StepInput) -> Any:
        plan = super().build_step(step)
        self.plans.append((plain(plan), snapshot(self._reqs)))
        return plan


def run(name: str, python: bool, check: bool, **options: Any) -> tuple[Any, Any, int]:
    """One seeded simulator run's plans and final scheduler state, and how many steps
    the C passes took, with them on or forced off (``python``)."""
    took = [0]
    real = scheduler_module.step_apply

    def counted(*a: Any) -> Any:
        took[0] += 1
        return real(*a)

    base: dict[str, Any] = {"seed": 3, "requests": 14, "context_tokens": 300,
                            "max_new_tokens": 40, "preempt_rate": 0.2, **options}
    with pytest.MonkeyPatch.context() as m:
        if python:
            m.setattr(scheduler_module, "step_vouch", lambda *a: -1)
        m.setattr(scheduler_module, "step_apply", counted)
        sim = Simulator(preset(name), SimOptions(**base), check=check,
                        scheduler_factory=Recording)
        sim.run()
    sched = sim.scheduler
    assert isinstance(sched, Recording)
    return sched.plans, snapshot(sched), took[0]


@pytest.mark.parametrize(("name", "check", "options"), [
    ("deepseek-v4-mtp", False, {}),
    ("deepseek-v4-mtp", True, {}),
    ("llama3-eagle3", False, {"policy": "arc"}),
    ("gpt-oss", False, {"max_offload_tokens": 200}),
    ("qwen3-next-mtp", False, {"request_cap_rate": 0.5}),
    ("gemma3", False, {"prompt_only": True}),
    # Shared prefixes and late reports: loads stay in flight while their requests go on
    # prefilling and decoding, and every other request has its own cap on U; both must
    # keep the Python store path (a load in flight moves no cursor; a cap lowers U).
    ("deepseek-v4-mtp", False, {"shared_prefix_rate": 1.0, "delay_rate": 0.8,
                                "request_cap_rate": 0.5, "prefill_budget": 64,
                                "seed": 5}),
])
def test_the_c_passes_leave_every_plan_and_state_as_the_python_loop_does(
        name: str, check: bool, options: dict[str, Any]) -> None:
    """Goal: step_apply applies blocks and moves quiet cursors exactly as
    ``_apply_blocks`` and ``_store_step`` do, over whole workloads (preemptions with
    their resent tables, caps, late reports, checks on and off)."""
    c_plans, c_state, took = run(name, python=False, check=check, **options)
    py_plans, py_state, none = run(name, python=True, check=check, **options)
    assert took >= len(c_plans) // 2 > 0 and none == 0
    assert c_plans == py_plans
    assert c_state == py_state


QUIET_SHAPES = st.lists(st.tuples(st.integers(1, 8), st.booleans(), st.integers(0, 6)),
                        min_size=1, max_size=4)


@st.composite
def quiet_cases(draw: Any) -> tuple[Any, Any, list[int], int, int]:
    """A quiet layout in both forms (the Python rule's shape, the C pass's) with cursors,
    frontier and storable."""
    py_shape, c_shape = [], []
    for tokens, draft, period in draw(QUIET_SHAPES):
        if period == 0:
            py_shape.append((tokens, draft, None))
            c_shape.append((tokens, draft, 0, ()))
            continue
        cuts = sorted(draw(st.lists(st.integers(0, period), max_size=4)))
        spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b]
        kept = KeptOffsets.of(period, spans)
        py_shape.append((tokens, draft, (period, kept)))
        c_shape.append((tokens, draft, period, kept.spans))
    frontier = draw(st.integers(0, 80))
    storable = draw(st.integers(0, frontier))
    cursors = [draw(st.integers(0, 12)) for _ in py_shape]
    return tuple(py_shape), tuple(c_shape), cursors, frontier, storable


@settings(max_examples=500, deadline=None)
@given(case=quiet_cases())
def test_the_c_quiet_rule_answers_as_quiet_cursors(case: Any) -> None:
    """Kills: the draft cap dropped or off by one, ``<`` for ``<=`` in the passed test,
    the segment short cut taken for a partial segment, a kept offset missed at a span's
    edge, the cursor not moved."""
    py_shape, c_shape, cursors, frontier, storable = case
    assert quiet_step(c_shape, cursors, frontier, storable) == \
        quiet_cursors(py_shape, cursors, frontier, storable)


def test_the_schedulers_quiet_layout_is_its_store_shape() -> None:
    for name in PRESETS:
        s = OffloadScheduler(preset(name), CPUOffloadManager(64))
        window, shape, pack_from = s._apply_layout
        assert window == tuple(g.kind is not GroupKind.FULL for g in s.config.groups)
        assert pack_from == scheduler_module._PACK_FROM
        for (tokens, draft, period, spans), (t, d, rule) in zip(
                shape, s._store_shape, strict=True):
            assert (tokens, draft) == (t, d)
            assert (period, spans) == ((0, ()) if rule is None else (rule[0], rule[1].spans))


@pytest.mark.parametrize("layout", [(), ((1, True, 0, ()),) * 65, ((0, True, 0, ()),),
                                    ((1, 1, 0, ()),), ((1, True, -1, ()),),
                                    ((1, True, 4, [(0, 1)]),), ((1, True, 4, ((0,),)),),
                                    ((1, True, 4, ((0, -1),)),), ((1, True, 4),)])
def test_a_malformed_quiet_layout_is_a_value_error(layout: Any) -> None:
    with pytest.raises(ValueError, match="quiet layout"):
        quiet_step(layout, [0] * max(len(layout), 1), 0, 0)


def both(make: Any) -> None:
    """One step on two copies of ``history()``, through the C passes and through the
    Python loop: the same plan (or the same error) and the same request state after."""
    out = []
    for python in (False, True):
        s = history()
        with pytest.MonkeyPatch.context() as m:
            if python:
                m.setattr(scheduler_module, "step_vouch", lambda *a: -1)
            try:
                result: Any = plain(s.build_step(make()))
            except KVCoreError as e:
                result = type(e)
        out.append((result, snapshot(s._reqs)))
    assert out[0] == out[1]


def test_a_resumed_request_has_its_tables_rebuilt_not_extended() -> None:
    """'a' holds 4 blocks a group; resumed, it resends all 5: 5 it must hold, not 9."""
    both(lambda: StepInput((decode(new_block_ids=((1, 2, 3, 4, 31), (5, 6, 7, 8, 32)),
                                   resumed=True),), (), frozenset({31, 32})))


def test_a_request_scheduled_and_preempted_in_one_step_stores_nothing() -> None:
    """Its blocks are applied to the cleared tables, and its store step never runs."""
    both(lambda: StepInput((decode("b", computed_tokens=0, scheduled_tokens=8,
                                   num_tokens=8, new_block_ids=((40, 41), (42, 43)),
                                   new_hashes=()),),
                           ("b",), frozenset({40, 41, 42, 43})))


def test_a_request_whose_load_is_in_flight_moves_no_cursor() -> None:
    """A quiet step of a request whose load is still in flight leaves its cursors where
    the load put them (``_store_step`` returns before the quiet rule): here the window
    group's chunk 4, which its keep rule skips, would otherwise be passed."""
    cfg = OffloadConfig((GroupSpec(GroupKind.FULL, 4, blocks_per_chunk=4),
                         GroupSpec(GroupKind.SLIDING, 4, window_tokens=4)),
                        hash_block_tokens=4, num_gpu_blocks=64, num_cpu_blocks=64,
                        num_workers=1)
    prompt = hashes(10, seed=3)
    out = []
    for python in (False, True):
        s = OffloadScheduler(cfg, CPUOffloadManager(cfg.num_cpu_blocks))
        s.add_request(RequestInfo("a", 32, prompt[:8]))
        assert s.lookup("a", 0, 32) == 0
        ids = (tuple(range(1, 9)), tuple(range(11, 19)))
        plan = s.build_step(StepInput((ScheduledRequest("a", 32, 0, 32, ids),), (),
                                      frozenset(ids[0] + ids[1])))
        s.worker_output([WorkerReport(0, p.job_id) for p in plan.stores])
        s.add_request(RequestInfo("b", 40, prompt))
        assert s.lookup("b", 0, 40) == 32
        tables = (tuple(range(21, 30)), (0,) * 7 + tuple(range(37, 39)))
        assert s.after_alloc("b", tables, (0, 0), 0, 32) is not None
        with pytest.MonkeyPatch.context() as m:
            if python:
                m.setattr(scheduler_module, "step_vouch", lambda *a: -1)
            step = s.build_step(StepInput((ScheduledRequest("b", 4, 32, 36, tables),), (),
                                          frozenset(tables[0] + tables[1][7:])))
        out.append((plain(step), list(s._reqs["b"].cursors)))
    assert out[0] == out[1]
    assert out[1][1] == [2, 8]


def test_cursors_that_are_not_the_schedulers_list_take_the_python_store_path() -> None:
    """A request's cursors replaced by a tuple, or holding a bool: the C pass leaves the
    store step to Python (which reads them as it always does) instead of raising after
    the blocks were applied."""
    def settled() -> OffloadScheduler:
        s = history()
        s.worker_output([WorkerReport(w, job) for job in list(s._jobs.jobs)
                         for w in range(CFG.num_workers)])
        return s

    plain_list = settled()
    plain_list._reqs["a"].cursors = [5, 5]  # the chunks below token 20 passed: quiet
    assert scheduler_module.step_apply((decode(),), plain_list._reqs, (),
                                       plain_list._apply_layout, 1, True) == []
    for odd in ((5, 5), type("Cursors", (list,), {})([5, 5]), [True, 5]):
        s = settled()
        s._reqs["a"].cursors = odd  # type: ignore[assignment]
        assert scheduler_module.step_apply((decode(),), s._reqs, (), s._apply_layout,
                                           s._stale.step, True) == [0]
        assert s._reqs["a"].hashes.size == 5


def test_step_apply_reads_only_the_steps_own_tuple() -> None:
    """Its callers pass ``StepInput.requests``; anything else (a list could change while
    the Python calls it makes run) is refused before anything is applied."""
    s = history()
    with pytest.raises(RuntimeError, match="changed after step_vouch"):
        scheduler_module.step_apply([decode()], s._reqs, (), s._apply_layout, 1, True)
    assert s._reqs["a"].hashes.size == 4
