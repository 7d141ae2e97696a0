"""Refinement: ``OffloadScheduler`` answers exactly as the reference model, for random engines.

Goal: show that the implementation refines ``kvcore.spec.model.ReferenceScheduler`` for
every hook: lookup answers, load and store transfer plans (job ids, keys, GPU ids,
block_index, CPU slots), flush sets, worker-output results, events, cursors, stats, and
the CPU tier's contents; and that no invariant breaks, whether judged by the spec's own
predicates (the implementation runs with ``check=True``) or by the fake engine's witness,
which checks stale blocks, the fence, E1 and J2 from the engine's side.

Method: a Hypothesis ``RuleBasedStateMachine``. ``initialize`` draws a configuration (a
scaled-down preset or a random mix of one to four FULL, SLIDING and MAMBA groups with
draft flags, windows, ``blocks_per_chunk`` 1-4, ``num_workers`` 1-4, a CPU tier of a few
chunks so eviction and "no room" happen) and an engine (prefill chunk, MTP draft tokens,
a GPU pool of one to three requests' worth of blocks, so preemption and block reuse
happen). Rules are thin: each draws a choice and hands it to the fake engine
(``_engine.Engine``), which drives both schedulers through ``_lockstep.Lockstep``:
requests arrive with prompts that share prefixes, are admitted (lookup, allocation,
``after_alloc``), stepped (chunked prefill, MTP decode with random acceptance), preempted,
aborted; worker reports arrive late, out of order, sometimes failed; duplicated reports
and reports for unknown jobs must raise and change nothing; the CPU tier is reset. The
invariant compares the drained events. A failure prints as a replayable program.

Regression tests follow the machine: partial window chunks (a null sub-block) were once
stored, breaking S2 or leaving CPU sub-blocks unwritten that a later load read; and the
reference once touched only ``W + e`` window chunks at a lookup, ignoring
``extra_retained_tokens``, so the LRU order of the two sides parted (the model was wrong).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from refinement._engine import Engine, chain_hashes

from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import (
    BadReportError,
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    UnknownJobError,
    WorkerReport,
)
from kvcore.sim._lockstep import Lockstep, observable
from kvcore.spec.model import ReferenceScheduler
from kvcore.spec.types import PENDING, GroupKind, GroupSpec, OffloadConfig, StoreLevel

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA


def _preset_groups() -> dict[str, tuple[tuple[GroupSpec, ...], int]]:
    """The presets' layouts at test scale (block sizes shrunk, structure kept)."""
    return {
        "llama3-eagle3": ((GroupSpec(FULL, 4, is_draft=True),), 4),
        "deepseek-v3-mtp": ((GroupSpec(FULL, 2, blocks_per_chunk=2, is_draft=True),), 2),
        "deepseek-v4-mtp": ((GroupSpec(FULL, 16),
                             GroupSpec(SLIDING, 4, window_tokens=8, is_draft=True),
                             GroupSpec(SLIDING, 1, window_tokens=2),
                             GroupSpec(SLIDING, 2, window_tokens=8)), 1),
        "gemma3": ((GroupSpec(FULL, 4), GroupSpec(SLIDING, 4, window_tokens=16)), 4),
        "gpt-oss": ((GroupSpec(FULL, 4), GroupSpec(SLIDING, 4, window_tokens=8)), 4),
        "qwen3-next-mtp": ((GroupSpec(FULL, 4, is_draft=True), GroupSpec(MAMBA, 4)), 4),
    }


@st.composite
def random_groups(draw: st.DrawFn, speculative: bool) -> tuple[tuple[GroupSpec, ...], int]:
    """One to four groups of any kinds; MAMBA groups share one chunk size (config rule)."""
    groups: list[GroupSpec] = []
    mamba: tuple[int, int] | None = None
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from([FULL, SLIDING, MAMBA]))
        tpb = draw(st.sampled_from([1, 2, 2, 4]))
        bpc = draw(st.integers(1, 4))
        if kind is MAMBA:
            mamba = mamba or (tpb, bpc)
            tpb, bpc = mamba
        window = draw(st.integers(1, 24)) if kind is SLIDING else None
        extra = draw(st.sampled_from([0, 0, 1, 3])) if kind is SLIDING else 0
        draft = speculative and draw(st.booleans())
        groups.append(GroupSpec(kind, tpb, bpc, window, draft, extra))
    unit = math.gcd(*(g.tokens_per_chunk for g in groups))
    return tuple(groups), draw(st.sampled_from([d for d in (1, 2, 4, 8) if unit % d == 0]))


@st.composite
def configs(draw: st.DrawFn) -> OffloadConfig:
    name = draw(st.sampled_from([None, None, *sorted(_preset_groups())]))
    if name is None:
        speculative = draw(st.sampled_from([True, True, False]))
        groups, hbt = draw(random_groups(speculative))
    else:
        groups, hbt = _preset_groups()[name]
        speculative = any(g.is_draft for g in groups)
    blocks = sum(-(-MAX_LEN // g.tokens_per_block) for g in groups)
    chunks = sum(MAX_LEN // g.tokens_per_chunk for g in groups)
    return OffloadConfig(
        groups, hash_block_tokens=hbt,
        # One to three requests' worth of GPU blocks: preemption and block reuse happen.
        num_gpu_blocks=blocks * draw(st.integers(1, 3)) + 1,
        # From a few chunks (a step's offer may not fit: None) to a few requests' worth.
        num_cpu_blocks=max(1, chunks * draw(st.sampled_from([2, 4, 6, 8, 16])) // 8),
        num_workers=draw(st.integers(1, 4)),
        prompt_only=draw(st.booleans()),
        max_offload_tokens=draw(st.sampled_from([None, None, None, 0, 8, 24])),
        store_level=draw(st.sampled_from([StoreLevel.BLOCK, StoreLevel.REQUEST])),
        speculative=speculative,
        draft_kv_elsewhere=speculative and not any(g.is_draft for g in groups),
        store_alignment=draw(st.booleans()),
        name=name or "random",
        # Mostly the default; sometimes so small that events are dropped between drains.
        max_pending_events=draw(st.sampled_from([65_536, 65_536, 65_536, 3])))


MAX_PROMPT, MAX_NEW, MAX_REQUESTS = 40, 12, 6
MAX_LEN = MAX_PROMPT + 8 + MAX_NEW + 4  # prompt + suffix + output + MTP lookahead


PREFIXES = st.sampled_from([MAX_PROMPT, MAX_PROMPT, 32, 24, 16, 8, 3, 0])
# Warm-up prompts are never empty: drawn directly rather than filtered out of PREFIXES.
WARM_PREFIXES = st.sampled_from([MAX_PROMPT, MAX_PROMPT, 32, 24, 16, 8, 3])


def base_prompt(i: int) -> list[int]:
    """Three fixed prompts that requests take prefixes of, so keys collide across requests."""
    return [(i * 5 + j * j) % 11 for j in range(MAX_PROMPT)]


def rarely(n: int) -> st.SearchStrategy[bool]:
    """True once in ``n`` draws. Hypothesis favours small and boundary integers, so
    ``integers(0, n - 1) == 0`` would be true far more often; ``sampled_from`` with the
    rare value last also shrinks towards it being False."""
    return st.sampled_from([False] * (n - 1) + [True])


def note_lookup(result: object) -> None:
    event("lookup: " + ("PENDING" if result is PENDING else "hit" if result else "0"))


class SchedulerMachine(RuleBasedStateMachine):
    """Drives a fake engine over the implementation and the model in lockstep."""

    engine: Engine
    pair: Lockstep
    # Whether ``checks`` is drawn; a test that needs the runtime checks on in every run
    # (one expecting an invariant to fire first) sets this False.
    draw_checks = True

    @initialize(config=configs(), chunk=st.integers(2, 24), spec_tokens=st.integers(0, 3),
                warm_up=st.lists(st.tuples(st.integers(0, 2), WARM_PREFIXES),
                                 min_size=1, max_size=3),
                checks=st.booleans())
    def setup(self, config: OffloadConfig, chunk: int, spec_tokens: int,
              warm_up: list[tuple[int, int]], checks: bool = True) -> None:
        """Build both schedulers; ``warm_up`` requests (base prompt, length) then run to the
        end, so the CPU tier holds prefixes that later requests can hit. The
        implementation runs with its runtime checks on or off (``checks``): the fast
        paths taken only with checks off must answer as the reference too."""
        checks = checks or not self.draw_checks
        manager = CPUOffloadManager.for_config(config, check=checks,
                                               max_pending_events=config.max_pending_events)
        impl = OffloadScheduler(config, manager, check=checks)
        self.pair = Lockstep(impl, ReferenceScheduler(config))
        self.engine = Engine(config, self.pair, prefill_chunk=chunk, spec_tokens=spec_tokens)
        for base, length in warm_up:
            self.engine.arrive(base_prompt(base)[:length], 2)
        self.engine.run(max_steps=4 * MAX_LEN)
        self.pair.take_events()

    # -- requests -----------------------------------------------------------------------------
    # Rules without a precondition do nothing when there is nothing to act on: with
    # Hypothesis's swarm testing, preconditions that are often false end examples early.

    @rule(base=st.integers(0, 2), prefix=PREFIXES,
          suffix=st.lists(st.integers(0, 3), max_size=8), new_tokens=st.integers(1, MAX_NEW),
          follow=st.sampled_from([None, None, 0, 1]),
          max_offload=st.sampled_from([None, None, None, 4, 16]),
          skip_reading=st.sampled_from([False, False, False, True]))
    def arrive(self, base: int, prefix: int, suffix: list[int], new_tokens: int,
               follow: int | None, max_offload: int | None, skip_reading: bool) -> None:
        """A request whose prompt is a prefix of a base prompt, or (``follow``) of an earlier
        request's whole text, plus a few tokens: its keys collide with earlier ones."""
        if len(self.engine.unfinished()) >= MAX_REQUESTS:
            return
        earlier = list(self.engine.reqs.values())
        if follow is not None and earlier:
            text = earlier[-1 - follow % len(earlier)].tokens
        else:
            text = base_prompt(base)
        prompt = text[:prefix][:MAX_PROMPT] + suffix
        self.engine.arrive(prompt or [1], new_tokens, max_offload_tokens=max_offload,
                           skip_reading=skip_reading)

    @rule(pick=st.integers(0, 7), whole=st.booleans(), new_tokens=st.integers(1, MAX_NEW))
    def repeat(self, pick: int, whole: bool, new_tokens: int) -> None:
        """An earlier request's prompt (or, with ``whole``, its whole text) asked again: the
        hit reaches the lookup limit, which is unaligned when window groups exist."""
        earlier = list(self.engine.reqs.values())
        if earlier and len(self.engine.unfinished()) < MAX_REQUESTS:
            req = earlier[-1 - pick % len(earlier)]
            text = req.tokens if whole else req.tokens[:req.prompt_len]
            self.engine.arrive(text[:MAX_PROMPT + 8], new_tokens)

    @rule(pick=st.integers(0, 7), local_units=st.sampled_from([0, 1, 2]))
    def admit(self, pick: int, local_units: int) -> None:
        """One waiting request is looked up with a local GPU prefix hit, then allocated."""
        waiting = self.engine.waiting()
        if waiting:
            note_lookup(self.engine.admit(waiting[pick % len(waiting)], local_units))

    @rule(admit=st.booleans(), preempt=st.sampled_from([None, None, None, 0, 1]),
          accept=st.integers(0, 3), steps=st.integers(1, 3))
    def step(self, admit: bool, preempt: int | None, accept: int, steps: int) -> None:
        """Engine steps; with ``admit``, every waiting request is looked up before each."""
        for n in range(steps):
            for rid in self.engine.waiting() if admit else ():
                note_lookup(self.engine.admit(rid))
            running = self.engine.running()
            victims = (running[preempt % len(running)],) if running and preempt is not None \
                and n == 0 else ()
            plan = self.engine.step(victims, accept)
            for what, count in (("load", len(plan.loads)), ("store", len(plan.stores)),
                                ("flush", len(plan.flush)), ("preempt", len(victims))):
                if count:
                    event(f"step: {what}")

    @rule(pick=st.integers(0, 7), go=rarely(8))
    def abort(self, pick: int, go: bool) -> None:
        """Sometimes (an eighth of the draws) a request is aborted, whatever its state."""
        alive = self.engine.unfinished()
        if alive and go:
            self.engine.abort(alive[pick % len(alive)])

    # -- workers ------------------------------------------------------------------------------

    @rule(picks=st.lists(st.tuples(st.integers(0, 63), rarely(8)), max_size=8),
          rest=st.booleans())
    def deliver(self, picks: list[tuple[int, bool]], rest: bool) -> None:
        """Some pending reports in drawn order (an eighth of them fail), then with ``rest``
        every other pending report, successful, in reverse order."""
        pending = self.engine.pending_reports()
        if not pending:
            return
        chosen: dict[tuple[int, int], bool] = {}
        for index, fail in picks:
            chosen.setdefault(pending[index % len(pending)], not fail)
        for pair in reversed(pending) if rest else ():
            chosen.setdefault(pair, True)
        out = self.engine.deliver([(j, w, ok) for (j, w), ok in chosen.items()])
        for what, n in (("failed load", len(out.failed_loads)),
                        ("failed store", len(out.failed_stores)),
                        ("finished load", len(out.finished_loads)),
                        ("completed", len(out.completed))):
            if n:
                event(f"output: {what}")

    @rule(pick=st.integers(0, 63), same_batch=st.booleans())
    def duplicate_report(self, pick: int, same_batch: bool) -> None:
        """A report repeated in one batch, or one already counted: BadReportError, no change."""
        reported = [(j, w) for j, ws in sorted(self.engine.reported.items()) for w in ws]
        live = [p for p in self.engine.pending_reports() if p[0] in self.engine.live]
        if reported and not (same_batch and live):
            job, worker = reported[pick % len(reported)]
            self._rejected([WorkerReport(worker, job)], BadReportError)
        elif live:
            job, worker = live[pick % len(live)]
            self._rejected([WorkerReport(worker, job), WorkerReport(worker, job)],
                           BadReportError)

    @rule(settled=st.booleans(), pick=st.integers(0, 63))
    def unknown_report(self, settled: bool, pick: int) -> None:
        """A report for a job never issued or already settled: UnknownJobError, no change."""
        done = sorted(j for j in self.engine.settled if j >= self.engine.stale_below)
        job = done[pick % len(done)] if settled and done else self.engine.next_job_id + pick
        self._rejected([WorkerReport(0, job)], UnknownJobError)

    def _rejected(self, batch: list[WorkerReport], error: type[Exception]) -> None:
        before = observable(self.pair.impl), observable(self.pair.model)
        try:
            self.pair.worker_output(batch)
        except error:
            pass
        else:
            raise AssertionError(f"{batch} was accepted; expected {error.__name__}")
        assert (observable(self.pair.impl), observable(self.pair.model)) == before

    @rule(go=rarely(16))
    def reset(self, go: bool) -> None:
        """Rarely (a sixteenth of the draws) the engine resets its prefix cache, between
        steps: never between an ``after_alloc`` and the ``build_step`` that issues its load."""
        if go and not self.engine.queued_loads:
            event("reset: jobs flushed" if self.engine.reset() else "reset: idle")

    def teardown(self) -> None:
        """Label the run by what happened in it (``--hypothesis-show-statistics``)."""
        if hasattr(self, "pair"):
            stats = self.pair.impl.stats()
            for name in ("loads", "stores", "failed_loads", "failed_stores", "deferrals",
                         "store_skipped_no_room"):
                event(f"run: {name} {'> 0' if getattr(stats, name) else '= 0'}")
            event(f"run: evictions {'> 0' if self.pair.impl.manager.stats().evictions else '= 0'}")

    @invariant()
    def events_agree(self) -> None:
        if hasattr(self, "pair"):
            self.pair.take_events()


SchedulerMachine.TestCase.settings = settings(
    settings.default, stateful_step_count=150, deadline=None)
TestSchedulerRefinement = SchedulerMachine.TestCase


@pytest.mark.parametrize("name", sorted(_preset_groups()))
def test_preset_layouts_are_valid(name: str) -> None:
    """Every test-scale preset builds, so a config error never hides inside a draw."""
    groups, hbt = _preset_groups()[name]
    cfg = OffloadConfig(groups, hbt, 64, 8, speculative=any(g.is_draft for g in groups))
    assert cfg.groups == groups


@pytest.mark.parametrize("make", [
    lambda cfg: ReferenceScheduler(cfg),
    lambda cfg: OffloadScheduler(cfg, CPUOffloadManager.for_config(cfg), check=True)],
    ids=["model", "implementation"])
def test_partial_chunk_is_never_stored(make: Any) -> None:
    """Regression (found by this machine; fixed in the store rule: only whole chunks are
    stored). A SLIDING group (window 2 tokens, 2 one-token blocks per chunk, a 2-chunk tier).
    Request 'b' fills the tier with two chunks being written, so 'a''s first offer of
    chunks 0 and 1 gets None. Then b's store completes, the engine frees a's positions
    0-2 (outside the window) and hands block 12 out again for position 4. The next
    offer evicts b's chunks and stores a's chunks 0 and 1; chunk 1 has lost position 2.
    Every stored chunk must be whole (all its blocks copied): the plan used to copy
    (10, 11, 13), putting position 3 into chunk 1's sub-block 0 (S2)."""
    cfg = OffloadConfig((GroupSpec(SLIDING, 1, blocks_per_chunk=2, window_tokens=2),),
                        hash_block_tokens=1, num_gpu_blocks=32, num_cpu_blocks=2)
    s = make(cfg)
    s.add_request(RequestInfo("b", 8, chain_hashes([1] * 8, 0, b"", 1)))
    s.add_request(RequestInfo("a", 8, chain_hashes([2] * 8, 0, b"", 1)))
    first = s.build_step(StepInput((ScheduledRequest("b", 4, 0, 8, ((1, 2, 3, 4),)),
                                    ScheduledRequest("a", 4, 0, 8, ((10, 11, 12, 13),))),
                                   (), frozenset({1, 2, 3, 4, 10, 11, 12, 13})))
    assert [p.request_id for p in first.stores] == ["b"]
    s.worker_output([WorkerReport(0, first.stores[0].job_id)])
    plan = s.build_step(StepInput((ScheduledRequest("a", 1, 4, 8, ((12,),)),), (),
                                  frozenset({12})))
    for store in plan.stores:
        for g in store.groups:
            assert len(g.gpu_block_ids) == 2 * len(g.keys), g


def test_load_reads_only_stored_sub_blocks() -> None:
    """Regression (fixed in the store rule: only whole chunks are stored). FULL chunks of 9
    one-token blocks and a SLIDING group (window 2, 4 blocks per chunk). Request A (14
    tokens) starts from a local prefix hit C = 10, so its window table is null below
    position 9. Window chunk 2 used to be stored from position 9, sub-block 0 never
    written, and request B (12 tokens, hit at T = 9, its window reaching back to position
    8) loaded that sub-block. Now the partial chunk is not stored, B gets no hit, and the
    engine's witness (no load of a sub-block no store wrote) holds throughout."""
    cfg = OffloadConfig((GroupSpec(FULL, 1, 9), GroupSpec(SLIDING, 1, 4, window_tokens=2)),
                        hash_block_tokens=1, num_gpu_blocks=64, num_cpu_blocks=16)
    impl = OffloadScheduler(cfg, CPUOffloadManager.for_config(cfg, check=True), check=True)
    e = Engine(cfg, Lockstep(impl, ReferenceScheduler(cfg)), prefill_chunk=8)
    a = e.arrive(list(range(14)), 1)
    assert e.admit(a, local_units=10) == 0
    assert [len(g.keys) for g in e.step().stores[0].groups] == [1, 0]
    e.deliver([(j, w, True) for j, w in e.pending_reports()])
    b = e.arrive(list(range(12)), 1)
    assert e.admit(b) == 0


def test_touch_covers_the_retained_reach() -> None:
    """Regression (found by the dev profile, hidden by CI's derandomized one; the model was
    wrong). FULL + SLIDING 2-token blocks, window 1 token, ``extra_retained_tokens`` 3, so
    the window reaches R = 3 tokens back: two chunks, not W = 1. Three 40-token warm-ups:
    each lookup touches the window keys from the reach before its boundary. The model
    touched from ``W + e`` chunks before it, leaving unrefreshed, at an aligned boundary,
    a chunk the lookup reads; "after lookup: CPU tier contents differ" (LRU order)."""
    cfg = OffloadConfig((GroupSpec(FULL, 2),
                         GroupSpec(SLIDING, 2, window_tokens=1, extra_retained_tokens=3)),
                        hash_block_tokens=1, num_gpu_blocks=65, num_cpu_blocks=48)
    machine = SchedulerMachine()
    machine.setup(cfg, chunk=2, spec_tokens=0, warm_up=[(0, 40)] * 3)
    machine.events_agree()
    impl, model = machine.pair.impl, machine.pair.model
    assert impl.stats().hit_tokens > 0  # the lookups hit, so the touch rule mattered
    for group, order in model.manager.recency.items():
        assert impl.manager.policy_of(group).order() == tuple(order)
