"""The bug zoo: every re-created upstream bug must be caught, by the check it declares.

Goal: show the checks have no blind spot for the bugs that motivated kvcore, and that
each kill is the declared check's doing (not an accident of another rule or a crash).
Method: for each mutant in ``kvcore.zoo``, run the battery ``kvcore check --mutants``
runs (directed scenarios, seeded simulations, the state machine), each stage and seed in
a fresh patch, on the mutant's own layouts, and require ``by == expected``. The same on
the default preset (what CI runs with no flags): every mutant killed as declared or
reported n/a. The unmutated battery passes on every layout used, so a kill is the
mutant's doing; the attribution itself is shown to fail for a mis-declared mutant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvcore import _check, zoo
from kvcore._scenarios import SCENARIOS
from kvcore.presets import DEFAULT_PRESET, preset
from kvcore.zoo import MUTANTS

BUDGET = {"seeds": 12, "examples": 60, "steps": 40}


def _mutant(name: str) -> zoo.Mutant:
    return next(m for m in MUTANTS if m.name == name)


def test_at_least_ten_mutants() -> None:
    assert len(MUTANTS) >= 10
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_is_killed_by_its_declared_check(mutant: zoo.Mutant) -> None:
    outcome = _check.run_mutant(mutant, None, **BUDGET)
    print(f"{mutant.name}: {outcome.describe()} on {outcome.preset} in {outcome.stage} "
          f"{outcome.seed}")
    assert outcome.status == "killed", f"{mutant.name}: {outcome.describe()}"
    assert outcome.by == outcome.expected == mutant.expect
    assert outcome.stage in _check.STAGES and outcome.seed


def test_default_preset_kills_every_mutant_that_applies() -> None:
    """What ``kvcore check --mutants`` does with no flags: the user's (default) layout."""
    outcomes = _check.run_mutants({DEFAULT_PRESET: preset(DEFAULT_PRESET)}, **BUDGET)
    bad = [f"{o.name}: {o.describe()}" for o in outcomes if not o.ok]
    assert not bad, bad
    killed = [o for o in outcomes if o.status == "killed"]
    assert all(o.by == o.expected for o in killed)
    assert len(killed) >= len(MUTANTS) - 2  # only the two zoo-layout mutants are n/a


def test_a_kill_by_another_check_fails_the_zoo() -> None:
    mislabelled = replace(_mutant("lookup-while-jobs"), expect="K1")
    outcome = _check.run_mutant(mislabelled, {DEFAULT_PRESET: preset(DEFAULT_PRESET)},
                                **BUDGET)
    assert outcome.status == "wrong check" and not outcome.ok
    assert outcome.describe() == "killed by J1, expected K1"


def test_a_mutant_that_cannot_matter_is_not_applicable() -> None:
    outcome = _check.run_mutant(_mutant("rearm-only-on-plain-shrink"),
                                {DEFAULT_PRESET: preset(DEFAULT_PRESET)}, **BUDGET)
    assert outcome.status == "n/a" and outcome.ok
    assert outcome.describe() == "n/a on this layout"


def test_each_stage_and_seed_gets_a_fresh_patch() -> None:
    entries: list[int] = []

    @contextlib.contextmanager
    def counting() -> Iterator[Any]:
        entries.append(1)
        yield None
    result = _check.run_battery(preset("gpt-oss"), preset="gpt-oss", seeds=3, examples=2,
                                steps=5, shrink=False, apply=counting)
    assert result.failure is None
    # per scenario, per simulation seed, the machine, per refinement and bad-calls seed
    assert len(entries) == len(SCENARIOS) + 3 + 1 + 3 + 3


@pytest.mark.parametrize("name", sorted({n for m in MUTANTS for n in m.layouts}))
def test_battery_passes_without_mutants(name: str) -> None:
    result = _check.run_battery(zoo.layout(name), preset=name, shrink=False, **BUDGET)
    assert result.failure is None, result.failure
