"""The bug zoo: every re-created upstream bug must be caught by the CI battery.

Goal: show the checks have no blind spot for the bugs that motivated kvcore. Method: for
each mutant in ``kvcore.zoo``, run the battery ``kvcore check --mutants`` runs (directed
scenarios, seeded simulations, the state machine) with the mutant applied, and require a
named check to fail (a crash is not a catch). The unmutated battery must pass on the same
layouts, so a kill is the mutant's doing.
"""

from __future__ import annotations

import pytest

from kvcore import _check
from kvcore.presets import PRESETS, preset
from kvcore.zoo import MUTANTS

LAYOUTS = {name: preset(name) for name in PRESETS}
BUDGET = {"seeds": 12, "examples": 60, "steps": 40}


def test_at_least_ten_mutants() -> None:
    assert len(MUTANTS) >= 10
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_is_killed(mutant) -> None:  # type: ignore[no-untyped-def]
    outcome = _check.run_mutant(mutant, LAYOUTS, **BUDGET)
    print(f"{mutant.name}: killed={outcome.killed} by={outcome.by} on {outcome.preset}")
    assert outcome.killed, f"{mutant.name} ({mutant.origin}) survived the battery"
    assert outcome.by, "a kill must name the check that caught it"


@pytest.mark.parametrize("name", sorted({p for m in MUTANTS for p in m.presets}))
def test_battery_passes_without_mutants(name: str) -> None:
    result = _check.run_battery(LAYOUTS[name], preset=name, shrink=False, **BUDGET)
    assert result.failure is None, result.failure
