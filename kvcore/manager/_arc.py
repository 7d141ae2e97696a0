"""Adaptive Replacement Cache (ARC) eviction over READY keys.

ARC splits the READY keys into T1 (seen once: stored, not touched since) and T2 (touched
again), and remembers recently evicted keys in ghost lists B1 (from T1) and B2 (from T2).
A touch that hits a ghost says the tier evicted too eagerly from that side, so ARC moves
its target size ``p`` for T1: a B1 hit raises it by ``max(1, |B2| / |B1|)`` (capped at
the capacity), a B2 hit lowers it by ``max(1, |B1| / |B2|)`` (floored at 0). Eviction
takes from T1 while ``|T1| >= int(p)``, otherwise from T2.

Differences from upstream's policy, on purpose:
- When the preferred list has no evictable key, eviction falls back to the other list in
  both directions. Upstream falls back only from T1 to T2, so it can answer None while
  evictable T1 keys exist; here None means exactly "not enough evictable keys", the same
  answer as LRU and the reference model.
- As in ``_lru``, WRITING keys have no place in T1 until their write completes (they still
  count towards ``|T1|``), and pins do not move keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from kvcore.manager._policy import EvictionPolicy
from kvcore.spec.types import Key


class ARCPolicy(EvictionPolicy):
    """ARC with ghost lists bounded by the capacity and an adaptive T1 target.

    ``choose`` simulates the T1 size as it picks, so a multi-key eviction follows the
    same T1/T2 sequence that single evictions would, without changing anything.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._writing = 0  # keys inserted and not yet ready: part of |T1|
        self._target = 0.0

    # -- views for tests and debugging ------------------------------------------------

    @property
    def target_t1(self) -> float:
        """``p``: the size ARC currently wants T1 to have."""
        return self._target

    @property
    def t1_size(self) -> int:
        """``|T1|`` as ARC's choice counts it: READY keys in T1 plus the WRITING ones."""
        return len(self._t1) + self._writing

    def lists(self) -> dict[str, tuple[Key, ...]]:
        """T1, T2, B1 and B2, each least recent first (T1 holds READY keys only)."""
        return {"t1": tuple(self._t1), "t2": tuple(self._t2),
                "b1": tuple(self._b1), "b2": tuple(self._b2)}

    # -- transitions ------------------------------------------------------------------

    def insert(self, key: Key) -> None:
        self._writing += 1
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def ready(self, key: Key) -> None:
        self._writing -= 1
        self._t1[key] = None

    def ready_many(self, keys: Sequence[Key]) -> None:
        self._writing -= len(keys)
        t1 = self._t1
        for key in keys:
            t1[key] = None

    def discard(self, key: Key) -> None:
        self._writing -= 1

    def touch(self, keys: Sequence[Key]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in reversed(keys):
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1:
                step = max(1.0, len(b2) / len(b1))
                self._target = min(float(self.capacity), self._target + step)
                b1.move_to_end(key)
            elif key in b2:
                step = max(1.0, len(b1) / len(b2))
                self._target = max(0.0, self._target - step)
                b2.move_to_end(key)

    def choose(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        """Pick from T1 while the simulated ``|T1| >= int(p)``, else from T2, falling back
        to the other list when the preferred one has no evictable key left."""
        t1_size = self.t1_size
        from_t1 = _candidates(self._t1, can_evict)
        from_t2 = _candidates(self._t2, can_evict)
        chosen: list[Key] = []
        while len(chosen) < n:
            prefer_t1 = t1_size >= int(self._target)
            first, second = (from_t1, from_t2) if prefer_t1 else (from_t2, from_t1)
            key = next(first, None)
            if key is None:
                key = next(second, None)
            if key is None:
                return None
            if key in self._t1:
                t1_size -= 1
            chosen.append(key)
        return chosen

    def evict(self, victims: Sequence[Key]) -> None:
        """Victims become ghosts of their list; each ghost list keeps ``capacity`` keys."""
        for key in victims:
            if key in self._t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        for ghosts in (self._b1, self._b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)

    def clear(self) -> None:
        for keys in (self._t1, self._t2, self._b1, self._b2):
            keys.clear()
        self._writing = 0
        self._target = 0.0


def _candidates(keys: OrderedDict[Key, None], can_evict: Callable[[Key], bool]
                ) -> Iterator[Key]:
    """The evictable keys of one list, least recent first, read lazily."""
    return (key for key in keys if can_evict(key))
