"""Smoke tests: the binding loads and matches its header (step one of docs/style.md's two steps).

Goal: catch a stale or mismatched build before any copy test runs. Method: compare the
compiled module's ABI version, struct sizes and constants with the header and with the
Python mirrors in kvcore/_native.py; check that cffi releases the GIL around the copy calls
(read from the wrapper cffi generates, which is deterministic, rather than timed); check
that a missing CUDA library is reported with a reason and never breaks import.
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore import _cuda, _native

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "native" / "kvcore_copy.h"


def header_defines(path: Path) -> dict[str, int]:
    """Integer #defines of the header's cffi block."""
    block = _cuda.read_cdef(path)
    return {m[1]: int(m[2]) for m in re.finditer(r"#define\s+(KVC_\w+)\s+(-?\d+)", block)}


def test_binding_loads_and_matches_header() -> None:
    ffi, lib = _native.load()
    defines = header_defines(HEADER)
    assert lib.kvc_abi_version() == defines["KVC_ABI_VERSION"]
    assert lib.kvc_sizeof_region() == ffi.sizeof("kvc_region") == 48
    assert lib.kvc_sizeof_desc() == ffi.sizeof("kvc_desc") == 7 * 8
    assert lib.kvc_sizeof_error() == ffi.sizeof("kvc_error")
    for name, value in defines.items():
        assert getattr(lib, name) == value, name


def test_python_mirrors_match_header() -> None:
    defines = header_defines(HEADER)
    for status in _native.Status:
        assert defines[f"KVC_{status.name}"] == status.value, status
    for side in _native.Side:
        assert defines[f"KVC_SIDE_{side.name}"] == side.value, side
    assert len(_native.Status) == defines["KVC_STATUS_COUNT"]
    assert defines["KVC_REGION_REFUSE_ROW0"] == _native.REGION_REFUSE_ROW0
    assert defines["KVC_REGION_DEVICE"] == _native.REGION_DEVICE
    assert defines["KVC_COPY_PLAIN"] == _native.COPY_PLAIN
    assert defines["KVC_COPY_STREAM"] == _native.COPY_STREAM
    assert defines["KVC_COPY_NO_STREAM"] == _native.COPY_NO_STREAM


def test_every_status_has_distinct_text() -> None:
    texts = [_native.status_text(s) for s in _native.Status]
    assert all(texts) and len(set(texts)) == len(texts)
    assert _native.status_text(10_000) == "unknown status code"
    assert _native.status_text(-1) == "unknown status code"


def test_cffi_releases_the_gil_around_copy_calls(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """cffi's API mode wraps each call in Py_BEGIN/END_ALLOW_THREADS; prove it for ours."""
    monkeypatch.chdir(ROOT)  # the build script uses paths relative to the project root
    builder = runpy.run_path(str(ROOT / "native" / "build_native.py"),
                             run_name="kvcore_build_check")["ffibuilder"]
    out = tmp_path / "wrapper.c"
    builder.emit_c_code(str(out))
    source = out.read_text()
    for fn in ("kvc_copy", "kvc_validate"):
        body = source.split(f"_cffi_f_{fn}(PyObject *self, PyObject *args)", 1)[1]
        body = body.split("\n}\n", 1)[0]
        assert "Py_BEGIN_ALLOW_THREADS" in body and f"{{ result = {fn}(" in body, fn


def test_cuda_absence_is_reported_not_raised() -> None:
    reason = _cuda.cuda_unavailable_reason()
    assert _cuda.cuda_available() == (reason is None)
    if reason is not None:
        assert "CUDA" in reason or "cuda" in reason


def test_import_without_cuda_library_works(tmp_path: Path) -> None:
    """A machine without the CUDA library imports kvcore and gets a reason with a fix."""
    code = ("import kvcore, kvcore.transfer as t; r = t.cuda_unavailable_reason();"
            "assert not t.cuda_available() and 'native/build_native.py --cuda' in r, r")
    env = {"KVCORE_CUDA_LIB": str(tmp_path / "missing.so"), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
