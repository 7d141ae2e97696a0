"""Build hook: metadata lives in pyproject.toml; this file adds what it cannot spell.

Two things have no pyproject.toml spelling. cffi's ``cffi_modules`` keyword (the build
script compiles the C copy library and, when nvcc is found, the CUDA one). And a package
list that is discovered yet maps folders: kvcore/ is found by ``find_packages`` (so a new
subpackage such as kvcore/integrations/vllm/ ships without editing a list; a hand list once
left kvcore.scheduler out of the wheel), while spec/ and proofs/ install as kvcore.spec and
kvcore.proofs (``package-dir`` in pyproject.toml).
"""

from setuptools import Extension, find_packages, setup

MAPPED = {"kvcore.spec": "spec", "kvcore.proofs": "proofs"}


def discovered_packages() -> list[str]:
    """kvcore and its subpackages, then each mapped folder and its subpackages."""
    packages = find_packages(include=["kvcore", "kvcore.*"])
    for name, folder in MAPPED.items():
        packages.append(name)
        packages.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return packages


# kvcore._scan reads Python objects (exact ints, exact bytes), which cffi cannot hand to C,
# so it is a plain CPython extension (native/kvcore_scan.c, no dependencies).
SCAN = Extension("kvcore._scan", ["native/kvcore_scan.c"], extra_compile_args=["-O2", "-Wall"])
# kvcore._index holds the CPU tier's keys inline (native/kvcore_index.c says why): a
# CPython type, for the same reason.
INDEX = Extension("kvcore._index", ["native/kvcore_index.c"],
                  extra_compile_args=["-O2", "-Wall"])

setup(packages=discovered_packages(), cffi_modules=["native/build_native.py:ffibuilder"],
      ext_modules=[SCAN, INDEX])
