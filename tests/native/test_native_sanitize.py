"""The C copy library under AddressSanitizer and UndefinedBehaviorSanitizer.

Goal: no descriptor table, valid, hostile or rewritten by another thread during the call,
makes the library touch a byte outside what it validated, or run into undefined behaviour.
Method: ``sanitize_copy.c`` (next to this file) links ``native/kvcore_copy.c`` directly,
with every region its own exact-size malloc, and is built with
``-fsanitize=address,undefined -fno-sanitize-recover=all``, so any such access aborts it.
Skipped, with the reason, where no C compiler with the sanitizer runtimes is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NATIVE = HERE.parents[1] / "native"
FLAGS = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         "-fno-omit-frame-pointer", "-Wall", "-Wextra", "-Werror", "-pthread"]


def test_copy_library_is_clean_under_asan_and_ubsan(tmp_path: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (gcc or cc) on PATH")
    exe = tmp_path / "sanitize_copy"
    build = subprocess.run([cc, *FLAGS, "-I", str(NATIVE), str(HERE / "sanitize_copy.c"),
                            str(NATIVE / "kvcore_copy.c"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "sanitize" in build.stderr and "cannot find" in build.stderr:
        pytest.skip(f"the sanitizer runtimes are not installed: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr
    env = dict(os.environ, ASAN_OPTIONS="abort_on_error=0:detect_leaks=1",
               UBSAN_OPTIONS="print_stacktrace=1")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and "sanitize ok" in run.stdout, run.stdout + run.stderr
