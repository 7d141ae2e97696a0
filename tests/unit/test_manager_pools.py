"""One CPU pool per group: routing by key group, per-group eviction, atomic refusals.

Goal: a slot holds one chunk of one group, so each group's keys live in their own pool
of ``capacity_g`` slots (ids 0..capacity_g-1, the rows the transfer engine pinned for
that group), a store evicts only keys of its own groups, and a store that one group
cannot make room for changes nothing in any group. Every test runs on the
implementation (LRU and ARC where the order does not matter) and on the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcore.manager import CPUOffloadManager, cpu_capacities
from kvcore.presets import PRESETS
from kvcore.spec.errors import ArgumentTypeError, KeyGroupError
from kvcore.spec.manager_model import ReferenceManager
from kvcore.spec.types import MAX_GROUPS, Key, make_key

MAKERS: dict[str, Callable[[Any], Any]] = {
    "lru": lambda cap: CPUOffloadManager(cap, "lru", check=True),
    "model": ReferenceManager,
}
ALL = {**MAKERS, "arc": lambda cap: CPUOffloadManager(cap, "arc", check=True)}


def key(name: str, group: int) -> Key:
    return make_key(name.encode(), group)


def fill(m: Any, keys: list[Key]) -> None:
    assert m.prepare_store(keys) is not None
    m.complete_store(keys)


def snapshot(m: Any, keys: list[Key]) -> object:
    return (m.stats(), [(m.state_of(k), m.slot_of(k)) for k in keys])


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_a_store_evicts_only_its_own_groups_keys(make: Callable[[Any], Any]) -> None:
    """Group 1's keys are the least recent overall, yet a group-0 store evicts group 0's
    least recent key. Kills: one shared recency order; evicting from the wrong group."""
    m = make((2, 2))
    old1, old2 = key("c", 1), key("d", 1)
    a, b = key("a", 0), key("b", 0)
    fill(m, [old1, old2])
    fill(m, [a, b])
    got = m.prepare_store([key("e", 0)])
    assert got is not None and got.evicted == (a,) and got.slots == (m.slot_of(key("e", 0)),)
    assert m.state_of(old1) == m.state_of(old2) == "ready"


@pytest.mark.parametrize("make", ALL.values(), ids=ALL.keys())
def test_slot_ids_are_per_group(make: Callable[[Any], Any]) -> None:
    """Each pool hands out 0, 1, ... and recycles its own freed slots. Kills: one slot
    counter for all groups; a freed slot returned to another group's list."""
    m = make((2, 3))
    assert m.prepare_store([key("a", 0), key("x", 1), key("b", 0), key("y", 1)]).slots \
        == (0, 0, 1, 1)
    m.complete_store([key("a", 0), key("x", 1), key("b", 0)], success=True)
    m.complete_store([key("y", 1)], success=False)  # slot 1 of group 1 is free again
    assert m.prepare_store([key("z", 1), key("w", 1)]).slots == (2, 1)  # fresh first
    assert m.stats().capacity == 5 and m.stats().used == 5


@pytest.mark.parametrize("make", ALL.values(), ids=ALL.keys())
def test_a_full_group_refuses_even_when_another_has_room(make: Callable[[Any], Any]) -> None:
    """Group 0's only key is pinned; group 1 is empty: a group-0 store is None. Kills:
    room counted over all groups (a shared pool would take group 1's free slots)."""
    m = make((1, 3))
    fill(m, [key("a", 0)])
    m.prepare_load([key("a", 0)])
    before = snapshot(m, [key("a", 0), key("n", 0)])
    assert m.prepare_store([key("n", 0)]) is None
    assert m.stats().stores_skipped_no_room == 1
    assert snapshot(m, [key("a", 0), key("n", 0)])[1] == before[1]  # type: ignore[index]


@pytest.mark.parametrize("make", ALL.values(), ids=ALL.keys())
def test_refusal_is_atomic_across_groups(make: Callable[[Any], Any]) -> None:
    """Group 0 could evict, group 1 cannot (pinned): nothing changes in either group, no
    event. Kills: evicting group 0's victims before group 1 is checked."""
    m = make((2, 2))
    keys = [key("a", 0), key("b", 0), key("c", 1), key("d", 1), key("n", 0), key("o", 1)]
    fill(m, keys[:4])
    m.prepare_load(keys[2:4])
    m.take_events()
    before = snapshot(m, keys)
    assert m.prepare_store([key("n", 0), key("o", 1)]) is None
    after = snapshot(m, keys)
    assert after[1] == before[1]  # type: ignore[index]
    assert m.take_events() == []
    m.complete_load(keys[2:4])  # now both groups can evict: the same call succeeds
    got = m.prepare_store([key("n", 0), key("o", 1)])
    assert got is not None and len(got.evicted) == 2
    assert {k[-1] for k in got.evicted} == {0, 1}


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_a_key_of_a_group_without_a_pool_is_refused_first(make: Callable[[Any], Any]) -> None:
    """Kills: routing an unknown group to pool 0 (or growing pools without bound)."""
    m = make((2,))
    with pytest.raises(KeyGroupError) as info:
        m.prepare_store([key("a", 0), key("b", 1)])
    assert info.value.group == 1 and info.value.bound == 1 and "group=1" in str(info.value)
    assert m.stats().used == 0 and m.slot_of(key("a", 0)) is None
    with pytest.raises(KeyGroupError):
        make(4).prepare_store([key("a", MAX_GROUPS)])


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_one_int_gives_every_group_that_many_slots(make: Callable[[Any], Any]) -> None:
    """``num_cpu_blocks`` is slots per group. Kills: one int treated as a shared total."""
    m = make(2)
    for g in range(3):
        fill(m, [key("a", g), key("b", g)])
    assert m.stats().used == 6 and m.stats().evictions == 0 and m.stats().capacity == 6
    assert [m.slot_of(key("b", g)) for g in range(3)] == [1, 1, 1]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_for_config_sizes_each_pool_as_the_transfer_engine(name: str) -> None:
    """Kills: the manager and the engine reading a group's capacity from two rules."""
    from kvcore.transfer import cpu_capacity
    cfg = PRESETS[name]()
    m = CPUOffloadManager.for_config(cfg)
    caps = tuple(cpu_capacity(cfg, g) for g in range(len(cfg.groups)))
    assert cpu_capacities(cfg) == caps
    assert [m.capacity_of(g) for g in range(len(cfg.groups))] == list(caps)
    assert m.stats().capacity == sum(caps)
    with pytest.raises(KeyGroupError):
        m.prepare_store([key("a", len(cfg.groups))])


@pytest.mark.parametrize("group", ["0", None, 1.5, True, [0]])
@pytest.mark.parametrize("method", ["capacity_of", "policy_of"])
def test_a_group_that_is_not_an_int_is_named(method: str, group: object) -> None:
    """``"0"`` or ``[0]`` matches no pool, so the answer would be 0 / None: "no pool" for a
    question that was never valid. An int outside every pool still answers 0 / None."""
    m = CPUOffloadManager([4, 2])
    with pytest.raises(ArgumentTypeError, match=rf"^CPUOffloadManager.{method}: group="):
        getattr(m, method)(group)
    assert [m.capacity_of(g) for g in (0, 1, 2, -1)] == [4, 2, 0, 0]
    assert m.policy_of(0) is not None and m.policy_of(2) is None
