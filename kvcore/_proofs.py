"""Run the CrossHair obligations (``proofs/``) and say, per obligation, what CrossHair said.

Used by ``kvcore check`` and by ``pytest proofs``. Each obligation runs in its own
``crosshair check`` subprocess under explicit budgets in CPU seconds (CrossHair measures
``--per_condition_timeout`` and ``--per_path_timeout`` with ``time.process_time``), so a
busy machine slows a run down but does not change its answer. Z3's own query timeout is
wall-clock (CrossHair passes it half the per-path budget); the per-path budgets are set
generously for that reason.

Outcomes, per obligation:

- ``confirmed``: a proof obligation got "Confirmed over all paths";
- ``refuted``: a mutant got a counterexample, as it must;
- ``inconclusive``: the budget ran out without a counterexample (retried once first), or
  the very generous wall-clock guard fired; never a correctness failure;
- ``failed``: a counterexample to a proof obligation, a mutant that survived its budget
  twice, or a run that could not start (an import error, a mutant whose pattern left the
  source).

The report is ``failed`` if any obligation failed, else ``inconclusive`` if any was,
else ``confirmed``; ``skipped`` when there is no proofs folder or no CrossHair.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

CONFIRMED_LINE = "Confirmed over all paths."
# A hang guard only, mapped to inconclusive: CrossHair's CPU budget is what bounds a run.
GUARD_FACTOR = 10.0
GUARD_EXTRA_S = 600.0
TAIL_CHARS = 20_000


@dataclass(frozen=True)
class ProofSource:
    """Where the obligations live: ``proofs`` in a checkout, ``kvcore.proofs`` installed."""

    package: str
    folder: Path
    pythonpath: Path | None


@dataclass(frozen=True)
class ObligationOutcome:
    """What one obligation ended as, CrossHair's telling line, and the CPU it used."""

    name: str
    status: str  # "confirmed" | "refuted" | "inconclusive" | "failed"
    last_line: str
    cpu_seconds: float
    expected: str = "confirmed"
    attempts: int = 1
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.status == self.expected


@dataclass
class ProofReport:
    """The whole run: ``status`` is "confirmed", "inconclusive", "failed" or "skipped"."""

    status: str
    obligations: list[ObligationOutcome] = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0

    @property
    def cpu_seconds(self) -> float:
        return sum(o.cpu_seconds for o in self.obligations)

    @property
    def summary(self) -> str:
        """One line: the counts by status, or the reason it was skipped."""
        if self.status == "skipped":
            return f"skipped: {self.reason}"
        counts: dict[str, int] = {}
        for o in self.obligations:
            counts[o.status] = counts.get(o.status, 0) + 1
        parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        return f"{self.status}: {parts} ({self.cpu_seconds:.0f} CPU-s, {self.seconds:.0f} s)"


def locate() -> ProofSource | None:
    """The obligations of a source checkout (preferred), else the installed ``kvcore.proofs``."""
    root = Path(__file__).resolve().parent.parent
    folder = root / "proofs"
    if (folder / "__init__.py").exists() and (folder / "_bounded.py").exists():
        return ProofSource("proofs", folder, root)
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("kvcore.proofs")
        if spec is not None and spec.submodule_search_locations:
            folder = Path(next(iter(spec.submodule_search_locations)))
            return ProofSource("kvcore.proofs", folder, None)
    return None


def _import(source: ProofSource, name: str) -> ModuleType:
    if source.pythonpath is not None and str(source.pythonpath) not in sys.path:
        sys.path.insert(0, str(source.pythonpath))
    return importlib.import_module(f"{source.package}.{name}")


def obligation_modules(source: ProofSource) -> list[ModuleType]:
    names = sorted(p.stem for p in source.folder.glob("obligations_*.py"))
    return [_import(source, name) for name in names]


def short_name(module: str, function: str) -> str:
    return f"{module.rsplit('.', 1)[1].removeprefix('obligations_')}.{function}"


def _command(module: str, ob: Any) -> list[str]:
    return [sys.executable, "-m", "crosshair", "check", "--report_all",
            "--per_condition_timeout", str(ob.budget_s),
            "--per_path_timeout", str(ob.per_path_s), f"{module}.{ob.function}"]


def _env(source: ProofSource) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = "0"
    if source.pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(source.pythonpath), env.get("PYTHONPATH")]))
    return env


class Stopped(Exception):
    """The run was stopped (Ctrl-C, SIGTERM) while this obligation waited to start."""


class Children:
    """The CrossHair processes of one ``run_proofs``, so that a stopped run ends them.

    Each runs in its own session (so that a terminal's Ctrl-C reaches kvcore, which
    decides), and so nothing else would stop it: a ``kvcore check`` ended by a CI timeout
    left its CrossHair children running for up to their hang guard. ``stop`` kills every
    live one and refuses new ones; starting happens under the same lock, so none slips in.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self.stopped = False

    def start(self, command: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        with self._lock:
            if self.stopped:
                raise Stopped("the proofs were stopped")
            proc = subprocess.Popen(command, **kwargs)
            self._live.add(proc.pid)
            return proc

    def done(self, pid: int) -> None:
        with self._lock:
            self._live.discard(pid)

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            for pid in self._live:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


def _run_once(source: ProofSource, module: str, ob: Any, children: Children | None = None
              ) -> tuple[int | None, str, float]:
    """(exit code or None if the guard fired, output, child CPU seconds)."""
    guard = GUARD_FACTOR * ob.budget_s + GUARD_EXTRA_S
    children = children or Children()
    with tempfile.TemporaryFile("w+") as out:
        proc = children.start(_command(module, ob), stdout=out, stderr=subprocess.STDOUT,
                              env=_env(source), cwd=source.pythonpath or None, text=True,
                              start_new_session=True)
        start = time.monotonic()
        rc: int | None = None
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    rc = os.waitstatus_to_exitcode(status)
                    break
                if time.monotonic() - start > guard:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    pid, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.1)
        finally:
            children.done(proc.pid)
        proc.returncode = rc if rc is not None else -9
        out.seek(0)
        text = out.read()
    return rc, text[-TAIL_CHARS:], usage.ru_utime + usage.ru_stime


def classify(expect: str, function: str, rc: int | None, output: str) -> tuple[str, str]:
    """(status, the line that says why) of one CrossHair run, before any retry.

    ``inconclusive`` here means "ran out of budget"; the caller retries once.
    """
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ": error: " in ln]
    ours = [ln for ln in errors if f"when calling {function}(" in ln]
    tail = lines[-1] if lines else "(no output)"
    last = (ours or errors)[0] if ours or errors else tail
    if rc is None:
        return "inconclusive", f"wall-clock guard fired; last output: {last}"
    if errors and not ours:
        return "failed", last  # CrossHair could not run it (import error, crash)
    if expect == "refuted":
        if ours:
            return "refuted", last
        if rc == 0:
            return "inconclusive", f"mutant not refuted within budget: {last}"
        return "failed", f"crosshair exited {rc}: {last}"
    if ours:
        return "failed", last
    if rc == 0 and any(CONFIRMED_LINE in ln for ln in lines):
        return "confirmed", next(ln for ln in lines if CONFIRMED_LINE in ln)
    if rc == 0:
        return "inconclusive", f"budget ran out without a counterexample: {last}"
    return "failed", f"crosshair exited {rc}: {last}"


def run_obligation(source: ProofSource, module: str, ob: Any,
                   children: Children | None = None) -> ObligationOutcome:
    """Run one obligation; an out-of-budget run is retried once before it is reported."""
    name = short_name(module, ob.function)
    cpu = 0.0
    status, line, output = "inconclusive", "", ""
    attempts = 0
    for attempts in (1, 2):  # noqa: B007 - the count is reported
        rc, output, used = _run_once(source, module, ob, children)
        cpu += used
        status, line = classify(ob.expect, ob.function, rc, output)
        if status != "inconclusive":
            break
    if status == "inconclusive" and ob.expect == "refuted":
        status, line = "failed", f"mutant survived (not refuted twice): {line}"
    return ObligationOutcome(name, status, line, cpu, ob.expect, attempts, output)


def all_cases(source: ProofSource) -> list[tuple[str, Any]]:
    return [(m.__name__, ob) for m in obligation_modules(source) for ob in m.OBLIGATIONS]


def run_proofs(progress: Callable[[str], None], *, workers: int = 2,
               only: Sequence[str] | None = None) -> ProofReport:
    """Run every obligation (or those named in ``only``), two at a time, longest first."""
    start = time.monotonic()
    source = locate()
    if source is None:
        return ProofReport("skipped", reason="no proofs folder: neither a source checkout's "
                           "proofs/ nor an installed kvcore.proofs")
    if importlib.util.find_spec("crosshair") is None:
        return ProofReport("skipped", reason="CrossHair is not installed; pip install "
                           "crosshair-tool==0.0.113 to run the proofs")
    try:
        cases = all_cases(source)
    except Exception as exc:  # an obligation module that does not import is a failure
        line = f"{type(exc).__name__}: {exc}"
        progress(f"proofs: cannot load the obligations: {line}")
        return ProofReport("failed", [ObligationOutcome("import", "failed", line, 0.0)])
    if only is not None:
        cases = [c for c in cases if short_name(c[0], c[1].function) in only]
    cases.sort(key=lambda c: -c[1].budget_s)
    lock = threading.Lock()
    done: list[ObligationOutcome] = []
    children = Children()

    def one(case: tuple[str, Any]) -> ObligationOutcome:
        outcome = run_obligation(source, *case, children)
        if children.stopped:
            return outcome  # the run was stopped: no progress lines after it
        with lock:
            done.append(outcome)
            elapsed = time.monotonic() - start
            progress(f"proofs: [{len(done)}/{len(cases)}] {outcome.name}: {outcome.status} "
                     f"({outcome.cpu_seconds:.1f} CPU-s, {elapsed:.0f} s elapsed)")
            if not outcome.ok:
                progress(f"    crosshair: {outcome.last_line}")
        return outcome

    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        outcomes = list(pool.map(one, cases))
    except BaseException:  # Ctrl-C, SIGTERM: end the CrossHair children, then go on up
        children.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    report = ProofReport(overall(outcomes), outcomes, seconds=time.monotonic() - start)
    return report


def overall(outcomes: Sequence[ObligationOutcome]) -> str:
    if any(o.status == "failed" or (not o.ok and o.status != "inconclusive")
           for o in outcomes):
        return "failed"
    if any(o.status == "inconclusive" for o in outcomes):
        return "inconclusive"
    return "confirmed"
