"""The proof runner's children: a stopped ``kvcore check`` leaves no CrossHair running.

Each CrossHair run is started in its own session, so nothing but kvcore stops it; a CI
timeout (SIGTERM) or Ctrl-C used to leave them running for up to their hang guard (10 x
budget + 600 s). Here every obligation's command is replaced by ``sleep 60`` and the run
is interrupted: every child must be gone when ``run_proofs`` raises.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from kvcore import _proofs


def _alive(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:  # reaped: gone
        return False


def test_an_interrupted_run_ends_its_crosshair_children(
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    # Python's own SIGINT handler, whatever the runner or an earlier test left (a worker
    # process may ignore SIGINT): the interrupt below must raise KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))  # failed or not
    started: list[int] = []
    real_start = _proofs.Children.start

    def start(self: _proofs.Children, command: list[str], **kwargs: Any) -> Any:
        proc = real_start(self, ["sleep", "60"], **kwargs)
        started.append(proc.pid)
        return proc
    monkeypatch.setattr(_proofs.Children, "start", start)

    def interrupt_once_started() -> None:
        # Until both workers hold a child: a hang guard of 300 s, not a time budget (20 s
        # ran out beside a mutation run and the whole test suite on two cores).
        for _ in range(3000):
            if len(started) >= 2:
                break
            threading.Event().wait(0.1)
        # A real SIGINT, which wakes the main thread's wait (interrupt_main only sets a
        # flag that is seen once the wait ends on its own).
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        _proofs.run_proofs(lambda line: None)
    assert len(started) >= 2
    for _ in range(600):  # the kill is immediate; reaping may take a moment (a guard)
        if not any(_alive(pid) for pid in started):
            break
        threading.Event().wait(0.1)
    assert not any(_alive(pid) for pid in started), started


def test_a_stopped_registry_starts_nothing() -> None:
    children = _proofs.Children()
    children.stop()
    with pytest.raises(_proofs.Stopped):
        children.start(["true"])
