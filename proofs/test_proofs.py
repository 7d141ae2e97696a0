"""Run every CrossHair obligation and hold it to its declared status.

Goal: ``pytest proofs`` fails when a proof obligation gets a counterexample, when a
mutant of the kvcore function it guards is not refuted (a proof that cannot fail is
vacuous), or when an obligation cannot run at all. An obligation that runs out of its CPU
budget without a counterexample, twice, is INCONCLUSIVE: shown as a skip with CrossHair's
last line, never a failure, because it says nothing about correctness.

Method: each ``proofs/obligations_*.py`` lists its functions in ``OBLIGATIONS`` with an
expected status and explicit CrossHair budgets in CPU seconds; ``kvcore._proofs`` runs
each in its own ``crosshair check`` subprocess (the same runner ``kvcore check`` uses).
Without pytest-xdist the selection is started at once on two workers, longest budget
first, and each test waits for its own result; under xdist each test runs its own.
There is no wall-clock assertion anywhere.
"""

from __future__ import annotations

import ast
import inspect
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvcore import _proofs

from ._bounded import CONFIRMED, REFUTED, Obligation
from ._mutate import Mutant

SOURCE = _proofs.locate()
assert SOURCE is not None, "proofs/ not found next to kvcore"
MODULES = _proofs.obligation_modules(SOURCE)
CASES: list[tuple[str, Obligation]] = [(m.__name__, ob) for m in MODULES for ob in m.OBLIGATIONS]
WORKERS = 2
MARGIN = 5.0


def case_id(case: tuple[str, Obligation]) -> str:
    return _proofs.short_name(case[0], case[1].function)


@pytest.fixture(scope="session")
def pool(request: pytest.FixtureRequest
         ) -> Iterator[dict[str, Future[_proofs.ObligationOutcome]] | None]:
    """All selected obligations started at once on ``WORKERS`` threads (no xdist)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield None
        return
    wanted = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if spec is not None and "case" in spec.params and item.originalname == "test_obligation":
            wanted.append(spec.params["case"])
    wanted.sort(key=lambda case: -case[1].budget_s)
    executor = ThreadPoolExecutor(max_workers=WORKERS)
    assert SOURCE is not None
    futures = {case_id(c): executor.submit(_proofs.run_obligation, SOURCE, *c) for c in wanted}
    yield futures
    executor.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c)) for c in CASES])
def test_obligation(case: tuple[str, Obligation],
                    pool: dict[str, Future[_proofs.ObligationOutcome]] | None) -> None:
    key = case_id(case)
    assert SOURCE is not None
    outcome = (pool[key].result() if pool is not None and key in pool
               else _proofs.run_obligation(SOURCE, *case))
    if outcome.status == "inconclusive":
        pytest.skip(f"INCONCLUSIVE {key} after {outcome.attempts} runs "
                    f"({outcome.cpu_seconds:.0f} CPU-s): {outcome.last_line}")
    assert outcome.ok, (f"{key}: {outcome.status}, expected {outcome.expected}: "
                        f"{outcome.last_line}\n{outcome.output[-4000:]}")


# -- the runner's classification ----------------------------------------------------------


@pytest.mark.parametrize(("expect", "rc", "text", "status"), [
    (CONFIRMED, 0, "f.py:3: info: Confirmed over all paths.", "confirmed"),
    (CONFIRMED, 0, "f.py:3: info: Not confirmed.", "inconclusive"),
    (CONFIRMED, 0, "", "inconclusive"),
    (CONFIRMED, 1, "f.py:3: error: false when calling ob(1)", "failed"),
    (CONFIRMED, 2, "Traceback ...\nImportError: x", "failed"),
    (CONFIRMED, 1, "f.py:1: error: MutationError: pattern gone", "failed"),
    (CONFIRMED, None, "", "inconclusive"),
    (REFUTED, 1, "f.py:3: error: false when calling ob(1)", "refuted"),
    (REFUTED, 0, "f.py:3: info: Confirmed over all paths.", "inconclusive"),
    (REFUTED, 2, "Traceback", "failed"),
])
def test_classify(expect: str, rc: int | None, text: str, status: str) -> None:
    assert _proofs.classify(expect, "ob", rc, text)[0] == status


def test_report_status_is_failed_only_for_wrong_answers() -> None:
    def out(status: str, expected: str = CONFIRMED) -> _proofs.ObligationOutcome:
        return _proofs.ObligationOutcome("x", status, "", 0.0, expected)

    assert _proofs.overall([out("confirmed"), out("refuted", REFUTED)]) == "confirmed"
    assert _proofs.overall([out("confirmed"), out("inconclusive")]) == "inconclusive"
    assert _proofs.overall([out("inconclusive"), out("failed")]) == "failed"
    assert _proofs.overall([out("failed", REFUTED)]) == "failed"


# -- bookkeeping --------------------------------------------------------------------------


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
        assert ob.expect in (CONFIRMED, REFUTED)
        assert 0 < ob.per_path_s <= ob.budget_s
        assert ob.measured_s > 0, f"{ob.function}: no measured cost recorded"
        assert ob.budget_s >= MARGIN * ob.measured_s, \
            f"{ob.function}: budget {ob.budget_s} s is under {MARGIN}x its cost {ob.measured_s} s"
        doc = getattr(module, ob.function).__doc__ or ""
        assert "pre:" in doc, f"{ob.function} has unbounded inputs"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_obligation_has_a_mutant_of_kvcore(module: ModuleType) -> None:
    proofs = {ob.function for ob in module.OBLIGATIONS if ob.expect == CONFIRMED}
    mutants = [ob for ob in module.OBLIGATIONS if ob.expect == REFUTED]
    assert all(m.mutant_of in proofs for m in mutants)
    assert proofs <= {m.mutant_of for m in mutants}, "an obligation without a mutant"
    for m in mutants:
        # A mutant runs the obligation's own body with a kvcore function patched.
        source = inspect.getsource(getattr(module, m.function))
        used = [v for k, v in vars(module).items() if isinstance(v, Mutant) and
                f"{k}.applied()" in source]
        assert used, f"{m.function} patches no kvcore function"
        # A mutant of kvcore's code, never of the spec that judges it.
        assert all(u.mutation.module_name.startswith("kvcore.")
                   and not u.mutation.module_name.startswith("kvcore.spec") for u in used)


def test_obligations_call_kvcore_not_only_the_spec() -> None:
    for module in MODULES:
        source = inspect.getsource(module)
        assert "from kvcore.scheduler" in source or "from kvcore.manager" in source \
            or "from kvcore import" in source or "import kvcore." in source, module.__name__
        # The reference scheduler's module: an obligation compares kvcore with a predicate
        # or the spec's own rule for it, never runs the whole reference in kvcore's place.
        assert "kvcore.spec.model" not in source, f"{module.__name__} imports the reference"


def test_a_mutant_changes_the_function_and_restores_it() -> None:
    from kvcore.scheduler import _rules

    from .obligations_load import SKIPS_FIRST

    table = [5, 6, 7]
    original: Any = _rules.first_unfilled
    assert original(table, 0, 3) == 0
    with SKIPS_FIRST.applied():
        assert _rules.first_unfilled(table, 0, 3) == 1
    assert _rules.first_unfilled is original
