"""The lock step compares two computations: a mutant of any moved kvcore rule fails it.

Goal: before the reference had its own rules, a mutant of a shared rule (``first_unfilled``
skipping a block it should fill) fired hundreds of times and the refinement machine
passed. Now each rule kvcore owns (store offer, store end, source blocks, load plan,
first unfilled, report validation, completion) gets a small realistic mutant, patched
into kvcore at run time, and the refinement machine must fail on it
(``test_lock_step_alone_kills``) *with kvcore's runtime invariant checks off*, so it is
the comparison with the reference that kills it (a ``LockstepError``), not a predicate
or the fake engine's witness. Where an invariant also guards the rule, a second test
shows which one fires first with checks on (``test_runtime_invariant_kills``): L3, the
coverage invariant, kills the ``first_unfilled`` and short-load mutants that L1 and S1
let through.

Method: each mutant is a textual edit of the real function's source (``inspect``), which
must occur exactly once, compiled in the function's own module globals and patched in
with ``unittest.mock.patch`` where kvcore looks the name up. The machine runs
derandomized (the same examples on every run), without shrinking, for a bounded number
of examples; a mutant that survives them fails the test. Cost: a few seconds each.
"""

from __future__ import annotations

import contextlib
import inspect
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test
from refinement.test_scheduler_refinement import SchedulerMachine

from kvcore.scheduler import _rules, _store
from kvcore.scheduler import scheduler as _sched
from kvcore.sim._lockstep import LockstepError
from kvcore.spec.errors import InvariantViolation

# 100 examples found every mutant in most test orders but missed the null-in-chunk one
# after other modules had been imported (the derandomized draws shift); 300 kill all of
# them in every order tried, for about 10 s.
MAX_EXAMPLES = 300
STEPS = 40


def mutated(func: Callable[..., Any], old: str, new: str) -> Callable[..., Any]:
    """``func`` with the one occurrence of ``old`` in its source replaced by ``new``."""
    source = textwrap.dedent(inspect.getsource(func))
    assert source.count(old) == 1, f"{old!r} occurs {source.count(old)} times in {func}"
    namespace = dict(func.__globals__)
    exec(compile(source.replace(old, new), f"<mutant of {func.__qualname__}>", "exec"),
         namespace)
    return namespace[func.__name__]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Mutant:
    """One edit of one kvcore function, and where kvcore looks the function up."""

    rule: str
    target: Any          # the module or class holding the name kvcore calls
    name: str
    func: Callable[..., Any]
    old: str
    new: str
    invariant: str | None = None  # the runtime check expected to fire first, if any

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with mock.patch.object(self.target, self.name, mutated(self.func, self.old, self.new)):
            yield


MUTANTS = [
    Mutant("offer: only a chunk's last block is checked for null (upstream W24)",
           _store, "group_offer", _rules.group_offer,
           "if 0 in table[chunk * bpc:chunk * bpc + bpc]:",
           "if table[chunk * bpc + bpc - 1] == 0:"),
    Mutant("store end: a draft group's volatile chunk is storable",
           _rules, "store_end", _rules.store_end,
           "max(frontier // o - 1, 0)", "max(frontier // o, 0)", invariant="E1"),
    Mutant("source blocks: a chunk's ids read one position late",
           _store, "chunk_source_blocks", _rules.chunk_source_blocks,
           "tuple(table[start:start + blocks_per_chunk])",
           "tuple(table[start + 1:start + blocks_per_chunk + 1])"),
    Mutant("load plan: the last block told loaded is left out of the load",
           _rules, "group_load", _rules.group_load,
           "ids = tuple(table[start:end])", "ids = tuple(table[start:end - 1])",
           invariant="L3"),
    Mutant("first unfilled: every load skips the first block it should fill",
           _rules, "first_unfilled", _rules.first_unfilled,
           "return i\n", "return i + 1\n", invariant="L3"),
    Mutant("report validation: reports for the first job since the last reset are dropped",
           _sched.OffloadScheduler, "_validate_reports",
           _sched.OffloadScheduler._validate_reports,
           "if r.job_id < self._jobs.stale_below:", "if r.job_id <= self._jobs.stale_below:"),
    Mutant("completion: the manager is told all of the job's keys but the first",
           _sched.OffloadScheduler, "_complete", _sched.OffloadScheduler._complete,
           "keys = plan.keys\n", "keys = plan.keys[1:]\n", invariant="J2"),
]


def run_machine() -> None:
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, derandomize=True,
        database=None, deadline=None, phases=[Phase.generate], print_blob=False,
        suppress_health_check=list(HealthCheck)))


def failure_of(mutant: Mutant, checks: bool) -> BaseException:
    """What the refinement machine raised with ``mutant`` in (it must raise)."""
    patches = contextlib.ExitStack()
    with patches:
        patches.enter_context(mutant.applied())
        if checks:
            patches.enter_context(mock.patch.object(SchedulerMachine, "draw_checks", False))
        else:
            patches.enter_context(mock.patch.object(_sched, "checks_enabled",
                                                    lambda flag: False))
        try:
            run_machine()
        except (AssertionError, Flaky, Exception) as e:
            return e
    pytest.fail(f"the refinement machine passed with the mutant: {mutant.rule}")


def root_cause(error: BaseException) -> BaseException:
    """Hypothesis may wrap the failure (Flaky, an exception group); find the first cause."""
    if isinstance(error, BaseExceptionGroup):
        return root_cause(error.exceptions[0])
    return error


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_lock_step_alone_kills(mutant: Mutant) -> None:
    error = root_cause(failure_of(mutant, checks=False))
    assert isinstance(error, LockstepError), f"{mutant.rule}: killed by {error!r}, " \
        "not by the lock step"


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.invariant],
                         ids=[m.name for m in MUTANTS if m.invariant])
def test_runtime_invariant_kills(mutant: Mutant) -> None:
    error = root_cause(failure_of(mutant, checks=True))
    assert isinstance(error, InvariantViolation), f"{mutant.rule}: killed by {error!r}"
    assert mutant.invariant in {v.id for v in error.violations}, error


def test_the_unmutated_machine_passes_the_same_examples() -> None:
    """The kills are the mutants' doing: the same bounded run passes on kvcore as it is."""
    run_machine()
