"""The CPU tier: a fixed pool of chunk slots in host memory, with LRU or ARC eviction.

It must answer exactly as ``kvcore.spec.manager_model.ReferenceManager`` does (the
refinement tests compare them after every operation), but in O(1) amortized time per key
for ``lookup``, ``touch`` and the ``complete_*`` calls, and O(keys + evicted + keys
skipped) for ``prepare_store``, where the keys skipped are pinned keys and the call's own
keys met while walking the policy's order. Counters replace the model's recomputation.

With checking on (``check=True`` or ``KVCORE_CHECK=1``) every ``prepare_store`` that needed
room is described as an ``EvictionRecord`` and checked by the M1 predicate before the
eviction is applied; off, no record is built.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Sequence

from kvcore.manager._arc import ARCPolicy
from kvcore.manager._base import OffloadManager
from kvcore.manager._lru import LRUPolicy
from kvcore.manager._policy import EvictionPolicy
from kvcore.spec.errors import (
    ConfigError,
    InvariantViolation,
    KeyNotReadyError,
    NotPinnedError,
)
from kvcore.spec.hooks import MAX_KEY_BYTES, check_key, check_keys, check_success
from kvcore.spec.invariants import EvictionRecord, m1_eviction_safe
from kvcore.spec.manager_model import (
    MAX_CAPACITY_CHUNKS,
    ManagerEvent,
    ManagerStats,
    PrepareStoreResult,
)
from kvcore.spec.types import DEFAULT_MAX_PENDING_EVENTS, Key, Status, check_pending_events

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def check_capacity(capacity: object) -> None:
    """kvcore's own check (the reference manager has its own): a positive int in range."""
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise ConfigError("capacity", f"capacity={capacity!r} must be an int: the CPU tier's "
                          "size in chunks")
    if not 0 < capacity <= MAX_CAPACITY_CHUNKS:
        hint = ("must be positive: the CPU tier needs room for at least one chunk"
                if capacity <= 0 else
                f"exceeds {MAX_CAPACITY_CHUNKS} chunks; it counts chunks, not bytes")
        raise ConfigError("capacity", f"capacity={capacity} {hint}")




_EMPTY = PrepareStoreResult((), (), ())


class _Entry:
    """One stored key: its slot, its pin count, and whether its write has completed."""

    __slots__ = ("pins", "ready", "slot")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.pins = 0
        self.ready = False


def check_enabled(check: bool | None) -> bool:
    """The constructor flag wins; None defers to ``KVCORE_CHECK=1`` in the environment."""
    if check is None:
        return os.environ.get("KVCORE_CHECK") == "1"
    return bool(check)


class CPUOffloadManager(OffloadManager):
    """The CPU tier: ``capacity`` chunk slots, LRU or ARC eviction, events and stats.

    Slots are handed out fresh first, in increasing order, then from a LIFO list of
    recycled ones, so slot ids are deterministic (tests pin them, e.g. ``[2, 3, 0]``).
    Pending events hold at most ``max_pending_events`` keys (pass the config's
    ``max_pending_events``); the oldest are dropped beyond that and counted in
    ``stats().events_dropped``.
    """

    def __init__(self, capacity: int, policy: str = "lru", *, check: bool | None = None,
                 max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS) -> None:
        check_capacity(capacity)
        check_pending_events(max_pending_events)
        if not isinstance(policy, str) or policy not in POLICIES:
            raise ConfigError("policy", f"policy={policy!r} is not an eviction policy; "
                              f"choose one of {sorted(POLICIES)}")
        self._capacity = capacity
        self._policy: EvictionPolicy = POLICIES[policy](capacity)
        self._check = check_enabled(check)
        self._entries: dict[Key, _Entry] = {}
        self._next_fresh_slot = 0
        self._free_slots: list[int] = []
        self._writing = 0
        self._pinned = 0  # keys with at least one pin, not pins
        self._events: deque[ManagerEvent] = deque()
        self._event_keys = 0  # keys in ``_events``
        self._max_events = max_pending_events
        self._events_dropped = 0
        self._evictions = 0
        self._stores_skipped_no_room = 0
        self._stored_keys = 0
        # Predicate evaluations per invariant id, for reports (``kvcore check``).
        self.checked: dict[str, int] = {}

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy object (for tests and debugging)."""
        return self._policy

    @property
    def check(self) -> bool:
        """Whether runtime invariant checking is on."""
        return self._check

    # -- reads ----------------------------------------------------------------------

    def lookup(self, key: Key) -> Status:
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            check_key("lookup", key)
        entry = self._entries.get(key)
        if entry is None:
            return Status.MISS
        return Status.HIT if entry.ready else Status.PENDING

    def state_of(self, key: Key) -> str | None:
        """``"writing"``, ``"ready"``, ``"pinned"``, or None when absent."""
        check_key("state_of", key)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if not entry.ready:
            return "writing"
        return "pinned" if entry.pins else "ready"

    def slot_of(self, key: Key) -> int | None:
        check_key("slot_of", key)
        entry = self._entries.get(key)
        return None if entry is None else entry.slot

    def stats(self) -> ManagerStats:
        used = len(self._entries)
        return ManagerStats(
            capacity=self._capacity,
            used=used,
            writing=self._writing,
            pinned=self._pinned,
            evictable=used - self._writing - self._pinned,
            evictions=self._evictions,
            stores_skipped_no_room=self._stores_skipped_no_room,
            stored_keys=self._stored_keys,
            events_dropped=self._events_dropped,
        )

    # -- recency and loads ----------------------------------------------------------

    def touch(self, keys: Sequence[Key]) -> None:
        check_keys("touch", keys)
        self._policy.touch(keys)

    def prepare_load(self, keys: Sequence[Key]) -> tuple[int, ...]:
        """Pin each key once per occurrence; all keys are validated before any is pinned,
        so a rejected call (KeyNotReadyError) leaves every pin count as it was."""
        check_keys("prepare_load", keys)
        entries = self._entries
        for key in keys:  # validate every key before pinning any
            entry = entries.get(key)
            if entry is None or not entry.ready:
                raise KeyNotReadyError(key, "absent" if entry is None else "writing")
        slots = []
        for key in keys:
            entry = entries[key]
            if entry.pins == 0:
                self._pinned += 1
            entry.pins += 1
            slots.append(entry.slot)
        return tuple(slots)

    def complete_load(self, keys: Sequence[Key]) -> None:
        """Release one pin per occurrence; counted per key first, so a call releasing more
        pins than a key holds raises NotPinnedError before any pin moves."""
        check_keys("complete_load", keys)
        entries = self._entries
        for key, releases in Counter(keys).items():  # validate before releasing any
            entry = entries.get(key)
            if entry is None or not entry.ready or entry.pins < releases:
                pins = 0 if entry is None else entry.pins
                raise NotPinnedError(key, self.state_of(key) or "absent", pins, releases)
        for key in keys:
            entry = entries[key]
            entry.pins -= 1
            if entry.pins == 0:
                self._pinned -= 1

    # -- stores ---------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreResult | None:
        """Choose victims (a pure step), check them if asked, then apply; see the base.

        The fast None path answers without walking the policy when fewer keys are
        evictable than needed; otherwise the walk costs the victims plus the pinned and
        same-call keys it passes.
        """
        check_keys("prepare_store", keys)
        entries = self._entries
        to_store = [k for k in dict.fromkeys(keys) if k not in entries]
        if not to_store:
            return _EMPTY
        need = len(to_store) - (self._capacity - len(entries))
        victims: list[Key] = []
        if need > 0:
            before = self._fingerprint() if self._check else None
            chosen = self._choose(need, keys)
            if self._check:
                self._check_eviction(keys, chosen or [], need, chosen is None, before)
            if chosen is None:
                self._stores_skipped_no_room += 1
                return None
            victims = chosen
            self._evict(victims)
        slots = tuple(self._allocate(key) for key in to_store)
        return PrepareStoreResult(tuple(to_store), slots, tuple(victims))

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        """WRITING keys become READY (one stored event) or are dropped (no event)."""
        check_keys("complete_store", keys)
        check_success("complete_store", success)
        entries, policy = self._entries, self._policy
        done: list[Key] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.ready:
                continue  # READY before this store, or absent: not this store's key
            done.append(key)
            if success:
                entry.ready = True
                policy.ready(key)
            else:
                del entries[key]
                self._free_slots.append(entry.slot)
                policy.discard(key)
        self._writing -= len(done)
        if success and done:
            self._emit(ManagerEvent(tuple(done), removed=False))
            self._stored_keys += len(done)

    def take_events(self) -> list[ManagerEvent]:
        events, self._events, self._event_keys = list(self._events), deque(), 0
        return events

    def reset(self) -> None:
        """Forget every key and slot; cumulative counters stay (they are metrics)."""
        self._entries = {}
        self._next_fresh_slot = 0
        self._free_slots = []
        self._writing = self._pinned = 0
        self._events, self._event_keys = deque(), 0
        self._policy.clear()

    # -- helpers --------------------------------------------------------------------

    def _choose(self, need: int, keys: Sequence[Key]) -> list[Key] | None:
        """``need`` victims in policy order, or None; changes nothing."""
        if need > len(self._entries) - self._writing - self._pinned:
            return None  # fewer evictable keys than needed: no walk
        entries = self._entries
        protected = set(keys)
        return self._policy.choose(
            need, lambda k: entries[k].pins == 0 and k not in protected)

    def _evict(self, victims: list[Key]) -> None:
        for key in victims:
            self._free_slots.append(self._entries.pop(key).slot)
        self._policy.evict(victims)
        self._emit(ManagerEvent(tuple(victims), removed=True))
        self._evictions += len(victims)

    def _emit(self, event: ManagerEvent) -> None:
        """Buffer an event; past ``max_pending_events`` keys the oldest keys go first."""
        events = self._events
        events.append(event)
        self._event_keys += len(event.keys)
        excess = self._event_keys - self._max_events
        while excess > 0:
            first = events[0]
            if len(first.keys) <= excess:
                events.popleft()
                dropped = len(first.keys)
            else:
                events[0] = ManagerEvent(first.keys[excess:], first.removed)
                dropped = excess
            self._events_dropped += dropped
            self._event_keys -= dropped
            excess -= dropped

    def _allocate(self, key: Key) -> int:
        if self._next_fresh_slot < self._capacity:
            slot = self._next_fresh_slot
            self._next_fresh_slot += 1
        else:
            slot = self._free_slots.pop()
        self._entries[key] = _Entry(slot)
        self._writing += 1
        self._policy.insert(key)
        return slot

    def _fingerprint(self) -> tuple[int, ...]:
        """Cheap summary of the mutable state, to see whether a None answer changed it."""
        return (len(self._entries), self._next_fresh_slot, len(self._free_slots),
                self._writing, self._pinned, len(self._events), self._evictions)

    def _check_eviction(self, keys: Sequence[Key], victims: list[Key], need: int,
                        returned_none: bool, before: tuple[int, ...] | None) -> None:
        """M1, checked on the choice before it is applied (check mode only)."""
        record = EvictionRecord(
            call_keys=tuple(keys),
            evicted=tuple((k, self.state_of(k) or "absent") for k in victims),
            needed=need,
            returned_none=returned_none,
            changed_state=before != self._fingerprint(),
        )
        self.checked["M1"] = self.checked.get("M1", 0) + 1
        violations = m1_eviction_safe(record)
        if violations:
            raise InvariantViolation(violations)
