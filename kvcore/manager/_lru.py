"""Least-recently-used eviction over READY keys, with one OrderedDict.

The order holds READY keys only, least recent first. A key joins at the recent end when
its write completes and moves there when touched. WRITING keys have no place yet (their
completion makes them most recent anyway), and pinned keys keep theirs: a load does not
refresh a chunk, only ``touch`` does. Upstream's scenario depends on it: after a load of
``[2, 3]`` completes, a store that needs three slots evicts ``[2, 3, 4]``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from kvcore.manager._policy import EvictionPolicy
from kvcore.spec.types import Key


class LRUPolicy(EvictionPolicy):
    """LRU: evict the least recently completed or touched evictable key first.

    ``choose`` walks from the old end and skips keys the manager forbids (pinned keys and
    the call's own keys), so its cost is the number of victims plus the keys skipped.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def order(self) -> tuple[Key, ...]:
        """READY keys, least recent first (for tests and debugging)."""
        return tuple(self._order)

    def insert(self, key: Key) -> None:
        """WRITING keys get no place in the order until ``ready``."""

    def ready(self, key: Key) -> None:
        self._order[key] = None

    def ready_many(self, keys: Sequence[Key]) -> None:
        # OrderedDict.update(dict) is ~4x slower per key than item assignment.
        order = self._order
        for key in keys:
            order[key] = None

    def discard(self, key: Key) -> None:
        """A failed WRITING key never entered the order; nothing to undo."""

    def touch(self, keys: Sequence[Key]) -> None:
        order = self._order
        # Most keys a lookup touches are absent (a window's unstored chunks): the filter
        # drops them in C, and the moves run in C too (a zero-length deque consumes the
        # map); moving a key does not change which keys are present.
        deque(map(order.move_to_end, filter(order.__contains__, reversed(keys))), maxlen=0)

    def choose(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if n <= 0:
            return []
        chosen: list[Key] = []
        for key in self._order:
            if can_evict(key):
                chosen.append(key)
                if len(chosen) == n:
                    return chosen
        return None

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            del self._order[key]

    def clear(self) -> None:
        self._order.clear()
