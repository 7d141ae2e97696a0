"""Run every CrossHair obligation and hold it to its declared status.

Goal: ``pytest proofs`` fails when an obligation gets a counterexample, when one declared
CONFIRMED loses "Confirmed over all paths", or when a mutant is no longer refuted (a proof
that cannot fail is vacuous). It also checks the bookkeeping: every obligation file
declares each contract it holds, with its budget, and every obligation has a mutant.

Method: each ``proofs/obligations_*.py`` lists its functions in ``OBLIGATIONS`` with an
expected status and explicit CrossHair budgets (``--per_condition_timeout`` and
``--per_path_timeout``, CPU seconds; never CrossHair's defaults). Each is checked by its own
``crosshair check --report_all`` subprocess. Without pytest-xdist the whole selection is
started at once on a pool of two workers, longest budget first, and each test waits for
its own result; under xdist (``-n 2``) each test runs its subprocess itself. The wall-clock
limit of a subprocess only guards against a hang; no test asserts on time.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from proofs._bounded import CONFIRMED, NO_COUNTEREXAMPLE, REFUTED, Obligation

ROOT = Path(__file__).resolve().parents[1]
PROOFS = Path(__file__).resolve().parent
WORKERS = 2
CONFIRMED_LINE = "info: Confirmed over all paths."


def obligation_modules() -> list[ModuleType]:
    names = sorted(p.stem for p in PROOFS.glob("obligations_*.py"))
    return [importlib.import_module(f"proofs.{name}") for name in names]


MODULES = obligation_modules()
CASES: list[tuple[str, Obligation]] = [
    (m.__name__, ob) for m in MODULES for ob in m.OBLIGATIONS]


def case_id(module: str, ob: Obligation) -> str:
    return f"{module.rsplit('.', 1)[1].removeprefix('obligations_')}.{ob.function}"


@dataclass(frozen=True)
class Report:
    """What one ``crosshair check`` said."""

    command: tuple[str, ...]
    returncode: int
    output: str

    def lines(self, kind: str) -> list[str]:
        return [line for line in self.output.splitlines() if f": {kind}: " in line]


def run_crosshair(module: str, ob: Obligation) -> Report:
    command = (
        sys.executable, "-m", "crosshair", "check", "--report_all",
        "--per_condition_timeout", str(ob.per_condition_timeout_s),
        "--per_path_timeout", str(ob.per_path_timeout_s),
        f"{module}.{ob.function}",
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # A hang guard only: CrossHair's own budget is in CPU seconds and is what bounds it.
    wall_limit = 3 * ob.per_condition_timeout_s + 60
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=wall_limit, check=False)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else err.stdout
        return Report(command, -1, f"hang guard: no answer after {wall_limit} s\n{out or ''}")
    return Report(command, done.returncode, done.stdout + done.stderr)


@pytest.fixture(scope="session")
def pool(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[Report]] | None]:
    """All selected obligations started at once on ``WORKERS`` threads (no xdist)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield None
        return
    wanted = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if spec is not None and "case" in spec.params and item.originalname == "test_obligation":
            wanted.append(spec.params["case"])
    wanted.sort(key=lambda case: -case[1].per_condition_timeout_s)
    executor = ThreadPoolExecutor(max_workers=WORKERS)
    futures = {case_id(*case): executor.submit(run_crosshair, *case) for case in wanted}
    yield futures
    executor.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(*c)) for c in CASES])
def test_obligation(case: tuple[str, Obligation],
                    pool: dict[str, Future[Report]] | None) -> None:
    module, ob = case
    key = case_id(module, ob)
    report = pool[key].result() if pool is not None and key in pool else run_crosshair(*case)
    shown = " ".join(report.command) + "\n" + report.output
    errors = report.lines("error")
    if ob.expect == REFUTED:
        assert report.returncode == 1 and errors, f"mutant {key} was not refuted:\n{shown}"
        assert any(f"when calling {ob.function}(" in e for e in errors), shown
        return
    assert not errors, f"counterexample to {key}:\n{shown}"
    assert report.returncode == 0, f"crosshair failed on {key}:\n{shown}"
    if ob.expect == CONFIRMED:
        assert any(CONFIRMED_LINE in line for line in report.lines("info")), \
            f"{key} lost 'Confirmed over all paths' within its budget:\n{shown}"
    else:
        assert ob.expect == NO_COUNTEREXAMPLE


# -- bookkeeping --------------------------------------------------------------------------------


def contract_functions(module: ModuleType) -> set[str]:
    """Top-level functions of a module whose docstring holds a PEP316 ``post:``."""
    tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and "post:" in (ast.get_docstring(node) or "")}


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_contract_is_declared_with_a_budget(module: ModuleType) -> None:
    declared = [ob.function for ob in module.OBLIGATIONS]
    assert len(declared) == len(set(declared))
    assert set(declared) == contract_functions(module)
    for ob in module.OBLIGATIONS:
        assert ob.expect in (CONFIRMED, NO_COUNTEREXAMPLE, REFUTED)
        assert 0 < ob.per_path_timeout_s <= ob.per_condition_timeout_s
        doc = getattr(module, ob.function).__doc__ or ""
        assert "pre:" in doc, f"{ob.function} has unbounded inputs"
    total = sum(ob.per_condition_timeout_s for ob in module.OBLIGATIONS)
    assert total <= module.TOTAL_BUDGET_S, \
        f"{module.__name__}: budgets sum to {total} s, over its TOTAL_BUDGET_S"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_obligation_has_a_mutant(module: ModuleType) -> None:
    proofs = {ob.function for ob in module.OBLIGATIONS if ob.expect != REFUTED}
    mutants = [ob for ob in module.OBLIGATIONS if ob.expect == REFUTED]
    assert all(m.mutant_of in proofs for m in mutants)
    assert proofs <= {m.mutant_of for m in mutants}, "an obligation without a mutant"
    # Mutants get short budgets: finding a counterexample should be quick.
    assert all(m.per_condition_timeout_s <= 30 for m in mutants)


def test_some_obligation_is_confirmed_over_all_paths() -> None:
    assert any(ob.expect == CONFIRMED for _, ob in CASES)
    assert any(ob.function == "cycle_machine" and ob.expect == CONFIRMED for _, ob in CASES)
