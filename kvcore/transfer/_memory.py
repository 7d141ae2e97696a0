"""Registered memory: the byte layout of a KV tensor, its storage, and disjointness.

Every tensor the engine copies to or from is checked here once, at registration, and
kept as a ``_Pool``: its storage stays alive and its pointer and size are compared with
the registered ones before every copy, so a pool freed or resized in place is a failed
job, never a read of freed memory.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore._native import Region
from kvcore.spec.errors import TransferArgumentError

CPU_BUFFER_ALIGNMENT = 64  # an engine-provided CPU tier buffer starts on a cache line


@dataclass(frozen=True)
class _Pool:
    """One registered tensor's memory as it was at registration, its storage kept alive.

    Holding ``storage`` means the engine dropping its own reference (``del kv``) frees
    nothing kvcore still copies to. Freeing or moving the bytes in place
    (``untyped_storage().resize_()``, ``set_()``) cannot be prevented from Python, so
    ``changed()`` compares the storage's pointer and size, and the tensor's own pointer,
    with what was registered; every submit and every copy asks it first.
    """

    where: str
    tensor: torch.Tensor
    storage: torch.UntypedStorage
    storage_ptr: int
    storage_nbytes: int
    base: int
    row_bytes: int
    stride_bytes: int

    @property
    def rows(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def extent(self) -> int:
        """Bytes from ``base`` to the end of the last row (0 for a tensor without rows)."""
        return (self.rows - 1) * self.stride_bytes + self.row_bytes if self.rows else 0

    def region(self, flags: int) -> Region:
        return Region(base=self.base, size_bytes=self.extent, row_stride_bytes=self.stride_bytes,
                      row_bytes=self.row_bytes, num_rows=self.rows, flags=flags)

    def changed(self) -> str | None:
        """What changed since registration, or None while the memory is the registered one."""
        ptr, nbytes = self.storage.data_ptr(), self.storage.nbytes()
        if ptr != self.storage_ptr or nbytes != self.storage_nbytes:
            return (f"{self.where}'s storage was registered at {self.storage_ptr:#x} with "
                    f"{self.storage_nbytes} bytes and is now at {ptr:#x} with {nbytes} bytes "
                    "(freed or resized, e.g. untyped_storage().resize_())")
        if self.tensor.data_ptr() != self.base:
            return (f"{self.where} now points at {self.tensor.data_ptr():#x}, not the "
                    f"registered {self.base:#x} (set_() or a new storage)")
        return None


@dataclass(frozen=True)
class _Registered:
    """One GPU KV tensor, its CPU-tier twin, and their region indices."""

    gpu: torch.Tensor
    cpu: torch.Tensor
    row_bytes: int
    gpu_region: int
    cpu_region: int
    gpu_pool: _Pool
    cpu_pool: _Pool


def _bad(where: str, message: str, *, value: int | None = None,
         bound: int | None = None) -> TransferArgumentError:
    return TransferArgumentError(where, message, value=value, bound=bound)


def _row_layout(t: object, where: str) -> tuple[int, int]:
    """(row_bytes, row_stride_bytes) of a tensor whose dim 0 is the block id.

    Each row must be one contiguous byte range (any dtype; it is copied as bytes); rows may
    be strided, which covers per-layer views of a packed cross-layer tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise _bad(where, f"must be a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested or t.dim() < 1:
        raise _bad(where, f"must be a strided tensor with a block dimension first (layout "
                          f"{t.layout}{', nested' if t.is_nested else ''}, {t.dim()} dims)")
    if t.is_conj() or t.is_neg():
        raise _bad(where, "has a lazy conj/neg bit; pass t.resolve_conj().resolve_neg()")
    if any(s < 0 for s in t.stride()):
        raise _bad(where, f"has negative strides {t.stride()}; pass a tensor with "
                          "non-negative strides", value=min(t.stride()), bound=0)
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:], strict=True))):
        if size > 1 and stride != expected:
            raise _bad(where, f"rows are not contiguous (shape {tuple(t.shape)}, strides "
                              f"{t.stride()}); each block's bytes must be contiguous, e.g. "
                              "use .contiguous() on the pool", value=stride, bound=expected)
        expected *= size
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    stride_bytes = t.stride(0) * t.element_size()
    if row_bytes == 0:
        raise _bad(where, f"has 0 bytes per block (shape {tuple(t.shape)})", value=0, bound=1)
    if t.shape[0] > 1 and stride_bytes < row_bytes:
        raise _bad(where, f"rows overlap (row stride {stride_bytes} bytes < row {row_bytes} "
                          "bytes)", value=stride_bytes, bound=row_bytes)
    return row_bytes, stride_bytes


def _pool_of(t: object, where: str, device: torch.device) -> _Pool:
    """Check a tensor's layout, device and storage bounds; keep its storage.

    The bound is the one the C library cannot check: every byte a row id can reach,
    ``storage_offset * element_size + extent``, must lie inside the storage's allocation
    (a tensor whose storage was shrunk with ``untyped_storage().resize_()`` keeps its
    shape and would let a valid block id read freed memory).
    """
    row_bytes, stride_bytes = _row_layout(t, where)
    if not isinstance(t, torch.Tensor):  # _row_layout refused everything else already
        raise _bad(where, "must be a torch.Tensor")
    if t.device != device:
        raise _bad(where, f"is on {t.device}, but this engine's tensors are on {device}; "
                          "one TransferEngine serves one device")
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    offset = int(t.storage_offset()) * t.element_size()
    reach = (sum(int(n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) \
        * t.element_size() if t.numel() else 0
    if offset + reach > nbytes:
        raise _bad(where, f"reaches byte {offset + reach} of its storage (offset {offset} + "
                          f"extent {reach}), but the storage holds {nbytes} bytes (shrunk or "
                          "freed, e.g. by untyped_storage().resize_()); register a tensor "
                          "whose storage covers its shape", value=offset + reach, bound=nbytes)
    if t.data_ptr() != storage.data_ptr() + offset:
        raise _bad(where, f"data_ptr {t.data_ptr():#x} is not its storage's "
                          f"{storage.data_ptr():#x} + offset {offset}")
    return _Pool(where, t, storage, storage.data_ptr(), nbytes, t.data_ptr(), row_bytes,
                 stride_bytes)


def _rows_may_meet(a: _Pool, b: _Pool) -> bool:
    """Whether two pools whose byte spans intersect may share a byte.

    Views of one packed tensor interleave (layer k's rows sit between layer k-1's), so spans
    alone say nothing: with one common row stride, rows stay apart exactly when b's rows
    start at least a row of a after a's rows start, modulo the stride, and end before the
    next row of a. Other layouts whose spans meet are refused as not provably disjoint.
    """
    if a.rows > 1 and b.rows > 1 and a.stride_bytes == b.stride_bytes:
        d = (b.base - a.base) % a.stride_bytes
        return d < a.row_bytes or d + b.row_bytes > a.stride_bytes
    return True


def _check_disjoint(pools: Sequence[_Pool]) -> None:
    """No two registered tensors may share a byte: a load into one would change the other.

    One sweep over the spans in address order; only pairs whose spans meet are compared.
    """
    order = sorted((p for p in pools if p.rows), key=lambda p: p.base)
    active: list[_Pool] = []
    for p in order:
        active = [q for q in active if q.base + q.extent > p.base]
        for q in active:
            if _rows_may_meet(q, p):
                raise _bad(p.where, f"shares memory with {q.where} (bytes {p.base:#x}.."
                                    f"{p.base + p.extent:#x} and {q.base:#x}.."
                                    f"{q.base + q.extent:#x}); register each KV tensor once, "
                                    "in one group")
        active.append(p)



def _check_buffer(buf: object, where: str, nbytes: int, pinned: bool) -> torch.Tensor:
    """An engine-provided CPU tier buffer: exactly the bytes the groups need, nothing else.

    1-D contiguous uint8 on the CPU, its storage covering it, ``CPU_BUFFER_ALIGNMENT``-byte
    aligned, page-locked when the engine copies to a GPU (``pin_memory``), and exactly
    ``nbytes`` long: a larger buffer would be pinned memory no slot can use.
    """
    if not isinstance(buf, torch.Tensor):
        raise _bad(where, f"must be a torch.Tensor, not {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.layout != torch.strided:
        raise _bad(where, f"must be a 1-D uint8 tensor (got {buf.dtype}, shape "
                          f"{tuple(buf.shape)}); pass torch.empty(n, dtype=torch.uint8, "
                          "pin_memory=True)")
    if buf.device.type != "cpu":
        raise _bad(where, f"is on {buf.device}; the CPU tier lives in host memory")
    _pool_of(buf, where, torch.device("cpu"))  # its storage must cover it
    if not buf.is_contiguous():  # 1-D by now: stride 1, or at most one byte
        raise _bad(where, f"is not contiguous (stride {buf.stride(0)})", value=buf.stride(0),
                   bound=1)
    if buf.numel() != nbytes:
        raise _bad(where, f"holds {buf.numel()} bytes; the CPU tier needs exactly {nbytes} "
                          "(sum over its tensors of capacity x blocks_per_chunk x bytes per "
                          "block)", value=buf.numel(), bound=nbytes)
    if buf.data_ptr() % CPU_BUFFER_ALIGNMENT:
        raise _bad(where, f"starts at {buf.data_ptr():#x}, not a multiple of "
                          f"{CPU_BUFFER_ALIGNMENT} bytes", value=buf.data_ptr() %
                   CPU_BUFFER_ALIGNMENT, bound=0)
    if pinned and not buf.is_pinned():
        raise _bad(where, "is not page-locked; copies to the GPU need pinned memory "
                          "(torch.empty(..., pin_memory=True), or pass pin_memory=False)")
    return buf



def _writable_spans() -> list[tuple[int, int, bool]] | None:
    """This process's mappings as (start, end, writable), sorted, from Linux's
    /proc/self/maps; None where the system does not say (no file, an empty one, a line
    it cannot read): then nothing is refused for it."""
    try:
        with open("/proc/self/maps") as f:
            text = f.read()
        spans = []
        for line in text.splitlines():
            fields = line.split(maxsplit=2)
            lo, hi = fields[0].split("-", 1)
            spans.append((int(lo, 16), int(hi, 16), fields[1][1:2] == "w"))
    except (OSError, ValueError, IndexError):
        return None
    return sorted(spans) or None


def _check_writable(pools: Sequence[_Pool]) -> None:
    """Every byte of a host-memory pool lies in a writable mapping.

    A load writes the GPU pool and a store the CPU tier: a tensor over memory mapped
    read-only (``torch.frombuffer`` over a read-only ``mmap``) passed every layout check
    and then killed the process with a segfault in the copy. The mappings are read once
    per registration and each pool is found by bisection. Not covered: a tensor over an
    immutable Python object (``torch.frombuffer(b"...")``) lies in the writable heap, and
    torch keeps no read-only flag, so pools must be writable tensors (docs/engine.md).
    Device memory is not the host's to map, so only CPU pools are looked at.
    """
    host = [p for p in pools if p.rows and p.tensor.device.type == "cpu"]
    if not host:
        return
    spans = _writable_spans()
    if spans is None:
        return
    starts = [lo for lo, _, _ in spans]
    for p in host:
        end = p.base + p.extent
        covered = p.base
        at = max(bisect.bisect_right(starts, covered) - 1, 0)
        while covered < end and at < len(spans):
            lo, hi, writable = spans[at]
            if lo > covered or not writable:
                break
            covered = max(covered, hi)
            at += 1
        if covered < end:
            raise _bad(p.where, f"has bytes at {covered:#x} that are not writable memory of "
                                "this process (e.g. torch.frombuffer over a read-only "
                                "mmap); kvcore writes into every registered pool: pass a "
                                "writable tensor", value=covered, bound=end)


def check_pools(pools: Sequence[_Pool]) -> None:
    """What every registration asks of its pools together: no shared byte, all writable."""
    _check_disjoint(pools)
    _check_writable(pools)
