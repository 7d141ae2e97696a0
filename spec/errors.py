"""The three errors users see, defined once.

They live in ``spec`` (standard library only) because the spec's own validation raises
``ConfigError`` and its predicates feed ``InvariantViolation``; ``kvcore`` re-exports them.
There are two kinds of failure (TigerBeetle's split): bad input from the engine is an
*operating error* (``ConfigError``, ``KVCopyError``) raised whatever the flags say; a broken
invariant is a *programmer error* in kvcore itself (``InvariantViolation``). Each exception
carries its facts as fields so that ``--json`` output never parses message text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
    """Raised when a configuration is invalid or ambiguous.

    ``field`` names the offending field (dotted, e.g. ``groups[1].window_tokens``) so tools
    can point at it; the message says what is wrong and what to set instead. kvcore never
    warns and falls back: an ambiguous set-up is an error.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class KVCopyError(RuntimeError):
    """Raised when a copy descriptor is invalid; no byte has moved when it is raised.

    The copy library validates every descriptor before the first byte moves (invariant B1),
    so this error always means "nothing was copied". ``descriptor_index`` is the first bad
    descriptor, ``code`` the native status code, ``value`` and ``bound`` the offending number
    and the limit it broke (when known).
    """

    def __init__(
        self,
        message: str,
        *,
        code: int = 0,
        descriptor_index: int | None = None,
        job_id: int | None = None,
        group: int | None = None,
        value: int | None = None,
        bound: int | None = None,
    ) -> None:
        self.code = code
        self.descriptor_index = descriptor_index
        self.job_id = job_id
        self.group = group
        self.value = value
        self.bound = bound
        super().__init__(message)


class InvariantViolation(AssertionError):
    """Raised when runtime checking finds a broken invariant: a bug in kvcore, not the engine.

    ``ids`` lists the broken invariant ids (``"E1"``, ``"B1"``...) and ``violations`` the
    ``spec.invariants.Violation`` records with the offending values. It subclasses
    ``AssertionError`` because it reports a programmer error, but it is raised explicitly,
    so ``python -O`` does not strip it.
    """

    def __init__(self, violations: Sequence[Any]) -> None:
        self.violations = list(violations)
        self.ids = sorted({v.id for v in self.violations})
        lines = [f"{v.id}: {v.message}" for v in self.violations]
        super().__init__("invariants broken: " + "; ".join(lines))
