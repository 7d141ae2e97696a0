"""The eviction policy interface: which READY keys go first when the tier needs room.

A policy orders keys and nothing else. The manager owns states, pins and slots and tells
the policy about each transition; the policy answers one question, "which ``n`` keys,
among those the manager allows, should go?". Choosing and applying are separate calls
(``choose`` changes nothing, ``evict`` applies), so eviction is atomic by construction:
a choice that cannot be completed is simply dropped (invariant M1), and with checks on
the manager can test a choice before anything moves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

from kvcore._scan import suffixed
from kvcore.spec.types import Key


class EvictionPolicy(ABC):
    """Recency bookkeeping for one tier, driven by the manager's state transitions.

    The manager calls ``insert`` when a key starts WRITING, then exactly one of ``ready``
    (its write succeeded) or ``discard`` (it failed), and ``evict`` only with keys
    ``choose`` returned since the last change. Pins do not reach the policy: a pinned key
    keeps its place, and ``can_evict`` passed to ``choose`` skips it.
    """

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key) -> None:
        """``key`` starts WRITING; it has no recency until ``ready``."""

    @abstractmethod
    def ready(self, key: Key) -> None:
        """``key``'s write succeeded: it becomes the most recent READY key."""

    def ready_many(self, keys: Sequence[Key]) -> None:
        """``ready`` for each key in order (a store's keys complete together; policies
        override this to do it in one C-level call)."""
        for key in keys:
            self.ready(key)

    @abstractmethod
    def discard(self, key: Key) -> None:
        """``key``'s write failed: forget it (it was never READY, so leave no trace)."""

    @abstractmethod
    def touch(self, keys: Sequence[Key]) -> None:
        """Refresh recency, iterating in reverse so ``keys[0]`` ends the most recent.

        Keys the policy does not hold are ignored (ARC learns from its ghost lists).
        """

    def touch_hashes(self, hashes: Sequence[bytes], suffix: bytes) -> None:
        """``touch`` of the keys ``hash + suffix`` (checked by the manager): policies whose
        order is native take them without a key object each; the default makes them."""
        self.touch(suffixed(hashes, suffix))

    @abstractmethod
    def choose(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        """The ``n`` keys to evict, in policy order, or None if fewer qualify.

        Only keys with ``can_evict(key)`` true qualify. Changes nothing.
        """

    @abstractmethod
    def evict(self, victims: Sequence[Key]) -> None:
        """Apply a choice returned by ``choose``: the victims leave the policy."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything, as at construction."""
