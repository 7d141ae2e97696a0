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

from kvcore.manager import CPUOffloadManager, PrepareStoreResult
from kvcore.scheduler._checks import enforce
from kvcore.spec.errors import InvariantViolation
from kvcore.spec.invariants import EvictionOrderRecord, Violation
from kvcore.spec.manager_model import ReferenceManager
from kvcore.spec.types import Key, Status


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

    def __init__(self, capacity: int, policy: str = "lru", *, check: bool = True) -> None:
        self.real = CPUOffloadManager(capacity, policy, check=check)
        self.reference = ReferenceManager(capacity)
        self.policy_name = policy
        self.arc = _ArcLists(capacity) if policy == "arc" else None
        # Predicate evaluations per invariant id: the real tier's M1 plus the shadow's M2.
        self.checked = self.real.checked

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def lookup(self, key: Key) -> Status:
        status = self.real.lookup(key)
        want = self.reference.lookup(key)
        if status is not want:
            raise InvariantViolation([Violation(
                "M2", f"the tier answers {status.name} for key {key.hex()[:12]}, the "
                f"reference {want.name}", {"policy": self.policy_name})])
        return status

    def touch(self, keys: Sequence[Key]) -> None:
        self.real.touch(keys)
        self.reference.touch(keys)
        if self.arc is not None:
            self.arc.touch(keys)

    def prepare_load(self, keys: Sequence[Key]) -> tuple[int, ...]:
        slots = self.real.prepare_load(keys)
        want = self.reference.prepare_load(keys)
        self._compare_states(keys, "prepare_load", slots, want)
        return slots

    def complete_load(self, keys: Sequence[Key]) -> None:
        self.real.complete_load(keys)
        self.reference.complete_load(keys)
        self._compare_states(keys, "complete_load")

    def _compare_states(self, keys: Sequence[Key], call: str, slots: Any = None,
                        want: Any = None) -> None:
        """After a load call the keys' states (pinned or not) and slots are the reference's."""
        real, ref = self.real, self.reference
        bad = [k for k in dict.fromkeys(keys) if real.state_of(k) != ref.state_of(k)]
        if bad or slots != want:
            k = bad[0] if bad else keys[0]
            raise InvariantViolation([Violation(
                "M2", f"after {call} key {k.hex()[:12]} is {real.state_of(k)} in the tier, "
                f"{ref.state_of(k)} in the reference (slots {slots} vs {want})",
                {"policy": self.policy_name, "call": call})])

    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreResult | None:
        ref = self.reference
        absent = [k for k in dict.fromkeys(keys) if k not in ref.state]
        need = len(absent) - (ref.capacity - len(ref.state))
        record = self._order_record(keys, need) if need > 0 else None
        out = self.real.prepare_store(keys)
        victims = None if out is None else tuple(out.evicted)
        expected: PrepareStoreResult | None = None
        if out is not None:
            try:
                expected = ref.prepare_store(keys, victims=list(out.evicted))
            except ValueError:
                expected = None  # not a valid choice: M1/M2 below say why
        if record is not None:
            slots = None if out is None else tuple(out.slots)
            exp = None if expected is None else tuple(expected.slots)
            records = [EvictionOrderRecord(record.policy, need, record.queues, victims,
                                           record.t1_size, record.target, slots, exp)]
            enforce(records, self.checked)
        elif out is not None and expected is not None and out.slots != expected.slots:
            enforce([EvictionOrderRecord(self.policy_name, 0, ((),), (), slots=out.slots,
                                         expected_slots=expected.slots)], self.checked)
        if out is not None and self.arc is not None:
            self.arc.evicted(out.evicted)
            self.arc.stored(out.keys_to_store)
        return out

    def _order_record(self, keys: Sequence[Key], need: int) -> EvictionOrderRecord:
        """The evictable keys in rule order, as the shadow sees them before the call."""
        protected = set(keys)
        ref = self.reference

        def evictable(key: Key) -> bool:
            return ref.state.get(key) == "ready" and ref.pins[key] == 0 \
                and key not in protected
        if self.arc is None:
            queue = tuple(k for k in ref.recency if evictable(k))
            return EvictionOrderRecord("lru", need, (queue,), None)
        writing = sum(1 for s in ref.state.values() if s == "writing")
        queues = (tuple(k for k in self.arc.t1 if evictable(k)),
                  tuple(k for k in self.arc.t2 if evictable(k)))
        return EvictionOrderRecord("arc", need, queues, None, len(self.arc.t1) + writing,
                                   self.arc.target)

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        writing = [k for k in dict.fromkeys(keys) if self.reference.state.get(k) == "writing"]
        self.real.complete_store(keys, success)
        self.reference.complete_store(keys, success)
        if success and self.arc is not None:
            for key in writing:
                self.arc.t1[key] = None

    def take_events(self) -> list[Any]:
        self.reference.take_events()
        return self.real.take_events()

    def reset(self) -> None:
        self.real.reset()
        self.reference.reset()
        if self.arc is not None:
            self.arc.clear()
