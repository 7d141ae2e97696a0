"""B1 at the byte level: which copy descriptors the C library must refuse, and with what.

The copy library (``native/kvcore_copy.h``) promises to refuse, before any byte moves, every
table in which a region is inconsistent, a descriptor leaves its region, or two descriptors
meet (two destinations sharing a byte, or a source reading bytes another descriptor
writes). This module is that promise written as a reference, with Python's unbounded
integers and quadratic loops, from the header's words: it shares nothing with the C code.
``kvcore check`` (its "copy library" stage) and ``tests/native`` drive the C library with
hostile tables and compare every answer and every byte with it.

A region here is anything with the fields of ``kvc_region`` (``base``, ``size_bytes``,
``row_stride_bytes``, ``row_bytes``, ``num_rows``, ``flags``); a descriptor is the 7-tuple
``(src_region, src_row, src_offset, dst_region, dst_row, dst_offset, size)``. The status
codes are the header's, mirrored here once (``tests/native/test_native_smoke.py`` compares
the two); ``kvcore._native`` uses this mirror.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

U64 = (1 << 64) - 1
I64 = (1 << 63) - 1
REGION_REFUSE_ROW0 = 1
REGION_DEVICE = 2
REGION_FLAGS = REGION_REFUSE_ROW0 | REGION_DEVICE

Descriptor = tuple[int, int, int, int, int, int, int]
# (status, index, side, value, bound) of the first violation; index is the region's for
# Side.REGION, else the descriptor's.
Verdict = tuple[int, int, int, int, int]


class Status(enum.IntEnum):
    """The KVC_* status codes of native/kvcore_copy.h."""

    OK = 0
    E_NULL_ARGUMENT = 1
    E_LIMIT = 2
    E_FLAGS = 3
    E_REGION = 4
    E_OVERFLOW = 5
    E_REGION_ID = 6
    E_ROW_RANGE = 7
    E_NULL_ROW = 8
    E_NEGATIVE = 9
    E_ZERO_SIZE = 10
    E_SIZE = 11
    E_OFFSET = 12
    E_OVERLAP = 13
    E_SHAPE = 14
    E_NO_CUDA = 15
    E_DEFAULT_STREAM = 16
    E_CUDA = 17
    E_NOT_READY = 18
    E_METHOD = 19
    E_PAGEABLE = 20
    E_DST_OVERLAP = 21
    E_READS_WRITTEN = 22
    E_NO_MEMORY = 23
    E_STORAGE = 24


class Side(enum.IntEnum):
    """KVC_SIDE_*: which side of a descriptor an error is about."""

    NONE = 0
    SRC = 1
    DST = 2
    REGION = 3


class RegionShape(Protocol):
    @property
    def base(self) -> int: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def row_stride_bytes(self) -> int: ...
    @property
    def row_bytes(self) -> int: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def flags(self) -> int: ...


MAX_REGIONS = 65536
MAX_DESCRIPTORS = 16777216
COPY_FLAGS = 1 | 2 | 4  # KVC_COPY_PLAIN | KVC_COPY_STREAM | KVC_COPY_NO_STREAM


def call_violation(num_regions: int, num_descs: int, flags: int = 0) -> Verdict | None:
    """What is wrong with a call before any table is read: unknown copy flags, then too
    many regions or descriptors."""
    if flags & ~COPY_FLAGS:
        return (Status.E_FLAGS, 0, Side.NONE, _clamp(flags), COPY_FLAGS)
    if num_regions > MAX_REGIONS:
        return (Status.E_LIMIT, 0, Side.REGION, _clamp(num_regions), MAX_REGIONS)
    if num_descs > MAX_DESCRIPTORS:
        return (Status.E_LIMIT, 0, Side.NONE, _clamp(num_descs), MAX_DESCRIPTORS)
    return None


def first_violation(regions: Sequence[RegionShape], descs: Sequence[Sequence[int]],
                    flags: int = 0) -> Verdict | None:
    """The call's flags and sizes, then the first region, then the first descriptor that
    breaks a per-item rule."""
    call = call_violation(len(regions), len(descs), flags)
    if call:
        return call
    for i, r in enumerate(regions):
        bad = _region_violation(r)
        if bad:
            return (bad[0], i, Side.REGION, bad[1], bad[2])
    for i, d in enumerate(descs):
        desc_bad = _desc_violation(regions, d)
        if desc_bad:
            return (desc_bad[0], i, desc_bad[1], desc_bad[2], desc_bad[3])
    return None


def _clamp(v: int) -> int:
    return min(v, I64)


def _region_violation(r: RegionShape) -> tuple[int, int, int] | None:
    if r.flags & ~REGION_FLAGS:
        return (Status.E_FLAGS, r.flags, REGION_FLAGS)
    if r.base + r.size_bytes > U64:
        return (Status.E_OVERFLOW, _clamp(r.size_bytes), _clamp(U64 - r.base))
    if r.num_rows == 0:
        return None
    if r.base == 0:
        return (Status.E_REGION, 0, 1)
    if r.num_rows > 1 and r.row_bytes > r.row_stride_bytes:
        return (Status.E_REGION, _clamp(r.row_bytes), _clamp(r.row_stride_bytes))
    last = (r.num_rows - 1) * r.row_stride_bytes
    if last > U64:
        return (Status.E_OVERFLOW, _clamp(r.num_rows), _clamp(U64 // r.row_stride_bytes))
    if last + r.row_bytes > U64 or last + r.row_bytes > r.size_bytes:
        return (Status.E_REGION, _clamp(r.num_rows), _clamp(r.size_bytes))
    return None


def _side_violation(regions: Sequence[RegionShape], region: int, row: int, off: int,
                    size: int, side: int) -> tuple[int, int, int, int] | None:
    if not 0 <= region < len(regions):
        return (Status.E_REGION_ID, side, region, len(regions))
    r = regions[region]
    if not 0 <= row < r.num_rows:
        return (Status.E_ROW_RANGE, side, row, _clamp(r.num_rows))
    if row == 0 and r.flags & REGION_REFUSE_ROW0:
        return (Status.E_NULL_ROW, side, 0, 1)
    if off < 0:
        return (Status.E_NEGATIVE, side, off, 0)
    if size > r.row_bytes:
        return (Status.E_SIZE, side, size, _clamp(r.row_bytes))
    if off > r.row_bytes - size:
        return (Status.E_OFFSET, side, off, _clamp(r.row_bytes - size))
    return None


def address(regions: Sequence[RegionShape], region: int, row: int, off: int) -> int:
    r = regions[region]
    return r.base + row * r.row_stride_bytes + off


def _desc_violation(regions: Sequence[RegionShape], d: Sequence[int]
                    ) -> tuple[int, int, int, int] | None:
    sr, srow, soff, dr, drow, doff, size = d
    if size < 0:
        return (Status.E_NEGATIVE, Side.NONE, size, 0)
    if size == 0:
        return (Status.E_ZERO_SIZE, Side.NONE, 0, 1)
    bad = _side_violation(regions, sr, srow, soff, size, Side.SRC) or \
        _side_violation(regions, dr, drow, doff, size, Side.DST)
    if bad:
        return bad
    s, t = address(regions, sr, srow, soff), address(regions, dr, drow, doff)
    if s < t + size and t < s + size:
        return (Status.E_OVERLAP, Side.DST, _clamp(t), _clamp(s))
    return None


def cross_violations(regions: Sequence[RegionShape], descs: Sequence[Sequence[int]]
                     ) -> tuple[int, set[tuple[int, int]]] | None:
    """For a table every descriptor of which is valid: the cross-descriptor rule it breaks.

    Returns the status and every (index, value) pair the C library may report: two
    destinations sharing a byte as (later, earlier) on the destination side, else a source
    sharing a byte with another descriptor's destination as (reader, writer) on the source
    side (``CROSS_SIDE``).
    """
    spans = [(address(regions, d[0], d[1], d[2]), address(regions, d[3], d[4], d[5]), d[6])
             for d in descs]

    def meet(a: int, b: int, n: int, m: int) -> bool:
        return a < b + m and b < a + n

    dst = {(j, i) for j in range(len(spans)) for i in range(j)
           if meet(spans[j][1], spans[i][1], spans[j][2], spans[i][2])}
    if dst:
        return (Status.E_DST_OVERLAP, dst)
    reads = {(i, j) for i in range(len(spans)) for j in range(len(spans))
             if i != j and meet(spans[i][0], spans[j][1], spans[i][2], spans[j][2])}
    return (Status.E_READS_WRITTEN, reads) if reads else None


CROSS_SIDE: dict[int, int] = {Status.E_DST_OVERLAP: Side.DST, Status.E_READS_WRITTEN: Side.SRC}


def sequential_copy(memory: bytearray, origin: int, regions: Sequence[RegionShape],
                    descs: Sequence[Sequence[int]]) -> bytearray:
    """What an accepted table leaves in ``memory`` (addresses from ``origin``): one memcpy
    per descriptor, in order."""
    out = bytearray(memory)
    for sr, srow, soff, dr, drow, doff, size in descs:
        s = address(regions, sr, srow, soff) - origin
        t = address(regions, dr, drow, doff) - origin
        out[t:t + size] = out[s:s + size]
    return out
