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

from collections import Counter, deque
from collections.abc import Sequence
from itertools import groupby
from typing import NoReturn

from kvcore._checks import checks_enabled, enforce
from kvcore._index import KeyIndex
from kvcore._scan import same_tail, suffixed
from kvcore.manager._arc import ARCPolicy
from kvcore.manager._base import OffloadManager
from kvcore.manager._capacity import check_config, cpu_capacities
from kvcore.manager._lru import LRUPolicy
from kvcore.manager._policy import EvictionPolicy
from kvcore.spec.errors import (
    ArgumentRangeError,
    ArgumentTypeError,
    ConfigError,
    KeyGroupError,
    KeyNotReadyError,
    NotPinnedError,
)
from kvcore.spec.hooks import (
    MAX_KEY_BYTES,
    check_capacity,
    check_hashes,
    check_key,
    check_keys,
    check_success,
)
from kvcore.spec.invariants import BufferRecord, EvictionRecord
from kvcore.spec.manager_model import (
    ManagerEvent,
    ManagerStats,
    PrepareStoreResult,
)
from kvcore.spec.types import (
    DEFAULT_MAX_PENDING_EVENTS,
    KEY_GROUP_BYTES,
    MAX_GROUPS,
    Key,
    OffloadConfig,
    Status,
    check_pending_events,
    key_group,
)

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


class _Pool:
    """One group's slots: its own free list, counters and eviction policy."""

    __slots__ = ("capacity", "free", "next_fresh", "pinned", "policy", "used", "writing")

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        self.capacity = capacity
        self.policy = policy
        self.next_fresh = 0
        self.free: list[int] = []
        self.used = self.writing = self.pinned = 0  # pinned: keys with a pin, not pins

    def allocate(self) -> int:
        """Fresh ids in increasing order first, then the most recently freed one."""
        if self.next_fresh < self.capacity:
            self.next_fresh += 1
            return self.next_fresh - 1
        return self.free.pop()


_EMPTY = PrepareStoreResult((), (), ())


def _bad_group(where: str, group: object) -> NoReturn:
    """A group index that is not an int: ``"0"`` or ``[0]`` would never match a pool and
    read as "no pool" (0, None), a silent answer to a wrong question."""
    raise ArgumentTypeError(f"CPUOffloadManager.{where}", "group", group, "int",
                            "pass a group index (an int)")


# A stored key's record is one int, ``slot << SLOT_SHIFT | group << 1 | writing``, not an
# object: the tier holds hundreds of thousands of keys, and an object per key made each of
# them a container the cyclic garbage collector walks (a full collection over a 524K-key
# tier took 0.33 s, a scheduler stall every few steps) and cost 56 bytes more per key.
# The records live in a ``KeyIndex`` (keys inline, native/kvcore_index.c), whose
# ``read`` answers a block of keys' MISS / HIT / PENDING from the low bit in one call. Pin
# counts live beside it, holding only the pinned keys.
GROUP_BITS = (MAX_GROUPS - 1).bit_length()
GROUP_MASK = (1 << GROUP_BITS) - 1
SLOT_SHIFT = GROUP_BITS + 1
WRITING = 1
# What ``KeyIndex.read`` answers for an absent, a READY and a WRITING key.
_STATUS_OF = (Status.MISS, Status.HIT, Status.PENDING)


def _check_hashes(where: str, hashes: object, suffix: object) -> tuple[bytes, ...]:
    """Hashes as ``check_hashes`` takes them (bytes of one length, 1..MAX_HASH_BYTES, in
    a list or tuple) and a group's key suffix: exact bytes of KEY_GROUP_BYTES. Returns
    the checked copy, which is what the call then uses (a list subclass could iterate
    differently the second time)."""
    if type(suffix) is not bytes:
        raise ArgumentTypeError(where, "suffix", suffix, "bytes (a group's key suffix)",
                                "pass make_key(b'', group)")
    if len(suffix) != KEY_GROUP_BYTES:
        raise ArgumentRangeError(where, "len(suffix)", len(suffix),
                                 f"{KEY_GROUP_BYTES} bytes (a group's key suffix)",
                                 "pass make_key(b'', group)")
    return check_hashes(where, "hashes", hashes)


def _group(record: int) -> int:
    return record >> 1 & GROUP_MASK


class CPUOffloadManager(OffloadManager):
    """The CPU tier: one pool of chunk slots per group, LRU or ARC eviction per group.

    A slot holds one chunk of one group, so each key is routed by ``key_group(key)`` to its
    group's pool, and slot ids are per group: group ``g``'s are ``0..capacity_g - 1``, the
    rows ``TransferEngine`` pinned for that group. ``capacity`` is one int (every group
    gets that many slots, ``num_cpu_blocks``' meaning) or one int per group (then a store
    of a key of another group raises ``KeyGroupError``). ``for_config`` sizes the pools as
    the transfer engine does. Within a pool, slots are handed out fresh first, in
    increasing order, then from a LIFO list of recycled ones, so slot ids are
    deterministic (tests pin them, e.g. ``[2, 3, 0]``). A group's store evicts only keys
    of that group. Pending events hold at most ``max_pending_events`` keys (pass the
    config's ``max_pending_events``); the oldest are dropped beyond that and counted in
    ``stats().events_dropped``. ``stats().capacity`` sums the pools that exist: every
    group of a per-group capacity; with one int, group 0 and the groups stored so far.
    """

    def __init__(self, capacity: int | Sequence[int], policy: str = "lru", *,
                 check: bool | None = None,
                 max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS) -> None:
        capacity = check_capacity(capacity)
        check_pending_events(max_pending_events)
        self._check = checks_enabled(check)
        if not isinstance(policy, str) or policy not in POLICIES:
            raise ConfigError("policy", f"policy={policy!r} is not an eviction policy; "
                              f"choose one of {sorted(POLICIES)}")
        self._policy_class = POLICIES[policy]
        self._per_group = capacity if isinstance(capacity, tuple) else None
        self._capacity = capacity if isinstance(capacity, int) else 0
        self._group_bound = MAX_GROUPS if self._per_group is None else len(self._per_group)
        self._pools: dict[int, _Pool] = {}
        # Group 0's pool always exists (a one-group tier reports capacity as before); with
        # one int the other groups' pools are made at their first store.
        for group in range(1 if self._per_group is None else len(self._per_group)):
            self._pool(group)
        self._entries = KeyIndex()  # key -> slot << SLOT_SHIFT | group << 1 | writing
        self._pins: dict[Key, int] = {}  # pinned keys -> pins (absent: not pinned)
        self._events: deque[ManagerEvent] = deque()
        self._event_keys = 0  # keys in ``_events``, less the ``_head_skip`` dropped ones
        self._head_skip = 0  # keys of ``_events[0]`` already dropped (``_emit``)
        self._max_events = max_pending_events
        self._events_dropped = 0
        self._evictions = 0
        self._stores_skipped_no_room = 0
        self._stored_keys = 0
        # Predicate evaluations per invariant id, for reports (``kvcore check``).
        self.checked: dict[str, int] = {}

    @classmethod
    def for_config(cls, config: OffloadConfig, policy: str = "lru", *,
                   check: bool | None = None,
                   max_pending_events: int | None = None) -> CPUOffloadManager:
        """Pools sized exactly as ``TransferEngine`` pins rows (``cpu_capacities(config)``,
        one pool per group of ``config``); events bounded by the config's
        ``max_pending_events`` unless given."""
        check_config("CPUOffloadManager.for_config", config)
        events = config.max_pending_events if max_pending_events is None else max_pending_events
        return cls(cpu_capacities(config), policy, check=check, max_pending_events=events)

    def capacity_of(self, group: int) -> int:
        """Slots of ``group``'s pool (0 for a group outside a per-group capacity)."""
        if type(group) is not int:
            _bad_group("capacity_of", group)
        if self._per_group is not None:
            return self._per_group[group] if 0 <= group < len(self._per_group) else 0
        return self._capacity if 0 <= group < MAX_GROUPS else 0

    def _pool(self, group: int) -> _Pool:
        pool = self._pools.get(group)
        if pool is None:
            cap = self.capacity_of(group)
            pool = self._pools[group] = _Pool(cap, self._policy_class(cap))
        return pool

    def policy_of(self, group: int) -> EvictionPolicy | None:
        """Group ``group``'s eviction policy, or None before its pool exists."""
        if type(group) is not int:
            _bad_group("policy_of", group)
        pool = self._pools.get(group)
        return None if pool is None else pool.policy

    @property
    def policy(self) -> EvictionPolicy:
        """Group 0's eviction policy (for tests and debugging; see ``policy_of``)."""
        return self._pools[0].policy

    @property
    def check(self) -> bool:
        """Whether runtime invariant checking is on."""
        return self._check

    # -- reads ----------------------------------------------------------------------

    def lookup(self, key: Key) -> Status:
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            check_key("lookup", key)
        record = self._entries.get(key)
        if record is None:
            return Status.MISS
        return Status.PENDING if record & WRITING else Status.HIT

    def lookup_many(self, keys: Sequence[Key]) -> list[Status]:
        """``lookup`` of each key, in one call (a lookup reads keys in blocks)."""
        keys = check_keys("lookup_many", keys)
        return self._entries.read(keys, _STATUS_OF)

    def lookup_hashes(self, hashes: Sequence[bytes], suffix: bytes) -> list[Status]:
        """``lookup_many`` of the keys ``hash + suffix``: one group's chunk keys as its
        block hashes and the group's suffix (``make_key(b"", group)``).

        The scheduler's lookup reads a prompt's keys this way, so no key object is made
        for a probe: at 128K Llama tokens making the 8,192 keys alone was 0.15 ms. The
        keys are assembled next to the probe, in C.
        """
        hashes = _check_hashes("lookup_hashes", hashes, suffix)
        if type(self).lookup_many is not CPUOffloadManager.lookup_many:
            # A subclass that reads another way (or records reads) sees every read.
            return self.lookup_many(suffixed(hashes, suffix))
        return self._entries.read(hashes, _STATUS_OF, suffix)

    def state_of(self, key: Key) -> str | None:
        """``"writing"``, ``"ready"``, ``"pinned"``, or None when absent."""
        check_key("state_of", key)
        record = self._entries.get(key)
        if record is None:
            return None
        if record & WRITING:
            return "writing"
        return "pinned" if key in self._pins else "ready"

    def slot_of(self, key: Key) -> int | None:
        check_key("slot_of", key)
        record = self._entries.get(key)
        return None if record is None else record >> SLOT_SHIFT

    def stats(self) -> ManagerStats:
        pools = self._pools.values()
        used = len(self._entries)
        writing = sum(p.writing for p in pools)
        pinned = sum(p.pinned for p in pools)
        return ManagerStats(
            capacity=sum(p.capacity for p in pools),
            used=used,
            writing=writing,
            pinned=pinned,
            evictable=used - writing - pinned,
            evictions=self._evictions,
            stores_skipped_no_room=self._stores_skipped_no_room,
            stored_keys=self._stored_keys,
            events_dropped=self._events_dropped,
        )

    # -- recency and loads ----------------------------------------------------------

    def touch(self, keys: Sequence[Key]) -> None:
        """Each group's keys refresh that group's policy, in call order within the group."""
        keys = check_keys("touch", keys)
        if not keys:
            return
        pools = self._pools
        # The scheduler touches one group at a time: when every key ends with the first
        # key's group bytes (one C pass), the batch goes to that pool whole.
        if same_tail(keys, KEY_GROUP_BYTES):
            pool = pools.get(key_group(keys[0]))
            if pool is not None:
                pool.policy.touch(keys)
            return
        by_group: dict[int, list[Key]] = {}
        for key in keys:
            by_group.setdefault(key_group(key), []).append(key)
        for group, some in by_group.items():
            pool = pools.get(group)
            if pool is not None:
                pool.policy.touch(some)

    def touch_hashes(self, hashes: Sequence[bytes], suffix: bytes) -> None:
        """``touch`` of the keys ``hash + suffix``, ``hashes[0]`` most recent: one group's
        keys, as ``lookup_hashes`` reads them."""
        hashes = _check_hashes("touch_hashes", hashes, suffix)
        if type(self).touch is not CPUOffloadManager.touch:
            self.touch(suffixed(hashes, suffix))  # a subclass's touch sees every touch
            return
        if not hashes:
            return
        pool = self._pools.get(key_group(suffix))
        if pool is not None:
            pool.policy.touch_hashes(hashes, suffix)

    def prepare_load(self, keys: Sequence[Key]) -> tuple[int, ...]:
        """Pin each key once per occurrence; all keys are validated before any is pinned,
        so a rejected call (KeyNotReadyError) leaves every pin count as it was."""
        keys = check_keys("prepare_load", keys)
        entries, pins, pools = self._entries, self._pins, self._pools
        records: list[int] = []
        for key in keys:  # validate every key before pinning any
            record = entries.get(key)
            if record is None or record & WRITING:
                raise KeyNotReadyError(key, "absent" if record is None else "writing")
            records.append(record)
        slots = []
        for key, record in zip(keys, records, strict=True):
            held = pins.get(key, 0)
            if held == 0:
                pools[_group(record)].pinned += 1
            pins[key] = held + 1
            slots.append(record >> SLOT_SHIFT)
        return tuple(slots)

    def complete_load(self, keys: Sequence[Key]) -> None:
        """Release one pin per occurrence; counted per key first, so a call releasing more
        pins than a key holds raises NotPinnedError before any pin moves."""
        keys = check_keys("complete_load", keys)
        entries, pins = self._entries, self._pins
        for key, releases in Counter(keys).items():  # validate before releasing any
            held = pins.get(key, 0)
            record = entries.get(key)
            if record is None or record & WRITING or held < releases:
                raise NotPinnedError(key, self.state_of(key) or "absent", held, releases)
        for key in keys:
            held = pins[key] - 1
            if held:
                pins[key] = held
            else:
                del pins[key]
                self._pools[_group(entries[key])].pinned -= 1

    # -- stores ---------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreResult | None:
        """Choose victims group by group (a pure step), check them if asked, then apply.

        Atomic across groups: if any group lacks evictable room the answer is None and
        nothing changed. The fast None path answers without walking a policy when a
        group has fewer evictable keys than it needs; otherwise the walks cost the victims
        plus the pinned and same-call keys they pass.
        """
        keys = check_keys("prepare_store", keys)
        entries = self._entries
        to_store = [k for k in dict.fromkeys(keys) if k not in entries]
        if not to_store:
            return _EMPTY
        groups = [key_group(key) for key in to_store]
        by_group: dict[int, int] = {}
        for key, group in zip(to_store, groups, strict=True):  # all checked before changes
            if not 0 <= group < self._group_bound:
                raise KeyGroupError("prepare_store", key, group, self._group_bound)
            by_group[group] = by_group.get(group, 0) + 1
        before = self._fingerprint() if self._check else None
        victims: list[Key] = []
        needed = 0
        for group, count in by_group.items():
            pool = self._pools.get(group)
            free = self.capacity_of(group) if pool is None else pool.capacity - pool.used
            need = count - free
            if need <= 0:
                continue
            needed += need
            chosen = None if pool is None else self._choose(pool, need, keys)
            if chosen is None:
                if self._check:
                    self._check_eviction(keys, [], needed, True, before)
                self._stores_skipped_no_room += 1
                return None
            victims += chosen
        if victims:
            if self._check:
                self._check_eviction(keys, victims, needed, False, before)
            self._evict(victims)
        slots = tuple(map(self._allocate, to_store, groups))
        return PrepareStoreResult(tuple(to_store), slots, tuple(victims))

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        """WRITING keys become READY (one stored event) or are dropped (no event).

        A prefill's store completes thousands of keys at once, so the READY path makes
        one pass marking entries and hands each pool its run of keys in one call.
        """
        keys = check_keys("complete_store", keys)
        check_success("complete_store", success)
        if not success:
            self._fail_store(keys)
            return
        done: list[Key] = []
        groups: list[int] = []
        entries = self._entries
        # A key listed twice is no longer WRITING the second time.
        for key in keys:
            record = entries.get(key)
            if record is None or not record & WRITING:
                continue  # READY before this store, or absent: not this store's key
            entries[key] = record - WRITING
            done.append(key)
            groups.append(_group(record))
        if not done:
            return
        start = 0
        # A store's keys come group by group, so each pool gets one run (or a few).
        for group, run in groupby(groups):
            n = sum(1 for _ in run)
            pool = self._pools[group]
            pool.writing -= n
            pool.policy.ready_many(done[start:start + n])
            start += n
        self._emit(ManagerEvent(tuple(done), removed=False))
        self._stored_keys += len(done)

    def _fail_store(self, keys: Sequence[Key]) -> None:
        """A failed store's WRITING keys leave no trace (X1)."""
        entries = self._entries
        for key in keys:
            record = entries.get(key)
            if record is None or not record & WRITING:
                continue
            del entries[key]
            pool = self._pools[_group(record)]
            pool.writing -= 1
            pool.used -= 1
            pool.free.append(record >> SLOT_SHIFT)
            pool.policy.discard(key)

    def take_events(self) -> list[ManagerEvent]:
        if self._check:
            # M3 with the buffer counted afresh: the drain reads every event anyway.
            self._check_buffer(sum(len(e.keys) for e in self._events))
        events, self._events, self._event_keys = list(self._events), deque(), 0
        if self._head_skip:
            first = events[0]
            events[0] = ManagerEvent(first.keys[self._head_skip:], first.removed)
            self._head_skip = 0
        return events

    def reset(self) -> None:
        """Forget every key and slot; the pools stay (empty), cumulative counters stay."""
        self._entries, self._pins = KeyIndex(), {}
        for pool in self._pools.values():
            pool.next_fresh, pool.free = 0, []
            pool.used = pool.writing = pool.pinned = 0
            pool.policy.clear()
        self._events, self._event_keys, self._head_skip = deque(), 0, 0

    # -- helpers --------------------------------------------------------------------

    def _choose(self, pool: _Pool, need: int, keys: Sequence[Key]) -> list[Key] | None:
        """``need`` victims of ``pool`` in its policy's order, or None; changes nothing."""
        if need > pool.used - pool.writing - pool.pinned:
            return None  # fewer evictable keys than needed: no walk
        pins = self._pins
        protected = set(keys)
        return pool.policy.choose(need, lambda k: k not in pins and k not in protected)

    def _evict(self, victims: list[Key]) -> None:
        by_group: dict[int, list[Key]] = {}
        entries, pools = self._entries, self._pools
        for key in victims:
            record = entries.pop(key)
            pool = pools[_group(record)]
            pool.free.append(record >> SLOT_SHIFT)
            pool.used -= 1
            by_group.setdefault(_group(record), []).append(key)
        for group, pool in pools.items():
            some = by_group.get(group)
            if some:
                pool.policy.evict(some)
        self._emit(ManagerEvent(tuple(victims), removed=True))
        self._evictions += len(victims)

    def _emit(self, event: ManagerEvent) -> None:
        """Buffer an event; past ``max_pending_events`` keys the oldest keys go first.

        Dropping part of the oldest event is counted in ``_head_skip`` and its tuple cut
        only once half of it is gone (or when the events are taken): cutting it at every
        emit copied a prefill's 50K-key event for each one- or two-key event after it,
        O(that event) per store while nobody drained the buffer. The cut part stays
        referenced until then, at most half of one event beyond the bound.
        """
        events = self._events
        events.append(event)
        self._event_keys += len(event.keys)
        excess = self._event_keys - self._max_events
        if excess > 0:
            self._drop_oldest(excess)
        if self._check:
            self._check_buffer(None)

    def _drop_oldest(self, excess: int) -> None:
        events = self._events
        self._events_dropped += excess
        self._event_keys -= excess
        skip = self._head_skip + excess
        while skip and len(events[0].keys) <= skip:
            skip -= len(events.popleft().keys)
        if skip and 2 * skip >= len(events[0].keys):
            first = events[0]
            events[0] = ManagerEvent(first.keys[skip:], first.removed)
            skip = 0
        self._head_skip = skip

    def _allocate(self, key: Key, group: int) -> int:
        """A slot of ``group``'s pool (the key's group, read once by the caller)."""
        pool = self._pool(group)
        slot = pool.allocate()
        self._entries[key] = slot << SLOT_SHIFT | group << 1 | WRITING
        pool.used += 1
        pool.writing += 1
        pool.policy.insert(key)
        return slot

    def _fingerprint(self) -> tuple[int, ...]:
        """Cheap summary of the mutable state, to see whether a None answer changed it."""
        pools = tuple((g, p.next_fresh, len(p.free), p.used, p.writing, p.pinned)
                      for g, p in self._pools.items())
        return (len(self._entries), hash(pools), len(self._events), self._evictions)

    def _check_buffer(self, held: int | None) -> None:
        """M3 on the event buffer (check mode only): O(1) at each buffered event,
        O(events) at a drain, where ``held`` counts the keys the buffered events
        reference."""
        events = self._events
        record = BufferRecord("the tier's event buffer", self._event_keys, self._max_events,
                              self._head_skip, len(events[0].keys) if events else 0, held)
        enforce([record], self.checked, at_runtime=True)

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
        # The one funnel: counted and judged as every record.
        enforce([record], self.checked, at_runtime=True)
