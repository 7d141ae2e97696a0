"""The optional CUDA copy library, loaded lazily: ``cuda_available()`` and ``CudaCopier``.

``native/build/libkvcore_cuda.so`` is built by nvcc (``pip install -e .`` when nvcc is found,
or ``python native/build_native.py --cuda``). It is opened here with cffi's ABI mode, whose
declarations come from the same headers the library was compiled from, and which releases
the GIL around calls just as the API-mode C module does. Nothing here runs at import time:
a machine without CUDA imports kvcore and runs everything on the C path, and
``cuda_unavailable_reason()`` says why CUDA is off and what to do about it.

Paths can be overridden with ``KVCORE_CUDA_LIB`` (the library) and ``KVCORE_NATIVE_DIR``
(the directory holding the headers).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from kvcore import _native
from kvcore._native import DescriptorTable, RegionTable

HEADERS = ("kvcore_copy.h", "kvcore_copy_cuda.h")

AUTO = 0
BATCH = 1
PER_COPY = 2
KERNEL = 3
BATCH_V12080 = 4
METHODS = {"auto": AUTO, "batch": BATCH, "per_copy": PER_COPY, "kernel": KERNEL,
           "batch_v12080": BATCH_V12080}


def native_dir() -> Path:
    """Where the headers (and, by default, the built library) live."""
    env = os.environ.get("KVCORE_NATIVE_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "native"


def library_path() -> Path:
    env = os.environ.get("KVCORE_CUDA_LIB")
    return Path(env) if env else native_dir() / "build" / "libkvcore_cuda.so"


def read_cdef(path: Path) -> str:
    """The declarations between the CFFI markers (same rule as native/build_native.py)."""
    text = path.read_text(encoding="utf-8")
    begin, end = "/* CFFI-BEGIN */", "/* CFFI-END */"
    if begin not in text or end not in text:
        raise RuntimeError(f"{path} lacks the {begin} ... {end} markers")
    return text.split(begin, 1)[1].split(end, 1)[0]


@functools.cache
def _load() -> tuple[Any, Any] | str:
    """``(ffi, lib)`` when a device is usable, else the reason (a string) it is not."""
    path = library_path()
    hint = ("build it with `python native/build_native.py --cuda` (needs nvcc; "
            "KVCORE_CUDA_ARCH selects the GPU architecture)")
    if not path.exists():
        return f"the CUDA library {path} is not built; {hint}"
    try:
        import cffi

        ffi = cffi.FFI()
        ffi.cdef("".join(read_cdef(native_dir() / h) for h in HEADERS))
        lib = ffi.dlopen(str(path))
    except (OSError, RuntimeError, ImportError, cffi.CDefError) as exc:
        return f"the CUDA library {path} could not be loaded ({exc}); {hint}"
    if lib.kvc_cuda_abi_version() != lib.KVC_CUDA_ABI_VERSION or \
            lib.kvc_sizeof_desc() != ffi.sizeof("kvc_desc"):
        return f"the CUDA library {path} does not match its headers; {hint}"
    count = ffi.new("int32_t *")
    err = ffi.new("kvc_error *")
    if lib.kvc_cuda_device_count(count, err) != 0:
        return f"no usable CUDA driver (CUDA error {err.value}); the C path is used instead"
    if count[0] == 0:
        return "no CUDA device is visible; the C path is used instead"
    return ffi, lib


def cuda_available() -> bool:
    """True when the CUDA library is built, loads, and sees at least one device."""
    return not isinstance(_load(), str)


def cuda_unavailable_reason() -> str | None:
    """Why CUDA copies are off (and how to turn them on), or None when they are on."""
    loaded = _load()
    return loaded if isinstance(loaded, str) else None


def _loaded() -> tuple[Any, Any]:
    loaded = _load()
    if isinstance(loaded, str):
        raise RuntimeError(f"kvcore CUDA copies are unavailable: {loaded}")
    return loaded


class CudaCopier:
    """One device's CUDA copy context (validation on the host, then enqueue on a stream).

    The context is read-only after opening, so several threads may share it; streams and
    events are plain handles owned by whoever created them.
    """

    def __init__(self, device: int) -> None:
        self.ffi, self.lib = _loaded()
        out = self.ffi.new("kvc_cuda **")
        err = self.ffi.new("kvc_error *")
        status = self.lib.kvc_cuda_open(device, out, err)
        _native.raise_for_status(status, err, num_descs=0, context=f"opening cuda:{device}")
        self.ctx = out[0]

    def info(self) -> dict[str, int]:
        """Driver and runtime versions, the batched-copy ABI in use, device attributes."""
        info = self.ffi.new("kvc_cuda_info *")
        self.lib.kvc_cuda_get_info(self.ctx, info)
        names = ("device", "driver_version", "runtime_version", "batch_abi",
                 "unified_addressing", "can_use_host_pointer", "async_engine_count",
                 "multiprocessor_count")
        return {n: int(getattr(info, n)) for n in names}

    def _cast(self, ctype: str, cdata: Any) -> Any:
        """Re-type a pointer from the C module's ffi for this ffi (same layout, same header)."""
        main_ffi, _ = _native.load()
        return self.ffi.cast(ctype, int(main_ffi.cast("uintptr_t", cdata)))

    def copy(self, regions: RegionTable, descs: DescriptorTable, stream: int, *,
             method: int = AUTO, kernel_ctas: int = 0, **funnel: Any) -> None:
        """Validate, then enqueue on ``stream``; KVCopyError (nothing enqueued) when invalid."""
        err = self.ffi.new("kvc_error *")
        status = self.lib.kvc_cuda_copy(
            self.ctx, self._cast("kvc_region *", regions.cdata), len(regions),
            self._cast("kvc_desc *", descs.cdata), descs.count, stream, method, kernel_ctas,
            err)
        _native.raise_for_status(status, err, num_descs=descs.count, **funnel)

    def _handle(self, fn: Any, what: str) -> int:
        out = self.ffi.new("uint64_t *")
        err = self.ffi.new("kvc_error *")
        _native.raise_for_status(fn(self.ctx, out, err), err, num_descs=0, context=what)
        return int(out[0])

    def stream_create(self) -> int:
        return self._handle(self.lib.kvc_cuda_stream_create, "creating a stream")

    def event_create(self) -> int:
        return self._handle(self.lib.kvc_cuda_event_create, "creating an event")

    def event_record(self, event: int, stream: int) -> None:
        err = self.ffi.new("kvc_error *")
        status = self.lib.kvc_cuda_event_record(self.ctx, event, stream, err)
        _native.raise_for_status(status, err, num_descs=0, context="recording an event")

    def event_done(self, event: int) -> bool:
        """Non-blocking: has everything before the event completed?"""
        err = self.ffi.new("kvc_error *")
        status = self.lib.kvc_cuda_event_query(self.ctx, event, err)
        if status == _native.Status.E_NOT_READY:
            return False
        _native.raise_for_status(status, err, num_descs=0, context="querying an event")
        return True

    def event_synchronize(self, event: int) -> None:
        """Block (GIL released) until the event completes."""
        err = self.ffi.new("kvc_error *")
        status = self.lib.kvc_cuda_event_synchronize(self.ctx, event, err)
        _native.raise_for_status(status, err, num_descs=0, context="waiting for an event")

    def event_destroy(self, event: int) -> None:
        self.lib.kvc_cuda_event_destroy(self.ctx, event)

    def stream_destroy(self, stream: int) -> None:
        self.lib.kvc_cuda_stream_destroy(self.ctx, stream)

    def close(self) -> None:
        if self.ctx is not None:
            self.lib.kvc_cuda_close(self.ctx)
            self.ctx = None
