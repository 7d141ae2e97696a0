"""Opt-in exploration: the refinement and integrity machines with a fresh random seed.

Goal: CI's profile is derandomized, so it replays the same examples on every commit and
cannot find a divergence those examples miss (the touch-rule divergence of
``test_touch_covers_the_retained_reach`` hid from it while the dev profile found it at
once). This test explores instead: with ``KVCORE_EXPLORE_SECONDS`` set it runs the
scheduler refinement machine, the manager refinement machine and the integrity machine
(the simulator, every preset) round robin, in small batches of random examples, until
about that many seconds have passed. Without the variable it is skipped.

Reproducing: the master seed is printed at the start (to the real stderr, so it shows
even when pytest captures output) and can be fixed with ``KVCORE_EXPLORE_SEED``; each
batch's seed is derived from it and named in the failure. A failure is printed as a
step-by-step program with its ``@reproduce_failure`` blob, unshrunk (shrinking a long
program can take minutes), and saved to the Hypothesis example database
(``KVCORE_EXPLORE_DB``, default ``.hypothesis/examples``), from which the ordinary
replay tests (``TestSchedulerRefinement``, ...) run it again first, and shrink it, on
the next run that shares the directory.

CI: ``KVCORE_EXPLORE_SECONDS=60 python -m pytest -p no:cacheprovider -q -s
tests/refinement/test_explore.py``.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import core as hypothesis_core
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test
from refinement.test_manager_refinement import ManagerRefinement
from refinement.test_scheduler_refinement import SchedulerMachine

from kvcore.presets import PRESETS, preset
from kvcore.sim._machine import make_machine

BATCH_EXAMPLES = 8


def budget() -> float | None:
    raw = os.environ.get("KVCORE_EXPLORE_SECONDS")
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"KVCORE_EXPLORE_SECONDS={raw!r} must be a number of seconds, "
                         "e.g. 60") from None
    if not 0 < seconds <= 24 * 3600:
        raise ValueError(f"KVCORE_EXPLORE_SECONDS={raw!r} must be in (0, 86400]")
    return seconds


def machines() -> list[tuple[str, type[RuleBasedStateMachine], int]]:
    """(name, machine, steps per example), the scheduler refinement weighted double."""
    out: list[tuple[str, type[RuleBasedStateMachine], int]] = [
        ("scheduler-refinement", SchedulerMachine, 100),
        ("manager-refinement", ManagerRefinement, 100),
        ("scheduler-refinement", SchedulerMachine, 100),
    ]
    out += [(f"integrity-{name}", make_machine(preset(name)), 30) for name in sorted(PRESETS)]
    return out


def run_batch(machine: type[RuleBasedStateMachine], steps: int, batch_seed: int,
              database: DirectoryBasedExampleDatabase) -> None:
    """One batch of random examples, its randomness drawn from ``batch_seed``.

    ``hypothesis.seed`` would switch the example database off, so the batch seeds the
    random source Hypothesis draws an unseeded test's seed from instead (pinned
    Hypothesis; without that hook the batch is random but not repeatable).
    Shrinking is left out: it can take minutes on a long program, and the saved example
    is shrunk when the ordinary replay test runs it from the database.
    """
    test: Callable[[], Any] = get_state_machine_test(machine, settings=settings(
        max_examples=BATCH_EXAMPLES, stateful_step_count=steps, derandomize=False,
        database=database, deadline=None, print_blob=True, report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    local = getattr(hypothesis_core, "threadlocal", None)
    if local is not None and hasattr(local, "_hypothesis_global_random"):
        local._hypothesis_global_random = random.Random(batch_seed)
    test()


def test_explore() -> None:
    seconds = budget()
    if seconds is None:
        pytest.skip("exploration is opt-in: set KVCORE_EXPLORE_SECONDS (CI uses 60) to run "
                    "the state machines with a random seed for that long")
    master = int(os.environ.get("KVCORE_EXPLORE_SEED") or random.SystemRandom().getrandbits(32))
    db = DirectoryBasedExampleDatabase(os.environ.get("KVCORE_EXPLORE_DB",
                                                      ".hypothesis/examples"))
    print(f"kvcore explore: seed {master} (KVCORE_EXPLORE_SEED={master} to repeat), "
          f"{seconds:g} s", file=sys.__stderr__, flush=True)
    rng = random.Random(master)
    order = machines()
    deadline = time.monotonic() + seconds
    batches = 0
    while time.monotonic() < deadline:
        name, machine, steps = order[batches % len(order)]
        batch_seed = rng.getrandbits(64)
        try:
            run_batch(machine, steps, batch_seed, db)
        except BaseException as e:
            e.add_note(f"kvcore explore: machine {name}, batch {batches}, batch seed "
                       f"{batch_seed}, master seed {master}; the shrunk example above is "
                       "saved to the example database and replays first next time")
            raise
        batches += 1
    print(f"kvcore explore: {batches} batches of {BATCH_EXAMPLES} examples, no failure",
          file=sys.__stderr__, flush=True)
    assert batches > 0
