"""M1 obligations on the CPU tier: ``CPUOffloadManager.prepare_store`` / ``complete_store``.

Function under test: ``kvcore.manager._cpu.CPUOffloadManager`` (LRU and ARC), with its
own runtime check off, so the only judge is this file. A shadow of the key states
(absent, WRITING, READY with n pins), written here from the semantics, follows every
call; each ``prepare_store`` is then compared with it:

- it returns None exactly when fewer keys are evictable (READY, unpinned, not in the
  call) than it needs, and then nothing changed;
- otherwise it evicts exactly what it needs, all of them evictable (the M1 predicate
  ``m1_eviction_safe``, fed with the shadow's states), stores the call's absent keys in
  call order, and every slot of a held key is in ``0..capacity - 1`` and distinct.

Domain (enumerated, every case one path): capacity 1 or 2, both policies, every
sequence of two operations on two keys (store and complete, store only, pin if READY) after k0
was stored, followed by a ``prepare_store`` of every non-empty subset of three keys.

Mutant (a one-token change of kvcore, patched in while CrossHair runs): victims chosen
without the pin check, so a pinned key can be evicted while a load reads its slot.
"""

from __future__ import annotations

from kvcore.manager._cpu import CPUOffloadManager
from kvcore.spec.invariants import EvictionRecord, m1_eviction_safe
from kvcore.spec.types import Key, make_key

from ._bounded import CONFIRMED, REFUTED, Obligation, pick
from ._mutate import mutant

# Keys of group 0 (the tier routes each key by its group to that group's pool).
KEYS: tuple[Key, ...] = tuple(make_key(h, 0) for h in (b"k0", b"k1", b"k2"))
POLICIES = ("lru", "arc")
OPS = 3
HISTORY_KEYS = 2  # the history uses k0 and k1; the last call may add k2


def _state(shadow: dict[Key, int]) -> dict[Key, str]:
    """pins: -1 WRITING, 0 READY, n > 0 READY with n pins."""
    return {k: "writing" if p < 0 else ("pinned" if p else "ready") for k, p in shadow.items()}


def _check_store(m: CPUOffloadManager, shadow: dict[Key, int], capacity: int,
                 call: list[Key]) -> bool:
    """One prepare_store against the shadow; updates the shadow."""
    before = _state(shadow)
    absent = [k for k in dict.fromkeys(call) if k not in shadow]
    need = len(absent) - (capacity - len(shadow))
    evictable = [k for k, p in shadow.items() if p == 0 and k not in call]
    out = m.prepare_store(call)
    if out is None:
        return (absent != [] and need > len(evictable)
                and {k: m.state_of(k) for k in KEYS} == {k: before.get(k) for k in KEYS})
    if absent and need > len(evictable):
        return False
    record = EvictionRecord(tuple(call), tuple((k, before.get(k, "absent")) for k in out.evicted),
                            max(need, 0), False, False)
    if need > 0 and m1_eviction_safe(record):
        return False
    if need <= 0 and out.evicted:
        return False
    if list(out.keys_to_store) != absent:
        return False
    for k in out.evicted:
        del shadow[k]
    for k in absent:
        shadow[k] = -1
    slots = [m.slot_of(k) for k in shadow]
    return (all(s is not None and 0 <= s < capacity for s in slots)
            and len(set(slots)) == len(slots)
            and all(m.state_of(k) == _state(shadow)[k] for k in shadow))


def _apply(m: CPUOffloadManager, shadow: dict[Key, int], capacity: int, op: int) -> bool:
    kind, key = divmod(op, HISTORY_KEYS)
    if kind in (0, 1):
        if not _check_store(m, shadow, capacity, [key_of(key)]):
            return False
        if kind == 0 and shadow.get(key_of(key)) == -1:
            m.complete_store([key_of(key)])
            shadow[key_of(key)] = 0
    elif kind == 2 and shadow.get(key_of(key), -1) >= 0:
        m.prepare_load([key_of(key)])
        shadow[key_of(key)] += 1
    return True


def key_of(i: int) -> Key:
    return KEYS[i]


def _run(capacity: int, policy: int, ops: list[int], call: int) -> bool:
    cap = pick(capacity - 1, 2) + 1
    m = CPUOffloadManager(cap, POLICIES[pick(policy, 2)], check=False)
    shadow: dict[Key, int] = {}
    if not _apply(m, shadow, cap, 0):  # k0 stored first: every history starts with a key
        return False
    for op in ops:
        if not _apply(m, shadow, cap, pick(op, 3 * HISTORY_KEYS)):
            return False
    bits = pick(call - 1, 7) + 1
    keys = [k for i, k in enumerate(KEYS) if bits >> i & 1]
    return _check_store(m, shadow, cap, keys)


def prepare_store_safe(capacity: int, policy: int, ops: list[int], call: int) -> bool:
    """prepare_store against the shadow after every such history; see the
    module doc for the domain.

    pre: 1 <= capacity <= 2
    pre: 0 <= policy < 2
    pre: len(ops) == 2 and all(0 <= op < 6 for op in ops)
    pre: 1 <= call <= 7
    post: __return__
    """
    return _run(capacity, policy, ops, call)


EVICTS_PINNED = mutant("kvcore.manager._cpu:CPUOffloadManager._choose",
                       "lambda k: k not in pins and k not in protected",
                       "lambda k: k not in protected",
                       "victims are chosen without the pin check")


def mutant_evicts_pinned(capacity: int, policy: int, ops: list[int], call: int) -> bool:
    """prepare_store_safe with _choose ignoring pins.

    pre: 1 <= capacity <= 2
    pre: 0 <= policy < 2
    pre: len(ops) == 2 and all(0 <= op < 6 for op in ops)
    pre: 1 <= call <= 7
    post: __return__
    """
    with EVICTS_PINNED.applied():
        return _run(capacity, policy, ops, call)


OBLIGATIONS = (
    Obligation("prepare_store_safe", CONFIRMED, 1000, 20, 197.7),
    Obligation("mutant_evicts_pinned", REFUTED, 90, 20, 15.8, "prepare_store_safe"),
)
