"""The C copy library from Python: loading, packing tables, and the one error funnel.

``kvcore._kvcore_native`` is the cffi API-mode module built by ``pip install -e .`` from
``native/``. It is loaded lazily, so ``import kvcore`` works (scheduler, manager, spec) even
where the build has not run; the first copy then says how to build it.

Everything that crosses into C goes through two packers, ``RegionTable`` and
``DescriptorTable``: they turn wrong Python types into ``ValueError`` and numbers that do not
fit the C fields into ``KVCopyError``, because cffi would otherwise raise ``OverflowError``
or ``TypeError`` halfway through filling a table. ``raise_for_status`` is the one function
that turns a native status into ``KVCopyError`` (the C side owns the status texts, as in
argon2-cffi). cffi releases the GIL around every call into C, so copies run in parallel
with Python threads; ``tests/native/test_smoke.py`` checks that in the generated wrapper.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcore.spec.descriptors import REGION_DEVICE, REGION_REFUSE_ROW0, Side, Status
from kvcore.spec.errors import KVCopyError

# The status codes and sides are the header's, mirrored once in kvcore.spec.descriptors
# (beside the reference of what the library must refuse); re-exported here.
__all__ = ["REGION_DEVICE", "REGION_REFUSE_ROW0", "Side", "Status"]

INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)
UINT64_MAX = (1 << 64) - 1
DESC_FIELDS = 7  # kvc_desc: src_region, src_row, src_offset, dst_region, dst_row, dst_offset, size


COPY_PLAIN = 1
COPY_STREAM = 2
COPY_NO_STREAM = 4


@functools.cache
def load() -> tuple[Any, Any]:
    """``(ffi, lib)`` of the compiled module; ImportError that says how to build it."""
    try:
        module = importlib.import_module("kvcore._kvcore_native")
    except ImportError as exc:
        raise ImportError(
            "kvcore's C copy library (kvcore._kvcore_native) is not built; run "
            "`pip install -e .` in the kvcore checkout (it needs a C compiler and cffi)"
        ) from exc
    return module.ffi, module.lib


def status_text(status: int) -> str:
    """The C library's text for a status code (the one status -> text function)."""
    ffi, lib = load()
    return str(ffi.string(lib.kvc_status_text(int(status))).decode("utf-8"))


@dataclass(frozen=True)
class ErrorRecord:
    """A copy of ``kvc_error``: the first bad descriptor (or region) and what broke."""

    status: int
    index: int
    value: int
    bound: int
    side: int

    @classmethod
    def from_cdata(cls, err: Any) -> ErrorRecord:
        return cls(int(err.status), int(err.index), int(err.value), int(err.bound),
                   int(err.side))


_ROLE_DEFAULT = ("source row", "destination row")


def _describe(rec: ErrorRecord, roles: tuple[str, str]) -> str:
    """The teaching part of the message: what is wrong, with the value and its bound."""
    sides: dict[int, str] = {Side.SRC: roles[0], Side.DST: roles[1]}
    role = sides.get(rec.side, "descriptor")
    place = "offset" if rec.side in (Side.SRC, Side.DST) else "size"
    v, b = rec.value, rec.bound
    if rec.status == Status.E_ROW_RANGE:
        if b == 0:
            return f"{role} id {v} is refused: that region has no rows"
        low = 1 if role.startswith("GPU") else 0  # GPU block 0 is the null block
        return f"{role} id {v} is outside {low}..{b - 1}"
    texts: dict[int, str] = {
        Status.E_NULL_ROW: f"{role} id 0 is the null block and is never copied",
        Status.E_REGION_ID: f"{role} names region {v}, but regions are 0..{b - 1}",
        Status.E_NEGATIVE: f"{role} {place} {v} is negative",
        Status.E_ZERO_SIZE: "size_bytes=0; a descriptor must move at least 1 byte",
        Status.E_SIZE: f"size_bytes={v} is larger than the {role} of {b} bytes",
        Status.E_OFFSET: f"{role} offset {v} + size runs past the row end "
                         f"(offset must be <= {b})",
        Status.E_OVERLAP: "source and destination bytes overlap",
        Status.E_DST_OVERLAP: f"{role} bytes overlap those descriptor {v} writes; every "
                              "destination byte may be written by one descriptor only (a "
                              "block or chunk named twice as a destination?)",
        Status.E_READS_WRITTEN: f"{role} bytes are written by descriptor {v} of the same call; "
                                "a call may not read what it writes (split it in two calls)",
        Status.E_NO_MEMORY: f"the copy needs {v} bytes of scratch memory and the allocation "
                            "failed; pass fewer descriptors per call",
    }
    return texts.get(rec.status) or f"{status_text(rec.status)} (value={v}, bound={b})"


def make_error(rec: ErrorRecord, *, num_descs: int, context: str = "",
               roles: tuple[str, str] = _ROLE_DEFAULT, job_id: int | None = None,
               group: int | None = None, native: bool = False) -> KVCopyError:
    """Build the KVCopyError for a failed status: what is wrong, the value and its bound.
    Python's own range checks build theirs here too, so both read the same; ``native``
    says which one refused (the C funnel below sets it)."""
    where = f" ({context})" if context else ""
    if rec.side == Side.REGION:
        head = f"region {rec.index}{where}: {status_text(rec.status)} " \
               f"(value={rec.value}, bound={rec.bound})"
    elif rec.status == Status.E_NO_MEMORY:
        head = f"a call with {num_descs} descriptors{where}: {_describe(rec, roles)}"
    else:
        head = f"descriptor {rec.index} of {num_descs}{where}: {_describe(rec, roles)}"
    if rec.status == Status.E_CUDA:
        tail = f"; CUDA error {rec.value}; copies before this descriptor may have been enqueued."
    else:
        tail = "; no bytes were copied."
    region = rec.side == Side.REGION
    return KVCopyError(head + tail, code=rec.status,
                       descriptor_index=None if region else rec.index, job_id=job_id,
                       group=group, value=rec.value, bound=rec.bound, side=rec.side,
                       region_index=rec.index if region else None, native=native)


def raise_for_status(status: int, err: Any, *, num_descs: int, context: str = "",
                     roles: tuple[str, str] = _ROLE_DEFAULT, job_id: int | None = None,
                     group_of: Callable[[int], int] | None = None) -> None:
    """The one funnel: raise KVCopyError for a non-zero status, do nothing for KVC_OK.

    ``group_of`` maps a descriptor index to the KV group it belongs to, so that the error of
    a whole job names the group (TransferEngine builds one table per job).
    """
    if status == Status.OK:
        return
    rec = ErrorRecord.from_cdata(err)
    if rec.status != status:  # a status without a filled record (should not happen)
        rec = ErrorRecord(int(status), rec.index, rec.value, rec.bound, rec.side)
    group = None
    if group_of is not None and rec.side != Side.REGION and 0 <= rec.index < num_descs:
        group = group_of(rec.index)
        context = f"{context}, group {group}" if context else f"group {group}"
    raise make_error(rec, num_descs=num_descs, context=context, roles=roles, job_id=job_id,
                     group=group, native=True)


def _check_int(name: str, value: object) -> int:
    """Wrong Python types are ValueError (bool included: True is not a block id)."""
    if type(value) is not int:
        raise ValueError(f"{name}={value!r} must be an int, not {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Region:
    """One registered memory region (see ``kvc_region`` in native/kvcore_copy.h)."""

    base: int
    size_bytes: int
    row_stride_bytes: int
    row_bytes: int
    num_rows: int
    flags: int = 0


class RegionTable:
    """Regions packed once into a C array; validated in C on every call that uses them."""

    def __init__(self, regions: Sequence[Region]) -> None:
        ffi, _ = load()
        self.regions = tuple(regions)
        self.cdata = ffi.new("kvc_region[]", max(1, len(self.regions)))
        fields = ("base", "size_bytes", "row_stride_bytes", "row_bytes", "num_rows", "flags")
        for i, r in enumerate(self.regions):
            if not isinstance(r, Region):
                raise ValueError(f"regions[{i}]={r!r} must be a kvcore._native.Region")
            for name in fields:
                v = _check_int(f"regions[{i}].{name}", getattr(r, name))
                if not 0 <= v <= UINT64_MAX:
                    code = Status.E_NEGATIVE if v < 0 else Status.E_OVERFLOW
                    raise KVCopyError(
                        f"region {i}: {name}={v} does not fit an unsigned 64-bit field; "
                        "no bytes were copied.", code=code, value=v, bound=UINT64_MAX)
                setattr(self.cdata[i], name, v)

    def __len__(self) -> int:
        return len(self.regions)


class DescriptorTable:
    """A ``kvc_desc`` array: packed from Python tuples, or borrowed from an (n, 7) int64 buffer.

    ``keepalive`` holds the buffer (for example a torch tensor) the borrowed pointer lives in.
    """

    def __init__(self, cdata: Any, count: int, keepalive: object = None) -> None:
        self.cdata = cdata
        self.count = count
        self.keepalive = keepalive

    @classmethod
    def pack(cls, descs: Iterable[Sequence[int]]) -> DescriptorTable:
        """Pack 7-tuples (src_region, src_row, src_off, dst_region, dst_row, dst_off, size)."""
        ffi, _ = load()
        rows = list(descs)
        cdata = ffi.new("kvc_desc[]", max(1, len(rows)))
        flat = ffi.cast("int64_t *", cdata)
        for i, d in enumerate(rows):
            if isinstance(d, (str, bytes)) or not isinstance(d, Sequence) \
                    or len(d) != DESC_FIELDS:
                raise ValueError(f"descriptor {i}={d!r} must be a sequence of {DESC_FIELDS} ints")
            for j, v in enumerate(d):
                v = _check_int(f"descriptor {i} field {j}", v)
                if not INT64_MIN <= v <= INT64_MAX:
                    raise KVCopyError(
                        f"descriptor {i} of {len(rows)}: field {j} = {v} does not fit a signed "
                        "64-bit field (offsets and sizes overflow); no bytes were copied.",
                        code=Status.E_OVERFLOW, descriptor_index=i, value=v, bound=INT64_MAX)
                flat[i * DESC_FIELDS + j] = v
        return cls(cdata, len(rows))

    @classmethod
    def from_address(cls, address: int, count: int, keepalive: object) -> DescriptorTable:
        """Borrow ``count`` descriptors at ``address`` (contiguous int64, 7 per row)."""
        ffi, _ = load()
        return cls(ffi.cast("kvc_desc *", address), count, keepalive)


def columns_to_descriptors(columns: Sequence[Sequence[int]]) -> DescriptorTable:
    """Pack 7 parallel lists; lists of different lengths are a KVC_E_SHAPE KVCopyError."""
    if len(columns) != DESC_FIELDS:
        raise ValueError(f"expected {DESC_FIELDS} columns, got {len(columns)}")
    lengths = [len(c) for c in columns]
    if len(set(lengths)) > 1:
        raise KVCopyError(f"descriptor columns have mismatched lengths {lengths}; no bytes "
                          "were copied.", code=Status.E_SHAPE, value=max(lengths),
                          bound=min(lengths))
    return DescriptorTable.pack(list(zip(*columns, strict=True)))


def validate(regions: RegionTable, descs: DescriptorTable, *, context: str = "",
             roles: tuple[str, str] = _ROLE_DEFAULT, job_id: int | None = None,
             group_of: Callable[[int], int] | None = None) -> None:
    """Dry run: raise KVCopyError for the first bad descriptor; copy nothing."""
    ffi, lib = load()
    err = ffi.new("kvc_error *")
    status = lib.kvc_validate(regions.cdata, len(regions), descs.cdata, descs.count, err)
    raise_for_status(status, err, num_descs=descs.count, context=context, roles=roles,
                     job_id=job_id, group_of=group_of)


def copy(regions: RegionTable, descs: DescriptorTable, *, flags: int = 0, context: str = "",
         roles: tuple[str, str] = _ROLE_DEFAULT, job_id: int | None = None,
         group_of: Callable[[int], int] | None = None) -> None:
    """Validate everything, then copy with the GIL released; all or nothing."""
    ffi, lib = load()
    err = ffi.new("kvc_error *")
    status = lib.kvc_copy(regions.cdata, len(regions), descs.cdata, descs.count, flags, err)
    raise_for_status(status, err, num_descs=descs.count, context=context, roles=roles,
                     job_id=job_id, group_of=group_of)
