"""Plans into descriptor tables: the Python half of every job's checks.

A job (``kvcore.spec.plans.TransferPlan``) is checked here, where an error can name the
job, the group and the role of a bad id, and becomes one descriptor table over the
registered regions; the C library checks that table again before the first byte moves.
The mapping is the sequential one of ``kvcore.spec.plans``: GPU block ``i`` of a group
goes to sub-block ``(block_index % bpc + i) % bpc`` of chunk
``cpu_slots[(block_index % bpc + i) // bpc]``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from kvcore import _native
from kvcore._native import DescriptorTable, ErrorRecord, Side, Status
from kvcore.spec.errors import KVCopyError, TransferArgumentError, short_repr
from kvcore.spec.hooks import own_items
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import OffloadConfig

from ._memory import _bad, _Registered

# Ids per group in one job: the C library takes at most 2**24 descriptors per call, and a
# job's table holds ids x tensors of them; the full check is on the table's total.
MAX_IDS_PER_GROUP = 1 << 24
MAX_JOB_ID = (1 << 63) - 1


def _kv_error(message: str, code: int, *, job_id: int, group: int, index: int | None,
              value: int | None = None, bound: int | None = None) -> KVCopyError:
    return KVCopyError(message, code=code, descriptor_index=index, job_id=job_id, group=group,
                       value=value, bound=bound)


def _check_ints(name: str, values: object, job_id: int) -> tuple[int, ...]:
    """A tuple of plain ints (wrong Python types are argument errors, not copy errors).

    Only tuples and lists, at most ``MAX_IDS_PER_GROUP`` long, checked before they are
    copied: a tensor, a generator or ``range(10**12)`` is refused, not materialised.
    """
    if not isinstance(values, (tuple, list)):
        raise TransferArgumentError(name, f"{short_repr(values)} must be a tuple of ints, not "
                                          f"{type(values).__name__} (use .tolist() on a tensor)",
                                    job_id=job_id)
    # The list's or tuple's own length and items (not a subclass's ``__len__`` or
    # ``__iter__``), read once: what is checked is what is copied.
    size = list.__len__(values) if isinstance(values, list) else tuple.__len__(values)
    if size > MAX_IDS_PER_GROUP:
        raise TransferArgumentError(name, f"holds {size} ids; at most "
                                          f"{MAX_IDS_PER_GROUP} per group and job",
                                    value=size, bound=MAX_IDS_PER_GROUP, job_id=job_id)
    got = cast("tuple[int, ...]", own_items(values))
    for v in got:
        if type(v) is not int:
            raise TransferArgumentError(name, f"holds {short_repr(v)} ({type(v).__name__}); "
                                              "ids must be ints", job_id=job_id)
    return got


@dataclass(frozen=True)
class _Job:
    """A checked plan turned into one descriptor table (all groups, all tensors)."""

    table: DescriptorTable
    nbytes: int
    offsets: tuple[int, ...]  # first descriptor of each group
    context: str
    roles: tuple[str, str]

    def group_of(self, index: int) -> int:
        return bisect.bisect_right(self.offsets, index) - 1


def _roles(kind: JobKind) -> tuple[tuple[str, str], Side, Side]:
    """(source and destination role names, the GPU side, the CPU side) of a job kind."""
    if kind is JobKind.STORE:
        return ("GPU block", "CPU chunk"), Side.SRC, Side.DST
    return ("CPU chunk", "GPU block"), Side.DST, Side.SRC


@dataclass(frozen=True)
class _GroupIds:
    """One group's ids after the type checks: plain ints, ready for the range checks."""

    ids: tuple[int, ...]
    block_index: int
    slots: tuple[int, ...]


def _normalize_group(plan: TransferPlan, g: int, gt: object) -> _GroupIds:
    """Type checks (TransferArgumentError, a ValueError) for one group's share of a plan."""
    job = plan.job_id
    if not isinstance(gt, GroupTransfer):
        raise TransferArgumentError(f"job {job} plan.groups[{g}]", f"{short_repr(gt)} must be "
                                    "a GroupTransfer", job_id=job)
    ids = _check_ints(f"job {job} group {g} gpu_block_ids", gt.gpu_block_ids, job)
    slots = _check_ints(f"job {job} group {g} cpu_slots", gt.cpu_slots, job)
    (block_index,) = _check_ints(f"job {job} group {g} block_index", (gt.block_index,), job)
    return _GroupIds(ids, block_index, slots)


def _check_group_ranges(plan: TransferPlan, g: int, grp: _GroupIds, bpc: int,
                        num_gpu_blocks: int, num_cpu_blocks: int, first: int,
                        total: int) -> None:
    """B1 in Python, with names: ids in range, null block refused, shape, no double write."""
    roles, gpu_side, cpu_side = _roles(plan.kind)
    ctx = f"{plan.kind.value}, job {plan.job_id}, group {g}"

    def fail(status: int, i: int, value: int, bound: int, side: int) -> KVCopyError:
        rec = ErrorRecord(status, first + i, value, bound, side)
        return _native.make_error(rec, num_descs=total, context=ctx, roles=roles,
                                  job_id=plan.job_id, group=g)

    if grp.block_index < 0:
        raise _kv_error(f"{ctx}: block_index={grp.block_index} is negative; no bytes were "
                        "copied.", Status.E_NEGATIVE, job_id=plan.job_id, group=g,
                        index=first, value=grp.block_index, bound=0)
    # The chunk ordinal of the last GPU block, plus one: kvcore's own count, not the spec's
    # ``chunks_spanned`` that S1 judges with, so a slip in either is a disagreement.
    lead = grp.block_index % bpc
    expected = (lead + len(grp.ids) - 1) // bpc + 1 if grp.ids else 0
    if len(grp.slots) != expected:
        raise _kv_error(
            f"{ctx}: {len(grp.ids)} GPU blocks from block_index {grp.block_index} with "
            f"blocks_per_chunk={bpc} span {expected} chunks, but {len(grp.slots)} cpu_slots "
            "were given; no bytes were copied.", Status.E_SHAPE, job_id=plan.job_id,
            group=g, index=first, value=len(grp.slots), bound=expected)
    for i, b in enumerate(grp.ids):
        if not 0 < b < num_gpu_blocks:
            # The C library's fields for the same row: the null block breaks "id >= 1".
            if b == 0:
                raise fail(Status.E_NULL_ROW, i, b, 1, gpu_side)
            raise fail(Status.E_ROW_RANGE, i, b, num_gpu_blocks, gpu_side)
    for c, s in enumerate(grp.slots):
        if not 0 <= s < num_cpu_blocks:
            raise fail(Status.E_ROW_RANGE, max(0, c * bpc - lead), s, num_cpu_blocks, cpu_side)
    written = grp.ids if plan.kind is JobKind.LOAD else grp.slots
    seen: set[int] = set()
    for pos, x in enumerate(written):
        if x in seen:
            # A repeat is never the first chunk (pos >= 1), and lead < bpc, so the chunk's
            # first block is pos * bpc - lead >= 1: no clamp at 0 as for a bad slot above.
            i = pos if plan.kind is JobKind.LOAD else pos * bpc - lead
            what = "GPU block" if plan.kind is JobKind.LOAD else "CPU chunk"
            raise _kv_error(f"{ctx}: destination {what} {x} is written twice in one job; "
                            "no bytes were copied.", Status.E_DST_OVERLAP, job_id=plan.job_id,
                            group=g, index=first + i, value=x, bound=len(seen))
        seen.add(x)


def _group_table(kind: JobKind, grp: _GroupIds, bpc: int,
                 regs: Sequence[_Registered]) -> torch.Tensor:
    """The (tensors x blocks, 7) descriptor rows of one group, tensor-major (C coalesces)."""
    n, t = len(grp.ids), len(regs)
    i64 = torch.int64
    pos = torch.arange(n, dtype=i64) + grp.block_index % bpc
    cpu_row = torch.tensor(grp.slots, dtype=i64)[pos // bpc].expand(t, n)
    gpu_row = torch.tensor(grp.ids, dtype=i64).expand(t, n)
    row_bytes = torch.tensor([r.row_bytes for r in regs], dtype=i64).unsqueeze(1)
    cpu_off = (pos % bpc).unsqueeze(0) * row_bytes
    gpu_reg = torch.tensor([r.gpu_region for r in regs], dtype=i64).unsqueeze(1).expand(t, n)
    cpu_reg = torch.tensor([r.cpu_region for r in regs], dtype=i64).unsqueeze(1).expand(t, n)
    zero = torch.zeros((t, n), dtype=i64)
    size = row_bytes.expand(t, n)
    if kind is JobKind.STORE:
        cols = [gpu_reg, gpu_row, zero, cpu_reg, cpu_row, cpu_off, size]
    else:
        cols = [cpu_reg, cpu_row, cpu_off, gpu_reg, gpu_row, zero, size]
    return torch.stack(cols, dim=2).reshape(t * n, 7)



def check_plan(plan: object) -> TransferPlan:
    """The plan's own types (TransferArgumentError): what submit() refuses to queue.

    Answers a plain ``TransferPlan`` of the fields read once, and the caller keeps that
    copy: a subclass whose ``job_id`` property answered differently at each read left a
    job in flight for good (submit registered one id, the worker reported another), and a
    groups list whose ``__len__`` disagreed with its items got past the count check."""
    if not isinstance(plan, TransferPlan):
        raise _bad("plan", f"must be a TransferPlan, not {type(plan).__name__}")
    missing = [f for f in ("job_id", "kind", "request_id", "groups")
               if not hasattr(plan, f)]
    if missing:  # made without its constructor (object.__new__, a bad unpickle)
        raise _bad("plan", f"has no {', '.join(missing)}; build it with TransferPlan(...)")
    job = plan.job_id
    if type(job) is not int or not 0 <= job <= MAX_JOB_ID:
        raise _bad("plan.job_id", f"{short_repr(job)} must be an int in 0..{MAX_JOB_ID}")
    kind, groups, request_id = plan.kind, plan.groups, plan.request_id
    if not isinstance(kind, JobKind):
        raise TransferArgumentError("plan.kind", f"{short_repr(kind)} must be a "
                                    "JobKind (STORE or LOAD)", job_id=job)
    if not isinstance(groups, (tuple, list)):
        raise TransferArgumentError("plan.groups", f"{short_repr(groups)} must be a "
                                    "tuple of GroupTransfer", job_id=job)
    if type(plan) is TransferPlan and type(groups) is tuple:
        return plan
    return TransferPlan(job, kind, request_id, cast("tuple[GroupTransfer, ...]",
                                                    own_items(groups)))


def prepare_plan(plan: object, cfg: OffloadConfig, registered: Sequence[Sequence[_Registered]],
                 capacities: Sequence[int], *, check_ranges: bool = True) -> _Job:
    """Check a plan in Python (naming job, group and role) and build its table.

    ``registered`` and ``capacities`` are the engine's tensors and CPU slots per group;
    every id is range-checked against them before any descriptor is built.
    ``check_ranges=False`` builds the table of a well-shaped plan without the id checks,
    so that ``kvcore check`` can hand it to the C validator alone: the second line of
    defence must refuse what the first would have, naming the same group and values.
    """
    plan = check_plan(plan)
    if len(plan.groups) != len(cfg.groups):
        raise _kv_error(
            f"job {plan.job_id} has {len(plan.groups)} group entries but the config has "
            f"{len(cfg.groups)} groups (one GroupTransfer per group, possibly empty); "
            "no bytes were copied.", Status.E_SHAPE, job_id=plan.job_id, group=0,
            index=None, value=len(plan.groups), bound=len(cfg.groups))
    groups = [_normalize_group(plan, g, gt) for g, gt in enumerate(plan.groups)]
    counts = [len(grp.ids) * len(registered[g]) for g, grp in enumerate(groups)]
    offsets = [sum(counts[:g]) for g in range(len(counts))]
    total = sum(counts)
    if total > MAX_IDS_PER_GROUP:
        raise _kv_error(f"job {plan.job_id} needs {total} descriptors (ids x tensors); one "
                        f"call takes at most {MAX_IDS_PER_GROUP}: split the job; no bytes "
                        "were copied.", Status.E_LIMIT, job_id=plan.job_id, group=0,
                        index=None, value=total, bound=MAX_IDS_PER_GROUP)
    for g, grp in enumerate(groups):
        if check_ranges:
            _check_group_ranges(plan, g, grp, cfg.groups[g].blocks_per_chunk,
                                cfg.num_gpu_blocks, capacities[g], offsets[g], total)
    parts = [_group_table(plan.kind, grp, cfg.groups[g].blocks_per_chunk, registered[g])
             for g, grp in enumerate(groups) if grp.ids]
    table = torch.cat(parts).contiguous() if parts else torch.zeros((0, 7), dtype=torch.int64)
    nbytes = sum(len(grp.ids) * sum(r.row_bytes for r in registered[g])
                 for g, grp in enumerate(groups))
    roles, _, _ = _roles(plan.kind)
    return _Job(DescriptorTable.from_address(table.data_ptr(), total, table), nbytes,
                tuple(offsets), f"{plan.kind.value}, job {plan.job_id}", roles)
