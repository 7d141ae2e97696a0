"""Build hook: setuptools metadata lives in pyproject.toml; this file only adds cffi.

cffi's ``cffi_modules`` keyword has no pyproject.toml spelling, so it is passed here.
The build script compiles the C copy library (and, when nvcc is found, the CUDA one).
"""

from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
