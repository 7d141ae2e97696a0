"""cffi build script for kvcore's C copy library (API mode), plus the optional CUDA library.

setuptools runs this file (``setup.py``: ``cffi_modules=["native/build_native.py:ffibuilder"]``)
from the project root, so every path here is relative to that root. The C declarations are
read from ``native/kvcore_copy.h`` (the block between the CFFI-BEGIN and CFFI-END markers),
never repeated in a Python string, so the header stays the single source of truth.

The CUDA library is a separate shared object built by ``native/build_cuda.py`` with nvcc and
loaded lazily by ``kvcore/_cuda.py``; it never links into the C module, so importing kvcore
never needs CUDA. Run by hand:

    python native/build_native.py          # rebuild the C module in place (kvcore/)
    python native/build_native.py --cuda   # build native/build/libkvcore_cuda.so
"""

from __future__ import annotations

import importlib.util
import os
import sys

from cffi import FFI

NATIVE_DIR = "native"
HEADER = os.path.join(NATIVE_DIR, "kvcore_copy.h")


def read_cdef(path: str) -> str:
    """The declarations between the CFFI markers of a header; cffi parses only plain C."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    begin, end = "/* CFFI-BEGIN */", "/* CFFI-END */"
    if begin not in text or end not in text:
        raise RuntimeError(f"{path} lacks the {begin} ... {end} markers the build reads")
    return text.split(begin, 1)[1].split(end, 1)[0]


ffibuilder = FFI()
ffibuilder.cdef(read_cdef(HEADER))
ffibuilder.set_source(
    "kvcore._kvcore_native",
    '#include "kvcore_copy.h"',
    sources=[os.path.join(NATIVE_DIR, "kvcore_copy.c")],
    include_dirs=[NATIVE_DIR],
    extra_compile_args=["-O2", "-Wall"],
)


def _build_cuda_module() -> object:
    """Load native/build_cuda.py by path: this script is exec'd, not imported as a package."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build_cuda.py")
    spec = importlib.util.spec_from_file_location("kvcore_build_cuda", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# setuptools execs this file for every command (metadata, egg_info, build). The CUDA library
# is compiled only during an actual build, and build_cuda caches by source hash, so metadata
# steps stay fast; a CUDA failure is a warning unless KVCORE_BUILD_CUDA=1.
_BUILD_COMMANDS = {"build_ext", "build", "bdist_wheel", "editable_wheel", "develop", "install"}
if __name__ == "__cffi__" and _BUILD_COMMANDS.intersection(sys.argv[1:]):
    _build_cuda_module().build_from_setup()  # type: ignore[attr-defined]

if __name__ == "__main__":
    if "--cuda" in sys.argv[1:]:
        sys.exit(_build_cuda_module().main())  # type: ignore[attr-defined]
    # setuptools keeps the relative paths valid (cffi's compile() changes directory).
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.exit(subprocess.call([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root))
