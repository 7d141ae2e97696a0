"""``kvcore check``'s "copy library" stage: the C validator against hostile tables.

In the rest of the battery every table reaching C was built by the transfer engine from a
checked plan, so the C library's refusal paths never run: a validator that lets a bad row
through would pass every simulation. Here seeded random tables go to ``kvc_copy``
directly, inside one arena with guard bytes: regions shaped like the layout's pools (one
per group, row 0 refused where the group's tables use it as the null block, plus a CPU
pool), descriptors near the valid range with one field pushed to an edge now and then
(row -1, the row count, offsets past the row, 64-bit extremes), and tables that overlap
on purpose. Each call becomes a ``CopyCallRecord``: B1 says what must be refused and how,
X2 that everything else is copied byte for byte (``spec.invariants``, from the reference in
``spec.descriptors``). Bounded: ``cases`` calls of at most 8 descriptors in 4 KiB.
"""

from __future__ import annotations

import ctypes
import random

import torch

from kvcore import _native
from kvcore._checks import enforce
from kvcore._native import DescriptorTable, Region, RegionTable
from kvcore.spec.descriptors import (
    I64,
    MAX_REGIONS,
    REGION_REFUSE_ROW0,
    U64,
    Side,
    cross_violations,
    first_violation,
    sequential_copy,
)
from kvcore.spec.errors import KVCopyError
from kvcore.spec.invariants import CopyCallRecord
from kvcore.spec.types import OffloadConfig

ARENA_BYTES = 4096
GUARD = 256
EXTREMES = (-(1 << 63), -1, I64, I64 - 1, 1 << 62, 1 << 32)
# Copy flags: every known combination, and now and then an unknown bit.
FLAGS = (0,) * 8 + (1, 1, 1, 2, 2, 4, 4, 1 | 2, 1 | 4, 2 | 4) + (8,)


class _Arena:
    """One byte tensor holding every region between guard bytes, refilled per call."""

    def __init__(self) -> None:
        self.buf = torch.zeros(ARENA_BYTES + 2 * GUARD, dtype=torch.uint8)
        self.origin = self.buf.data_ptr()
        self.base = self.origin + GUARD

    def fill(self, rng: random.Random) -> bytearray:
        data = rng.randbytes(self.buf.numel())
        ctypes.memmove(self.origin, data, len(data))
        return bytearray(data)

    def snapshot(self) -> bytearray:
        return bytearray(ctypes.string_at(self.origin, self.buf.numel()))


def _regions(rng: random.Random, arena: _Arena, config: OffloadConfig) -> list[Region]:
    """One region per group (at most 3) and a CPU pool, or now and then 17-20 regions (the
    library's heap path); one in a while an inconsistent one."""
    kinds: list[object] = [g.kind for g in config.groups[:3]] + [None]
    if rng.random() < 0.05:
        kinds = [GPU_POOL] * rng.randint(16, 19) + [None]
    regions = []
    for kind in kinds:
        offset = rng.randrange(ARENA_BYTES)
        row_bytes = rng.randrange(1, 97)
        stride = row_bytes + rng.choice((0, 0, 8, 33))
        room = ARENA_BYTES - offset
        fit = (room - row_bytes) // stride + 1 if room >= row_bytes else 0
        rows = rng.randint(2, min(12, fit)) if fit >= 2 else fit
        extent = (rows - 1) * stride + row_bytes if rows else 0
        if extent > room:
            rows, extent = 0, 0
        # Row 0 of a GPU pool is the null block (a window or Mamba table's padding, which
        # the transfer engine drops): every GPU pool refuses it, the CPU pool has none.
        flags = REGION_REFUSE_ROW0 if kind is not None else 0
        if rng.random() < 0.01:
            flags |= 4  # an unknown flag
        size = extent - (1 if rng.random() < 0.01 and extent else 0)
        regions.append(_odd(rng, Region(arena.base + offset, size, stride, row_bytes, rows,
                                        flags)))
    return regions


GPU_POOL = "gpu"


def _odd(rng: random.Random, r: Region) -> Region:
    """Now and then a region at an edge of its own rules: rows closer than a row (valid for
    one row only), a null base, fields whose extent overflows 64 bits, or one that ends
    exactly at the top of the address space (valid). The C library
    must refuse the bad ones before it reads any descriptor."""
    roll = rng.random()
    if roll < 0.01 and r.row_bytes > 1:
        stride = rng.randrange(r.row_bytes)
        rows = rng.choice((1, 2, max(1, r.num_rows)))
        return Region(r.base, (rows - 1) * stride + r.row_bytes, stride, r.row_bytes, rows,
                      r.flags)
    if roll < 0.0125:
        return Region(0, r.size_bytes, r.row_stride_bytes, r.row_bytes, r.num_rows, r.flags)
    if roll < 0.015:
        return Region(U64 - rng.randrange(1, 64), r.size_bytes, r.row_stride_bytes,
                      r.row_bytes, r.num_rows, r.flags)
    if roll < 0.0175:
        return Region(r.base, U64 - rng.randrange(2), r.row_stride_bytes, r.row_bytes,
                      r.num_rows, r.flags)
    if roll < 0.02:
        return Region(r.base, r.size_bytes, 1 << rng.randrange(8, 40), r.row_bytes,
                      1 << rng.randrange(30, 62), r.flags)
    if roll < 0.0225:  # ends exactly at 2^64 - 1: valid; no rows, so nothing copies there
        return Region(U64 - r.size_bytes, r.size_bytes, r.row_stride_bytes, r.row_bytes, 0,
                      r.flags)
    return r


def _descriptors(rng: random.Random, regions: list[Region]) -> list[tuple[int, ...]]:
    """1-8 descriptors (33-40 one time in twenty: the heap path), some in runs contiguous
    on both sides (what the library merges), some meeting an earlier one on purpose, some
    with one field pushed to an edge."""
    count = 0 if rng.random() < 0.02 else rng.randint(33, 40) if rng.random() < 0.05 \
        else rng.randint(1, 8)
    descs: list[tuple[int, ...]] = []
    while len(descs) < count:
        sr, dr = rng.randrange(len(regions)), rng.randrange(len(regions))
        s, d = regions[sr], regions[dr]
        size = rng.randint(1, max(1, min(s.row_bytes, d.row_bytes)))
        desc = [sr, _row(rng, s), rng.randint(0, max(0, s.row_bytes - size)),
                dr, _row(rng, d), rng.randint(0, max(0, d.row_bytes - size)), size]
        if sr == dr and desc[1] == desc[4] and d.num_rows > 2:
            desc[4] = desc[1] % (d.num_rows - 1) + 1  # another row: a copy onto itself
        if rng.random() < 0.15:
            descs.extend(_run(rng, s, d, desc, count - len(descs)))
            continue
        if descs and rng.random() < 0.06:  # meet an earlier descriptor on purpose
            other = rng.choice(descs)
            side = rng.choice((0, 3))
            desc[side:side + 3] = other[rng.choice((0, 3)):][:3]
        elif rng.random() < 0.08:
            field = rng.randrange(7)
            limit = (len(regions), s.num_rows, s.row_bytes, len(regions), d.num_rows,
                     d.row_bytes, max(s.row_bytes, d.row_bytes))[field]
            desc[field] = rng.choice(EXTREMES) if rng.random() < 0.25 \
                else rng.randint(-2, limit + 2)
        descs.append(tuple(desc))
    return descs


def _run(rng: random.Random, s: Region, d: Region, first: list[int], room: int
         ) -> list[tuple[int, ...]]:
    """Up to 4 descriptors, each starting where the previous one ended on both sides
    (inside one row, or whole rows of packed regions)."""
    sr, srow, soff, dr, drow, doff, size = first
    out: list[tuple[int, ...]] = []
    whole = s.row_stride_bytes == s.row_bytes and d.row_stride_bytes == d.row_bytes
    for _ in range(min(room, rng.randint(2, 4))):
        if whole and (srow >= s.num_rows - 1 or drow >= d.num_rows - 1):
            break
        if not whole and (soff + size > s.row_bytes or doff + size > d.row_bytes):
            break
        if whole:
            out.append((sr, srow, 0, dr, drow, 0, s.row_bytes if s.row_bytes == d.row_bytes
                        else min(s.row_bytes, d.row_bytes)))
            srow, drow = srow + 1, drow + 1
        else:
            out.append((sr, srow, soff, dr, drow, doff, size))
            soff, doff = soff + size, doff + size
    return out


def _row(rng: random.Random, r: Region) -> int:
    """A row inside the region; row 0 (the null block) now and then."""
    if r.num_rows <= 1 or rng.random() < 0.02:
        return 0
    return rng.randrange(1, r.num_rows)


def _call(arena: _Arena, regions: list[Region], descs: list[tuple[int, ...]],
          flags: int, rng: random.Random) -> CopyCallRecord:
    before = arena.fill(rng)
    error: tuple[int, int, int, int, int] | None = None
    try:
        _native.copy(RegionTable(regions), DescriptorTable.pack(descs), flags=flags)
    except KVCopyError as exc:
        error = _refusal(exc)
    after = arena.snapshot()
    copied_ok = error is None and after == sequential_copy(before, arena.origin, regions, descs)
    return CopyCallRecord(tuple(regions), tuple(descs), error,
                          error is not None and after != before, copied_ok, flags)


def _too_many_regions(arena: _Arena) -> CopyCallRecord:
    """One call past KVC_MAX_REGIONS (the descriptor limit is left to tests/native: a table
    that large is 900 MiB)."""
    regions = [Region(arena.base, 8, 8, 8, 1)] * (MAX_REGIONS + 1)
    error = None
    try:
        _native.copy(RegionTable(regions), DescriptorTable.pack([]))
    except KVCopyError as exc:
        error = _refusal(exc)
    return CopyCallRecord(tuple(regions), (), error, False, error is None)


def _refusal(exc: KVCopyError) -> tuple[int, int, int, int, int]:
    """A refusal as B1 compares it: (status, index, side, value, bound), the index being the
    region's for a region error and the descriptor's otherwise."""
    side = int(exc.side or 0)
    index = exc.region_index if side == Side.REGION else exc.descriptor_index
    return (int(exc.code or 0), int(index or 0), side, int(exc.value or 0),
            int(exc.bound or 0))


def run_copy_library(config: OffloadConfig, cases: int, counts: dict[str, int],
                     seed: int = 0) -> None:
    """``cases`` seeded hostile calls; the first broken rule raises InvariantViolation.

    Each call is counted under the rule that judges it: B1 when the reference refuses the
    table, X2 when it must be carried out.
    """
    arena = _Arena()
    records = [_too_many_regions(arena)]
    for case in range(cases):
        rng = random.Random(f"copy:{seed}:{case}")
        regions = _regions(rng, arena, config)
        descs = _descriptors(rng, regions)
        records.append(_call(arena, regions, descs, rng.choice(FLAGS), rng))
        _judge(records, counts)
        records.clear()


def _judge(records: list[CopyCallRecord], counts: dict[str, int]) -> None:
    for r in records:
        bad = first_violation(r.regions, r.descs, r.flags) is not None or \
            cross_violations(r.regions, r.descs) is not None
        key = "B1" if bad else "X2"
        counts[key] = counts.get(key, 0) + 1
    enforce(records)
