"""``kvcore check``'s "set-up" and "transfer engine" stages: what the simulator never tries.

The simulator builds its engine once, with valid tensors, and sends it only plans the
scheduler built with its checks on, so the engine's own refusals (a bad argument at
construction, a bad id in a plan, a freed pool) never run there, and neither does any
byte mapping the scheduler happens not to produce. These two stages call them directly,
on the user's layout (its groups and chunk sizes; small pools):

- **set-up**: every valid variant of the constructors an engine calls must be accepted
  and honoured (X2); bad twins of each (``OffloadConfig`` fields, ``CPUOffloadManager``,
  ``group_capacity``, ``OffloadScheduler``, ``TransferEngine`` options, GPU tensors and
  CPU buffers) must raise a kvcore error that names the argument, and start no thread;
  the manager's calls with a key its state cannot take must raise the error that state
  implies and change nothing (A1).
- **transfer engine**: seeded random valid plans of both kinds, every pool compared after
  each job with a byte model built here from the sequential mapping of ``spec.plans``
  (X2); for half of them, every twin with one fault (an id past the pool, a null, a
  negative, a slot past the tier, a slot count one short, a destination written twice,
  a group missing, wrong types), through ``validate`` and ``submit``: the refusal must
  carry the code, descriptor index, group, value and bound the fault implies, move no
  byte and, through ``submit``, end as a failed job saying what ``validate`` said (A1);
  a pool freed in place must be refused (``validate``, E_STORAGE), a bad
  ``rebind_gpu_tensors`` must leave the old registration in use, a good one must work.

Bounded: ``cases`` plans on pools of at most a few KiB per tensor.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, NamedTuple, TypeVar, cast

import torch

from kvcore._checks import FAILING_CLOSE_SECONDS, JOB_SECONDS, enforce
from kvcore.manager import CPUOffloadManager, cpu_capacities, group_capacity
from kvcore.scheduler import OffloadScheduler
from kvcore.spec.descriptors import Side, Status
from kvcore.spec.errors import (
    ArgumentRangeError,
    ArgumentTypeError,
    BadKeyError,
    ConfigError,
    InvariantViolation,
    KeyGroupError,
    KeyNotReadyError,
    KVCopyError,
    KVCoreError,
    NotPinnedError,
    TransferArgumentError,
)
from kvcore.spec.hooks import MAX_KEY_BYTES, MAX_REPORT_INT
from kvcore.spec.invariants import BadCallRecord, SetupRecord, TransferOutcomeRecord, Violation
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan, sub_block_position
from kvcore.spec.types import Key, OffloadConfig, make_key
from kvcore.spec.types import Status as KeyStatus
from kvcore.transfer import TransferEngine, TransferResult, cpu_capacity
from kvcore.transfer._results import MAX_IN_FLIGHT
from kvcore.transfer._stream import MAX_EVENTS, SimulatedStream, StreamMisuse

# Pools of the stage: few blocks, so a plan's ids often meet the edges of the pool.
CPU_SLOTS = 6
MAX_CHUNKS = 3  # chunks per group and job
ENGINE_CASES = 400
# What each fault must name: KVCopyError fields (code, descriptor_index, group, value,
# bound, side) and a phrase of its message ("says"), or, for a wrong type, the
# TransferArgumentError's ``where``.
Expect = dict[str, object]


# -- the byte model ------------------------------------------------------------------------

def _rows(t: torch.Tensor) -> torch.Tensor:
    """A (blocks, row bytes) uint8 view of a pool whose rows are contiguous."""
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def _layout(config: OffloadConfig, widen: int = 1) -> OffloadConfig:
    """The user's groups and chunk sizes on small pools: room for MAX_CHUNKS chunks of
    every group as distinct GPU blocks, and CPU_SLOTS slots. ``widen`` multiplies every
    group's blocks per chunk: with single-block chunks a store never starts mid-chunk, so
    the sub-block mapping (and every index derived from it) would go untested."""
    if widen > 1:
        # A layout whose chunks cannot be widened within the config's limits (16,384-token
        # chunks: already many blocks each, so stores start mid-chunk anyway) keeps them.
        try:
            groups = tuple(replace(g, blocks_per_chunk=g.blocks_per_chunk * widen)
                           for g in config.groups)
            return _layout(replace(config, groups=groups))
        except ConfigError:
            pass
    top = max(g.blocks_per_chunk for g in config.groups) * MAX_CHUNKS + 3
    return replace(config, num_gpu_blocks=top, num_cpu_blocks=CPU_SLOTS)


def _tensors(config: OffloadConfig, rng: random.Random) -> list[list[torch.Tensor]]:
    """Per group: two per-layer tensors (uint8 and float16 rows), or on odd groups two
    per-layer views of one packed tensor (strided rows), or on every third group one
    tensor alone (an engine's one packed cache per group), filled with random bytes."""
    n = config.num_gpu_blocks
    out: list[list[torch.Tensor]] = []
    for g in range(len(config.groups)):
        if g % 3 == 2:
            ts = [torch.empty((n, 24), dtype=torch.uint8)]
        elif g % 2:
            packed = torch.empty((n, 2, 8), dtype=torch.uint8)
            ts = [packed[:, 0], packed[:, 1]]
        else:
            ts = [torch.empty((n, 16), dtype=torch.uint8),
                  torch.empty((n, 2, 3), dtype=torch.float16)]
        for t in ts:
            _rows(t).copy_(_random_bytes(rng, _rows(t).shape))
        out.append(ts)
    return out


def _random_bytes(rng: random.Random, shape: Sequence[int]) -> torch.Tensor:
    data = bytearray(rng.randbytes(math.prod(shape)))
    return torch.frombuffer(data, dtype=torch.uint8).reshape(tuple(shape))


@dataclass
class _Model:
    """What every pool must hold: GPU rows and CPU chunk rows, per group and tensor."""

    gpu: list[list[torch.Tensor]]
    cpu: list[list[torch.Tensor]]

    def apply(self, plan: TransferPlan, bpc: Sequence[int]) -> int:
        """Carry the plan out on the model (the sequential mapping); its byte count."""
        moved = 0
        for g, gt in enumerate(plan.groups):
            for i, block in enumerate(gt.gpu_block_ids):
                chunk, sub = sub_block_position(i, gt.block_index, bpc[g])
                slot = gt.cpu_slots[chunk]
                for gpu, cpu in zip(self.gpu[g], self.cpu[g], strict=True):
                    width = gpu.shape[1]
                    part = cpu[slot, sub * width:(sub + 1) * width]
                    if plan.kind is JobKind.STORE:
                        part.copy_(gpu[block])
                    else:
                        gpu[block].copy_(part)
                    moved += width
        return moved

    def differs(self, engine: TransferEngine, gpu: list[list[torch.Tensor]]) -> str | None:
        """The first pool whose bytes are not the model's, or None."""
        for g, ts in enumerate(gpu):
            for k, t in enumerate(ts):
                if not torch.equal(_rows(t), self.gpu[g][k]):
                    return f"GPU pool [{g}][{k}]"
                if not torch.equal(engine.cpu_tensor(g, k), self.cpu[g][k]):
                    return f"CPU tier [{g}][{k}]"
        return None


# -- plans and their faults ----------------------------------------------------------------

def _valid_plan(rng: random.Random, job: int, config: OffloadConfig,
                caps: Sequence[int]) -> TransferPlan:
    """A plan every rule allows: per group none, or 1-MAX_CHUNKS chunks from any start."""
    kind = rng.choice((JobKind.STORE, JobKind.LOAD))
    top = config.num_gpu_blocks
    groups = []
    for g, spec in enumerate(config.groups):
        bpc = spec.blocks_per_chunk
        if rng.random() < 0.25:
            groups.append(GroupTransfer())
            continue
        chunks = rng.randint(1, min(MAX_CHUNKS, caps[g]))
        lead = rng.randrange(bpc)
        n = rng.randint(max(1, (chunks - 1) * bpc - lead + 1), chunks * bpc - lead)
        slots = tuple(rng.sample(range(caps[g]), chunks))
        if kind is JobKind.LOAD:  # destinations distinct; a store may read a block twice
            ids = tuple(rng.sample(range(1, top), n))
        else:
            ids = tuple(rng.randrange(1, top) for _ in range(n))
        groups.append(GroupTransfer(ids, rng.randrange(3) * bpc + lead, slots))
    return TransferPlan(job, kind, f"req-{job}", tuple(groups))


def _faults(plan: TransferPlan, config: OffloadConfig, caps: Sequence[int],
            tensors: Sequence[int], rng: random.Random
            ) -> list[tuple[str, object, Expect]]:
    """Twins of ``plan`` with one thing wrong, and what the refusal must say."""
    job, top = plan.job_id, config.num_gpu_blocks
    out: list[tuple[str, object, Expect]] = [
        ("not a plan", (job, plan.kind, plan.groups), {"where": "plan"}),
        ("a bool job id", replace(plan, job_id=True), {"where": "plan.job_id"}),
        # The documented range is 0..2**63-1 (a C int64): the number itself, not
        # MAX_JOB_ID, so a wrong constant is caught too.
        ("a job id of 2**63", replace(plan, job_id=1 << 63), {"where": "plan.job_id"}),
        ("a negative job id", replace(plan, job_id=-1), {"where": "plan.job_id"}),
        ("a str kind", replace(plan, kind="store"), {"where": "plan.kind"}),  # type: ignore[arg-type]
        ("a group missing", replace(plan, groups=plan.groups[:-1]),
         {"code": Status.E_SHAPE, "group": 0, "value": len(plan.groups) - 1,
          "bound": len(plan.groups)}),
        ("groups in a dict", replace(plan, groups=dict(enumerate(plan.groups))),  # type: ignore[arg-type]
         {"where": "plan.groups"}),
        ("a group that is not a GroupTransfer",
         replace(plan, groups=((), *plan.groups[1:])),  # type: ignore[arg-type]
         {"where": f"job {job} plan.groups[0]"}),
        # Made without its constructor (object.__new__, a bad unpickle): no fields at all.
        ("a plan without its fields", object.__new__(TransferPlan), {"where": "plan"}),
    ]
    used = [g for g, gt in enumerate(plan.groups) if gt.gpu_block_ids]
    if not used:
        return out
    g = rng.choice(used)
    gt = plan.groups[g]
    bpc = config.groups[g].blocks_per_chunk
    lead = gt.block_index % bpc
    first = sum(len(plan.groups[h].gpu_block_ids) * tensors[h] for h in range(g))
    gpu_side = Side.SRC if plan.kind is JobKind.STORE else Side.DST
    cpu_side = Side.DST if plan.kind is JobKind.STORE else Side.SRC
    i = rng.randrange(len(gt.gpu_block_ids))
    c = rng.randrange(len(gt.cpu_slots))

    def with_group(**change: object) -> TransferPlan:
        groups = list(plan.groups)
        groups[g] = replace(gt, **change)  # type: ignore[arg-type]
        return replace(plan, groups=tuple(groups))

    def ids_with(value: object) -> TransferPlan:
        return with_group(gpu_block_ids=(*gt.gpu_block_ids[:i], value,
                                         *gt.gpu_block_ids[i + 1:]))

    def slots_with(at: int, value: int) -> TransferPlan:
        return with_group(cpu_slots=(*gt.cpu_slots[:at], value, *gt.cpu_slots[at + 1:]))

    at_chunk = first + max(0, c * bpc - lead)  # the first descriptor of chunk c
    ranged = {"group": g, "descriptor_index": first + i, "side": gpu_side}
    out += [
        ("a GPU id past the pool", ids_with(top),
         {"code": Status.E_ROW_RANGE, "value": top, "bound": top, **ranged}),
        ("a negative GPU id", ids_with(-1),
         {"code": Status.E_ROW_RANGE, "value": -1, "bound": top, **ranged}),
        ("the null block", ids_with(0),
         {"code": Status.E_NULL_ROW, "value": 0, "bound": 1, **ranged}),
        ("a float id", ids_with(float(gt.gpu_block_ids[i])),
         {"where": f"job {job} group {g} gpu_block_ids"}),
        ("ids in a range", with_group(gpu_block_ids=range(1, 3)),
         {"where": f"job {job} group {g} gpu_block_ids"}),
        ("a slot past the tier", slots_with(c, caps[g]),
         {"code": Status.E_ROW_RANGE, "group": g, "descriptor_index": at_chunk,
          "value": caps[g], "bound": caps[g], "side": cpu_side}),
        ("one slot short", with_group(cpu_slots=gt.cpu_slots[:-1]),
         {"code": Status.E_SHAPE, "group": g, "descriptor_index": first,
          "value": len(gt.cpu_slots) - 1, "bound": len(gt.cpu_slots)}),
        ("a negative block_index", with_group(block_index=-1),
         {"code": Status.E_NEGATIVE, "group": g, "descriptor_index": first, "value": -1,
          "bound": 0}),
    ]
    if plan.kind is JobKind.LOAD and len(gt.gpu_block_ids) > 1:
        j = rng.randrange(1, len(gt.gpu_block_ids))
        ids = gt.gpu_block_ids
        twice = with_group(gpu_block_ids=(*ids[:j], ids[rng.randrange(j)], *ids[j + 1:]))
        out.append(("a GPU block written twice", twice,
                    {"code": Status.E_DST_OVERLAP, "group": g, "descriptor_index": first + j,
                     "bound": j, "says": "destination GPU block"}))
    if plan.kind is JobKind.STORE and len(gt.cpu_slots) > 1:
        j = rng.randrange(1, len(gt.cpu_slots))
        out.append(("a CPU chunk written twice", slots_with(j, gt.cpu_slots[rng.randrange(j)]),
                    {"code": Status.E_DST_OVERLAP, "group": g,
                     "descriptor_index": first + j * bpc - lead, "bound": j,
                     "says": "destination CPU chunk"}))
    return out


def _c_expect(expect: Expect) -> Expect | None:
    """What the C validator alone must say of a fault, or None where it cannot see it.

    A range fault (an id past its pool, negative, the null block): the same fields as
    Python's refusal. C cannot see the rest: a wrong type or shape never becomes a table,
    and a chunk slot given twice is a plan error even where the two chunks' blocks fill
    different rows of the slot (no byte is written twice, so C rightly copies it)."""
    return expect if "side" in expect else None


T = TypeVar("T")


def _valid(call: str, make: Callable[[], T], checked: dict[str, int], *,
           passes: tuple[type[Exception], ...] = ()) -> T:
    """``make()``, a call every rule allows; a refusal of it is an X2 violation. An
    exception of ``passes`` is no refusal (a wait that timed out): it reaches the caller,
    which judges what it means."""
    try:
        out = make()
    except passes:
        raise
    except Exception as exc:  # any refusal of a valid call, whatever its class
        enforce([SetupRecord(call, f"{type(exc).__name__}: {exc}")], checked)
        raise  # enforce raised already; kept for the type checker
    enforce([SetupRecord(call, None)], checked)
    return out


def _name(exc: BaseException | None) -> str | None:
    return None if exc is None else type(exc).__name__


def _mismatch(exc: BaseException | None, expect: Expect) -> str:
    """How a refusal differs from what its fault implies ("" when it agrees)."""
    if exc is None:
        return ""
    if "where" in expect:
        if not isinstance(exc, TransferArgumentError):
            return f"raised {type(exc).__name__}, a wrong type is a TransferArgumentError"
        return _named(exc, str(expect["where"]))
    if not isinstance(exc, KVCopyError):
        return f"raised {type(exc).__name__}, a bad id is a KVCopyError"
    return _carries(exc, expect)


# -- the stages ----------------------------------------------------------------------------

@dataclass
class _Bench:
    """The engine under test, its tensors and the model they must equal."""

    config: OffloadConfig
    engine: TransferEngine
    gpu: list[list[torch.Tensor]]
    model: _Model
    caps: tuple[int, ...]
    bpc: tuple[int, ...]
    checked: dict[str, int]

    @classmethod
    def open(cls, cfg: OffloadConfig, rng: random.Random, checked: dict[str, int],
             stream: int | None = None) -> _Bench:
        gpu = _tensors(cfg, rng)
        engine = _valid("TransferEngine: the stage's pools",
                        lambda: TransferEngine(cfg, gpu, simulate_stream=stream), checked)
        for g, ts in enumerate(gpu):
            for k in range(len(ts)):
                cpu = _valid(f"cpu_tensor({g}, {k})", partial(engine.cpu_tensor, g, k),
                             checked)
                cpu.copy_(_random_bytes(rng, cpu.shape))
        model = _Model([[_rows(t).clone() for t in ts] for ts in gpu],
                       [[engine.cpu_tensor(g, k).clone() for k in range(len(ts))]
                        for g, ts in enumerate(gpu)])
        return cls(cfg, engine, gpu, model, tuple(cpu_capacity(cfg, g) for g in
                                                  range(len(cfg.groups))),
                   tuple(g.blocks_per_chunk for g in cfg.groups), checked)

    def run(self, *plans: TransferPlan, close: bool = False) -> None:
        """Valid plans, all submitted before any is waited for: each carried out whole,
        and every pool equals the model after them, applied in submission order (X2).
        With ``close``, ``close()`` follows the submits at once: it finishes queued jobs
        (docs/native.md), those still on the stream when the worker's queue ends too."""
        if not plans:
            return
        planned = [self.model.apply(plan, self.bpc) for plan in plans]
        for plan in plans:
            _valid(f"submit: valid plan {plan.job_id}", partial(self.engine.submit, plan),
                   self.checked)
        jobs = tuple(plan.job_id for plan in plans)
        if close:
            # Bounded: a worker that never stops is X2 (a valid call refused), not a hang.
            _valid(f"close(timeout={JOB_SECONDS:.0f})",
                   partial(self.engine.close, timeout=JOB_SECONDS), self.checked)
            results = _one_each(jobs, [r for r in self.engine.poll() if r.job_id in jobs])
        else:
            results = self._finished(*jobs)
        wrong = self.model.differs(self.engine, self.gpu)
        enforce([TransferOutcomeRecord(plan.job_id, n, r.success, r.bytes, r.error, wrong)
                 for plan, n, r in zip(plans, planned, results, strict=True)], self.checked)

    def bounce(self, name: str, twin: object, expect: Expect, job: int) -> None:
        """One bad twin through ``validate`` and then ``submit`` (A1)."""
        raised: BaseException | None = None
        try:
            self.engine.validate(twin)  # type: ignore[arg-type]
        except Exception as exc:  # judged below: which class, which fields
            raised = exc
        in_c = _c_expect(expect)
        wrong = _mismatch(raised, expect)
        if not wrong and in_c is not None and isinstance(raised, KVCopyError) and raised.native:
            # Both lines of defence must hold: the C validator refusing alone means the
            # Python checks (the first line, which run before any table is built) let the
            # bad id through.
            wrong = "came from the C validator alone: kvcore's Python checks let it through"
        self.record(f"validate: {name}", _name(raised), isinstance(raised, KVCoreError),
                     wrong)
        refusal = str(raised) if isinstance(raised, KVCopyError) else None
        if in_c is not None:
            # The second line of defence: the same table with the Python id checks left
            # out. C must refuse it as Python did, and the error must name the group its
            # descriptor belongs to (``group_of``), not a neighbour's.
            raised = None
            try:
                self.engine._validate_in_c(twin)  # type: ignore[arg-type]
            except Exception as exc:  # judged below: which class, which fields
                raised = exc
            wrong = _mismatch(raised, in_c)
            if not wrong and isinstance(raised, KVCopyError) and not raised.native:
                # Same fields by design: only ``native`` tells a Python refusal (the
                # table built with the id checks after all) from the validator's.
                wrong = "came from kvcore's Python checks, not the C validator"
            self.record(f"C validator alone: {name}", _name(raised),
                        isinstance(raised, KVCoreError), wrong)
        try:
            self.engine.submit(twin)  # type: ignore[arg-type]
        except Exception as exc:  # a wrong type is refused at submit
            self.record(f"submit: {name}", _name(exc), isinstance(exc, KVCoreError),
                         _mismatch(exc, expect))
            return
        (result,) = self._finished(job)
        self.record(f"submit: {name}", None if result.success else "a failed job", True,
                    _failed_job(result, refusal))

    def _finished(self, *jobs: int) -> list[TransferResult]:
        """The jobs' results once all have finished, in the order asked (taken off the
        engine's poll queue); a job reported no result, or twice, as a failed one."""
        try:
            done = [r for r in _valid(f"wait({list(jobs)[:4]}, timeout={JOB_SECONDS:.0f})",
                                      partial(self.engine.wait, jobs, timeout=JOB_SECONDS),
                                      self.checked, passes=(TimeoutError,))
                    if r.job_id in jobs]
        except TimeoutError:  # a job never reported: failed below, not a hang
            done = [r for r in self.engine.poll() if r.job_id in jobs]
        self.engine.poll()
        return _one_each(jobs, done)

    def record(self, call: str, raised: str | None, kvcore_error: bool,
               mismatch: str) -> None:
        """A1 for one bad call, with "changed" read from the pools against the model."""
        changed = self.model.differs(self.engine, self.gpu) is not None
        enforce([BadCallRecord(call, raised, kvcore_error, changed, mismatch)], self.checked)


def run_transfer_engine(config: OffloadConfig, cases: int, checked: dict[str, int],
                        seed: int = 0) -> None:
    """The "transfer engine" stage: ``cases`` valid plans, bad twins between them, and a
    freed pool with bad and good rebinds every 40 plans. Three passes: on the user's chunk
    sizes; with two blocks for each of the user's blocks per chunk (so stores start
    mid-chunk); and on the stand-in stream (``simulate_stream``), with plans submitted
    in bursts of up to ``MAX_IN_FLIGHT + 3`` before they are waited for, so that jobs
    queue behind events, retire in order and land late."""
    for widen, stream, share in ((1, False, 3), (2, False, 3), (1, True, 2)):
        _engine_pass(_layout(config, widen), cases * share // 8, checked,
                     f"{seed}:{widen}{':stream' if stream else ''}", stream)


def _engine_pass(cfg: OffloadConfig, cases: int, checked: dict[str, int], seed: str,
                 stream: bool = False) -> None:
    rng = random.Random(f"engine:{seed}")
    bench = _Bench.open(cfg, rng, checked, rng.randrange(1 << 64) if stream else None)
    tensors = tuple(len(ts) for ts in bench.gpu)
    burst: list[TransferPlan] = []
    size = 1
    try:
        for job in range(1, cases + 1):
            plan = _valid_plan(rng, job, bench.config, bench.caps)
            if rng.random() < 0.5:  # every fault of this plan, one at a time
                bench.run(*burst)  # bad twins are judged against settled pools
                burst.clear()
                for name, twin, expect in _faults(plan, bench.config, bench.caps, tensors,
                                                  rng):
                    bench.bounce(name, twin, expect, job)
            if job == cases:  # the documented largest job id, 2**63 - 1, is a valid one
                plan = replace(plan, job_id=(1 << 63) - 1)
            elif job == 1:  # and so is the smallest, 0
                plan = replace(plan, job_id=0)
            burst.append(plan)
            if len(burst) >= size or job == cases or job % 40 == 0:
                bench.run(*burst)
                burst.clear()
                size = rng.randint(1, MAX_IN_FLIGHT + 3) if stream else 1
            if job % 40 == 0:
                _rebinds(bench, rng, cases + job)
        _read_back(bench)
        _accessors(bench)
        _wait_limits(bench)
        _wait_ids(bench)
        if stream:
            _held_job(bench, rng, 2 * cases + 1)
        tail = [_valid_plan(rng, 3 * cases + i, bench.config, bench.caps)
                for i in range(1, (MAX_IN_FLIGHT + 3 if stream else 2) + 1)]
        bench.run(*tail, close=True)
        if stream:
            _events_released(bench.engine, "the stage's engine", bench.checked)
            _held_close(bench, rng, 4 * cases + 1)
            _dead_worker(bench, rng, 4 * cases + 5)
            _dropped_engine(bench, rng, 4 * cases + 9)
        _after_close(bench, _valid_plan(rng, 4 * cases, bench.config, bench.caps))
    except BaseException:
        with contextlib.suppress(Exception):  # failing already: nothing may hide that
            bench.engine.close(timeout=FAILING_CLOSE_SECONDS)
        raise


def _wait_limits(bench: _Bench) -> None:
    """A wait's limit at its edges is valid: 0 polls, ``threading.TIMEOUT_MAX`` is the
    longest the lock takes, inf and None wait without one (nothing is in flight here, so
    each returns at once). Past them (negative, NaN, beyond the lock's maximum, a string,
    a bool) a kvcore error names the limit, before anything waits."""
    for limit in (0, 0.0, threading.TIMEOUT_MAX, math.inf, None):
        _valid(f"drain(timeout={limit!r})", partial(bench.engine.drain, limit), bench.checked)
    for bad in (-1, -0.5, math.nan, threading.TIMEOUT_MAX * 2, "5", True):
        _refused(bench, f"drain(timeout={bad!r})", partial(bench.engine.drain, bad),  # type: ignore[arg-type]
                 "drain(timeout)")


def _wait_ids(bench: _Bench) -> None:
    """``wait(job_ids)`` takes any iterable of ints (nothing is in flight here, so each
    returns at once); a str, a bare int, None or an id that is not an int is refused
    naming ``wait(job_ids)`` before anything waits (a non-int id would match no job, and
    the fence the wait stands for would not hold)."""
    for form, ids in (("a list", [1, 2]), ("a tuple", (1,)), ("a set", {3}),
                      ("a generator", (i for i in (4, 5))), ("an empty list", [])):
        _valid(f"wait(job_ids=as {form})", partial(bench.engine.wait, ids), bench.checked)
    for bad in ("12", 5, None, [1, "2"], [1.0], (True,)):
        _refused(bench, f"wait({bad!r})", partial(bench.engine.wait, bad),  # type: ignore[arg-type]
                 "wait(job_ids)")


class _Gate:
    """The stand-in stream with its events held: while closed, no event passes and a wait
    for one blocks (bounded by ``JOB_SECONDS``), so a submitted job stays in flight for as
    long as the check needs, whatever the worker thread's timing. ``waiting`` is set once
    the worker waits on a held event: it has taken every job queued so far and takes the
    next one only after the gate opens. Everything else goes to the stream itself."""

    def __init__(self, stream: SimulatedStream) -> None:
        self.stream = stream
        self.opened = threading.Event()
        self.waiting = threading.Event()
        self.kill = False  # the worker dies at the held event once the gate opens

    def event_done(self, event: int) -> bool:
        return self.opened.is_set() and self.stream.event_done(event)

    def event_synchronize(self, event: int) -> None:
        self.waiting.set()
        self.opened.wait(JOB_SECONDS)
        if self.kill:
            # What no ``except Exception`` catches: the worker thread ends here (quietly:
            # threading's excepthook passes SystemExit over).
            raise SystemExit("the check stopped the transfer worker")
        self.stream.event_synchronize(event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _held_job(bench: _Bench, rng: random.Random, job: int) -> None:
    """A job the stand-in stream holds in flight (on every group but the last): its id
    submitted again is refused naming ``plan.job_id`` (two jobs under one id: the first
    result would settle the second's job and free slots whose bytes are still moving);
    ``in_flight()`` lists it; a ``wait`` or a ``rebind_gpu_tensors`` with a short limit
    raises TimeoutError rather than answering as if it had finished. Behind it, a job on
    the last group is queued and then that group's pool is freed in place: the worker
    must look at the pools again before its copy and fail the job, nothing copied,
    saying what ``validate`` says now (the copy would read freed memory). Once the
    stream goes on, the held job is carried out whole (X2). Without the hold these ran
    only when the worker happened to be slower than the next call, or never."""
    engine, cfg, last = bench.engine, bench.config, len(bench.gpu) - 1
    stream = engine._cuda
    if not isinstance(stream, SimulatedStream):
        return
    plan = _valid_plan(rng, job, cfg, bench.caps)
    if last:
        plan = replace(plan, groups=(*plan.groups[:last], GroupTransfer()))
    behind = _valid_plan(rng, job + 1, cfg, bench.caps)
    while not behind.groups[last].gpu_block_ids:
        behind = _valid_plan(rng, job + 1, cfg, bench.caps)
    # A store: a worker that copies anyway reads the freed pool, never writes into it.
    behind = replace(behind, kind=JobKind.STORE, groups=tuple(
        gt if g == last else GroupTransfer() for g, gt in enumerate(behind.groups)))
    gate, fresh, refusal = _Gate(stream), bench.gpu, None
    engine._cuda = gate  # type: ignore[assignment]
    try:
        _valid(f"submit: valid plan {job}, held in flight", partial(engine.submit, plan),
               bench.checked)
        _refused(bench, f"submit: job {job} again while it is in flight",
                 partial(engine.submit, plan), "plan.job_id")
        listed = engine.in_flight()
        enforce([SetupRecord(f"in_flight() while job {job} is held",
                             None if listed == [job] else f"answered {listed}")],
                bench.checked)
        answer: object = None
        try:
            answer = engine.wait([job], timeout=0.05)
        except TimeoutError:
            answer = TimeoutError
        enforce([SetupRecord(f"wait([{job}], timeout=0.05) while it is held",
                             None if answer is TimeoutError else
                             f"returned {answer!r} instead of raising TimeoutError")],
                bench.checked)
        answer = None
        try:  # new pools, or the held copy's later reads and writes miss them
            engine.rebind_gpu_tensors([[t.clone() for t in ts] for ts in bench.gpu],
                                      timeout=0.05)
        except TimeoutError:
            answer = TimeoutError
        enforce([SetupRecord(f"rebind_gpu_tensors(timeout=0.05) while job {job} is held",
                             None if answer is TimeoutError else
                             "rebound with a job in flight instead of raising TimeoutError")],
                bench.checked)
        if last and gate.waiting.wait(JOB_SECONDS):
            _valid(f"submit: valid plan {job + 1} behind the held one",
                   partial(engine.submit, behind), bench.checked)
            fresh = [[t.clone() if g == last else t for t in ts]
                     for g, ts in enumerate(bench.gpu)]
            bench.gpu[last][0].untyped_storage().resize_(0)  # freed while queued
            try:
                engine.validate(behind)
                refusal = "validate accepted it"
            except Exception as exc:  # judged below, through the job's result
                refusal = str(exc)
    finally:
        gate.opened.set()
        engine._cuda = stream
    planned = bench.model.apply(plan, bench.bpc)
    if refusal is None:
        (result,) = bench._finished(job)
    else:  # both at once: _finished takes every other result off the poll queue
        result, queued = bench._finished(job, job + 1)
        why = _failed_job(queued, refusal)
        enforce([BadCallRecord("submit: a pool freed after its job was queued",
                               None if queued.success else "a failed job", True, False, why)],
                bench.checked)
        _valid("rebind_gpu_tensors: the freed pool replaced",
               partial(engine.rebind_gpu_tensors, fresh), bench.checked)
        bench.gpu = fresh
    wrong = bench.model.differs(engine, bench.gpu)
    enforce([TransferOutcomeRecord(job, planned, result.success, result.bytes, result.error,
                                   wrong)], bench.checked)


def _events_released(engine: TransferEngine, which: str, checked: dict[str, int]) -> None:
    """Once an engine on the stand-in stream has closed, every event it created is
    destroyed (on CUDA a leaked event outlives the engine)."""
    stream = engine._cuda
    live = stream.live_events() if isinstance(stream, SimulatedStream) else 0
    enforce([SetupRecord(f"close() of {which}: its events destroyed",
                         None if live == 0 else f"{live} events still alive")], checked)


def _held_close(bench: _Bench, rng: random.Random, job: int) -> None:
    """``close(timeout)`` on an engine whose job the stand-in stream holds, with a second
    job filling its queue (``max_queued_jobs=1``): TimeoutError, not a hang and not a
    silent return with the worker still running, and the stop mark that found the queue
    full is left to a thread of its own; the engine takes no submit from then on; once
    the job can finish, a second ``close()`` finishes both (reported, successful) and
    destroys every event. A second engine on the stage's pools, so the stage's own
    engine is left as it was; the jobs are stores, which write only into this engine's
    own tier."""
    engine = _valid("TransferEngine: the stage's pools, a second engine on the stand-in "
                    "stream, max_queued_jobs=1",
                    lambda: TransferEngine(bench.config, bench.gpu, simulate_stream=job,
                                           max_queued_jobs=1), bench.checked)
    stream = cast(SimulatedStream, engine._cuda)  # simulate_stream was given
    plan = replace(_valid_plan(rng, job, bench.config, bench.caps), kind=JobKind.STORE)
    queued = replace(plan, job_id=job + 2)
    gate, want = _Gate(stream), [(job, True)]
    engine._cuda = gate  # type: ignore[assignment]
    try:
        _valid(f"submit: valid plan {job}, held in flight", partial(engine.submit, plan),
               bench.checked)
        if gate.waiting.wait(JOB_SECONDS):  # the worker holds it: the queue is empty
            _valid(f"submit: valid plan {job + 2}, filling the queue",
                   partial(engine.submit, queued), bench.checked)
            want.append((job + 2, True))
        answer: object = None
        try:
            engine.close(timeout=0.05)
        except TimeoutError as exc:
            answer = exc
        enforce([SetupRecord(f"close(timeout=0.05) while job {job} is held",
                             None if isinstance(answer, TimeoutError) else
                             "returned with the worker still running instead of raising "
                             "TimeoutError")], bench.checked)
        refused: BaseException | None = None
        try:
            engine.submit(replace(plan, job_id=job + 1))
        except Exception as exc:  # judged by the record
            refused = exc
        enforce([BadCallRecord("submit after a close() that timed out", _name(refused),
                               isinstance(refused, KVCoreError), False,
                               _named(refused, "TransferEngine.submit"))], bench.checked)
    finally:
        gate.opened.set()
        engine._cuda = stream
        with contextlib.suppress(Exception):  # judged below
            engine.close(timeout=JOB_SECONDS)
    done = [(r.job_id, r.success) for r in engine.poll()]
    enforce([SetupRecord(f"close() once job {job} could finish",
                         None if done == want else f"reported {done}")], bench.checked)
    _events_released(engine, "a second engine, closed after a timeout", bench.checked)


def _dead_worker(bench: _Bench, rng: random.Random, job: int) -> None:
    """A worker thread that dies with a job in flight (an error no handler catches) must
    still report it, failed with nothing moved, so that a ``wait`` for it returns
    instead of hanging (and the fence it stands for fails the job rather than waiting
    forever); the engine then still closes and destroys its events. A third engine on
    the stage's pools; the job is a store into its own tier."""
    engine = _valid("TransferEngine: the stage's pools, a third engine on the stand-in "
                    "stream", lambda: TransferEngine(bench.config, bench.gpu,
                                                     simulate_stream=job), bench.checked)
    stream = cast(SimulatedStream, engine._cuda)  # simulate_stream was given
    plan = replace(_valid_plan(rng, job, bench.config, bench.caps), kind=JobKind.STORE)
    gate = _Gate(stream)
    gate.kill = True
    engine._cuda = gate  # type: ignore[assignment]
    # The death is the check's own doing: its report (threading.excepthook; a test
    # runner's hook reports even SystemExit) is left out for this one thread, until
    # close() has joined it.
    hook = threading.excepthook

    def quiet(args: Any) -> None:
        if args.thread is not engine._thread or args.exc_type is not SystemExit:
            hook(args)

    threading.excepthook = quiet
    try:
        _valid(f"submit: valid plan {job}, its worker to die", partial(engine.submit, plan),
               bench.checked)
        gate.waiting.wait(JOB_SECONDS)
        gate.opened.set()
        done = [(r.job_id, r.success, r.bytes, r.error)
                for r in engine.wait([job], timeout=JOB_SECONDS)]
        want = [(job, False, 0, "transfer worker stopped")]
        problem = None if done == want else f"reported {done}, not {want}"
    except TimeoutError:
        problem = "no result: a wait for it would hang"
    finally:
        gate.opened.set()
        engine._cuda = stream
        with contextlib.suppress(Exception):  # judged below
            engine.close(timeout=JOB_SECONDS)
        threading.excepthook = hook
    enforce([SetupRecord(f"job {job} when its worker died", problem)], bench.checked)
    _events_released(engine, "a third engine, whose worker died", bench.checked)


def _dropped_engine(bench: _Bench, rng: random.Random, job: int) -> None:
    """An engine the caller drops without ``close()`` (one per rebuild in an engine that
    forgets it) is freed: its worker stops and its events are destroyed, once the job
    it queued has run. A fourth engine on the stage's pools; the job is a store into its
    own tier."""
    engine = _valid("TransferEngine: the stage's pools, a fourth engine on the stand-in "
                    "stream, dropped without close()",
                    lambda: TransferEngine(bench.config, bench.gpu, simulate_stream=job),
                    bench.checked)
    stream = cast(SimulatedStream, engine._cuda)  # simulate_stream was given
    thread = engine._thread
    plan = replace(_valid_plan(rng, job, bench.config, bench.caps), kind=JobKind.STORE)
    _valid(f"submit: valid plan {job}, then the engine dropped", partial(engine.submit, plan),
           bench.checked)
    del engine
    gc.collect()
    thread.join(JOB_SECONDS)  # a hang guard: the finalizer's stop mark ends it at once
    live = stream.live_events()
    problem = ("its worker still runs" if thread.is_alive()
               else None if live == 0 else f"{live} events still alive")
    enforce([SetupRecord("an engine dropped without close(): freed, its worker stopped "
                         "and its events destroyed", problem)], bench.checked)


def _after_close(bench: _Bench, plan: TransferPlan) -> None:
    """A closed engine refuses a submit (CallOrderError naming it, nothing queued), and a
    context manager's ``with`` hands back the engine itself and closes it on the way
    out."""
    _refused(bench, "submit after close()", partial(bench.engine.submit, plan),
             "TransferEngine.submit")
    engine = _valid("TransferEngine: the stage's pools, in a with block",
                    lambda: TransferEngine(bench.config, bench.gpu), bench.checked)
    try:
        with engine as entered:
            enforce([SetupRecord("with TransferEngine(...) as e: e is the engine",
                                 None if entered is engine else f"e is {entered!r}")],
                    bench.checked)
        _refused(bench, "submit after the with block", partial(engine.submit, plan),
                 "TransferEngine.submit")
    finally:  # a no-op once closed; a with block that left it open must not leak it
        with contextlib.suppress(Exception):
            engine.close(timeout=FAILING_CLOSE_SECONDS)


def _refused(bench: _Bench, call: str, make: Callable[[], object], *wanted: str) -> None:
    """A1 for a bad call: ``make()`` must raise a kvcore error naming one of ``wanted``
    and change nothing."""
    raised: BaseException | None = None
    try:
        make()
    except Exception as exc:  # judged by the record
        raised = exc
    bench.record(call, _name(raised), isinstance(raised, KVCoreError), _named(raised, *wanted))


def _one_each(jobs: Sequence[int], done: list[TransferResult]) -> list[TransferResult]:
    """Each job's one result, in the order of ``jobs``; a job reported no result, or
    more than one, as a failed one."""
    by_job = {r.job_id: r for r in done}
    reported = Counter(r.job_id for r in done)
    return [by_job[j] if reported[j] == 1
            else TransferResult(j, False, 0, 0.0, f"{reported[j]} results reported")
            for j in jobs]


def _read_back(bench: _Bench) -> None:
    """``read_cpu_chunk``, the tier's read-back: the first and last slot of every group
    must read what the model holds (X2); a slot past the tier, a negative one or a bool,
    a group or tensor index past the engine's must be refused naming the argument and
    its range (A1)."""
    for g, cap in enumerate(bench.caps):
        want = bench.model.cpu[g][0]
        for slot in (0, cap - 1):
            got = _valid(f"read_cpu_chunk({g}, 0, {slot})",
                         partial(bench.engine.read_cpu_chunk, g, 0, slot), bench.checked)
            enforce([SetupRecord(f"read_cpu_chunk({g}, 0, {slot}) reads the chunk's bytes",
                                 None if got == bytes(want[slot].tolist())
                                 else "bytes differ from the model's")], bench.checked)
        groups, tensors = len(bench.caps), len(bench.gpu[g])
        bad_calls: list[tuple[tuple[object, object, object], str, str]] = [
            ((g, 0, cap), "slot", f"0..{cap - 1}"), ((g, 0, -1), "slot", f"0..{cap - 1}"),
            ((g, 0, True), "slot", f"0..{cap - 1}"),
            ((groups, 0, 0), "group", f"0..{groups - 1}"), ((-1, 0, 0), "group", "0.."),
            ((g, tensors, 0), "tensor", f"0..{tensors - 1}"),
            ((g, True, 0), "tensor", f"0..{tensors - 1}"),
            # A value is named whole up to a 60-character repr, cut to 56 + "...>" past it.
            ((g, 0, "x" * 58), "slot", "'" + "x" * 58 + "' is a str"),
            ((g, 0, "x" * 59), "slot", "'" + "x" * 55 + "...> is a str")]
        for args, names, says in bad_calls:
            raised: BaseException | None = None
            try:
                bench.engine.read_cpu_chunk(*args)  # type: ignore[arg-type]
            except Exception as exc:  # judged by the record
                raised = exc
            wrong = _named(raised, names)
            if not wrong and raised is not None:
                wrong = _carries(raised, {"says": says})
            enforce([BadCallRecord(f"read_cpu_chunk{args!r}", _name(raised),
                                   isinstance(raised, KVCoreError), False, wrong)],
                    bench.checked)


def _accessors(bench: _Bench) -> None:
    """The tier's size accessors: ``num_tensors``, ``pinned_bytes`` per group and in all,
    and ``cpu_tier_bytes`` must answer what the engine was built with (X2: an engine
    sizing its own buffers from them gets the truth); a group past the engine's, a
    negative one or a bool must be refused naming ``group`` (A1)."""
    engine, groups = bench.engine, len(bench.caps)
    sizes = [sum(t.numel() * t.element_size() for t in ts) for ts in bench.model.cpu]
    answers: list[tuple[str, Callable[[], int], int]] = []
    for g in range(groups):
        answers.append((f"num_tensors({g})", partial(engine.num_tensors, g), len(bench.gpu[g])))
        answers.append((f"pinned_bytes({g})", partial(engine.pinned_bytes, g), sizes[g]))
    answers.append(("pinned_bytes()", engine.pinned_bytes, sum(sizes)))
    answers.append(("cpu_tier_bytes()", engine.cpu_tier_bytes, sum(sizes)))
    for call, ask, want in answers:
        got = _valid(call, ask, bench.checked)
        enforce([SetupRecord(f"{call} answers {want}", None if got == want
                             else f"answered {got!r}")], bench.checked)
    for name in ("num_tensors", "pinned_bytes"):
        for group in (groups, -1, True):
            _refused(bench, f"{name}({group!r})", partial(getattr(engine, name), group),
                     "group")


def _failed_job(result: TransferResult, refusal: str | None) -> str:
    """How a bad plan that got past submit differs from a failed job that moved nothing,
    took no negative time and says what validate said (``refusal``); "" when it agrees.
    A job that succeeded is judged by its record as accepted."""
    if result.bytes:
        return f"moved {result.bytes} bytes"
    if not result.seconds >= 0:
        return f"took {result.seconds} s"
    if refusal is not None and result.error != refusal:
        return f"its failed job says {result.error!r}, validate {refusal[:80]!r}"
    return ""


def _rebinds(bench: _Bench, rng: random.Random, job: int) -> None:
    """Bad rebinds change nothing (the next plan still copies the old pools); a pool freed
    in place, or pointed at new memory, is refused (E_STORAGE); a good rebind to fresh
    pools works."""
    g = rng.randrange(len(bench.gpu))
    _bad_rebinds(bench, g)
    plan = _valid_plan(rng, job, bench.config, bench.caps)
    bench.run(plan)
    fresh = [[t.clone() for t in ts] for ts in bench.gpu]
    while not plan.groups[g].gpu_block_ids:
        plan = _valid_plan(rng, job, bench.config, bench.caps)
    only_g = tuple(gt if h == g else GroupTransfer() for h, gt in enumerate(plan.groups))
    _valid(f"drain(timeout={JOB_SECONDS:.0f})", partial(bench.engine.drain, timeout=JOB_SECONDS),
           bench.checked)
    pool = bench.gpu[g][0]
    # Every other time the pool is not freed but pointed at new memory (``set_``): its
    # storage object is the registered one, only the tensor's address tells, and a copy to
    # the old address would land where the tensor no longer reads.
    how = "pointed elsewhere" if job // 40 % 2 else "freed in place"
    if how == "freed in place":
        pool.untyped_storage().resize_(0)  # what a sleep mode does to a pool
    else:
        twin = pool.clone()
        pool.set_(twin.untyped_storage(), twin.storage_offset(), twin.shape, twin.stride())
    raised: BaseException | None = None
    try:
        bench.engine.validate(replace(plan, groups=only_g))
    except Exception as exc:  # judged by the record
        raised = exc
    # Not ``bench.record``: comparing the pools would read the freed one.
    wrong = _mismatch(raised, {"code": Status.E_STORAGE, "group": g})
    enforce([BadCallRecord(f"validate: a pool {how}", _name(raised),
                           isinstance(raised, KVCoreError), False, wrong)], bench.checked)
    # Through submit the same plan ends as a failed job that moved nothing and says what
    # validate said.
    _valid("submit: a plan on a freed pool", partial(bench.engine.submit,
                                                       replace(plan, groups=only_g)),
           bench.checked)
    (result,) = bench._finished(plan.job_id)
    why = _failed_job(result, None if raised is None else str(raised))
    enforce([BadCallRecord(f"submit: a pool {how}", None if result.success
                           else "a failed job", True, False, why)], bench.checked)
    if len(bench.gpu) > 1:
        # The freed pool is group g's alone: a plan that leaves group g out is still valid.
        others = tuple(GroupTransfer() if h == g else gt for h, gt in enumerate(plan.groups))
        _valid("validate: a plan beside a freed pool it does not touch",
               partial(bench.engine.validate, replace(plan, groups=others)), bench.checked)
    _valid("rebind_gpu_tensors: fresh pools", partial(bench.engine.rebind_gpu_tensors, fresh),
           bench.checked)
    bench.gpu = fresh


def _bad_rebinds(bench: _Bench, g: int) -> None:
    """Rebinds that must be refused, naming the argument."""
    gpu, n = bench.gpu, bench.config.num_gpu_blocks
    width = _rows(gpu[g][0]).shape[1]

    def swapped(t: torch.Tensor) -> list[list[torch.Tensor]]:
        return [[t, *ts[1:]] if h == g else list(ts) for h, ts in enumerate(gpu)]

    twins: list[tuple[str, object, str]] = [
        ("a group missing", gpu[:-1], "gpu_tensors"),
        ("a tensor for the groups", gpu[0][0], "gpu_tensors"),
        ("None", None, "gpu_tensors"),
        ("a dict of groups", dict(enumerate(gpu)), "gpu_tensors"),
        ("a tensor missing", [ts[:-1] if h == g else ts for h, ts in enumerate(gpu)],
         f"gpu_tensors[{g}]"),
        ("a wider row", swapped(torch.zeros((n, width + 1), dtype=torch.uint8)),
         f"gpu_tensors[{g}][0]"),
        ("one block more", swapped(torch.zeros((n + 1, width), dtype=torch.uint8)),
         f"gpu_tensors[{g}][0]"),
    ]
    for name, tensors, where in twins:
        _refused(bench, f"rebind_gpu_tensors: {name}",
                 partial(bench.engine.rebind_gpu_tensors, tensors), where)  # type: ignore[arg-type]


def _named(exc: BaseException | None, *wanted: str) -> str:
    """"" when the error names one of ``wanted`` (a ConfigError's field, an argument
    error's argument or where), else what it names instead."""
    if exc is None:
        return ""
    names = {getattr(exc, a, None) for a in ("field", "argument", "where")}
    if names & set(wanted):
        return ""
    got = sorted(str(x) for x in names if x is not None)
    return f"names {', '.join(got) or 'nothing'}; the fault is in {' or '.join(wanted)}"


# -- the set-up stage ----------------------------------------------------------------------

Call = Callable[[], object]


class SetupTwin(NamedTuple):
    """A construction with one fault: the argument its error must name and, where the
    fault is specific, what the error must carry (``_carries``: attributes such as value
    and bound, and under "says" a phrase of its message)."""

    name: str
    call: Call
    wanted: tuple[str, ...]
    expect: Expect | None = None
# One bad value per kind of OffloadConfig / GroupSpec field, by its declared type.
BAD_VALUES: dict[str, tuple[object, ...]] = {
    "int": (-1, True), "int | None": (-1, 1.5), "bool": (1, "yes"), "str": (7,),
    "StoreLevel": ("block",), "tuple[GroupSpec, ...]": ((),), "GroupKind": ("full",),
}


def _config_twins(config: OffloadConfig) -> list[tuple[str, Call, tuple[str, ...]]]:
    """``OffloadConfig`` and each ``GroupSpec`` with one field of a wrong type or range."""
    out: list[tuple[str, Call, tuple[str, ...]]] = []
    for f in fields(config):
        for bad in BAD_VALUES.get(str(f.type), ()):
            def top(n: str = f.name, v: object = bad) -> object:
                return replace(config, **{n: v})  # type: ignore[arg-type]
            out.append((f"OffloadConfig: {f.name}={bad!r}", top, (f.name,)))
    for g, spec in enumerate(config.groups):
        for f in fields(spec):
            for bad in BAD_VALUES.get(str(f.type), ()):
                def call(g: int = g, n: str = f.name, v: object = bad) -> object:
                    groups = list(config.groups)
                    groups[g] = replace(config.groups[g], **{n: v})  # type: ignore[arg-type]
                    return replace(config, groups=tuple(groups))
                out.append((f"GroupSpec {g}: {f.name}={bad!r}", call,
                            (f"groups[{g}].{f.name}", f"groups[{g}]")))
    return out


def _object_twins(config: OffloadConfig) -> list[tuple[str, Call, tuple[str, ...]]]:
    """The manager's and the scheduler's constructors with one argument wrong."""
    def manager() -> CPUOffloadManager:
        return CPUOffloadManager.for_config(config)
    # A tier with no pool for the last group (another config's): its first store of that
    # group would fail after the step had changed the scheduler. (A one-group config
    # has no such tier: an empty capacity list is the tier's own refusal.)
    short = [("OffloadScheduler: a manager without the last group's pool",
              lambda: OffloadScheduler(config, CPUOffloadManager(
                  list(cpu_capacities(config))[:-1])), ("manager",))] \
        if len(config.groups) > 1 else []
    return [
        *short,
        ("CPUOffloadManager: capacity=-1", lambda: CPUOffloadManager(-1), ("capacity",)),
        ("CPUOffloadManager: capacity=True", lambda: CPUOffloadManager(True), ("capacity",)),
        ("CPUOffloadManager: policy='fifo'", lambda: CPUOffloadManager(4, "fifo"),
         ("policy",)),
        ("CPUOffloadManager: policy=b'lru'", lambda: CPUOffloadManager(4, b"lru"),  # type: ignore[arg-type]
         ("policy",)),
        ("CPUOffloadManager: check='yes'", lambda: CPUOffloadManager(4, check="yes"),  # type: ignore[arg-type]
         ("check",)),
        ("CPUOffloadManager: max_pending_events=-1",
         lambda: CPUOffloadManager(4, max_pending_events=-1), ("max_pending_events",)),
        ("CPUOffloadManager.for_config: a dict", lambda: CPUOffloadManager.for_config({}),  # type: ignore[arg-type]
         ("config",)),
        ("CPUOffloadManager.for_config: policy='mru'",
         lambda: CPUOffloadManager.for_config(config, "mru"), ("policy",)),
        ("group_capacity: group -1", lambda: group_capacity(config, -1), ("group",)),
        ("group_capacity: one group past the config",
         lambda: group_capacity(config, len(config.groups)), ("group",)),
        ("group_capacity: a bool group", lambda: group_capacity(config, True), ("group",)),
        ("cpu_capacities: a dict", lambda: cpu_capacities({}), ("config",)),  # type: ignore[arg-type]
        ("OffloadScheduler: a dict config", lambda: OffloadScheduler({}, manager()),  # type: ignore[arg-type]
         ("config",)),
        ("OffloadScheduler: no manager", lambda: OffloadScheduler(config, None), ("manager",)),
        ("OffloadScheduler.job_in_flight: job -1",
         lambda: OffloadScheduler(config, manager()).job_in_flight(-1), ("job_id",)),
        ("OffloadScheduler.job_in_flight: a bool job",
         lambda: OffloadScheduler(config, manager()).job_in_flight(True), ("job_id",)),
        ("OffloadScheduler: check='no'", lambda: OffloadScheduler(config, manager(),
                                                                   check="no"),  # type: ignore[arg-type]
         ("check",)),
    ]


def _overlapping(blocks: int) -> torch.Tensor:
    """A pool of 16-byte rows 8 bytes apart: each row shares half its bytes with the next."""
    return torch.zeros(blocks * 8 + 8, dtype=torch.uint8).as_strided((blocks, 16), (8, 1))


def _two_strides(gpu: list[list[torch.Tensor]], g: int, n: int) -> list[list[torch.Tensor]]:
    """``gpu`` with group ``g``'s tensors replaced by two views of one storage: 16-byte rows
    16 bytes apart and 16-byte rows 32 bytes apart (both start at byte 0)."""
    storage = torch.zeros(n * 32, dtype=torch.uint8)
    views = [storage[:n * 16].view(n, 16), storage.as_strided((n, 16), (32, 1))]
    return [views if h == g else list(ts) for h, ts in enumerate(gpu)]


def _engine_twins(cfg: OffloadConfig, gpu: list[list[torch.Tensor]], tier_bytes: int
                  ) -> list[tuple[str, Call, tuple[str, ...]]]:
    """``TransferEngine`` built with one option, tensor or CPU buffer wrong."""
    n, g = cfg.num_gpu_blocks, len(gpu) - 1
    where = f"gpu_tensors[{g}][0]"

    def with_tensor(t: object) -> list[list[object]]:
        return [[t, *ts[1:]] if h == g else list(ts) for h, ts in enumerate(gpu)]

    def engine(tensors: object = gpu, **kw: object) -> Call:
        return lambda: TransferEngine(cfg, tensors, **kw)  # type: ignore[arg-type]

    shrunk = torch.zeros(2 * n * 16, dtype=torch.uint8)
    behind = shrunk[n * 16:].view(n, 16)  # a view at an offset into its storage ...
    shrunk.untyped_storage().resize_(n * 16 + 8)  # ... whose storage no longer covers it
    shared = [list(ts) for ts in gpu]
    shared[g] = [gpu[0][0], *gpu[g][1:]] if g else [gpu[0][0], gpu[0][0]]
    out: list[tuple[str, Call, tuple[str, ...]]] = [
        ("a dict config", lambda: TransferEngine({}, gpu), ("config",)),  # type: ignore[arg-type]
        ("a tensor for gpu_tensors", engine(gpu[0][0]), ("gpu_tensors",)),
        # Neither a tensor nor a list: no length at all, and one that has the right one.
        ("gpu_tensors=None", engine(None), ("gpu_tensors",)),
        ("a dict of groups for gpu_tensors", engine(dict(enumerate(gpu))), ("gpu_tensors",)),
        ("a group missing", engine(gpu[:-1]), ("gpu_tensors",)),
        ("cuda_method='bogus'", engine(cuda_method="bogus"), ("cuda_method",)),
        ("pin_memory='yes'", engine(pin_memory="yes"), ("pin_memory",)),
        ("max_queued_jobs=0", engine(max_queued_jobs=0), ("max_queued_jobs",)),
        # The documented bound (docs/native.md: 1..2^20), not the constant under test.
        ("max_queued_jobs past the limit", engine(max_queued_jobs=(1 << 20) + 1),
         ("max_queued_jobs",)),
        ("max_queued_jobs=True", engine(max_queued_jobs=True), ("max_queued_jobs",)),
        ("simulate_stream=-1", engine(simulate_stream=-1), ("simulate_stream",)),
        ("simulate_stream=2^64, one past the largest seed", engine(simulate_stream=1 << 64),
         ("simulate_stream",)),
        ("simulate_stream=True", engine(simulate_stream=True), ("simulate_stream",)),
        ("simulate_faults=-0.1", engine(simulate_stream=1, simulate_faults=-0.1),
         ("simulate_faults",)),
        ("simulate_faults=1.5", engine(simulate_stream=1, simulate_faults=1.5),
         ("simulate_faults",)),
        ("simulate_faults=NaN", engine(simulate_stream=1, simulate_faults=float("nan")),
         ("simulate_faults",)),
        ("simulate_faults=True", engine(simulate_stream=1, simulate_faults=True),
         ("simulate_faults",)),
        ("simulate_faults without a stand-in stream", engine(simulate_faults=0.5),
         ("simulate_faults",)),
        ("a group without tensors", engine([[] if h == g else ts for h, ts in enumerate(gpu)]),
         (f"gpu_tensors[{g}]",)),
        ("a list for a tensor", engine(with_tensor([[0] * 16] * n)), (where,)),
        ("one block more", engine(with_tensor(torch.zeros((n + 1, 16), dtype=torch.uint8))),
         (where,)),
        ("rows not contiguous", engine(with_tensor(torch.zeros((n, 3, 2)).transpose(1, 2))),
         (where,)),
        ("a 0-d tensor", engine(with_tensor(torch.tensor(5))), (where,)),
        ("storage shrunk under a view", engine(with_tensor(behind)), (where,)),
        ("one tensor registered twice", engine(shared),
         (f"gpu_tensors[{g}][0]", f"gpu_tensors[{g}][1]", "gpu_tensors[0][0]")),
        ("rows overlap", engine(with_tensor(_overlapping(n))), (where,)),
        # Two tensors of different row strides over one storage share its first bytes;
        # only views of one stride can be shown apart, so this must be refused.
        ("two strides over one storage", engine(_two_strides(gpu, g, n)),
         (f"gpu_tensors[{g}][0]", f"gpu_tensors[{g}][1]")),
        # A tensor with no memory behind it (data_ptr 0): beside CPU tensors it is one on
        # another device; alone (a one-group layout) a device kvcore does not serve.
        ("a tensor on the meta device", engine(with_tensor(
            torch.empty((n, 16), dtype=torch.uint8, device="meta"))), (where, "gpu_tensors")),
        # Its bytes are not what it reads as: a raw copy would serve unconjugated values.
        ("a tensor with a lazy conj bit", engine(with_tensor(
            torch.zeros((n, 2), dtype=torch.complex64).conj())), (where,)),
    ]
    # Rows can overlap from two blocks on: the smallest pool where the check applies.
    small = [[_overlapping(2) if (h, k) == (g, 0) else torch.zeros((2, 16), dtype=torch.uint8)
              for k in range(len(ts))] for h, ts in enumerate(gpu)]
    with contextlib.suppress(ConfigError):  # a layout that cannot have a 2-block pool
        two = replace(cfg, num_gpu_blocks=2)
        out.append(("rows overlap in a 2-block pool",
                    lambda: TransferEngine(two, small),  # type: ignore[arg-type]
                    (where,)))
    buffers: list[tuple[str, object, dict[str, object]]] = [
        ("a list of buffers one short", [torch.empty(1, dtype=torch.uint8)] * g, {}),
        ("a byte too few", torch.empty(tier_bytes - 1, dtype=torch.uint8), {}),
        ("a byte too many", torch.empty(tier_bytes + 1, dtype=torch.uint8), {}),
        ("strided", torch.empty(2 * tier_bytes, dtype=torch.uint8)[::2], {}),
        ("not pinned for pin_memory=True", torch.empty(tier_bytes, dtype=torch.uint8),
         {"pin_memory": True}),
        # Of exactly ``tier_bytes`` elements, contiguous and aligned: only the dtype or the
        # shape is wrong.
        ("float32", torch.empty(tier_bytes, dtype=torch.float32), {}),
        ("2-D", torch.empty((tier_bytes, 1), dtype=torch.uint8), {}),
        ("a bytearray", bytearray(tier_bytes), {}),
        ("on the meta device", torch.empty(tier_bytes, dtype=torch.uint8, device="meta"), {}),
    ]
    for name, buf, kw in buffers:
        out.append((f"cpu_buffer {name}", engine(cpu_buffer=buf, **kw), ("cpu_buffer",)))
    return [(f"TransferEngine: {name}", call, want) for name, call, want in out]


def _policies(tier: CPUOffloadManager, groups: int) -> list[Any]:
    """Each group's eviction policy, as ``policy_of`` answers (None: no pool yet)."""
    return [tier.policy_of(g) for g in range(groups)]


def _valid_setups(config: OffloadConfig, cfg: OffloadConfig, gpu: list[list[torch.Tensor]],
                  checked: dict[str, int]) -> int:
    """Constructions every rule allows, which must succeed and be honoured (X2); the
    bytes of the CPU tier, the size a CPU buffer must have."""
    good = _valid("TransferEngine: valid tensors", lambda: TransferEngine(cfg, gpu), checked)
    try:
        tier_bytes = good.pinned_bytes()
        per_group = [good.pinned_bytes(g) for g in range(len(gpu))]
    finally:
        _valid("close() of valid tensors", partial(good.close, timeout=JOB_SECONDS), checked)
    made: list[tuple[str, Callable[[], TransferEngine]]] = [
        ("an exact cpu_buffer", lambda: TransferEngine(
            cfg, gpu, cpu_buffer=torch.empty(tier_bytes, dtype=torch.uint8))),
        ("one cpu_buffer per group", lambda: TransferEngine(
            cfg, gpu, cpu_buffer=[torch.empty(n, dtype=torch.uint8) for n in per_group])),
        ("max_queued_jobs=1", lambda: TransferEngine(cfg, gpu, max_queued_jobs=1)),
        ("max_queued_jobs at the documented limit 2^20", lambda: TransferEngine(
            cfg, gpu, max_queued_jobs=1 << 20)),
        ("pin_memory=False", lambda: TransferEngine(cfg, gpu, pin_memory=False)),
        ("simulate_stream=0, the smallest seed", lambda: TransferEngine(
            cfg, gpu, simulate_stream=0)),
        ("simulate_stream=2^64-1, the largest seed", lambda: TransferEngine(
            cfg, gpu, simulate_stream=(1 << 64) - 1)),
        ("simulate_faults=1, every copy failed", lambda: TransferEngine(
            cfg, gpu, simulate_stream=1, simulate_faults=1)),
    ]
    # Per-layer views of one packed tensor in a 2-block pool: rows interleave from two
    # blocks on, and views of one stride are told apart by their offsets alone.
    with contextlib.suppress(ConfigError):  # a layout that cannot have a 2-block pool
        two = replace(cfg, num_gpu_blocks=2)
        packed = [torch.zeros((2, 2, 8), dtype=torch.uint8) for _ in cfg.groups]
        made.append(("per-layer views of a packed 2-block pool", lambda: TransferEngine(
            two, [[p[:, 0], p[:, 1]] for p in packed])))
    for name, make in made:
        engine = _valid(f"TransferEngine: {name}", make, checked)
        _valid(f"close() of {name}", partial(engine.close, timeout=JOB_SECONDS), checked)
    for policy in ("lru", "arc"):
        mgr: CPUOffloadManager = _valid(f"CPUOffloadManager.for_config({policy!r})",
                      partial(CPUOffloadManager.for_config, config, policy), checked)
        pools = _valid(f"CPUOffloadManager.for_config({policy!r}).policy_of(each group)",
                       partial(_policies, mgr, len(config.groups)), checked)
        names = [None if p is None else p.name for p in pools]
        debug = _valid(f"CPUOffloadManager.for_config({policy!r}).policy",
                       partial(getattr, mgr, "policy"), checked)
        enforce([SetupRecord(f"CPUOffloadManager.for_config({policy!r}): every group's pool "
                             "runs it, and .policy is group 0's",
                             None if names == [policy] * len(names) and debug is pools[0]
                             else f"policies {names}")], checked)
    flat = _valid("CPUOffloadManager(7)", lambda: CPUOffloadManager(7), checked)
    sizes = _valid("CPUOffloadManager(7).capacity_of(each group)",
                   lambda: [flat.capacity_of(g) for g in range(len(config.groups))], checked)
    enforce([SetupRecord("CPUOffloadManager(7): every group's pool holds 7 slots, and "
                         "before any store its stats report group 0's 7",
                         None if sizes == [7] * len(sizes) and flat.stats().capacity == 7
                         else f"capacities {sizes}, stats {flat.stats().capacity}")],
            checked)
    # A group no pool serves has no room: past the 64 groups a key can name (flat), past
    # the config's groups (sized for it), or negative.
    sized = _valid("CPUOffloadManager.for_config", partial(CPUOffloadManager.for_config, config),
                   checked)
    per_group = [_valid(f"for_config: capacity_of({g})", partial(sized.capacity_of, g),
                        checked) for g in range(len(config.groups))]
    enforce([SetupRecord("for_config: every group's pool holds the config's slots",
                         None if per_group == [config.num_cpu_blocks] * len(per_group)
                         else f"capacities {per_group}")], checked)
    outside = [_valid(f"capacity_of({g}) of a group no pool serves", partial(m.capacity_of, g),
                      checked)
               for m, g in ((flat, 64), (flat, -1), (sized, len(config.groups)), (sized, -1))]
    enforce([SetupRecord("capacity_of a group no pool serves is 0",
                         None if outside == [0, 0, 0, 0] else f"capacities {outside}")],
            checked)
    sched = _valid("OffloadScheduler", lambda: OffloadScheduler(config, flat, check=False),
                   checked)
    # job_in_flight takes any id in 0..MAX_REPORT_INT (a superset of the ids a job or a
    # report can have, 1..): both ends are questions with an answer (False, on a
    # scheduler that made no job), not bad calls.
    for job in (0, MAX_REPORT_INT):
        got = _valid(f"OffloadScheduler.job_in_flight({job})",
                     partial(sched.job_in_flight, job), checked)
        enforce([SetupRecord(f"OffloadScheduler.job_in_flight({job}) before any job is False",
                             None if got is False else f"answered {got!r}")], checked)
    return int(tier_bytes)


def _phrase_twins(config: OffloadConfig, cfg: OffloadConfig, gpu: list[list[torch.Tensor]],
                  tier_bytes: int) -> list[SetupTwin]:
    """Twins whose argument alone does not tell the fault apart: the message must say it
    (and, where the error carries them, its value and bound must be the fault's).

    A GPU tensor on torch's ``meta`` device gives two devices on a CPU-only machine, the
    smallest case of "several devices"; a check that let it through would still refuse
    the meta tensor later, naming the same argument for another reason.
    """
    g = len(gpu) - 1
    meta = [list(ts) for ts in gpu]
    meta[g][0] = torch.empty(gpu[g][0].shape, dtype=gpu[g][0].dtype, device="meta")
    last = len(config.groups) - 1
    empty = [list(ts) for ts in gpu]
    empty[g][0] = torch.zeros((cfg.num_gpu_blocks, 0), dtype=torch.uint8)
    # A view at byte offset 16n of a storage cut to 16n + 8 bytes: its n rows of 16 bytes
    # end at byte 32n, past the storage's end (value: where it ends; bound: the storage).
    n = cfg.num_gpu_blocks
    cut = torch.zeros(2 * n * 16, dtype=torch.uint8)
    behind = [list(ts) for ts in gpu]
    behind[g][0] = cut[n * 16:].view(n, 16)
    cut.untyped_storage().resize_(n * 16 + 8)
    # 32 bytes past a 64-byte boundary (docs/native.md: "64-byte aligned"; the documented
    # figure, not the constant under test), whatever torch's allocator returned: aligned
    # to 16 and 32, so a check weakened to either lets it through.
    raw = torch.empty(tier_bytes + 128, dtype=torch.uint8)
    skip = (32 - raw.data_ptr()) % 64
    odd = raw[skip:skip + tier_bytes]
    return [
        SetupTwin("TransferEngine: cpu_buffer misaligned (its offset)",
                  lambda: TransferEngine(cfg, gpu, cpu_buffer=odd), ("cpu_buffer",),
                  {"says": "not a multiple of 64 bytes", "value": 32, "bound": 0}),
        SetupTwin("TransferEngine: storage shrunk under a view (its extent)",
                  lambda: TransferEngine(cfg, behind), (f"gpu_tensors[{g}][0]",),
                  {"says": f"reaches byte {2 * n * 16} of its storage (offset {n * 16} + "
                           f"extent {n * 16})", "value": 2 * n * 16, "bound": n * 16 + 8}),
        SetupTwin("TransferEngine: a tensor of 0 bytes per block",
                  lambda: TransferEngine(cfg, empty), (f"gpu_tensors[{g}][0]",),
                  {"says": "0 bytes per block", "value": 0, "bound": 1}),
        SetupTwin("TransferEngine: tensors on cpu and meta",
                  lambda: TransferEngine(cfg, meta), ("gpu_tensors",),
                  {"says": "several devices"}),
        SetupTwin("group_capacity: one group past the config (its range)",
                  lambda: group_capacity(config, last + 1), ("group",), {"says": f"0..{last}"}),
    ]


def _carries(raised: BaseException, expect: Expect) -> str:
    """How an error's attributes (and, under "says", its message) differ from what the
    fault implies ("" when they agree)."""
    wrong = [f"{a}={getattr(raised, a, None)!r}, the fault implies {v!r}"
             for a, v in expect.items() if a != "says" and getattr(raised, a, None) != v]
    says = expect.get("says")
    if isinstance(says, str) and says not in str(raised):
        wrong.append(f"a message without {says!r}")
    return f"carries {'; '.join(wrong)}" if wrong else ""


def _recency(mgr: CPUOffloadManager, groups: Sequence[int]) -> list[tuple[Key, ...]]:
    """Each group's policy order (most recent first; empty for a policy without one)."""
    return [tuple(getattr(mgr.policy_of(g), "order", tuple)()) for g in groups]


# Keys the manager checks below keep in one group at once: ``_mixed_touch`` stores two
# per group (a touch reorders only a group holding two), ``_manager_calls`` a ready, a
# pinned and a writing key in group 0.
MANAGER_CHECK_SLOTS = 3


def _roomy_tier(config: OffloadConfig) -> CPUOffloadManager:
    """The layout's tier (``for_config``: its groups, its event bound), with at least
    ``MANAGER_CHECK_SLOTS`` slots per group.

    ``num_cpu_blocks`` may legally be 1; such a tier rightly refuses a store of the keys
    these checks hold at once, and that refusal is the layout's limit, not kvcore's fault
    (no X2). Every rule these checks judge is per key, so a few more slots change none."""
    slots = max(MANAGER_CHECK_SLOTS, config.num_cpu_blocks)
    return CPUOffloadManager.for_config(replace(config, num_cpu_blocks=slots))


def _mixed_touch(config: OffloadConfig, checked: dict[str, int]) -> None:
    """A ``touch`` naming keys of two groups refreshes each group's own LRU order (X2):
    the scheduler touches one group per call, an engine driving the tier may not."""
    mgr = _roomy_tier(config)
    a0, b0, a1, b1 = (make_key(bytes([i]) * 8, g) for i, g in ((1, 0), (2, 0), (3, 1), (4, 1)))
    for name, step in (("prepare_store", partial(mgr.prepare_store, [a0, b0, a1, b1])),
                       ("complete_store", partial(mgr.complete_store, [a0, b0, a1, b1])),
                       ("touch", partial(mgr.touch, [a0, a1]))):
        _valid(f"CPUOffloadManager.{name} (keys of groups 0 and 1)", step, checked)
    orders = _recency(mgr, (0, 1))
    enforce([SetupRecord("CPUOffloadManager.touch of keys of two groups: each group's "
                         "touched key becomes its most recent",
                         None if orders == [(b0, a0), (b1, a1)]
                         else f"LRU orders {[[k.hex()[:4] for k in o] for o in orders]}")],
            checked)


def _manager_valid_calls(config: OffloadConfig, checked: dict[str, int]) -> None:
    """Manager calls every rule allows that the scheduler never makes (X2): a touch across
    groups, a first store that fills a pool exactly, lookups of the shortest and longest
    keys."""
    if len(config.groups) > 1:
        _mixed_touch(config, checked)
    # The first store into an empty pool may fill it exactly: 3 keys into 3 slots.
    small = CPUOffloadManager([3] * len(config.groups))
    fill = [make_key(bytes([9, i]) * 4, 0) for i in range(3)]
    out = _valid("CPUOffloadManager([3, ...]).prepare_store of 3 keys of group 0",
                 partial(small.prepare_store, fill), checked)
    enforce([SetupRecord("a first store of exactly a pool's capacity is accepted whole",
                         None if out is not None and list(out.keys_to_store) == fill
                         and sorted(out.slots) == [0, 1, 2] else f"answered {out}")], checked)
    # Empty batches are batches: nothing to read, nothing to refresh.
    empty: tuple[tuple[str, Call, object], ...] = (
            ("lookup_many([])", partial(small.lookup_many, []), []),
            ("touch([])", partial(small.touch, []), None),
            ("lookup_hashes([], suffix)", partial(small.lookup_hashes, [], make_key(b"", 0)),
             []),
            ("touch_hashes([], suffix)", partial(small.touch_hashes, [], make_key(b"", 0)),
             None))
    for name, ask, want in empty:
        got = _valid(f"CPUOffloadManager.{name}", ask, checked)
        enforce([SetupRecord(f"CPUOffloadManager.{name} answers {want!r}",
                             None if got == want else f"answered {got!r}")], checked)
    # The shortest and the longest keys are keys: a lookup answers MISS, not an error.
    for edge in (b"k", bytes(MAX_KEY_BYTES)):
        for name, ask in (("lookup", partial(small.lookup, edge)),
                          ("lookup_many", partial(small.lookup_many, [edge]))):
            got = _valid(f"CPUOffloadManager.{name}: a key of {len(edge)} bytes", ask, checked)
            enforce([SetupRecord(f"CPUOffloadManager.{name}: an absent key of {len(edge)} "
                                 "bytes is a MISS",
                                 None if got in (KeyStatus.MISS, [KeyStatus.MISS])
                                 else f"answered {got}")], checked)


def _manager_calls(config: OffloadConfig, checked: dict[str, int]) -> None:
    """The manager's calls with a key its state cannot take (A1).

    The scheduler never sends these (it releases only what it pinned), so the simulator
    never does; an engine driving the manager itself can. Each must raise the error the
    key's state implies, carrying that state, the pin count and the releases, and change
    nothing: a multi-key call is validated before any key is released. The tier has room
    for the three keys it holds (``_roomy_tier``) whatever the layout's ``num_cpu_blocks``.
    """
    mgr = _roomy_tier(config)

    def key(i: int, group: int = 0) -> Key:
        return make_key(bytes([i]) * 8, group)
    ready, pinned, writing, absent = key(1), key(2), key(3), key(4)
    # The set-up itself is valid calls on an empty tier of the config's groups (X2).
    setup: list[tuple[str, Call]] = [
        ("prepare_store", partial(mgr.prepare_store, [ready, pinned])),
        ("complete_store", partial(mgr.complete_store, [ready, pinned])),
        ("prepare_load", partial(mgr.prepare_load, [pinned])),
        ("prepare_store", partial(mgr.prepare_store, [writing]))]
    for name, step in setup:
        _valid(f"CPUOffloadManager.{name} on an empty tier", step, checked)
    states = [mgr.state_of(k) for k in (ready, pinned, writing)]
    enforce([SetupRecord("CPUOffloadManager: two stores, a completion and a load on an empty "
                         "tier leave ready, pinned and writing keys",
                         None if states == ["ready", "pinned", "writing"]
                         else f"states {states}")], checked)
    keys = (ready, pinned, writing, absent)
    cases: list[tuple[str, Call, type[KVCoreError], Expect]] = [
        ("complete_load: an absent key", lambda: mgr.complete_load([absent]), NotPinnedError,
         {"state": "absent", "pins": 0, "releases": 1}),
        ("complete_load: a ready key", lambda: mgr.complete_load([ready]), NotPinnedError,
         {"state": "ready", "pins": 0, "releases": 1}),
        ("complete_load: a writing key", lambda: mgr.complete_load([writing]), NotPinnedError,
         {"state": "writing", "pins": 0, "releases": 1}),
        ("complete_load: a key pinned once, released twice",
         lambda: mgr.complete_load([pinned, pinned]), NotPinnedError,
         {"state": "pinned", "pins": 1, "releases": 2}),
        ("complete_load: a pinned key beside an absent one",
         lambda: mgr.complete_load([pinned, absent]), NotPinnedError,
         {"state": "absent", "pins": 0, "releases": 1}),
        ("prepare_load: an absent key", lambda: mgr.prepare_load([absent]), KeyNotReadyError,
         {"state": "absent"}),
        ("prepare_load: a ready key beside a writing one",
         lambda: mgr.prepare_load([ready, writing]), KeyNotReadyError, {"state": "writing"}),
        ("prepare_store: a key of a group past the config",
         lambda: mgr.prepare_store([key(5, len(config.groups))]), KeyGroupError,
         {"group": len(config.groups)}),
        ("lookup: a key past MAX_KEY_BYTES", lambda: mgr.lookup(bytes(MAX_KEY_BYTES + 1)),
         BadKeyError, {}),
        ("lookup: an empty key", lambda: mgr.lookup(b""), BadKeyError, {}),
        ("lookup_many: an empty key", lambda: mgr.lookup_many([b""]), BadKeyError, {}),
    ]
    # A key of the wrong type has a length that looks right (a str, a bytearray) or none
    # at all (an int): each call that takes keys refuses all three, naming the call.
    odd: tuple[object, ...] = (ready.hex(), bytearray(ready), 7)
    for bad in odd:
        kind = type(bad).__name__
        for method in ("lookup", "state_of", "slot_of"):
            cases.append((f"{method}: a {kind} key", partial(getattr(mgr, method), bad),
                          BadKeyError, {"where": method}))
        for method in ("lookup_many", "touch", "prepare_load", "complete_load",
                       "prepare_store", "complete_store"):
            cases.append((f"{method}: a {kind} key beside a good one",
                          partial(getattr(mgr, method), [ready, bad]), BadKeyError,
                          {"where": method}))
    # A group index of the wrong type, and a key suffix (the hash-batch calls) of the
    # wrong type or length: each named, before anything is read or moved.
    suffix = make_key(b"", 0)
    for method in ("capacity_of", "policy_of"):
        for bad in ("0", 1.0, None):
            cases.append((f"{method}({bad!r})", partial(getattr(mgr, method), bad),
                          ArgumentTypeError, {"argument": "group"}))
    for method in ("lookup_hashes", "touch_hashes"):
        call = getattr(mgr, method)
        cases += [
            (f"{method}: a str suffix", partial(call, [ready[:8]], suffix.hex()),
             ArgumentTypeError, {"argument": "suffix"}),
            (f"{method}: a suffix a byte short", partial(call, [ready[:8]], suffix[:-1]),
             ArgumentRangeError, {"argument": "len(suffix)"}),
            (f"{method}: a suffix a byte long", partial(call, [ready[:8]], suffix + b"\0"),
             ArgumentRangeError, {"argument": "len(suffix)"})]
    cases += [
        ("touch: one key, not a list of keys", partial(mgr.touch, ready),  # type: ignore[arg-type]
         ArgumentTypeError, {"argument": "keys"}),
        ("complete_store: success='yes'", partial(mgr.complete_store, [writing], "yes"),  # type: ignore[arg-type]
         ArgumentTypeError, {"argument": "success"}),
    ]
    groups = range(len(config.groups))  # the recency order: all that a touch changes
    for name, call, cls, expect in cases:
        before = (mgr.stats(), [mgr.state_of(k) for k in keys], _recency(mgr, groups))
        raised: BaseException | None = None
        try:
            call()
        except Exception as exc:  # judged by the record
            raised = exc
        wrong = "" if raised is None or isinstance(raised, cls) else f"is not a {cls.__name__}"
        wrong = wrong or (_carries(raised, expect) if raised is not None else "")
        after = (mgr.stats(), [mgr.state_of(k) for k in keys], _recency(mgr, groups))
        enforce([BadCallRecord(f"CPUOffloadManager.{name}", _name(raised),
                               isinstance(raised, KVCoreError), after != before, wrong)],
                checked)
    # A failed store names a READY key before its WRITING one: the READY key stays, the
    # WRITING one leaves no trace (X1's tier half), whatever the order.
    _valid("CPUOffloadManager.complete_store(success=False) of a READY and a WRITING key",
           partial(mgr.complete_store, [ready, writing], False), checked)
    states = [mgr.state_of(k) for k in (ready, writing)]
    enforce([SetupRecord("a failed store drops its WRITING keys and keeps the READY ones",
                         None if states == ["ready", None] else f"states {states}")],
            checked)


def _canary() -> None:
    """The battery's detectors must bite before anything they pass is believed.

    Every stage judges records through ``enforce``, and the report's counts come from
    it; one that judged nothing (its predicate table empty, its loop skipped) would pass
    every run, and one that counted nothing would report a check that never ran. A
    record A1 condemns (a bad call that was accepted) must raise and be counted once, or
    the run stops with A1 itself.
    """
    condemned = BadCallRecord("the battery's canary: a bad call that was accepted", None,
                              kvcore_error=False, changed=False)
    counts: dict[str, int] = {}
    try:
        enforce([condemned], counts)
    except InvariantViolation:
        if counts == {"A1": 1}:
            return
        problem = f"enforce counted {counts} for one A1 record"
    else:
        problem = "enforce passed a record that A1 condemns"
    raise InvariantViolation([Violation("A1", f"the checks are off: {problem}, so no "
                                        "stage's figures mean anything")])


def _stream_canary() -> None:
    """The stand-in stream's misuse detectors must bite: they stand in for the CUDA
    driver's refusals (and for what it would silently get wrong), and a detector that
    never fires would pass an engine that misuses events on every machine without a GPU.
    Each misuse below must raise StreamMisuse; X2 otherwise."""
    stream = SimulatedStream(0)
    events = [stream.event_create() for _ in range(MAX_EVENTS)]
    gone = events.pop()
    stream.event_destroy(gone)
    stream.event_record(events[0], 0)

    def misuse(what: str, call: Callable[[], object]) -> str | None:
        try:
            call()
        except StreamMisuse:
            return None
        return f"the stand-in stream took {what}"

    problems = [
        misuse("one more event than it holds", lambda: [stream.event_create(),
                                                         stream.event_create()]),
        misuse("an event recorded again while pending",
               partial(stream.event_record, events[0], 0)),
        misuse("a query of a destroyed event", partial(stream.event_done, gone)),
        misuse("a wait for a destroyed event", partial(stream.event_synchronize, gone)),
        misuse("a record of an event never created",
               partial(stream.event_record, MAX_EVENTS + 7, 0)),
    ]
    stream.event_synchronize(events[0])
    if not stream.event_done(events[0]):
        problems.append("the stand-in stream left a waited-for event pending")
    found = [p for p in problems if p is not None]
    if found:
        raise InvariantViolation([Violation("X2", f"{p}: its misuse detectors are off, so "
                                            "the stand-in pass cannot see an engine misuse "
                                            "events") for p in found])


def run_setup(config: OffloadConfig, checked: dict[str, int]) -> None:
    """The "set-up" stage: every constructor twin must raise a kvcore error naming the
    argument, and leave no thread behind (A1). It starts with the canary (``_canary``)."""
    _canary()
    _stream_canary()
    cfg = _layout(config)
    gpu = _tensors(cfg, random.Random("setup"))
    tier_bytes = _valid_setups(config, cfg, gpu, checked)
    twins = [SetupTwin(*t) for t in
             _config_twins(config) + _object_twins(config) + _engine_twins(cfg, gpu, tier_bytes)]
    twins += _phrase_twins(config, cfg, gpu, tier_bytes)
    for name, call, wanted, expect in twins:
        threads = threading.active_count()
        raised: BaseException | None = None
        made: object = None
        try:
            made = call()
        except Exception as exc:  # judged by the record
            raised = exc
        if isinstance(made, TransferEngine):
            with contextlib.suppress(TimeoutError):  # judged below: it should not exist
                made.close(timeout=JOB_SECONDS)
        wrong = _named(raised, *wanted)
        if not wrong and raised is not None and expect:
            wrong = _carries(raised, expect)
        enforce([BadCallRecord(name, _name(raised), isinstance(raised, KVCoreError),
                               threading.active_count() > threads, wrong)], checked)
    _manager_valid_calls(config, checked)
    _manager_calls(config, checked)
