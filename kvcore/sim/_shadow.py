"""A lock-step shadow of the CPU tier: the reference manager beside the real one (M2).

The simulator hands the scheduler a ``ShadowedManager``: every call goes to the real
``CPUOffloadManager`` and to ``spec.manager_model.ReferenceManager``. Before each
``prepare_store`` that needs room, the shadow lists the evictable keys in the order the
policy's rule ranks them, from its own bookkeeping (the reference's LRU recency, or the
ARC lists kept here from ARC's published rules, never from kvcore's ``ARCPolicy``), and
M2 compares the tier's victims and slots with that. Lookups are compared too: a status
that differs from the reference's is an M2 violation at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvcore._checks import enforce
from kvcore.manager import CPUOffloadManager, PrepareStoreResult
from kvcore.spec.errors import KVCoreError
from kvcore.spec.invariants import EvictionOrderRecord, TierAgreementRecord, m2_eviction_order
from kvcore.spec.manager_model import ReferenceManager
from kvcore.spec.types import DEFAULT_MAX_PENDING_EVENTS, Key, Status, key_group


class _ArcLists:
    """ARC's T1/T2/B1/B2 and target p, kept from the rules in the manager's documentation.

    T1: READY keys seen once; T2: touched again; B1/B2: ghosts of keys evicted from
    each, at most ``capacity`` each. A touch of a B1 ghost raises p by
    max(1, |B2| / |B1|) (at most the capacity), of a B2 ghost lowers it by
    max(1, |B1| / |B2|) (at least 0). A store's key leaves the ghost lists.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.target = 0.0

    def stored(self, keys: Sequence[Key]) -> None:
        for key in keys:
            self.b1.pop(key, None)
            self.b2.pop(key, None)

    def touch(self, keys: Sequence[Key]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                self.target = min(float(self.capacity),
                                  self.target + max(1.0, len(self.b2) / len(self.b1)))
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.target = max(0.0, self.target - max(1.0, len(self.b1) / len(self.b2)))
                self.b2.move_to_end(key)

    def evicted(self, keys: Sequence[Key]) -> None:
        for key in keys:
            if key in self.t1:
                del self.t1[key]
                self.b1[key] = None
            elif key in self.t2:
                del self.t2[key]
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)

    def clear(self) -> None:
        for keys in (self.t1, self.t2, self.b1, self.b2):
            keys.clear()
        self.target = 0.0


class ShadowedManager:
    """The real CPU tier, with every answer compared with the reference's (M2)."""

    def __init__(self, capacity: int | Sequence[int], policy: str = "lru", *,
                 check: bool = True, max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS
                 ) -> None:
        self.real = CPUOffloadManager(capacity, policy, check=check,
                                      max_pending_events=max_pending_events)
        self.reference = ReferenceManager(capacity, max_pending_events)
        self.policy_name = policy
        # ARC's lists per group (each pool runs its own ARC), made at the group's first store.
        self.is_arc = policy == "arc"
        self.arcs: dict[int, _ArcLists] = {}
        # Predicate evaluations per invariant id: the real tier's M1 plus the shadow's M2.
        self.checked = self.real.checked

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _call(self, name: str, *args: Any) -> Any:
        """The real tier's ``name(*args)``. A kvcore error is the caller's to judge; any
        other exception is a tier that fails where the reference answers (M2), named as
        such instead of surfacing later as a crash of whatever called it."""
        try:
            return getattr(self.real, name)(*args)
        except KVCoreError:
            raise
        except Exception as exc:  # judged by the record, then re-raised
            enforce([TierAgreementRecord(name, f"raised {type(exc).__name__}: {exc}",
                                         "an answer", self.policy_name)], self.checked)
            raise

    def lookup(self, key: Key) -> Status:
        status = self._call("lookup", key)
        want = self.reference.lookup(key)
        enforce([TierAgreementRecord(f"lookup({key.hex()[:12]})", status.name, want.name,
                                     self.policy_name)], self.checked)
        return status  # type: ignore[no-any-return]

    def lookup_many(self, keys: Sequence[Key]) -> list[Status]:
        """The scheduler's read path (a block of keys per call): each status must be the
        reference's."""
        got = self._call("lookup_many", keys)
        want = [self.reference.lookup(k) for k in keys]
        enforce([TierAgreementRecord(f"lookup_many of {len(keys)} keys",
                                     [s.name for s in got], [s.name for s in want],
                                     self.policy_name)], self.checked)
        return got  # type: ignore[no-any-return]

    def lookup_hashes(self, hashes: Sequence[bytes], suffix: bytes) -> list[Status]:
        """The same read with the keys given as one group's hashes and its suffix (the
        path the scheduler takes with kvcore's tier): each status the reference's."""
        got = self._call("lookup_hashes", hashes, suffix)
        want = [self.reference.lookup(h + suffix) for h in hashes]
        enforce([TierAgreementRecord(f"lookup_hashes of {len(hashes)} keys",
                                     [s.name for s in got], [s.name for s in want],
                                     self.policy_name)], self.checked)
        return got  # type: ignore[no-any-return]

    def touch_hashes(self, hashes: Sequence[bytes], suffix: bytes) -> None:
        self._call("touch_hashes", hashes, suffix)
        keys = [h + suffix for h in hashes]
        self.reference.touch(keys)
        for arc in self.arcs.values():
            arc.touch(keys)

    def touch(self, keys: Sequence[Key]) -> None:
        self._call("touch", keys)
        self.reference.touch(keys)
        for arc in self.arcs.values():
            arc.touch(keys)  # keys of other groups are in none of its lists: ignored

    def prepare_load(self, keys: Sequence[Key]) -> tuple[int, ...]:
        slots: tuple[int, ...] = self._call("prepare_load", keys)
        want = self.reference.prepare_load(keys)
        self._compare_states(keys, "prepare_load", slots, want)
        return slots

    def complete_load(self, keys: Sequence[Key]) -> None:
        self._call("complete_load", keys)
        self.reference.complete_load(keys)
        self._compare_states(keys, "complete_load")

    def _compare_states(self, keys: Sequence[Key], call: str, slots: Any = None,
                        want: Any = None) -> None:
        """After a load call the keys' states (pinned or not) and slots are the reference's."""
        real, ref = self.real, self.reference
        unique = list(dict.fromkeys(keys))
        enforce([TierAgreementRecord(
            f"{call} of {len(unique)} keys: states and slots",
            ([real.state_of(k) for k in unique], slots),
            ([ref.state_of(k) for k in unique], want), self.policy_name)], self.checked)

    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreResult | None:
        ref = self.reference
        absent = [k for k in dict.fromkeys(keys) if k not in ref.state]
        needs: dict[int, int] = {}
        for key in absent:
            needs[key_group(key)] = needs.get(key_group(key), 0) + 1
        needs = {g: n - (ref.capacity_of(g) - ref.used_of(g)) for g, n in needs.items()}
        records = {g: self._order_record(g, keys, n) for g, n in needs.items() if n > 0}
        out: PrepareStoreResult | None = self._call("prepare_store", keys)
        expected: PrepareStoreResult | None = None
        if out is not None:
            try:
                expected = ref.prepare_store(keys, victims=list(out.evicted))
            except ValueError:
                expected = None  # not a valid choice: M1/M2 below say why
        slots = None if out is None else tuple(out.slots)
        exp = None if expected is None else tuple(expected.slots)
        if records:
            judged = [EvictionOrderRecord(
                r.policy, r.needed, r.queues,
                None if out is None else tuple(k for k in out.evicted if key_group(k) == g),
                r.t1_size, r.target, slots, exp, r.tier_target, r.tier_t1_size)
                for g, r in records.items()]
            if out is None:
                # A refusal is atomic across groups: it is right when some group's rule
                # refuses too; the groups that had room are then not judged.
                judged = [r for r in judged if not m2_eviction_order(r)] or judged
            enforce(judged, self.checked)
        elif out is not None and expected is not None and out.slots != expected.slots:
            enforce([EvictionOrderRecord(self.policy_name, 0, ((),), (), slots=out.slots,
                                         expected_slots=expected.slots)], self.checked)
        if out is not None and self.is_arc:
            for key in out.evicted:
                self.arcs[key_group(key)].evicted([key])
            for key in out.keys_to_store:
                self._arc(key_group(key)).stored([key])
        return out

    def _arc(self, group: int) -> _ArcLists:
        if group not in self.arcs:
            self.arcs[group] = _ArcLists(self.reference.capacity_of(group))
        return self.arcs[group]

    def _order_record(self, group: int, keys: Sequence[Key],
                      need: int) -> EvictionOrderRecord:
        """Group ``group``'s evictable keys in rule order, as the shadow sees them before
        the call: victims are the policy's choice within the group's own pool."""
        protected = set(keys)
        ref = self.reference

        def evictable(key: Key) -> bool:
            return ref.state.get(key) == "ready" and ref.pins[key] == 0 \
                and key not in protected
        if not self.is_arc:
            queue = tuple(k for k in ref.recency.get(group, []) if evictable(k))
            return EvictionOrderRecord("lru", need, (queue,), None)
        arc = self._arc(group)
        writing = sum(1 for k, s in ref.state.items()
                      if s == "writing" and key_group(k) == group)
        queues = (tuple(k for k in arc.t1 if evictable(k)),
                  tuple(k for k in arc.t2 if evictable(k)))
        tier = self.real.policy_of(group)
        return EvictionOrderRecord("arc", need, queues, None, len(arc.t1) + writing,
                                   arc.target, tier_target=getattr(tier, "target_t1", None),
                                   tier_t1_size=getattr(tier, "t1_size", None))

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        writing = [k for k in dict.fromkeys(keys) if self.reference.state.get(k) == "writing"]
        self._call("complete_store", keys, success)
        self.reference.complete_store(keys, success)
        if success and self.is_arc:
            for key in writing:
                self._arc(key_group(key)).t1[key] = None

    def take_events(self) -> list[Any]:
        """The events since the last call, which must be the reference's: a store reported
        as an eviction (or the other way round) misleads every router that reads them."""
        got: list[Any] = self._call("take_events")
        want = self.reference.take_events()
        dropped = self.real.stats().events_dropped, self.reference.stats().events_dropped
        enforce([TierAgreementRecord("take_events (events, dropped)", (got, dropped[0]),
                                     (want, dropped[1]), self.policy_name)], self.checked)
        return got

    def reset(self) -> None:
        self._call("reset")
        self.reference.reset()
        for arc in self.arcs.values():
            arc.clear()


class KeysOnlyTier(ShadowedManager):
    """An engine's own tier with only the base interface: keys in, statuses out, no
    ``lookup_hashes``/``touch_hashes``. The scheduler then reads and touches through
    ``lookup_many`` and ``touch`` with whole keys (``StatusReader``'s key path), which
    kvcore's own tier never takes (``SimOptions.keys_only_tier``)."""

    lookup_hashes = None  # type: ignore[assignment]
    touch_hashes = None  # type: ignore[assignment]
