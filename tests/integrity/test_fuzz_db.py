"""Shared counterexamples: a failure one fuzz runner finds is replayed first by the next.

Goal: ``kvcore fuzz --db redis://...`` lets a fleet of GPU runners share what they find.
Method: start a real ``redis-server`` on a free loopback port; run the state machine with
a bug-zoo mutant applied (so a failure exists) against Hypothesis's Redis example
database; then run again with a fresh process-local counter and check the saved example
fails at once (the reuse phase runs before any generation). The same for a directory.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore import _check
from kvcore.cli import _database
from kvcore.presets import preset
from kvcore.scheduler import OffloadScheduler
from kvcore.zoo import MUTANTS

MUTANT = next(m for m in MUTANTS if m.name == "draft-tail-stored")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def redis_url() -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    port = _free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _fuzz_once(db: Any) -> tuple[_check.BatteryResult, int]:
    """One fuzz round with the mutant applied; returns the result and examples started."""
    started = [0]
    result = _check.BatteryResult()
    with MUTANT.apply():
        def factory(*args: Any, **kwargs: Any) -> OffloadScheduler:
            started[0] += 1
            return OffloadScheduler(*args, **kwargs)
        _check.run_machine(preset("llama3-eagle3"), 200, 40, result, factory=factory,
                           shrink=False, database=db)
    return result, started[0]


def _replays_first(db_spec: str) -> None:
    first, n_first = _fuzz_once(_database(db_spec))
    assert first.failure is not None and "E1" in first.failure.ids
    second, n_second = _fuzz_once(_database(db_spec))
    assert second.failure is not None and "E1" in second.failure.ids
    # The saved example runs first: it fails at once (plus Hypothesis's one re-run to
    # report it), well before the first run needed to find it by generation.
    assert n_second <= 2, (n_first, n_second)


def test_redis_database_replays_counterexample(redis_url: str) -> None:
    _replays_first(redis_url)


def test_directory_database_replays_counterexample(tmp_path: Path) -> None:
    _replays_first(str(tmp_path / "db"))
