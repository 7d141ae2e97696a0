"""Runtime checking: build spec records at each hook and raise on any violation.

Off by default; when off the scheduler never calls into this module, so checks cost
nothing. The records are the same ones the state machines and proofs use, so a rule
broken in production reads exactly like one broken in a test.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvcore.spec.errors import InvariantViolation
from kvcore.spec.invariants import PREDICATE_IDS, PREDICATES, check


def checks_enabled(flag: bool | None) -> bool:
    """The constructor flag wins; otherwise ``KVCORE_CHECK=1`` turns checks on."""
    if flag is not None:
        return flag
    return os.environ.get("KVCORE_CHECK", "") == "1"


def tally(records: Sequence[object], counts: dict[str, int]) -> None:
    """Count, per invariant id, the predicate evaluations ``records`` will get."""
    for record in records:
        for predicate in PREDICATES.get(type(record), ()):
            key = PREDICATE_IDS[predicate.__name__]
            counts[key] = counts.get(key, 0) + 1


def enforce(records: Sequence[object], counts: dict[str, int] | None = None) -> None:
    """Raise ``InvariantViolation`` listing every broken id among ``records``."""
    if counts is not None:
        tally(records, counts)
    violations = check(records)
    if violations:
        raise InvariantViolation(violations)
