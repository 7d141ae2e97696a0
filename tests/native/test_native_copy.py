"""The C copy API directly: known answers, one table of bad descriptors, hostile fuzzing.

Goal: every descriptor the C library accepts lies inside its regions, every one it refuses
is refused before any byte moves, and the process never crashes. Method: regions are carved
out of one arena tensor surrounded by guard bytes; a Python reference validator (written
from the header's rules, with unbounded ints) predicts the exact status, index, side, value
and bound for any input; Hypothesis drives hostile regions and descriptors, and after each
call the whole arena must equal the reference copy (sequential memcpy semantics) on success
or be unchanged on error.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from hypothesis import currently_in_test_context, event, given
from hypothesis import strategies as st

from kvcore import _native
from kvcore._native import DescriptorTable, Region, RegionTable, Side, Status
from kvcore.spec.descriptors import address, sequential_copy
from kvcore.spec.descriptors import cross_violations as reference_overlaps
from kvcore.spec.descriptors import first_violation as reference_check
from kvcore.spec.errors import KVCopyError

U64 = (1 << 64) - 1
I64 = (1 << 63) - 1
ARENA_BYTES = 4096
GUARD = 256  # bytes before and after the regions that no valid copy may touch


class Arena:
    """One uint8 tensor holding every region, filled with seeded random bytes."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.buf = torch.randint(0, 256, (ARENA_BYTES + 2 * GUARD,), dtype=torch.uint8,
                                 generator=gen)
        self.base = self.buf.data_ptr() + GUARD

    def snapshot(self) -> bytearray:
        return bytearray(ctypes.string_at(self.buf.data_ptr(), self.buf.numel()))

    def region(self, offset: int, stride: int, row_bytes: int, rows: int,
               flags: int = 0, size: int | None = None) -> Region:
        extent = (rows - 1) * stride + row_bytes if rows else 0
        return Region(self.base + offset, extent if size is None else size, stride, row_bytes,
                      rows, flags)


def reference_copy(arena: Arena, before: bytearray, regions: list[Region],
                   descs: Sequence[tuple[int, ...]]) -> bytearray:
    """Sequential memcpy semantics over a snapshot (what the C library promises)."""
    return sequential_copy(before, arena.buf.data_ptr(), regions, descs)


def run_and_check(arena: Arena, regions: list[Region], descs: Sequence[tuple[int, ...]],
                  flags: int = 0) -> KVCopyError | None:
    """Copy through the C API and compare every arena byte with the reference."""
    expected_error = reference_check(regions, descs)
    if currently_in_test_context():  # statistics for --hypothesis-show-statistics
        event("accepted" if expected_error is None else Status(expected_error[0]).name)
    before = arena.snapshot()
    error = None
    try:
        _native.copy(RegionTable(regions), DescriptorTable.pack(descs), flags=flags)
    except KVCopyError as exc:
        error = exc
    after = arena.snapshot()
    cross = reference_overlaps(regions, descs) if expected_error is None else None
    if currently_in_test_context() and cross is not None:
        event(Status(cross[0]).name)
    if cross is not None:
        assert error is not None, f"accepted, expected {Status(cross[0]).name}"
        assert error.code == cross[0] and error.bound == 0, error
        assert (error.descriptor_index, error.value) in cross[1], (error, cross[1])
        assert after == before, "an invalid call changed bytes"
    elif expected_error is None:
        assert error is None, error
        assert after == reference_copy(arena, before, regions, descs)
    else:
        assert error is not None, f"accepted, expected {expected_error}"
        status, index, side, value, bound = expected_error
        assert (error.code, error.value, error.bound) == (status, value, bound), error
        assert error.descriptor_index == (None if side == Side.REGION else index), error
        assert after == before, "an invalid call changed bytes"
    return error


# -- known answers ---------------------------------------------------------------------------

def two_regions(arena: Arena) -> list[Region]:
    """A 'GPU' pool (8 rows of 64 B, row 0 refused) and a 'CPU' pool (4 rows of 128 B)."""
    return [arena.region(0, 64, 64, 8, flags=_native.REGION_REFUSE_ROW0),
            arena.region(1024, 128, 128, 4)]


@pytest.mark.parametrize("flags", [0, _native.COPY_PLAIN, _native.COPY_STREAM,
                                   _native.COPY_NO_STREAM])
def test_gather_and_scatter_known_answer(flags: int) -> None:
    arena = Arena(1)
    regions = two_regions(arena)
    descs = [(0, 3, 0, 1, 2, 64, 64), (0, 4, 0, 1, 2, 0, 64), (1, 3, 0, 0, 7, 0, 64),
             (0, 1, 8, 1, 0, 16, 32), (0, 1, 40, 1, 0, 48, 24)]
    assert run_and_check(arena, regions, descs, flags) is None
    # Reading a row another descriptor of the same call writes is refused on every path.
    descs[2] = (1, 2, 0, 0, 7, 0, 64)
    error = run_and_check(arena, regions, descs, flags)
    assert error is not None and error.code == Status.E_READS_WRITTEN
    assert (error.descriptor_index, error.value) in {(2, 0), (2, 1)}


def test_empty_call_is_a_no_op() -> None:
    arena = Arena(2)
    assert run_and_check(arena, two_regions(arena), []) is None
    _native.validate(RegionTable([]), DescriptorTable.pack([]))


def test_strided_rows_of_a_packed_tensor() -> None:
    """A per-layer view: rows 96 B apart, 32 usable bytes each (row_bytes < stride)."""
    arena = Arena(3)
    regions = [arena.region(0, 96, 32, 10, flags=_native.REGION_REFUSE_ROW0),
               arena.region(2048, 64, 64, 5)]
    assert run_and_check(arena, regions, [(0, 9, 0, 1, 4, 32, 32), (1, 0, 0, 0, 1, 0, 32)]) \
        is None
    error = run_and_check(arena, regions, [(0, 9, 16, 1, 4, 0, 32)])
    assert error is not None and error.code == Status.E_OFFSET


def test_validate_only_never_copies() -> None:
    arena = Arena(4)
    before = arena.snapshot()
    _native.validate(RegionTable(two_regions(arena)),
                     DescriptorTable.pack([(0, 3, 0, 1, 2, 0, 64)]))
    assert arena.snapshot() == before


# -- one table of bad descriptors -------------------------------------------------------------

BAD_DESCRIPTORS = [
    # (why, descriptor, status, side)
    ("negative source id", (0, -1, 0, 1, 0, 0, 64), Status.E_ROW_RANGE, Side.SRC),
    ("source id = row count", (0, 8, 0, 1, 0, 0, 64), Status.E_ROW_RANGE, Side.SRC),
    ("destination id = row count", (0, 1, 0, 1, 4, 0, 64), Status.E_ROW_RANGE, Side.DST),
    ("huge id", (0, I64, 0, 1, 0, 0, 64), Status.E_ROW_RANGE, Side.SRC),
    ("most negative id", (0, -I64 - 1, 0, 1, 0, 0, 64), Status.E_ROW_RANGE, Side.SRC),
    ("null GPU block as source", (0, 0, 0, 1, 0, 0, 64), Status.E_NULL_ROW, Side.SRC),
    ("null GPU block as destination", (1, 0, 0, 0, 0, 0, 64), Status.E_NULL_ROW, Side.DST),
    ("size larger than a row", (0, 1, 0, 1, 0, 0, 65), Status.E_SIZE, Side.SRC),
    ("size larger than the destination row", (1, 1, 0, 0, 1, 0, 128), Status.E_SIZE, Side.DST),
    ("offset past the row", (0, 1, 1, 1, 0, 0, 64), Status.E_OFFSET, Side.SRC),
    ("offset near 2**63 (overflow)", (0, 1, I64, 1, 0, 0, 64), Status.E_OFFSET, Side.SRC),
    ("destination offset overflow", (0, 1, 0, 1, 0, I64 - 10, 64), Status.E_OFFSET, Side.DST),
    ("negative offset", (0, 1, -8, 1, 0, 0, 8), Status.E_NEGATIVE, Side.SRC),
    ("negative size", (0, 1, 0, 1, 0, 0, -64), Status.E_NEGATIVE, Side.NONE),
    ("huge negative size", (0, 1, 0, 1, 0, 0, -I64 - 1), Status.E_NEGATIVE, Side.NONE),
    ("zero-length copy", (0, 1, 0, 1, 0, 0, 0), Status.E_ZERO_SIZE, Side.NONE),
    ("unknown source region", (4, 1, 0, 1, 0, 0, 64), Status.E_REGION_ID, Side.SRC),
    ("negative destination region", (0, 1, 0, -1, 0, 0, 64), Status.E_REGION_ID, Side.DST),
    ("source equals destination", (0, 2, 0, 0, 2, 0, 64), Status.E_OVERLAP, Side.DST),
    ("partial overlap in a row", (1, 1, 0, 1, 1, 32, 64), Status.E_OVERLAP, Side.DST),
    ("zero-row region", (3, 0, 0, 1, 0, 0, 8), Status.E_ROW_RANGE, Side.SRC),
]


@pytest.mark.parametrize(("why", "desc", "status", "side"), BAD_DESCRIPTORS,
                         ids=[row[0] for row in BAD_DESCRIPTORS])
def test_bad_descriptor_table(why: str, desc: tuple[int, ...], status: int, side: int) -> None:
    """Each bad descriptor sits at index 2 between good ones; nothing at all may move."""
    arena = Arena(5)
    regions = [*two_regions(arena), arena.region(3000, 8, 8, 1), arena.region(3100, 8, 8, 0)]
    good = [(0, 3, 0, 1, 2, 0, 64), (0, 4, 0, 1, 2, 64, 64), (0, 5, 0, 1, 3, 0, 64)]
    error = run_and_check(arena, regions, [good[0], good[1], desc, good[2]])
    assert error is not None and error.code == status and error.descriptor_index == 2
    assert "no bytes were copied" in str(error) and "descriptor 2 of 4" in str(error)
    expected = reference_check(regions, [desc])
    assert expected is not None and expected[2] == side


@pytest.mark.parametrize("value", [1 << 63, -(1 << 63) - 1, 1 << 64, 1 << 200])
def test_values_beyond_64_bits_are_copy_errors(value: int) -> None:
    with pytest.raises(KVCopyError) as info:
        DescriptorTable.pack([(0, 1, value, 1, 0, 0, 64)])
    assert info.value.code == Status.E_OVERFLOW and info.value.descriptor_index == 0


@pytest.mark.parametrize("bad", [(0, 1.0, 0, 1, 0, 0, 64), (0, "1", 0, 1, 0, 0, 64),
                                 (0, True, 0, 1, 0, 0, 64), (0, 1, 0, 1, 0, 0),
                                 "0101000", (0, None, 0, 1, 0, 0, 64)])
def test_wrong_python_types_are_value_errors(bad: object) -> None:
    with pytest.raises(ValueError):
        DescriptorTable.pack([bad])  # type: ignore[list-item]


def test_mismatched_column_lengths() -> None:
    with pytest.raises(KVCopyError) as info:
        _native.columns_to_descriptors([[0], [1], [0], [1], [0, 1], [0], [64]])
    assert info.value.code == Status.E_SHAPE


def test_null_tables_and_limits_are_refused() -> None:
    ffi, lib = _native.load()
    err = ffi.new("kvc_error *")
    assert lib.kvc_validate(ffi.NULL, 1, ffi.NULL, 0, err) == Status.E_NULL_ARGUMENT
    assert lib.kvc_copy(ffi.NULL, 0, ffi.NULL, 3, 0, err) == Status.E_NULL_ARGUMENT
    table = DescriptorTable.pack([(0, 1, 0, 1, 0, 0, 64)])
    too_many = lib.KVC_MAX_DESCRIPTORS + 1
    assert lib.kvc_validate(ffi.NULL, 0, table.cdata, too_many, err) == Status.E_LIMIT
    assert lib.kvc_copy(ffi.NULL, lib.KVC_MAX_REGIONS + 1, table.cdata, 1, 0, err) \
        == Status.E_LIMIT
    assert lib.kvc_copy(ffi.NULL, 0, ffi.NULL, 0, 1 << 40, err) == Status.E_FLAGS


def test_inconsistent_regions_are_refused() -> None:
    arena = Arena(6)
    ok = arena.region(0, 64, 64, 4)
    cases = [replace(ok, size_bytes=ok.size_bytes - 1), replace(ok, row_bytes=65),
             replace(ok, base=0), replace(ok, flags=8), replace(ok, base=U64 - 10),
             replace(ok, row_stride_bytes=1 << 62, size_bytes=1 << 62)]
    for region in cases:
        error = run_and_check(arena, [region, arena.region(1024, 64, 64, 4)],
                              [(1, 0, 0, 1, 1, 0, 64)])
        assert error is not None and error.descriptor_index is None, region
    with pytest.raises(KVCopyError):
        RegionTable([replace(ok, num_rows=-1)])
    with pytest.raises(KVCopyError):
        RegionTable([replace(ok, size_bytes=1 << 64)])
    with pytest.raises(ValueError):
        RegionTable([replace(ok, base=1.5)])  # type: ignore[arg-type]


def test_region_checks_at_their_exact_edges() -> None:
    """Each region rule one step either side of its edge, C against the reference.

    The random tables rarely land on 2**64 exactly, and an off-by-one there decides between
    refusing a legal region and accepting one whose row arithmetic wraps. Kills the
    mutants of ``kvc_check_region`` that survived the hostile and random tests: ``>=`` for
    ``>`` in the base-plus-size overflow test, ``num_rows >= 1`` for ``> 1`` (a single row
    may be wider than the stride: there is no second row), and the overflow test on
    ``(num_rows - 1) * stride`` dropped or its ``!= 0`` flipped (the product then wraps to
    0 and the extent test passes).
    """
    arena = Arena(7)
    pools = [arena.region(0, 64, 64, 4), arena.region(1024, 64, 64, 4)]
    desc = (0, 1, 0, 1, 2, 0, 64)
    cases = [
        (Region(U64 - 64, 64, 64, 64, 0), None),  # ends exactly at 2**64 - 1
        (Region(U64 - 63, 64, 64, 64, 0), Status.E_OVERFLOW),  # one byte past it
        (arena.region(2048, 32, 64, 1), None),  # one row, wider than the stride
        (arena.region(2048, 32, 64, 2, size=96), Status.E_REGION),  # a second row overlaps
        # (2**32 rows past the first) * 2**32 bytes = 2**64: wraps to 0 unless refused.
        (Region(arena.base + 2048, 64, 1 << 32, 64, (1 << 32) + 1), Status.E_OVERFLOW),
        # One row fewer: the last row starts at 2**64 - 2**32, inside a region that ends
        # at 2**64 - 1 (never addressed: only its shape is checked).
        (Region(4096, U64 - 4096, 1 << 32, 64, 1 << 32), None),
    ]
    for region, status in cases:
        error = run_and_check(arena, [*pools, region], [desc])
        assert (None if error is None else error.code) == status, (region, error)
        if error is not None:
            assert error.descriptor_index is None, (region, error)


def test_a_copy_may_end_exactly_where_it_starts_reading() -> None:
    """One descriptor's source and destination in one row: touching is legal, one shared
    byte is an overlap. Kills ``<=`` for the first ``<`` of the self-overlap test in
    ``kvc_check_desc``, which refused an adjacent copy and survived the random tables (the
    second one's ``<=`` they already caught; the reverse case pins it here too)."""
    arena = Arena(8)
    rows = [arena.region(0, 128, 128, 2)]
    cases = [((0, 0, 0, 0, 0, 64, 64), None),  # source [0, 64), destination [64, 128)
             ((0, 0, 64, 0, 0, 0, 64), None),  # the other way round
             ((0, 0, 0, 0, 0, 63, 64), Status.E_OVERLAP),
             ((0, 0, 63, 0, 0, 0, 64), Status.E_OVERLAP)]
    for desc, status in cases:
        error = run_and_check(arena, rows, [desc])
        assert (None if error is None else error.code) == status, (desc, error)


def test_concurrent_copies_from_several_threads() -> None:
    """No shared state in C: threads copying into disjoint rows all land their bytes."""
    src = torch.randint(0, 256, (64, 4096), dtype=torch.uint8)
    dst = torch.zeros((64, 4096), dtype=torch.uint8)
    regions = RegionTable([Region(src.data_ptr(), src.numel(), 4096, 4096, 64),
                           Region(dst.data_ptr(), dst.numel(), 4096, 4096, 64)])
    errors: list[BaseException] = []

    def worker(first: int) -> None:
        try:
            for _ in range(20):
                descs = DescriptorTable.pack([(0, r, 0, 1, 63 - r, 0, 4096)
                                              for r in range(first, 64, 4)])
                _native.copy(regions, descs)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert torch.equal(dst, src.flip(0))


# -- hostile fuzzing ----------------------------------------------------------------------------

def edge_ints(limit: int) -> st.SearchStrategy[int]:
    """Small values around a limit plus the 64-bit extremes."""
    return st.one_of(st.integers(-2, limit + 2),
                     st.sampled_from([-(1 << 63), -1, I64, I64 - 1, 1 << 62, 1 << 32]))


def rare(value: int, common: int) -> st.SearchStrategy[int]:
    """``common`` most of the time, ``value`` about one time in eight."""
    return st.sampled_from([common] * 7 + [value])


@st.composite
def hostile_regions(draw: st.DrawFn, arena: Arena) -> list[Region]:
    """1-3 regions inside the arena; now and then an unknown flag or one byte too few."""
    regions = []
    for _ in range(draw(st.integers(1, 3))):
        offset = draw(st.integers(0, ARENA_BYTES - 1))
        row_bytes = draw(st.integers(0, 96))
        stride = row_bytes + draw(st.sampled_from([0, 0, 8, 33]))
        room = ARENA_BYTES - offset
        rows = draw(st.integers(0, max(0, min(12, (room - row_bytes) // max(stride, 1) + 1))))
        extent = (rows - 1) * stride + row_bytes if rows else 0
        if extent > room:
            rows, extent = 0, 0
        flags = draw(st.sampled_from([0, 0, 0, _native.REGION_REFUSE_ROW0])) | \
            draw(rare(4, 0))
        size = max(0, extent - draw(rare(1, 0)))
        regions.append(arena.region(offset, stride, row_bytes, rows, flags, size))
    return regions


@st.composite
def hostile_descriptors(draw: st.DrawFn, regions: list[Region]) -> list[tuple[int, ...]]:
    """Descriptors drawn near the valid range, with one field at a time pushed to an edge."""
    descs = []
    for _ in range(draw(st.integers(0, 6))):
        sr = draw(st.integers(0, len(regions) - 1))
        dr = draw(st.integers(0, len(regions) - 1))
        s, d = regions[sr], regions[dr]
        size = draw(st.integers(1, max(1, min(s.row_bytes, d.row_bytes))))
        desc = [sr, draw(st.integers(0, max(0, s.num_rows - 1))),
                draw(st.integers(0, max(0, s.row_bytes - size))), dr,
                draw(st.integers(0, max(0, d.num_rows - 1))),
                draw(st.integers(0, max(0, d.row_bytes - size))), size]
        if draw(st.booleans()):
            field = draw(st.integers(0, 6))
            limits = [len(regions), s.num_rows, s.row_bytes, len(regions), d.num_rows,
                      d.row_bytes, max(s.row_bytes, d.row_bytes)]
            desc[field] = draw(edge_ints(limits[field]))
        descs.append(tuple(desc))
    return descs


@given(st.data())
def test_hostile_inputs_match_the_reference(data: st.DataObject) -> None:
    arena = Arena()
    regions = data.draw(hostile_regions(arena))
    descs = data.draw(hostile_descriptors(regions))
    flags = data.draw(st.sampled_from([0, _native.COPY_PLAIN, _native.COPY_STREAM]))
    run_and_check(arena, regions, descs, flags)


@st.composite
def valid_copies(draw: st.DrawFn, regions: list[Region]) -> list[tuple[int, ...]]:
    """Mostly-valid descriptors (so the copy path, not just validation, is exercised)."""
    descs: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(1, 8))):
        sr, dr = draw(st.integers(0, 1)), draw(st.integers(0, 1))
        s, d = regions[sr], regions[dr]
        size = draw(st.integers(1, min(s.row_bytes, d.row_bytes)))
        desc = (sr, draw(st.integers(1, s.num_rows - 1)), draw(st.integers(0, s.row_bytes - size)),
                dr, draw(st.integers(1, d.num_rows - 1)), draw(st.integers(0, d.row_bytes - size)),
                size)
        if reference_check(regions, [*descs, desc]) is None and \
                reference_overlaps(regions, [*descs, desc]) is None:
            descs.append(desc)  # keep the table valid, so the copy itself is what is tested
    return descs or [(0, 1, 0, 1, 1, 0, 1)]


@given(st.data())
def test_valid_copies_match_sequential_semantics(data: st.DataObject) -> None:
    arena = Arena()
    regions = two_regions(arena)
    descs = data.draw(valid_copies(regions))
    run_and_check(arena, regions, descs, data.draw(st.sampled_from([0, _native.COPY_PLAIN])))


# -- overlap between the descriptors of one call ------------------------------------------------

CROSS_DESCRIPTORS = [
    # (why, descriptors, expected (status, index, value) or None when accepted)
    ("one destination twice", [(0, 1, 0, 1, 0, 0, 64), (0, 2, 0, 1, 0, 0, 64)],
     (Status.E_DST_OVERLAP, 1, 0)),
    ("destinations share 32 bytes", [(0, 1, 0, 1, 0, 0, 64), (0, 2, 0, 1, 0, 32, 64)],
     (Status.E_DST_OVERLAP, 1, 0)),
    ("destinations share the last byte", [(0, 2, 0, 1, 1, 63, 1), (0, 1, 0, 1, 1, 0, 64)],
     (Status.E_DST_OVERLAP, 1, 0)),
    ("third overlaps the first", [(0, 1, 0, 1, 0, 0, 64), (0, 2, 0, 1, 1, 0, 64),
                                  (0, 3, 0, 1, 0, 8, 8)], (Status.E_DST_OVERLAP, 2, 0)),
    ("reads what an earlier one writes", [(0, 1, 0, 1, 0, 0, 64), (1, 0, 0, 0, 2, 0, 64)],
     (Status.E_READS_WRITTEN, 1, 0)),
    ("reads what a later one writes", [(1, 0, 0, 0, 2, 0, 64), (0, 1, 0, 1, 0, 0, 64)],
     (Status.E_READS_WRITTEN, 0, 1)),
    ("reads one byte another writes", [(0, 1, 0, 1, 0, 0, 8), (1, 0, 7, 0, 2, 0, 1)],
     (Status.E_READS_WRITTEN, 1, 0)),
    ("adjacent destinations", [(0, 1, 0, 1, 0, 0, 64), (0, 2, 0, 1, 0, 64, 64)], None),
    ("one source read twice", [(0, 1, 0, 1, 0, 0, 64), (0, 1, 0, 1, 1, 0, 64)], None),
    ("reads right after another's destination", [(0, 1, 0, 1, 0, 0, 64),
                                                 (1, 0, 64, 0, 2, 0, 64)], None),
]


@pytest.mark.parametrize(("why", "descs", "expected"), CROSS_DESCRIPTORS,
                         ids=[row[0] for row in CROSS_DESCRIPTORS])
def test_overlap_between_descriptors(why: str, descs: list[tuple[int, ...]],
                                     expected: tuple[int, int, int] | None) -> None:
    """Every copy path may reorder (the CUDA batch has no order), so no byte is written twice
    and none is both read and written in one call; sources may repeat."""
    arena = Arena(7)
    regions = two_regions(arena)
    error = run_and_check(arena, regions, descs)
    if expected is None:
        assert error is None
        return
    assert error is not None
    assert (error.code, error.descriptor_index, error.value) == expected
    assert "no bytes were copied" in str(error) and f"descriptor {expected[2]}" in str(error)
    with pytest.raises(KVCopyError) as info:  # the dry run reports the same
        _native.validate(RegionTable(regions), DescriptorTable.pack(descs))
    assert (info.value.code, info.value.descriptor_index) == expected[:2]


FAKE_BASES = [1 << 12, (1 << 30) + 4096, 1 << 47, (1 << 62) + 64]
FAKE_STRIDES = [64, 96, 4096, 1 << 20, 1 << 41]


def check_validate(regions: list[Region], descs: list[tuple[int, ...]]) -> int:
    """Dry-run through C and compare the verdict with the two reference checks."""
    expected = reference_check(regions, descs)
    cross = reference_overlaps(regions, descs) if expected is None else None
    try:
        _native.validate(RegionTable(regions), DescriptorTable.pack(descs))
    except KVCopyError as exc:
        if expected is not None:
            assert (exc.code, exc.value, exc.bound) == (expected[0], expected[3], expected[4])
        else:
            assert cross is not None, f"refused a valid table: {exc}"
            assert exc.code == cross[0] and (exc.descriptor_index, exc.value) in cross[1]
        return int(exc.code)
    assert expected is None and cross is None, f"accepted, expected {expected or cross}"
    return Status.OK


@given(st.data())
def test_overlap_check_matches_the_quadratic_reference(data: st.DataObject) -> None:
    """Many descriptors over regions far apart in the address space (validation never touches
    the memory, so the regions are fake): the sort's paths (sorted input, 8-bit digits,
    keys wider than 40 bits) all give the verdict of the all-pairs reference."""
    regions = []  # region 0 is read from, the others are written (and now and then read)
    for _ in range(data.draw(st.integers(2, 4))):
        stride = data.draw(st.sampled_from(FAKE_STRIDES))
        row_bytes = data.draw(st.sampled_from([1, 16, 64]))
        regions.append(Region(data.draw(st.sampled_from(FAKE_BASES)), 40 * stride, stride,
                              row_bytes, 40))
    slots = [(r, row) for r in range(1, len(regions)) for row in range(40)]
    order = data.draw(st.permutations(slots))
    n = data.draw(st.integers(0, min(150, len(slots))))
    descs = []
    for i in range(n):
        dr, drow = order[i]  # distinct destination rows ...
        sr, srow = 0, data.draw(st.integers(0, 39))
        size = min(regions[sr].row_bytes, regions[dr].row_bytes)
        size = data.draw(st.sampled_from([size, max(1, size // 2)]))
        doff = data.draw(st.sampled_from([0, regions[dr].row_bytes - size]))
        descs.append((sr, srow, 0, dr, drow, doff, size))
    fault = data.draw(st.sampled_from(["none", "dst", "read"])) if n > 1 else "none"
    if fault != "none":  # ... except for one injected fault
        i, j = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
        other = descs[j]
        if fault == "dst":
            descs[i] = (*descs[i][:3], *other[3:5], 0, descs[i][6])
        else:
            descs[i] = (*other[3:5], 0, *descs[i][3:])
    if data.draw(st.booleans()):
        descs.sort(key=lambda d: address(regions, d[3], d[4], d[5]))  # the sorted fast path
    event(Status(check_validate(regions, descs)).name)


def test_wide_keys_and_long_tables_are_sorted_exactly() -> None:
    """Destinations 2**60 bytes apart and 2000 descriptors: one late duplicate is found."""
    regions = [Region(1 << 12, 4096 * 64, 64, 64, 4096),
               Region(1 << 20, 1000 * (1 << 50), 1 << 50, 64, 1000),
               Region((1 << 62) + (1 << 20), 1000 * 64, 64, 64, 1000)]
    gen = torch.Generator().manual_seed(9)
    rows = torch.randperm(2000, generator=gen).tolist()
    descs = [(0, i, 0, 1 + r // 1000, r % 1000, 0, 64) for i, r in enumerate(rows)]
    assert check_validate(regions, descs) == Status.OK
    dup = (0, 7, 0, *descs[123][3:])
    assert check_validate(regions, [*descs, dup]) == Status.E_DST_OVERLAP
    reader = (2, descs[1500][4], 0, 0, 4000, 0, 64) if descs[1500][3] == 2 else \
        (1, descs[1500][4], 0, 0, 4000, 0, 64)
    assert check_validate(regions, [*descs, reader]) == Status.E_READS_WRITTEN


# -- the caller's table is read once ------------------------------------------------------------

def test_copy_validates_its_own_reading_of_the_table() -> None:
    """A table that passed kvc_validate and was then rewritten is judged again by kvc_copy:
    a validation is never trusted across calls, and nothing is copied."""
    arena = Arena(8)
    regions = RegionTable(two_regions(arena))
    table = torch.tensor([[0, 3, 0, 1, 2, 0, 64], [0, 4, 0, 1, 3, 0, 64]], dtype=torch.int64)
    descs = DescriptorTable.from_address(table.data_ptr(), 2, table)
    _native.validate(regions, descs)
    table[1, 6] = 1 << 20  # now larger than a row
    before = arena.snapshot()
    with pytest.raises(KVCopyError) as info:
        _native.copy(regions, descs)
    assert (info.value.code, info.value.descriptor_index) == (Status.E_SIZE, 1)
    assert arena.snapshot() == before


def run_child(code: str, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter: a crash is a signal there, and fails here."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (f"child exited with {proc.returncode} (negative: killed by "
                                  f"signal {-proc.returncode})\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def test_a_table_rewritten_during_the_copy_never_copies_part() -> None:
    """Another thread flips the last descriptor's size between valid and too large while C
    copies with the GIL released. Each call must either copy everything (it read the valid
    size) or fail with KVC_E_SIZE having copied nothing (it read the bad one): a library
    that validated one reading and copied from a second would copy all but the last block
    and then fail, or copy a megabyte out of bounds."""
    out = run_child("""
        import sys, threading, time, torch
        from kvcore import _native
        from kvcore._native import DescriptorTable, Region, RegionTable, Status
        from kvcore.spec.errors import KVCopyError
        sys.setswitchinterval(1e-4)
        n, row = 4096, 256
        src = torch.randint(1, 256, (n, row), dtype=torch.uint8)
        dst = torch.zeros((n, row), dtype=torch.uint8)
        regions = RegionTable([Region(src.data_ptr(), n * row, row, row, n),
                               Region(dst.data_ptr(), n * row, row, row, n)])
        ids = torch.arange(n)
        z = torch.zeros(n, dtype=torch.int64)
        table = torch.stack([z, ids, z, z + 1, ids.flip(0), z, z + row], 1).contiguous()
        descs = DescriptorTable.from_address(table.data_ptr(), n, table)
        size = table[n - 1, 6:7]
        stop = threading.Event()
        def flip():
            while not stop.is_set():
                size.fill_(1 << 20)
                size.fill_(row)
        t = threading.Thread(target=flip)
        t.start()
        outcomes = {"copied": 0, "refused": 0}
        deadline = time.monotonic() + 3.0
        try:
            while time.monotonic() < deadline or sum(outcomes.values()) < 20:
                dst.zero_()
                try:
                    _native.copy(regions, descs)
                except KVCopyError as exc:
                    assert (exc.code, exc.descriptor_index) == (Status.E_SIZE, n - 1), exc
                    assert int(dst.count_nonzero()) == 0, "a refused call copied bytes"
                    outcomes["refused"] += 1
                else:
                    assert torch.equal(dst, src.flip(0)), "an accepted call copied wrong bytes"
                    outcomes["copied"] += 1
        finally:
            stop.set()
            t.join()
        print(outcomes)
    """)
    assert "copied" in out


def test_scratch_allocation_failure_is_no_memory() -> None:
    """When the per-call scratch cannot be allocated the call fails with KVC_E_NO_MEMORY,
    before it reads a descriptor; the same table then fails on its real fault."""
    out = run_child("""
        import resource
        from kvcore import _native
        from kvcore._native import DescriptorTable, RegionTable, Status
        from kvcore.spec.errors import KVCopyError
        ffi, _ = _native.load()
        n = 1 << 21  # 2M zero descriptors: 112 MiB table, 96 MiB scratch
        table = DescriptorTable(ffi.new("kvc_desc[]", n), n)
        regions = RegionTable([])
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (32 << 20), hard))
        try:
            _native.validate(regions, table)
        except KVCopyError as exc:
            first = exc
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        assert first.code == Status.E_NO_MEMORY, first
        assert first.value == n * 48 and "scratch memory" in str(first), first
        try:
            _native.copy(regions, table)
        except KVCopyError as exc:
            assert (exc.code, exc.descriptor_index) == (Status.E_ZERO_SIZE, 0), exc
        print("ok")
    """)
    assert out.strip() == "ok"
