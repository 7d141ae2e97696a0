"""Refinement: the CPU tier answers exactly as the reference manager, for random histories.

Goal: show that ``CPUOffloadManager`` refines ``kvcore.spec.manager_model.ReferenceManager``.
With LRU the two must agree on everything observable: every return value, every
exception (type, key and state), the events, the stats, and each key's status, slot and
state after every step. ARC chooses different victims, and the spec allows any choice of
evictable keys outside the call, so for ARC the model is handed ARC's victims and must
accept them (it raises if they are not exactly the number needed, all READY, unpinned
and outside the call); everything else must then agree exactly too. That covers what
both policies must share: capacity never exceeded, pinned and WRITING keys never
evicted, eviction atomic (None changes nothing, not even the policy's private order),
same-call keys never evicted, and events consistent with the contents.

Method: a Hypothesis ``RuleBasedStateMachine`` over eight keys and a capacity of one to
four chunks, so that eviction, pins and no-room answers happen often. Each rule applies
one operation to both managers and compares the outcomes; the invariants compare the
observable state, and every eviction is also judged by the spec's M1 predicate. Touches
favour stored and recently evicted keys, so LRU order and ARC's ghost lists matter. The
implementation runs with ``check=True``, exercising its own runtime M1 check as well.
``hypothesis.event`` labels show, with ``--hypothesis-show-statistics``, how often the
interesting branches (evictions, None answers, T2 evictions) were reached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcore.manager import ARCPolicy, CPUOffloadManager, LRUPolicy, PrepareStoreResult
from kvcore.spec.invariants import EvictionRecord, m1_eviction_safe
from kvcore.spec.manager_model import ReferenceManager
from kvcore.spec.types import Key, Status, key_group, make_key

# Two groups (keys alternate), so routing, per-group eviction and per-group slot ids matter.
KEYS: list[Key] = [make_key(b"k%d" % i, i % 2) for i in range(8)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=5)
mostly_true = st.sampled_from([True, True, True, False])  # stores usually succeed


def outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    """A call's result, or its exception's type, key and state, for comparison."""
    try:
        return ("ok", call())
    except (KeyError, ValueError, TypeError) as e:
        return ("error", type(e), getattr(e, "key", None), getattr(e, "state", None))


def policy_view(m: CPUOffloadManager) -> object:
    """Every pool's whole ordering state: LRU's order, or ARC's lists and target."""
    views = []
    for group in (0, 1):
        policy = m.policy_of(group)
        if policy is None:
            views.append(None)
        elif isinstance(policy, ARCPolicy):
            views.append((policy.lists(), policy.target_t1))
        else:
            assert isinstance(policy, LRUPolicy)
            views.append(policy.order())
    return views


def m1_record(model: ReferenceManager, keys: list[Key],
              got: PrepareStoreResult | None) -> EvictionRecord | None:
    """The M1 record of a ``prepare_store`` about to run on ``model``; None if no room
    was needed. Built from the model's state before the call."""
    to_store = {key for key in keys if model.state_of(key) is None}
    need = 0
    for group in {key_group(key) for key in to_store}:
        used = sum(1 for key in KEYS if key_group(key) == group and model.state_of(key))
        absent = sum(1 for key in to_store if key_group(key) == group)
        need += max(0, absent - (model.capacity_of(group) - used))
    if need <= 0:
        return None
    evicted = got.evicted if got is not None else ()
    return EvictionRecord(
        call_keys=tuple(keys),
        evicted=tuple((key, model.state_of(key) or "absent") for key in evicted),
        needed=need,
        returned_none=got is None,
        changed_state=False,  # the invariants compare states: the model changed nothing
    )


class ManagerRefinement(RuleBasedStateMachine):
    """Drives the implementation and the model with the same operations."""

    def __init__(self) -> None:
        super().__init__()
        self.impl = CPUOffloadManager(1)
        self.model = ReferenceManager(1)
        self.policy = "lru"
        self.dropped = 0
        self.announced: set[Key] = set()  # keys the events say are loadable
        self.gone: list[Key] = []  # evicted keys, most recent last (ARC's ghosts)

    @initialize(capacity=st.integers(1, 4) | st.tuples(st.integers(1, 4), st.integers(1, 4)),
                policy=st.sampled_from(["lru", "arc"]),
                max_events=st.sampled_from([65_536, 65_536, 0, 1, 3]))
    def setup(self, capacity: int | tuple[int, int], policy: str, max_events: int) -> None:
        """``capacity``: one int for both groups or one per group; ``max_events``: the
        event buffer's cap in keys; small caps drop events often."""
        self.impl = CPUOffloadManager(capacity, policy, check=True,
                                      max_pending_events=max_events)
        self.model = ReferenceManager(capacity, max_events)
        self.policy = policy
        self.dropped = 0

    def keys_in(self, *states: str) -> list[Key]:
        return [key for key in KEYS if self.model.state_of(key) in states]

    def draw_keys(self, data: st.DataObject, pool: list[Key], min_size: int = 0) -> list[Key]:
        """Keys mostly from ``pool``, sometimes any key."""
        some_key = st.sampled_from(pool) | st.sampled_from(KEYS) if pool \
            else st.sampled_from(KEYS)
        return data.draw(st.lists(some_key, min_size=min_size, max_size=5))

    # -- stores -------------------------------------------------------------------

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[Key]) -> None:
        policy_before = policy_view(self.impl)
        arc_prefers_t2 = self.arc_prefers_t2()
        got = outcome(lambda: self.impl.prepare_store(keys))
        result = got[1] if got[0] == "ok" else None
        record = m1_record(self.model, keys, result)
        victims = result.evicted if self.policy == "arc" and result is not None else None
        assert got == outcome(lambda: self.model.prepare_store(keys, victims))
        if record is not None:
            assert m1_eviction_safe(record) == []
            event(f"{self.policy}: " + ("None" if result is None else "evicted")
                  + (" while ARC prefers T2" if arc_prefers_t2 else ""))
        if got == ("ok", None):  # atomic: not even the policy's private state moved
            assert policy_view(self.impl) == policy_before
        if result is not None:
            self.gone = [k for k in self.gone if k not in result.keys_to_store][-4:]
            self.gone.extend(result.evicted)

    def arc_prefers_t2(self) -> bool:
        policy = self.impl.policy
        if not isinstance(policy, ARCPolicy):
            return False
        writing = sum(1 for k in KEYS if key_group(k) == 0
                      and self.model.state_of(k) == "writing")
        return len(policy.lists()["t1"]) + writing < int(policy.target_t1)

    @rule(keys=key_lists, success=mostly_true)
    def store_and_complete(self, keys: list[Key], success: bool) -> None:
        """The common path, prepare then complete, so READY keys accumulate."""
        self.prepare_store(keys)
        self.impl.complete_store(keys, success)
        self.model.complete_store(keys, success)

    @rule(data=st.data(), rounds=st.integers(1, 6))
    def busy_steps(self, data: st.DataObject, rounds: int) -> None:
        """Several store-touch rounds in one rule, so short runs still reach deep states
        (full tier, ghost hits, an ARC target above |T1|)."""
        for _ in range(rounds):
            keys = data.draw(key_lists)
            self.store_and_complete(keys, data.draw(mostly_true))
            self.touch(data)

    @precondition(lambda self: self.keys_in("writing"))
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        """Completes some WRITING keys, maybe with READY or absent ones mixed in."""
        keys = self.draw_keys(data, self.keys_in("writing"), min_size=1)
        self.impl.complete_store(keys, success)
        self.model.complete_store(keys, success)

    # -- loads and recency --------------------------------------------------------

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        """Mostly READY keys (they pin); any key may turn it into an operating error."""
        keys = self.draw_keys(data, self.keys_in("ready", "pinned"))
        assert outcome(lambda: self.impl.prepare_load(keys)) == \
            outcome(lambda: self.model.prepare_load(keys))

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        """Mostly pinned keys; duplicates and other keys make operating errors."""
        keys = self.draw_keys(data, self.keys_in("pinned"))
        assert outcome(lambda: self.impl.complete_load(keys)) == \
            outcome(lambda: self.model.complete_load(keys))

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        """Stored keys (their order matters) and evicted ones (ARC's ghost hits)."""
        keys = self.draw_keys(data, self.keys_in("ready", "pinned", "writing") + self.gone)
        self.impl.touch(keys)
        self.model.touch(keys)

    @rule(data=st.data(), group=st.sampled_from([0, 1]))
    def touch_hashes(self, data: st.DataObject, group: int) -> None:
        """The scheduler's touch: one group's keys as hashes and the group's suffix (the
        same order and ghost effects as ``touch`` of the keys)."""
        pool = [k for k in self.keys_in("ready", "pinned", "writing") + self.gone
                if key_group(k) == group]
        keys = [k for k in self.draw_keys(data, pool) if key_group(k) == group]
        suffix = make_key(b"", group)
        self.impl.touch_hashes([k[:-len(suffix)] for k in keys], suffix)
        self.model.touch(keys)

    @rule(data=st.data(), group=st.sampled_from([0, 1]))
    def lookup_hashes(self, data: st.DataObject, group: int) -> None:
        """The scheduler's block read: one status per hash, each the model's."""
        keys = [k for k in data.draw(key_lists) if key_group(k) == group]
        suffix = make_key(b"", group)
        assert self.impl.lookup_hashes([k[:-len(suffix)] for k in keys], suffix) == \
            [self.model.lookup(k) for k in keys]

    # -- events and reset ---------------------------------------------------------

    @rule()
    def take_events(self) -> None:
        """Events match, and replayed in order they describe exactly the READY keys."""
        events = self.impl.take_events()
        assert events == self.model.take_events()
        assert sum(len(e.keys) for e in events) <= self.model.max_pending_events
        dropped, self.dropped = self.dropped, self.impl.stats().events_dropped
        if dropped != self.dropped:  # the oldest events were dropped: no replay
            event("events dropped")
            self.announced = set(self.keys_in("ready", "pinned"))
            return
        for e in events:
            for key in e.keys:
                assert (key in self.announced) == e.removed, (key, e)
                if e.removed:
                    self.announced.discard(key)
                else:
                    self.announced.add(key)
        assert self.announced == set(self.keys_in("ready", "pinned"))

    @rule()
    def reset(self) -> None:
        self.impl.reset()
        self.model.reset()
        self.announced = set()
        self.gone = []

    # -- invariants ---------------------------------------------------------------

    @invariant()
    def same_observable_state(self) -> None:
        stats = self.impl.stats()
        assert stats == self.model.stats()
        assert stats.used == stats.writing + stats.pinned + stats.evictable
        assert stats.used <= stats.capacity
        for key in KEYS:
            assert self.impl.lookup(key) == self.model.lookup(key)
            assert self.impl.slot_of(key) == self.model.slot_of(key)
            assert self.impl.state_of(key) == self.model.state_of(key)

    @invariant()
    def slots_are_distinct_and_in_range(self) -> None:
        """Distinct within a pool: slot ids are per group (both groups start at 0)."""
        slots = [(key_group(k), s) for k, s in zip(KEYS, map(self.impl.slot_of, KEYS),
                                                   strict=True) if s is not None]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < self.model.capacity_of(key_group(key))
                   for key, s in zip(KEYS, map(self.impl.slot_of, KEYS), strict=True)
                   if s is not None)

    @invariant()
    def hits_are_exactly_the_ready_keys(self) -> None:
        for key in KEYS:
            ready = self.impl.state_of(key) in ("ready", "pinned")
            assert (self.impl.lookup(key) is Status.HIT) == ready


TestManagerRefinement = ManagerRefinement.TestCase
