"""Runtime checking: build spec records at each hook and raise on any violation.

Off by default; when off the scheduler never calls into this module, so checks cost
nothing. The records are the same ones the state machines and proofs use, so a rule
broken in production reads exactly like one broken in a test.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvcore.spec.errors import ConfigError, InvariantViolation
from kvcore.spec.invariants import PREDICATE_IDS, PREDICATES, check

# A job a checked run (the simulator, ``kvcore check``'s transfer engine stage) waits for
# must be reported within this many seconds: its copies are a few KiB, so a minute on the
# busiest machine means never (X2, not a hang).
JOB_SECONDS = 60.0
# After a failure the check closes its transfer engines this long at most: a worker stuck
# in a loop is left behind (a daemon thread) so that the failure is reported, not a hang.
FAILING_CLOSE_SECONDS = 1.0


def checks_enabled(flag: bool | None) -> bool:
    """The constructor flag wins; otherwise ``KVCORE_CHECK=1`` turns checks on.

    Only True, False or None: ``check="no"`` is truthy, so taking any value would turn
    checks on where the caller meant them off (ConfigError instead).
    """
    if flag is None:
        return os.environ.get("KVCORE_CHECK", "") == "1"
    if not isinstance(flag, bool):
        raise ConfigError("check", f"check={flag!r} must be True, False or None (None: "
                          "KVCORE_CHECK=1 in the environment turns checks on)")
    return flag


def tally(records: Sequence[object], counts: dict[str, int]) -> None:
    """Count, per invariant id, the predicate evaluations ``records`` will get."""
    for record in records:
        for predicate in PREDICATES.get(type(record), ()):
            key = PREDICATE_IDS[predicate.__name__]
            counts[key] = counts.get(key, 0) + 1


def enforce(records: Sequence[object], counts: dict[str, int] | None = None, *,
            at_runtime: bool = False) -> None:
    """Raise ``InvariantViolation`` listing every broken id among ``records``;
    ``at_runtime`` marks a library hook's own check (the scheduler's, the tier's), as
    against a harness judging the library from outside."""
    if counts is not None:
        tally(records, counts)
    violations = check(records)
    if violations:
        raise InvariantViolation(violations, at_runtime=at_runtime)
