"""Build kvcore's optional CUDA copy library with nvcc: native/build/libkvcore_cuda.so.

Why a separate shared object instead of a second cffi extension: the CUDA library must never
be a link-time dependency of ``import kvcore`` (a machine without CUDA still imports and runs
everything on the C path), and setuptools cannot compile ``.cu`` files. ``kvcore/_cuda.py``
opens the library lazily with cffi's ABI mode (which also releases the GIL around calls).

Environment:
- ``KVCORE_BUILD_CUDA``: ``0`` skips, ``1`` makes any failure fatal, unset builds when nvcc
  is found and only warns on failure (so ``pip install -e .`` never breaks for CUDA).
- ``KVCORE_CUDA_ARCH``: semicolon-separated SM versions, default ``90`` (H100/H200).
- ``NVCC``: the compiler; default ``nvcc`` on PATH, then ``$CUDA_HOME/bin/nvcc``.

The runtime is linked statically (``-cudart static``): the library then needs only the
driver (libcuda.so.1) at run time, which any machine with a GPU has.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("kvcore_copy_cuda.cu", "kvcore_copy.c")
HEADERS = ("kvcore_copy.h", "kvcore_copy_cuda.h")
OUTPUT = os.path.join(HERE, "build", "libkvcore_cuda.so")
NVCC_TIMEOUT_S = 600


def find_nvcc() -> str | None:
    """The nvcc to use, or None; the search order is documented in the module docstring."""
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def nvcc_command(nvcc: str, output: str) -> list[str]:
    """The full nvcc command line: one step, sources in, shared object out."""
    archs = os.environ.get("KVCORE_CUDA_ARCH", "90").replace(",", ";").split(";")
    gencode: list[str] = []
    for arch in (a.strip() for a in archs if a.strip()):
        gencode += ["-gencode", f"arch=compute_{arch},code=[sm_{arch},compute_{arch}]"]
    return [nvcc, "-O2", "-shared", "-std=c++17", "-Xcompiler", "-fPIC,-Wall",
            "-cudart", "static", *gencode, "-I", HERE,
            *(os.path.join(HERE, s) for s in SOURCES), "-o", output]


def _fingerprint(cmd: list[str]) -> str:
    """Hash of the sources, headers and command: the library is rebuilt only when it changes."""
    h = hashlib.sha256(" ".join(cmd).encode())
    for name in SOURCES + HEADERS:
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def build(required: bool) -> str | None:
    """Build (or reuse) the library; return its path, or None with a message on stderr."""
    nvcc = find_nvcc()
    if nvcc is None:
        return _give_up("nvcc not found; set NVCC or CUDA_HOME, or KVCORE_BUILD_CUDA=0 to "
                        "skip the CUDA library", required)
    missing = [n for n in SOURCES + HEADERS if not os.path.exists(os.path.join(HERE, n))]
    if missing:
        return _give_up(f"sources missing: {', '.join(missing)}", required)
    os.makedirs(os.path.dirname(OUTPUT), exist_ok=True)
    tmp = OUTPUT + ".tmp"
    cmd = nvcc_command(nvcc, tmp)
    stamp = OUTPUT + ".stamp"
    fingerprint = _fingerprint(cmd)
    if os.path.exists(OUTPUT) and os.path.exists(stamp):
        with open(stamp, encoding="utf-8") as f:
            if f.read().strip() == fingerprint:
                return OUTPUT
    print("kvcore: building the CUDA library: " + " ".join(cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return _give_up(f"nvcc could not run: {exc}", required)
    if proc.returncode != 0:
        return _give_up(f"nvcc failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}",
                        required)
    os.replace(tmp, OUTPUT)
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(fingerprint + "\n")
    return OUTPUT


def _give_up(message: str, required: bool) -> str | None:
    if required:
        raise RuntimeError(f"kvcore CUDA build failed (KVCORE_BUILD_CUDA=1): {message}")
    print(f"kvcore: CUDA library not built ({message}); the C path still works. "
          "Set KVCORE_BUILD_CUDA=1 to make this fatal.", file=sys.stderr)
    return None


def build_from_setup() -> None:
    """Called by build_native.py during a setuptools build; honours KVCORE_BUILD_CUDA."""
    mode = os.environ.get("KVCORE_BUILD_CUDA", "")
    if mode == "0":
        return
    build(required=(mode == "1"))


def main() -> int:
    """``python native/build_native.py --cuda``: build and fail loudly (exit 1) on error."""
    if os.environ.get("KVCORE_BUILD_CUDA", "") == "0":
        print("kvcore: KVCORE_BUILD_CUDA=0, nothing to do", file=sys.stderr)
        return 0
    try:
        path = build(required=True)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":  # ``python native/build_cuda.py``: no cffi needed, only nvcc
    sys.exit(main())
