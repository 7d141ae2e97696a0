"""The reference CPU-tier manager: what a manager must answer, in the simplest correct code.

This is the model that ``kvcore.CPUOffloadManager`` is compared against, step by step, in
the refinement tests (TigerBeetle's state checker). It favours being obviously right over
being fast: plain dicts, one recency list per group, and recomputation wherever a counter
would do.

Semantics (docs/semantics.md, "Manager: the CPU tier"; invariant M1):

- Capacity is counted in chunks, per group: a slot holds one chunk of one group, each key
  belongs to the pool of its group (its last KEY_GROUP_BYTES, as ``make_key`` writes
  them), and slot ids are per pool, ``0..capacity_g - 1``. A stored key is WRITING, READY,
  or READY and pinned by n loads. ``lookup`` answers HIT (READY, pinned or not), PENDING
  (WRITING) or MISS (absent).
- Recency covers the READY keys only, one order per group, least recent first. A key
  enters at the most recent end when its write completes; ``touch`` moves keys to that
  end, iterating in reverse so the first key ends most recent (a prefix's early chunks
  outlive its later ones). Pins do not move a key, so a chunk that was loaded keeps its
  place (upstream's ``[2, 3, 4]`` eviction after a load depends on this).
- ``prepare_store`` stores the keys that are absent. When a group needs more slots than
  its pool has free it evicts exactly that many evictable keys of that group (READY,
  unpinned, not among the call's own keys), least recent first; the evicted keys are
  listed group by group, groups in the order their first absent key appears. If any group
  cannot make its room the call returns None and changes nothing (M1: atomic), whatever
  room the other groups have. A key of a group without a pool (past a per-group capacity's
  length, or >= MAX_GROUPS) is a ``KeyGroupError``, raised first.
- Slots, per pool: fresh ids in increasing order first (a high-water mark), then recycled
  ids from a LIFO free list. The exact ids are observable, so the order is part of the
  spec.
- Events: one removed event per evicting ``prepare_store``, one stored event per
  successful ``complete_store`` that made keys READY. A failed store emits nothing: its
  keys were never announced, so there is nothing to withdraw (a failed transfer never
  becomes a hit, X1). ``reset`` drops pending events and emits none. The pending events
  hold at most ``max_pending_events`` keys: beyond that the oldest keys are dropped (an
  event loses its oldest keys first) and counted in ``events_dropped``, so a caller that
  never drains them costs bounded memory.
- Arguments are checked before anything changes: keys are ``bytes`` of 1..MAX_KEY_BYTES
  in a list or tuple, ``success`` is a ``bool``; otherwise ``BadKeyError`` or
  ``ArgumentTypeError``.
- Cumulative counters (evictions, stores skipped, keys stored) survive ``reset``: they
  are metrics, and a metric counter never goes backwards.

The value types and the manager's operating errors live here, beside the model, because
``spec`` imports nothing from ``kvcore`` and both managers must return and raise the same
things for the refinement tests to compare them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.spec.errors import (
    InvalidKeyError,
    KeyGroupError,
    KeyNotReadyError,
    NotPinnedError,
)
from kvcore.spec.hooks import check_capacity, check_key, check_keys, check_success
from kvcore.spec.types import (
    DEFAULT_MAX_PENDING_EVENTS,
    KEY_GROUP_BYTES,
    MAX_GROUPS,
    Key,
    Status,
    check_pending_events,
)

# -- values -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrepareStoreResult:
    """What ``prepare_store`` decided: the keys to write, where, and what made room.

    ``keys_to_store`` are the call's keys that were absent, deduplicated, in call order;
    ``slots[i]`` is the slot of ``keys_to_store[i]``; ``evicted`` are the keys removed to
    make room, in eviction order. All three are empty when every key was already present.
    """

    keys_to_store: tuple[Key, ...]
    slots: tuple[int, ...]
    evicted: tuple[Key, ...]


@dataclass(frozen=True)
class ManagerEvent:
    """Keys that became loadable (``removed=False``) or stopped being loadable (True)."""

    keys: tuple[Key, ...]
    removed: bool


@dataclass(frozen=True)
class ManagerStats:
    """A snapshot of the tier: occupancy now, plus cumulative counters.

    ``used == writing + pinned + evictable`` and ``used <= capacity`` always hold.
    ``evictions`` counts evicted keys, ``stores_skipped_no_room`` counts ``prepare_store``
    calls that returned None, and ``stored_keys`` counts keys that became READY.
    """

    capacity: int
    used: int
    writing: int
    pinned: int
    evictable: int
    evictions: int
    stores_skipped_no_room: int
    stored_keys: int
    events_dropped: int = 0


# -- operating errors -------------------------------------------------------------------


def check_key_types(keys: Sequence[object]) -> None:
    """Raise InvalidKeyError for the first key that is not ``bytes``."""
    for key in keys:
        if type(key) is not bytes:
            raise InvalidKeyError(key)


# -- the model --------------------------------------------------------------------------


def _group_of(key: Key) -> int:
    """The group a key names: its last KEY_GROUP_BYTES, big-endian (as make_key writes it)."""
    return int.from_bytes(key[-KEY_GROUP_BYTES:], "big")


class ReferenceManager:
    """The reference CPU tier with LRU eviction; see the module docstring for the rules.

    One pool per group: ``capacity`` is one int (every group has that many slots) or one
    per group. ``state`` maps each stored key to ``"writing"`` or ``"ready"``; ``slot`` and
    ``pins`` hold its slot (within its group's pool) and pin count; ``recency[g]`` lists
    group ``g``'s READY keys, least recent first. ``pools`` are the groups with a pool:
    every group of a per-group capacity; with one int, group 0 and the groups stored so far.
    """

    def __init__(self, capacity: int | Sequence[int],
                 max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS) -> None:
        self.capacity: int | tuple[int, ...] = check_capacity(capacity)
        check_pending_events(max_pending_events)
        self.max_pending_events = max_pending_events
        self.events_dropped = 0
        self.state: dict[Key, str] = {}
        self.slot: dict[Key, int] = {}
        self.pins: dict[Key, int] = {}
        self.recency: dict[int, list[Key]] = {}
        # Group 0 always has a pool; with one int, other groups get theirs when first stored.
        self.pools: set[int] = set(range(self.groups())) \
            if isinstance(self.capacity, tuple) else {0}
        self.next_fresh_slot: dict[int, int] = {}
        self.free_slots: dict[int, list[int]] = {}
        self.events: list[ManagerEvent] = []
        self.evictions = 0
        self.stores_skipped_no_room = 0
        self.stored_keys = 0

    def groups(self) -> int:
        """How many groups may have a pool: the per-group list's length, else MAX_GROUPS."""
        return len(self.capacity) if isinstance(self.capacity, tuple) else MAX_GROUPS

    def capacity_of(self, group: int) -> int:
        """Slots of ``group``'s pool; 0 outside the groups."""
        if not 0 <= group < self.groups():
            return 0
        return self.capacity[group] if isinstance(self.capacity, tuple) else self.capacity

    # -- reads --------------------------------------------------------------------------

    def lookup(self, key: Key) -> Status:
        """HIT if READY (pinned or not), PENDING if WRITING, MISS if absent. Changes nothing."""
        check_key("lookup", key)
        if key not in self.state:
            return Status.MISS
        return Status.HIT if self.state[key] == "ready" else Status.PENDING

    def state_of(self, key: Key) -> str | None:
        """``"writing"``, ``"ready"``, ``"pinned"``, or None when absent."""
        check_key("state_of", key)
        if key not in self.state:
            return None
        if self.state[key] == "ready" and self.pins[key] > 0:
            return "pinned"
        return self.state[key]

    def slot_of(self, key: Key) -> int | None:
        """The key's slot, or None when absent."""
        check_key("slot_of", key)
        return self.slot.get(key)

    def evictable_keys(self, group: int, protected: Sequence[Key] = ()) -> list[Key]:
        """Group ``group``'s READY, unpinned keys outside ``protected``, least recent first."""
        return [k for k in self.recency.get(group, [])
                if self.pins[k] == 0 and k not in protected]

    def used_of(self, group: int) -> int:
        """Keys stored in ``group``'s pool, recounted."""
        return sum(1 for k in self.state if _group_of(k) == group)

    def stats(self) -> ManagerStats:
        """Occupancy recounted from the states, plus the cumulative counters."""
        states = [self.state_of(k) for k in self.state]
        return ManagerStats(
            capacity=sum(self.capacity_of(g) for g in self.pools),
            used=len(states),
            writing=states.count("writing"),
            pinned=states.count("pinned"),
            evictable=states.count("ready"),
            evictions=self.evictions,
            stores_skipped_no_room=self.stores_skipped_no_room,
            stored_keys=self.stored_keys,
            events_dropped=self.events_dropped,
        )

    # -- recency and loads --------------------------------------------------------------

    def touch(self, keys: Sequence[Key]) -> None:
        """Make READY keys most recent, ``keys[0]`` last so it ends the most recent."""
        keys = check_keys("touch", keys)
        for key in reversed(keys):
            order = self.recency.get(_group_of(key), [])
            if key in order:
                order.remove(key)
                order.append(key)

    def prepare_load(self, keys: Sequence[Key]) -> tuple[int, ...]:
        """Pin every key (once per occurrence) and return their slots in key order."""
        keys = check_keys("prepare_load", keys)
        for key in keys:
            if self.state.get(key) != "ready":
                raise KeyNotReadyError(key, "writing" if key in self.state else "absent")
        for key in keys:
            self.pins[key] += 1
        return tuple(self.slot[k] for k in keys)

    def complete_load(self, keys: Sequence[Key]) -> None:
        """Release one pin per occurrence of each key."""
        keys = check_keys("complete_load", keys)
        for key in keys:
            pins, releases = self.pins.get(key, 0), list(keys).count(key)
            if self.state.get(key) != "ready" or pins < releases:
                raise NotPinnedError(key, self.state_of(key) or "absent", pins, releases)
        for key in keys:
            self.pins[key] -= 1

    # -- stores -------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[Key],
                      victims: Sequence[Key] | None = None) -> PrepareStoreResult | None:
        """Reserve slots for the absent keys, evicting least recent keys of their groups.

        Each group needs the slots its absent keys lack in its own pool and evicts only
        its own keys; if any group cannot make its room the answer is None and nothing
        changed. ``victims`` replaces the LRU choice with another policy's (ARC's), so the
        tests can check that policy against this model: for every group it must name
        exactly the number of that group's keys needed, all evictable and outside the
        call, or ValueError is raised.
        """
        keys = check_keys("prepare_store", keys)
        to_store: list[Key] = []
        for key in keys:
            if key not in self.state and key not in to_store:
                to_store.append(key)
        if not to_store:
            return PrepareStoreResult((), (), ())
        groups = list(dict.fromkeys(_group_of(k) for k in to_store))
        for key in to_store:
            if not 0 <= _group_of(key) < self.groups():
                raise KeyGroupError("prepare_store", key, _group_of(key), self.groups())
        needs = {g: sum(1 for k in to_store if _group_of(k) == g)
                 - (self.capacity_of(g) - self.used_of(g)) for g in groups}
        allowed = {g: self.evictable_keys(g, protected=keys) for g in groups}
        if any(needs[g] > len(allowed[g]) for g in groups):
            self.stores_skipped_no_room += 1
            return None
        lru = [k for g in groups for k in allowed[g][:max(needs[g], 0)]]
        chosen = lru if victims is None else list(victims)
        for g in groups:
            mine = [k for k in chosen if _group_of(k) == g]
            if len(mine) != max(needs[g], 0) or not set(mine) <= set(allowed[g]):
                raise ValueError(f"victims {chosen!r} are not {needs[g]} evictable keys "
                                 f"of group {g}")
        if len(set(chosen)) != len(chosen) or len(chosen) != len(lru):
            raise ValueError(f"victims {chosen!r} are not {len(lru)} distinct keys of the "
                             "groups that need room")
        for key in chosen:
            self.free_slots.setdefault(_group_of(key), []).append(self.slot[key])
            self._forget(key)
        if chosen:
            self._emit(ManagerEvent(tuple(chosen), removed=True))
            self.evictions += len(chosen)
        slots = tuple(self._allocate(key) for key in to_store)
        return PrepareStoreResult(tuple(to_store), slots, tuple(chosen))

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        """Finish a store: WRITING keys become READY, or are dropped if it failed.

        READY and absent keys are left alone: a key may have been present before the
        store was prepared, and the scheduler, not the tier, accounts for jobs (J2).
        """
        keys = check_keys("complete_store", keys)
        check_success("complete_store", success)
        done = [k for k in dict.fromkeys(keys) if self.state.get(k) == "writing"]
        for key in done:
            if success:
                self.state[key] = "ready"
                self.recency.setdefault(_group_of(key), []).append(key)
            else:
                self.free_slots.setdefault(_group_of(key), []).append(self.slot[key])
                self._forget(key)
        if success and done:
            self._emit(ManagerEvent(tuple(done), removed=False))
            self.stored_keys += len(done)

    def take_events(self) -> list[ManagerEvent]:
        """Drain the events produced since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def reset(self) -> None:
        """Forget every key and slot; cumulative counters stay (they are metrics)."""
        self.state, self.slot, self.pins, self.recency = {}, {}, {}, {}
        self.next_fresh_slot, self.free_slots, self.events = {}, {}, []

    # -- helpers ------------------------------------------------------------------------

    def _emit(self, event: ManagerEvent) -> None:
        """Append an event; beyond ``max_pending_events`` keys, drop the oldest keys."""
        self.events.append(event)
        excess = sum(len(e.keys) for e in self.events) - self.max_pending_events
        while excess > 0:
            first = self.events[0]
            if len(first.keys) <= excess:
                del self.events[0]
                dropped = len(first.keys)
            else:
                self.events[0] = ManagerEvent(first.keys[excess:], first.removed)
                dropped = excess
            self.events_dropped += dropped
            excess -= dropped

    def _allocate(self, key: Key) -> int:
        group = _group_of(key)
        self.pools.add(group)
        fresh = self.next_fresh_slot.get(group, 0)
        if fresh < self.capacity_of(group):
            slot = fresh
            self.next_fresh_slot[group] = fresh + 1
        else:
            slot = self.free_slots[group].pop()
        self.state[key], self.slot[key], self.pins[key] = "writing", slot, 0
        return slot

    def _forget(self, key: Key) -> None:
        del self.state[key], self.slot[key], self.pins[key]
        order = self.recency.get(_group_of(key), [])
        if key in order:
            order.remove(key)
