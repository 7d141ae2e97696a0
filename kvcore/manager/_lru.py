"""Least-recently-used eviction over READY keys, with one ``KeyOrder``.

The order holds READY keys only, least recent first. A key joins at the recent end when
its write completes and moves there when touched. WRITING keys have no place yet (their
completion makes them most recent anyway), and pinned keys keep theirs: a load does not
refresh a chunk, only ``touch`` does. Upstream's scenario depends on it: after a load of
``[2, 3]`` completes, a store that needs three slots evicts ``[2, 3, 4]``.

The order is a ``kvcore._index.KeyOrder`` (keys inline, links in arrays), not an
OrderedDict: a lookup of a 128K-token prompt touches 8,192 keys of a multi-million-key
tier, and each OrderedDict move was a few cache misses in a row (2.2 ms for the batch);
``KeyOrder.touch`` probes a window of keys at once. It behaves as the OrderedDict did
(``tests/unit/test_index.py`` compares them operation by operation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcore._index import KeyOrder
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
        self._order = KeyOrder()

    def order(self) -> tuple[Key, ...]:
        """READY keys, least recent first (for tests and debugging)."""
        return tuple(self._order)

    def insert(self, key: Key) -> None:
        """WRITING keys get no place in the order until ``ready``."""

    def ready(self, key: Key) -> None:
        self._order.add_many((key,))

    def ready_many(self, keys: Sequence[Key]) -> None:
        self._order.add_many(keys)

    def discard(self, key: Key) -> None:
        """A failed WRITING key never entered the order; nothing to undo."""

    def touch(self, keys: Sequence[Key]) -> None:
        """Present keys move to the recent end, the first key most recent; absent ones
        (a window's unstored chunks, most of what a lookup touches) are skipped."""
        self._order.touch(keys)

    def touch_hashes(self, hashes: Sequence[bytes], suffix: bytes) -> None:
        """``touch`` of ``hash + suffix`` each, the keys assembled inside ``KeyOrder``; a
        subclass that overrides ``touch`` gets the keys made, through it."""
        if type(self).touch is not LRUPolicy.touch:
            super().touch_hashes(hashes, suffix)
            return
        self._order.touch(hashes, suffix)

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
        self._order.remove_many(victims)

    def clear(self) -> None:
        self._order.clear()
