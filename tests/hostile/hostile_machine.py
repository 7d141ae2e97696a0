"""The hostile caller: random public-API sequences, about one call in five a bad one.

Run by ``test_hostile_api.py`` in a subprocess (``python hostile_machine.py``), so that a
crash in the copy library is seen as a signal rather than taking pytest down with it.

Valid traffic comes from the refinement suite's fake engine (``refinement._engine``):
requests arrive with shared prefixes, are looked up, allocated and loaded, stepped,
preempted and aborted; reports arrive late and sometimes failed; the tier is reset. Every
hook call it makes goes through ``Checked``, which counts it and requires it to succeed.
Each step's loads and stores are then executed by a real ``TransferEngine`` over CPU
tensors: before a store the engine "forward pass" writes each source block with bytes
derived from the chunk's key and sub-block, and after a load every filled block must
hold exactly those bytes (a wrong slot, a stale block or a lost byte shows up here).

Bad traffic (``bad_call``, ``bad_plan``): a call built from the current state with one
argument made wrong in a way that must be rejected whatever the state: a wrong type, an
out-of-range number, an unknown or duplicate id, a hash of the wrong type or length, a
block id outside the pool or a null in a FULL group, a bad report field; manager calls
with bad keys or flags; transfer plans with out-of-range or mismatched ids. Property:
a bad call raises an error class of ``kvcore.spec.errors`` (not ``InvariantViolation``)
and leaves the scheduler and its manager exactly as before (``state_snapshot``), a bad
plan finishes as a failed result with zero bytes and both tiers' bytes unchanged; no
call takes more than 5 s (SIGALRM), none is accepted. At the end the script prints a
``HOSTILE`` line with the call counts.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from refinement._engine import Engine

from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
)
from kvcore.sim._snapshot import snapshot
from kvcore.spec import errors
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan, sub_block_position
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
from kvcore.transfer import TransferEngine

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
CALL_SECONDS = 5
ROW = 8  # bytes per GPU block row
COUNTS: Counter[str] = Counter()

LAYOUTS = [
    (GroupSpec(FULL, 2, 2),),
    (GroupSpec(FULL, 2), GroupSpec(SLIDING, 2, window_tokens=4)),
    (GroupSpec(FULL, 2, 2), GroupSpec(MAMBA, 2, 2)),
]


class HangError(Exception):
    """A call ran past CALL_SECONDS."""


@contextmanager
def deadline(what: str) -> Iterator[None]:
    def expire(_sig: int, _frame: object) -> None:
        raise HangError(f"{what} ran past {CALL_SECONDS} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, CALL_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def is_kvcore_error(e: BaseException) -> bool:
    return type(e).__module__ == errors.__name__ and not isinstance(
        e, errors.InvariantViolation)


class Checked:
    """The scheduler behind the fake engine: every hook call counted and timed."""

    def __init__(self, sched: OffloadScheduler) -> None:
        self.sched = sched
        self.manager = sched.manager

    def _ok(self, name: str, *args: Any) -> Any:
        COUNTS["calls"] += 1
        with deadline(name):
            return getattr(self.sched, name)(*args)

    def add_request(self, info: Any) -> Any:
        return self._ok("add_request", info)

    def add_hashes(self, rid: Any, hashes: Any) -> Any:
        return self._ok("add_hashes", rid, hashes)

    def lookup(self, rid: Any, computed: Any, num_tokens: Any) -> Any:
        return self._ok("lookup", rid, computed, num_tokens)

    def after_alloc(self, *args: Any) -> Any:
        return self._ok("after_alloc", *args)

    def build_step(self, step: Any) -> Any:
        return self._ok("build_step", step)

    def worker_output(self, reports: Any) -> Any:
        return self._ok("worker_output", reports)

    def request_finished(self, rid: Any) -> Any:
        return self._ok("request_finished", rid)

    def reset(self) -> Any:
        return self._ok("reset")

    def take_events(self) -> Any:
        return self._ok("take_events")

    def reject(self, name: str, call: Callable[[], object]) -> None:
        """``call`` carries a bad argument: it must raise a kvcore error, changing nothing."""
        COUNTS["calls"] += 1
        COUNTS["bad"] += 1
        before = snapshot(self.sched)
        try:
            with deadline(name):
                call()
        except HangError:
            raise
        except Exception as e:
            if not is_kvcore_error(e):
                raise AssertionError(f"{name}: {type(e).__name__} is not a kvcore error: "
                                     f"{e}") from e
            if snapshot(self.sched) != before:
                raise AssertionError(f"{name}: rejected ({type(e).__name__}: {e}) but the "
                                     "state changed") from e
            COUNTS[f"rejected {type(e).__name__}"] += 1
            return
        raise AssertionError(f"{name}: a bad call was accepted")


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).tolist())


def chunk_bytes(key: bytes, sub: int) -> bytes:
    """What the forward pass wrote into sub-block ``sub`` of the chunk with ``key``."""
    return hashlib.blake2b(key + bytes((sub,)), digest_size=ROW).digest()


BadCall = Callable[["HostileMachine", st.DataObject], tuple[str, Callable[[], object]]]


def _tracked(m: HostileMachine) -> list[str]:
    return sorted(m.sched.tracked_requests())


def _some_rid(m: HostileMachine, data: st.DataObject) -> str:
    ids = _tracked(m)
    return data.draw(st.sampled_from(ids)) if ids else "r0"


def _step(*srs: Callable[[], ScheduledRequest], preempted: Any = (),
          allocated: Any = frozenset()) -> Callable[[HostileMachine], object]:
    return lambda m: m.sched.build_step(StepInput(tuple(f() for f in srs), preempted,
                                                  allocated))


def _sr(m: HostileMachine, rid: str, ids: Any = None, hashes: Any = (), **kw: Any
        ) -> Callable[[], ScheduledRequest]:
    n = len(m.config.groups)
    block_ids = ids if ids is not None else tuple((1,) for _ in range(n))
    args = {"scheduled_tokens": 1, "computed_tokens": 0, "num_tokens": 1, **kw}
    return lambda: ScheduledRequest(rid, new_block_ids=block_ids, new_hashes=hashes, **args)


def bad_calls(m: HostileMachine, data: st.DataObject) -> tuple[str, Callable[[], object]]:
    """One call that must be rejected, chosen from every hook and manager method."""
    s, n, top = m.sched, len(m.config.groups), m.config.num_gpu_blocks
    rid = _some_rid(m, data)
    full = next(g for g, spec in enumerate(m.config.groups) if spec.kind is FULL)
    h8 = b"h" * 8  # the fake engine's hashes are 8-byte blake2b digests

    def tables_with(g: int, v: int) -> tuple[tuple[int, ...], ...]:
        return tuple((v,) if i == g else (1,) for i in range(n))

    bad: dict[str, Callable[[], object]] = {
        "add_request str hash": lambda: s.add_request(RequestInfo("new", 4, ("x" * 8,))),
        "add_request int hash": lambda: s.add_request(RequestInfo("new", 4, (8,))),
        "add_request bytearray hash": lambda: s.add_request(
            RequestInfo("new", 4, (bytearray(8),))),
        "add_request wrong hash length": lambda: s.add_request(
            RequestInfo("new", 4, (b"x" * 5,) if s._hash_len else (b"x" * 5, h8))),
        "add_request negative prompt": lambda: s.add_request(RequestInfo("new", -2)),
        "add_request bool prompt": lambda: s.add_request(RequestInfo("new", True)),
        "add_request skip_reading str": lambda: s.add_request(
            RequestInfo("new", 4, skip_reading="no")),
        "add_request empty id": lambda: s.add_request(RequestInfo("", 4)),
        "add_request not a RequestInfo": lambda: s.add_request(("new", 4)),
        "add_request tracked id": lambda: s.add_request(RequestInfo(rid, 4)) if _tracked(m)
        else s.add_request(RequestInfo(3, 4)),  # type: ignore[arg-type]
        "add_hashes unknown": lambda: s.add_hashes("unknown", [h8]),
        "add_hashes str": lambda: s.add_hashes(rid, ["x" * 8]),
        "add_hashes wrong length": lambda: s.add_hashes(rid, [b"x" * 12]),
        "add_hashes bytes as list": lambda: s.add_hashes(rid, h8),
        "lookup unknown": lambda: s.lookup("unknown", 0, 2),
        "lookup negative": lambda: s.lookup(rid, -1, 2),
        "lookup bool": lambda: s.lookup(rid, 0, False),
        "lookup computed > tokens": lambda: s.lookup(rid, 3, 2),
        "lookup str id": lambda: s.lookup(b"r0", 0, 2),
        "after_alloc unknown": lambda: s.after_alloc("unknown", tables_with(0, 1), (0,) * n,
                                                     0, 2),
        "after_alloc negative load": lambda: s.after_alloc(rid, tables_with(0, 1), (0,) * n,
                                                           0, -2),
        "after_alloc id >= pool": lambda: s.after_alloc(rid, tables_with(0, top), (0,) * n,
                                                        0, 2),
        "after_alloc FULL null": lambda: s.after_alloc(rid, tables_with(full, 0), (0,) * n,
                                                       0, 2),
        "after_alloc bool id": lambda: s.after_alloc(rid, tables_with(0, True), (0,) * n,
                                                     0, 2),
        "after_alloc group count": lambda: s.after_alloc(rid, ((1,),) * (n + 1),
                                                         (0,) * (n + 1), 0, 2),
        "after_alloc load not the hit": lambda: s.after_alloc(rid, tables_with(0, 1),
                                                              (0,) * n, 0, 10**6),
    }
    bad.update(_later_calls(m, rid, full, tables_with))
    name = data.draw(st.sampled_from(sorted(bad)))
    return name, bad[name]


def _later_calls(m: HostileMachine, rid: str, full: int,
                 tables_with: Callable[[int, int], tuple[tuple[int, ...], ...]]
                 ) -> dict[str, Callable[[], object]]:
    """The bad build_step, worker_output, request_finished and manager calls."""
    s, top = m.sched, m.config.num_gpu_blocks
    job = min(m.engine.live) if m.engine.live else None
    unknown_job = m.engine.next_job_id + 1000
    h8 = b"h" * 8
    return {
        "build_step not a StepInput": lambda: s.build_step([]),
        "build_step duplicate": lambda: _step(_sr(m, rid), _sr(m, rid))(m),
        "build_step preempted twice": lambda: _step(preempted=(rid, rid))(m),
        "build_step allocated 0": lambda: _step(allocated={0})(m),
        "build_step allocated >= pool": lambda: _step(allocated={top})(m),
        "build_step allocated negative": lambda: _step(allocated={-1})(m),
        "build_step id >= pool": lambda: _step(_sr(m, rid, tables_with(0, top + 5)))(m),
        "build_step FULL null": lambda: _step(_sr(m, rid, tables_with(full, 0)))(m),
        "build_step str hash": lambda: _step(_sr(m, rid, hashes=("h" * 8,)))(m),
        "build_step wrong hash length": lambda: _step(_sr(m, rid, hashes=(b"h" * 3,)))(m),
        "build_step negative tokens": lambda: _step(_sr(m, rid, num_tokens=-1))(m),
        "build_step unknown": lambda: _step(_sr(m, "unknown"))(m),
        "worker_output job 0": lambda: s.worker_output([WorkerReport(0, 0)]),
        "worker_output str job": lambda: s.worker_output([WorkerReport(0, "1")]),
        "worker_output negative bytes": lambda: s.worker_output(
            [WorkerReport(0, job or unknown_job, bytes=-1)]),
        "worker_output success str": lambda: s.worker_output(
            [WorkerReport(0, job or unknown_job, success="no")]),
        "worker_output worker out of range": lambda: s.worker_output(
            [WorkerReport(m.config.num_workers, job or unknown_job)]),
        "worker_output unknown job": lambda: s.worker_output([WorkerReport(0, unknown_job)]),
        "worker_output twice in a batch": lambda: s.worker_output(
            [WorkerReport(0, job or unknown_job)] * 2),
        "worker_output not a report": lambda: s.worker_output([(0, 1)]),
        "request_finished unknown": lambda: s.request_finished("unknown"),
        "request_finished int": lambda: s.request_finished(0),
        "manager lookup str": lambda: s.manager.lookup("key"),
        "manager touch bytes": lambda: s.manager.touch(h8),
        "manager prepare_load absent": lambda: s.manager.prepare_load([b"never stored"]),
        "manager complete_load unpinned": lambda: s.manager.complete_load([b"never stored"]),
        "manager prepare_store str": lambda: s.manager.prepare_store(["key"]),
        "manager complete_store success str": lambda: s.manager.complete_store([h8], "no"),
    }


class HostileMachine(RuleBasedStateMachine):
    """The fake engine's traffic, bad calls among it, and real copies on CPU tensors."""

    config: OffloadConfig
    sched: OffloadScheduler
    engine: Engine
    transfer: TransferEngine
    gpu: list[torch.Tensor]

    @initialize(layout=st.sampled_from(range(len(LAYOUTS))), workers=st.integers(1, 2),
                check=st.booleans(), events=st.sampled_from([4, 65_536]),
                cpu_blocks=st.sampled_from([3, 12, 48]))
    def setup(self, layout: int, workers: int, check: bool, events: int,
              cpu_blocks: int) -> None:
        groups = LAYOUTS[layout]
        self.config = OffloadConfig(groups, hash_block_tokens=2, num_gpu_blocks=48,
                                    num_cpu_blocks=cpu_blocks, num_workers=workers,
                                    max_pending_events=events)
        manager = CPUOffloadManager.for_config(self.config, check=check,
                                               max_pending_events=events)
        self.sched = OffloadScheduler(self.config, manager, check=check)
        self.checked = Checked(self.sched)
        self.engine = Engine(self.config, self.checked, prefill_chunk=4)
        self.gpu = [torch.zeros((48, ROW), dtype=torch.uint8) for _ in groups]
        self.transfer = TransferEngine(self.config, [[t] for t in self.gpu])
        self.plan_ids = 10**6
        self._stored_then_asked_again()

    def _stored_then_asked_again(self) -> None:
        """One prompt run to the end, then asked again, so every example copies and checks
        a load: the random rules alone reach one only by chance (a dev-profile run of 40
        examples once checked no load at all, and the test's coverage assertion failed)."""
        # Short enough that the smallest tier (3 chunks) still holds its first chunk.
        length = 10 if self.config.num_cpu_blocks > 3 else 6
        tokens = [(7 * j + 1) % 5 for j in range(length)]
        before = COUNTS["loads checked"]
        for _ in range(2):
            rid = self.engine.arrive(tokens, 1)
            for _ in range(40):
                if self.engine.reqs[rid].state == "finished" and not self.engine.live:
                    break
                self.run(1)
        COUNTS["examples"] += 1
        COUNTS["examples with a load"] += COUNTS["loads checked"] > before

    def teardown(self) -> None:
        if hasattr(self, "transfer"):
            self.transfer.close()

    # -- valid traffic ------------------------------------------------------------------

    @rule(base=st.integers(0, 2), length=st.integers(2, 14), new=st.integers(1, 6))
    def arrive(self, base: int, length: int, new: int) -> None:
        if len(self.engine.unfinished()) < 5:
            self.engine.arrive([(base * 3 + j * j) % 5 for j in range(length)], new)

    @rule(pick=st.integers(0, 7))
    def repeat(self, pick: int) -> None:
        """An earlier request's prompt again: it hits what that request stored."""
        earlier = list(self.engine.reqs.values())
        if earlier and len(self.engine.unfinished()) < 5:
            req = earlier[-1 - pick % len(earlier)]
            self.engine.arrive(req.tokens[:req.prompt_len + 2], 2)

    @rule(pick=st.integers(0, 7))
    def admit(self, pick: int) -> None:
        waiting = self.engine.waiting()
        if waiting:
            self.engine.admit(waiting[pick % len(waiting)])

    @rule(preempt=st.sampled_from([False, False, False, True]), accept=st.integers(0, 1))
    def step(self, preempt: bool, accept: int) -> None:
        running = self.engine.running()
        plan = self.engine.step((running[0],) if preempt and running else (), accept)
        self._copy(plan.flush, plan.loads, plan.stores)

    @rule(steps=st.integers(1, 4))
    def run(self, steps: int) -> None:
        """Whole engine cycles: admit every waiting request, step, deliver every report."""
        for _ in range(steps):
            for rid in self.engine.waiting():
                self.engine.admit(rid)
            self.step(False, 0)
            self.deliver(False)

    @rule(fail=st.sampled_from([False, False, False, False, True]))
    def deliver(self, fail: bool) -> None:
        pending = self.engine.pending_reports()
        if pending:
            self.engine.deliver([(j, w, not (fail and i == 0))
                                 for i, (j, w) in enumerate(pending)])

    @rule(pick=st.integers(0, 7), go=st.sampled_from([False] * 5 + [True]))
    def abort(self, pick: int, go: bool) -> None:
        alive = self.engine.unfinished()
        if alive and go:
            self.engine.abort(alive[pick % len(alive)])

    @rule(go=st.sampled_from([False] * 9 + [True]))
    def reset(self, go: bool) -> None:
        if go and not self.engine.queued_loads:
            self.engine.reset()

    @rule()
    def take_events(self) -> None:
        self.checked.take_events()

    # -- bad traffic ----------------------------------------------------------------------

    @rule(data=st.data(), count=st.integers(1, 2))
    def bad_call(self, data: st.DataObject, count: int) -> None:
        for _ in range(count):
            name, call = bad_calls(self, data)
            self.checked.reject(name, call)

    @rule(data=st.data())
    def bad_plan(self, data: st.DataObject) -> None:
        """A plan no scheduler would build: it must fail with zero bytes, copying nothing."""
        n, top = len(self.config.groups), self.config.num_gpu_blocks
        cpu = self.config.num_cpu_blocks
        bpc = self.config.groups[0].blocks_per_chunk
        good = tuple(range(1, bpc + 1))
        bad_groups = {
            "gpu id >= pool": (GroupTransfer((top,) * bpc, 0, (0,), (b"k",)),),
            "gpu id 0 (null)": (GroupTransfer((0,) * bpc, 0, (0,), (b"k",)),),
            "negative gpu id": (GroupTransfer((-1,) * bpc, 0, (0,), (b"k",)),),
            "cpu slot >= tier": (GroupTransfer(good, 0, (cpu,), (b"k",)),),
            "negative cpu slot": (GroupTransfer(good, 0, (-1,), (b"k",)),),
            "too few slots": (GroupTransfer(good * 3, 0, (0,), (b"k",)),),
            "huge id": (GroupTransfer((2**62,) * bpc, 0, (0,), (b"k",)),),
        }
        name = data.draw(st.sampled_from(sorted(bad_groups)))
        groups = bad_groups[name] + tuple(GroupTransfer() for _ in range(n - 1))
        kind = data.draw(st.sampled_from([JobKind.LOAD, JobKind.STORE]))
        self.plan_ids += 1
        plan = TransferPlan(self.plan_ids, kind, "hostile", groups)
        before = self._tier_bytes()
        COUNTS["calls"] += 1
        COUNTS["bad"] += 1
        with deadline(f"bad plan {name}"):
            self.transfer.submit(plan)
            (result,) = self.transfer.wait([plan.job_id], timeout=CALL_SECONDS)
        self.transfer.poll()
        assert not result.success and result.bytes == 0, (name, result)
        assert self._tier_bytes() == before, f"bad plan {name} changed bytes"
        COUNTS["rejected plan"] += 1

    # -- the copies and the byte check ----------------------------------------------------

    def _tier_bytes(self) -> list[bytes]:
        return [_raw(t) for t in self.gpu] + [
            _raw(self.transfer.cpu_tensor(g, 0)) for g in range(len(self.gpu))]

    def _run(self, plan: TransferPlan) -> None:
        COUNTS["copies"] += 1
        with deadline(f"copy {plan.job_id}"):
            self.transfer.submit(plan)
            (result,) = self.transfer.wait([plan.job_id], timeout=CALL_SECONDS)
        self.transfer.poll()
        assert result.success, (plan, result.error)

    def _copy(self, flush: tuple[int, ...], loads: tuple[TransferPlan, ...],
              stores: tuple[TransferPlan, ...]) -> None:
        for plan in loads:
            self._run(plan)
            self._check_loaded(plan)
        for plan in stores:
            self._write_sources(plan)
            self._run(plan)

    def _blocks(self, plan: TransferPlan) -> Iterator[tuple[int, int, bytes]]:
        """(group, GPU block, expected bytes) for every block a plan moves."""
        for g, gt in enumerate(plan.groups):
            bpc = self.config.groups[g].blocks_per_chunk
            for i, block in enumerate(gt.gpu_block_ids):
                chunk, sub = sub_block_position(i, gt.block_index, bpc)
                yield g, block, chunk_bytes(gt.keys[chunk], sub)

    def _write_sources(self, plan: TransferPlan) -> None:
        for g, block, data in self._blocks(plan):
            self.gpu[g][block] = torch.tensor(list(data), dtype=torch.uint8)

    def _check_loaded(self, plan: TransferPlan) -> None:
        for g, block, data in self._blocks(plan):
            got = _raw(self.gpu[g][block])
            assert got == data, f"load {plan.job_id} group {g} block {block}: wrong bytes"
        COUNTS["loads checked"] += 1


def main() -> int:
    """Run the machine under the test suite's Hypothesis profile (``tests`` and
    ``tests/unit`` must be on ``PYTHONPATH``; ``test_hostile_api`` sets it)."""
    import conftest  # noqa: F401  (registers and loads the Hypothesis profile)

    examples = int(os.environ.get("KVCORE_HOSTILE_EXAMPLES", "0")) or settings().max_examples
    run_state_machine_as_test(HostileMachine, settings=settings(
        settings(), max_examples=examples, stateful_step_count=60, deadline=None))
    print("HOSTILE " + " ".join(f"{k.replace(' ', '_')}={v}"
                                for k, v in sorted(COUNTS.items())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
