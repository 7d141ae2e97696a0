"""Unit tests for the CPU tier manager (LRU) and the reference manager it refines.

Goal: pin the manager's observable behaviour, scenario by scenario, starting with
upstream vLLM's manager catalogue (docs/upstream.md §7.4) reproduced against
kvcore's API with upstream's exact slot ids, plus kvcore's own rules: operating errors
that name the key and change nothing, configuration errors that name the field, and
runtime checking of M1.

Method: each scenario runs against both ``CPUOffloadManager(policy="lru")`` and
``ReferenceManager`` (the ``manager`` fixture), so a scenario that passes pins both the
model and the implementation. Where kvcore differs from upstream on purpose, the test
says so in its docstring and pins kvcore's answer. "State unchanged" is checked by
comparing a deep snapshot of the object's attributes before and after the call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.manager import (
    CPUOffloadManager,
    EvictionPolicy,
    InvalidKeyError,
    KeyNotReadyError,
    LRUPolicy,
    ManagerEvent,
    NotPinnedError,
    OffloadManager,
    PrepareStoreResult,
)
from kvcore.manager import _cpu as cpu_module
from kvcore.spec.errors import (
    ArgumentRangeError,
    ArgumentTypeError,
    ConfigError,
    InvariantViolation,
    short_key,
)
from kvcore.spec.manager_model import ReferenceManager
from kvcore.spec.types import Key, Status, make_key

Manager = Any  # CPUOffloadManager or ReferenceManager: the same public methods


def k(*ids: int) -> list[Key]:
    """Keys named by small ints, as upstream's tests name blocks by int hashes."""
    return [make_key(str(i).encode(), 0) for i in ids]


def result(store: Sequence[int], slots: Sequence[int],
           evicted: Sequence[int] = ()) -> PrepareStoreResult:
    return PrepareStoreResult(tuple(k(*store)), tuple(slots), tuple(k(*evicted)))


def stored(*ids: int) -> ManagerEvent:
    return ManagerEvent(tuple(k(*ids)), removed=False)


def removed(*ids: int) -> ManagerEvent:
    return ManagerEvent(tuple(k(*ids)), removed=True)


FACTORIES: dict[str, Callable[[int], Manager]] = {
    "impl": lambda capacity: CPUOffloadManager(capacity, "lru", check=True),
    "model": ReferenceManager,
}


@pytest.fixture(params=sorted(FACTORIES))
def make(request: pytest.FixtureRequest) -> Callable[[int], Manager]:
    """Build a manager of the given capacity: the implementation, then the model."""
    return FACTORIES[request.param]


def deep_state(obj: object) -> object:
    """A comparable snapshot of an object graph (order-sensitive for ordered dicts)."""
    if isinstance(obj, OrderedDict):
        return ("ordered", [(key, deep_state(v)) for key, v in obj.items()])
    if isinstance(obj, dict):
        return {key: deep_state(v) for key, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [deep_state(v) for v in obj]
    if isinstance(obj, set | frozenset):
        return frozenset(obj)
    if hasattr(obj, "__dict__"):
        return (type(obj).__name__, deep_state(vars(obj)))
    if hasattr(obj, "__slots__"):
        return (type(obj).__name__, [deep_state(getattr(obj, s)) for s in obj.__slots__])
    return obj


def fill(m: Manager, *ids: int) -> None:
    """Store and complete keys, so they are READY."""
    assert m.prepare_store(k(*ids)) is not None
    m.complete_store(k(*ids))


# -- upstream catalogue (§7.4) -----------------------------------------------------------


def test_cpu_manager_scenario(make: Callable[[int], Manager]) -> None:
    """Upstream ``test_cpu_manager``, step by step, with its exact slot ids."""
    m = make(4)
    # 1. prepare_store [1, 2] gives slots [0, 1].
    assert m.prepare_store(k(1, 2)) == result([1, 2], [0, 1])
    # 2. lookup answers PENDING while writing; no event yet.
    assert [m.lookup(x) for x in k(1, 2)] == [Status.PENDING, Status.PENDING]
    assert m.take_events() == []
    # 3. completion emits one stored event; lookups hit.
    m.complete_store(k(1, 2))
    assert m.take_events() == [stored(1, 2)]
    assert [m.lookup(x) for x in k(1, 2, 3)] == [Status.HIT, Status.HIT, Status.MISS]
    # 4. [2, 3, 4, 5] stores the absent three, evicts 1, fresh slots then the freed one.
    assert m.prepare_store(k(2, 3, 4, 5)) == result([3, 4, 5], [2, 3, 0], [1])
    assert m.take_events() == [removed(1)]
    # 5. no room: only 2 is evictable and two slots are needed.
    assert m.prepare_store(k(1, 6)) is None
    m.complete_store(k(2, 3, 4, 5))
    # 6. loads pin: slots in key order, and pinned keys cannot make room.
    assert m.prepare_load(k(2, 3)) == (1, 2)
    assert m.prepare_store(k(6, 7, 8)) is None
    # 7. once released, the oldest three go; freed slots come back LIFO.
    m.complete_load(k(2, 3))
    assert m.prepare_store(k(6, 7, 8)) == result([6, 7, 8], [3, 2, 1], [2, 3, 4])
    m.complete_store(k(6, 7, 8))
    # 8. touch order: after touching [5, 6, 7], 8 is the oldest.
    m.touch(k(5, 6, 7))
    assert m.prepare_store(k(9)) == result([9], [1], [8])
    # 9. a failed store removes only the key it was writing; 7 was READY and stays.
    m.complete_store(k(7, 9), success=False)
    assert m.lookup(k(7)[0]) is Status.HIT
    assert m.lookup(k(9)[0]) is Status.MISS
    # 10. the events, in order; the failed store announced nothing.
    assert m.take_events() == [stored(3, 4, 5), removed(2, 3, 4), stored(6, 7, 8),
                               removed(8)]


def test_prepare_load_preserves_key_order(make: Callable[[int], Manager]) -> None:
    m = make(4)
    fill(m, 1, 2, 3, 4)
    assert m.prepare_load(k(3, 1, 4, 2)) == (2, 0, 3, 1)


@pytest.mark.parametrize("policy", ["lru", "arc", "model"])
def test_already_stored_block_not_evicted_during_prepare_store(policy: str) -> None:
    """A key already stored is one of the call's keys, so it is protected from eviction."""
    m = ReferenceManager(4) if policy == "model" else CPUOffloadManager(4, policy)
    fill(m, 1, 2)
    m.touch(k(1))  # 2 becomes the least recent
    assert m.prepare_store(k(2, 3, 4, 5)) == result([3, 4, 5], [2, 3, 0], [1])
    m.complete_store(k(2, 3, 4, 5))
    assert m.lookup(k(2)[0]) is Status.HIT


def test_no_reuse_filter_first_seen_keys_are_stored(make: Callable[[int], Manager]) -> None:
    """Pinned difference from upstream ``test_filter_reused_manager``.

    Upstream can wrap the tier in a filter that stores a key only after it was looked up
    ``store_threshold`` times. kvcore's tier has no such filter: what to offer is the
    scheduler's decision (docs/semantics.md, Store), and the tier stores whatever it is offered.
    """
    m = make(4)
    assert m.lookup(k(1)[0]) is Status.MISS
    assert m.prepare_store(k(1, 2)) == result([1, 2], [0, 1])


def test_stores_skipped_counter_counts_none_answers(make: Callable[[int], Manager]) -> None:
    """Pinned difference: upstream counts stores its reuse filter skipped; kvcore counts
    ``prepare_store`` calls that found no room (returned None)."""
    m = make(2)
    fill(m, 1, 2)
    m.prepare_load(k(1, 2))
    assert m.prepare_store(k(3)) is None
    assert m.prepare_store(k(3, 4, 5)) is None  # more than the capacity
    assert m.prepare_store(k(1)) == result([], [])  # nothing to store: not a skip
    assert m.stats().stores_skipped_no_room == 2


def test_cache_usage_stats(make: Callable[[int], Manager]) -> None:
    """Upstream's usage gauge is the fraction held by transfers: (writing + pinned) / cap."""
    m = make(4)
    m.prepare_store(k(1, 2, 3))
    s = m.stats()
    assert (s.used, s.writing, s.pinned, s.evictable) == (3, 3, 0, 0)
    m.complete_store(k(1, 2, 3))
    m.prepare_load(k(1, 1, 2))  # 1 is pinned twice but counts once
    s = m.stats()
    assert (s.used, s.writing, s.pinned, s.evictable) == (3, 0, 2, 1)
    assert (s.writing + s.pinned) / s.capacity == 0.5


def test_evictable_count_over_lifecycle(make: Callable[[int], Manager]) -> None:
    m = make(3)
    counts = []
    m.prepare_store(k(1, 2))
    counts.append(m.stats().evictable)
    m.complete_store(k(1, 2))
    counts.append(m.stats().evictable)
    m.prepare_load(k(1))
    counts.append(m.stats().evictable)
    m.prepare_load(k(1))
    m.complete_load(k(1))
    counts.append(m.stats().evictable)  # still pinned once
    m.complete_load(k(1))
    counts.append(m.stats().evictable)
    m.prepare_store(k(3, 4))  # evicts the older of 1 and 2
    counts.append(m.stats().evictable)
    assert counts == [0, 2, 1, 1, 2, 1]
    assert m.stats().evictions == 1


def test_fast_none_path_does_not_walk_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """When fewer keys are evictable than needed, the answer is None without a walk."""
    m = CPUOffloadManager(2, "lru")
    fill(m, 1, 2)
    m.prepare_load(k(1))

    def forbidden(*_: object) -> None:
        raise AssertionError("policy.choose called on the fast None path")

    monkeypatch.setattr(m.policy, "choose", forbidden)
    assert m.prepare_store(k(3, 4)) is None


# -- kvcore's own rules ------------------------------------------------------------------


def test_prepare_store_edge_cases(make: Callable[[int], Manager]) -> None:
    m = make(3)
    assert m.prepare_store([]) == result([], [])
    assert m.prepare_store(k(1, 2, 1, 2)) == result([1, 2], [0, 1])  # deduplicated
    assert m.prepare_store(k(2, 1)) == result([], [])  # WRITING counts as present
    assert m.prepare_store(k(3, 4)) is None  # WRITING keys are never evicted
    assert m.stats().used == 2


def test_same_call_keys_are_never_evicted(make: Callable[[int], Manager]) -> None:
    m = make(2)
    fill(m, 1, 2)
    assert m.prepare_store(k(1, 2, 3)) is None  # 1 and 2 are the call's own keys
    assert m.prepare_store(k(2, 3)) == result([3], [0], [1])


def test_failed_store_frees_slot_and_announces_nothing(make: Callable[[int], Manager]) -> None:
    m = make(3)
    fill(m, 1)
    m.take_events()
    m.prepare_store(k(2, 3))
    m.complete_store(k(3, 2), success=False)
    assert m.take_events() == []
    assert [m.lookup(x) for x in k(2, 3)] == [Status.MISS, Status.MISS]
    assert m.stats().used == 1
    assert m.prepare_store(k(4, 5)) == result([4, 5], [1, 2])  # freed 3 then 2: LIFO


def test_complete_store_ignores_ready_absent_and_repeated_keys(
        make: Callable[[int], Manager]) -> None:
    m = make(3)
    fill(m, 1)
    m.take_events()
    m.prepare_store(k(2))
    m.complete_store(k(1, 9, 2, 2))
    m.complete_store(k(2))  # a repeated completion finds nothing WRITING
    assert m.take_events() == [stored(2)]
    assert m.stats().stored_keys == 2


def test_touch_makes_first_key_most_recent(make: Callable[[int], Manager]) -> None:
    m = make(3)
    fill(m, 1, 2, 3)
    m.touch(k(3, 2, 99))  # 99 is unknown and ignored
    assert m.prepare_store(k(4)) == result([4], [0], [1])
    assert m.prepare_store(k(5)) == result([5], [1], [2])  # 2 is older than 3


def test_lookup_and_loads_do_not_refresh_recency(make: Callable[[int], Manager]) -> None:
    """Only ``touch`` and completion move a key; ``lookup`` is a pure read and a load
    keeps the key's place (upstream's step 7 depends on it)."""
    m = make(2)
    fill(m, 1, 2)
    assert m.lookup(k(1)[0]) is Status.HIT
    m.prepare_load(k(1))
    m.complete_load(k(1))
    assert m.prepare_store(k(3)) == result([3], [0], [1])


def test_reset_clears_contents_but_not_counters(make: Callable[[int], Manager]) -> None:
    m = make(2)
    fill(m, 1, 2)
    m.prepare_store(k(3))
    m.prepare_load(k(2))
    m.reset()
    s = m.stats()
    assert (s.used, s.writing, s.pinned, s.evictable) == (0, 0, 0, 0)
    assert (s.evictions, s.stored_keys) == (1, 2)
    assert m.take_events() == []
    assert m.lookup(k(2)[0]) is Status.MISS
    assert m.prepare_store(k(4)) == result([4], [0])  # slots start afresh


# -- operating errors: name the key, change nothing ----------------------------------


def _prepared(m: Manager) -> Manager:
    """1 and 2 READY, 3 WRITING, 1 pinned once."""
    fill(m, 1, 2)
    m.prepare_store(k(3))
    m.prepare_load(k(1))
    return m


BAD_CALLS: list[tuple[str, Callable[[Manager], object], type[Exception], bytes, str]] = [
    ("load absent", lambda m: m.prepare_load(k(1, 9)), KeyNotReadyError, k(9)[0], "absent"),
    ("load writing", lambda m: m.prepare_load(k(2, 3)), KeyNotReadyError, k(3)[0], "writing"),
    ("unpin unpinned", lambda m: m.complete_load(k(1, 2)), NotPinnedError, k(2)[0], "ready"),
    ("unpin twice", lambda m: m.complete_load(k(1, 1)), NotPinnedError, k(1)[0], "pinned"),
    ("unpin writing", lambda m: m.complete_load(k(3)), NotPinnedError, k(3)[0], "writing"),
    ("unpin absent", lambda m: m.complete_load(k(9)), NotPinnedError, k(9)[0], "absent"),
]


@pytest.mark.parametrize(("call", "error", "key", "state"),
                         [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_names_the_key_and_changes_nothing(
        make: Callable[[int], Manager], call: Callable[[Manager], object],
        error: type[Exception], key: bytes, state: str) -> None:
    m = _prepared(make(4))
    before = deep_state(m)
    with pytest.raises(error) as info:
        call(m)
    assert deep_state(m) == before
    assert info.value.key == key  # type: ignore[attr-defined]
    assert info.value.state == state  # type: ignore[attr-defined]
    assert repr(key) in str(info.value)
    assert isinstance(info.value, KeyError | ValueError)


@pytest.mark.parametrize(("keys", "pins", "releases"), [
    ((9,), 0, 1),      # absent: no pins
    ((2,), 0, 1),      # ready, never pinned
    ((1, 1), 1, 2),    # pinned once, released twice
])
def test_an_unpin_error_says_how_many_pins_the_key_holds(
        make: Callable[[int], Manager], keys: tuple[int, ...], pins: int,
        releases: int) -> None:
    """The error carries the pin count it compared with the releases asked for, so an
    engine can tell a double release from a release of a key it never loaded. Kills a
    wrong count for an absent key (``held = 1`` when the key has no pins)."""
    m = _prepared(make(4))
    with pytest.raises(NotPinnedError) as info:
        m.complete_load(k(*keys))
    assert (info.value.pins, info.value.releases) == (pins, releases)
    assert f"pins={pins}" in str(info.value)


def test_non_bytes_key_is_rejected_before_anything_changes(
        make: Callable[[int], Manager]) -> None:
    m = _prepared(make(4))
    before = deep_state(m)
    with pytest.raises(InvalidKeyError, match="str, not bytes"):
        m.prepare_store([b"5", "6"])
    assert deep_state(m) == before


def test_long_keys_are_shortened_in_messages() -> None:
    key = bytes(range(64))
    text = str(KeyNotReadyError(key, "absent"))
    assert "(64 bytes)" in text
    assert len(short_key(key)) < 60


# -- configuration errors ------------------------------------------------------------

BAD_CONFIGS: list[tuple[object, object, str]] = [
    (0, "lru", "capacity"),
    (-3, "lru", "capacity"),
    (True, "lru", "capacity"),
    (2.0, "lru", "capacity"),
    ("4", "lru", "capacity"),
    (1 << 41, "lru", "capacity"),
    (4, "fifo", "policy"),
    (4, "LRU", "policy"),
    (4, None, "policy"),
]


@pytest.mark.parametrize(("capacity", "policy", "field"), BAD_CONFIGS)
def test_bad_config_raises_config_error_naming_the_field(
        capacity: object, policy: object, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        CPUOffloadManager(capacity, policy)  # type: ignore[arg-type]
    assert info.value.field == field


def test_reference_rejects_bad_capacity_the_same_way() -> None:
    with pytest.raises(ConfigError) as info:
        ReferenceManager(0)
    assert info.value.field == "capacity"


# -- interface parity ----------------------------------------------------------------


def test_reference_and_implementation_share_the_interface() -> None:
    m = CPUOffloadManager(2)
    assert isinstance(m, OffloadManager)
    abstract = OffloadManager.__abstractmethods__
    assert abstract <= set(dir(ReferenceManager))
    assert {"state_of", "slot_of"} <= set(dir(ReferenceManager)) & set(dir(m))


# -- runtime checking (M1) -----------------------------------------------------------


class _BadChoice(EvictionPolicy):
    """A mutant LRU policy that ignores ``can_evict``: it offers whatever is oldest."""

    name = "bad"

    def __init__(self, capacity: int, short: bool = False) -> None:
        super().__init__(capacity)
        self.keys: list[Key] = []
        self.short = short

    def insert(self, key: Key) -> None:
        self.keys.append(key)

    def ready(self, key: Key) -> None:
        pass

    def discard(self, key: Key) -> None:
        self.keys.remove(key)

    def touch(self, keys: Sequence[Key]) -> None:
        pass

    def choose(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        return self.keys[:n - 1] if self.short else self.keys[:n]

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            self.keys.remove(key)

    def clear(self) -> None:
        self.keys.clear()


def _with_policy(m: CPUOffloadManager, policy: EvictionPolicy) -> CPUOffloadManager:
    m._pools[0].policy = policy
    return m


@pytest.mark.parametrize("setup", ["pinned", "writing", "own", "short"])
def test_check_mode_catches_unsafe_eviction(setup: str) -> None:
    """Each mutant choice breaks one M1 clause; two keys stay evictable, so the fast
    None path does not hide the bad choice."""
    m = _with_policy(CPUOffloadManager(3, check=True), _BadChoice(3, setup == "short"))
    if setup == "writing":
        m.prepare_store(k(1))
        fill(m, 2, 3)
    else:
        fill(m, 1, 2, 3)
    if setup == "pinned":
        m.prepare_load(k(1))
    keys = {"own": k(1, 4), "short": k(4, 5)}.get(setup, k(4))
    with pytest.raises(InvariantViolation) as info:
        m.prepare_store(keys)
    assert info.value.ids == ["M1"]


def test_check_off_builds_no_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, the mutant goes unnoticed and the predicate is never reached (zero cost)."""
    def forbidden(*_: object) -> None:
        raise AssertionError("M1 record built with checks off")

    monkeypatch.delenv("KVCORE_CHECK", raising=False)
    monkeypatch.setattr(cpu_module, "EvictionRecord", forbidden)
    m = _with_policy(CPUOffloadManager(2), _BadChoice(2))
    fill(m, 1, 2)
    m.prepare_load(k(1))
    assert m.prepare_store(k(3)) == result([3], [0], [1])


@pytest.mark.parametrize(("env", "flag", "expected"), [
    (None, None, False), ("1", None, True), ("0", None, False),
    ("1", False, False), (None, True, True),
])
def test_check_flag_and_environment(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                    flag: bool | None, expected: bool) -> None:
    if env is None:
        monkeypatch.delenv("KVCORE_CHECK", raising=False)
    else:
        monkeypatch.setenv("KVCORE_CHECK", env)
    assert CPUOffloadManager(2, check=flag).check is expected


def test_check_mode_accepts_correct_evictions_and_none() -> None:
    m = CPUOffloadManager(2, "arc", check=True)
    fill(m, 1, 2)
    m.prepare_load(k(1))
    assert m.prepare_store(k(3, 4)) is None
    assert m.prepare_store(k(3)) == result([3], [1], [2])


@given(st.integers(0, 6),
       st.lists(st.one_of(st.integers(1, 9), st.none()), max_size=14))
@settings(max_examples=300, deadline=None)
def test_the_event_buffer_drops_the_oldest_keys_as_a_flat_list_would(
        cap: int, script: list[int | None]) -> None:
    """``max_pending_events`` against a flat model: every key of every event in order, the
    oldest beyond the cap dropped, regrouped by event at ``take_events``. Cuts inside the
    oldest event are applied lazily (``_emit``), so this holds the lazy count to the flat
    answer at every take, and the cut part under half of the oldest event (kills:
    take_events ignoring the pending cut, a cut one key off, the dropped count off by the
    lazy part, the half compared with the newest event instead of the oldest)."""
    m = CPUOffloadManager(1 << 10, check=True, max_pending_events=cap)
    flat: list[tuple[int, Key]] = []  # (event number, key), oldest first
    dropped = fresh = events = 0
    for step in script:
        if step is None:  # the engine drains the buffer
            want: dict[int, list[Key]] = {}
            for number, key in flat:
                want.setdefault(number, []).append(key)
            got = m.take_events()
            assert [list(e.keys) for e in got] == list(want.values())
            assert not any(e.removed for e in got)
            flat = []
            continue
        keys = [make_key(i.to_bytes(8, "little") + bytes(24), 0)
                for i in range(fresh, fresh + step)]
        fresh += step
        out = m.prepare_store(keys)
        assert out is not None and list(out.keys_to_store) == keys
        m.complete_store(keys)
        flat += [(events, key) for key in keys]
        events += 1
        over = max(0, len(flat) - cap)
        dropped += over
        del flat[:over]
        assert m.stats().events_dropped == dropped
        # The memory bound docs/engine.md states: dropped keys stay referenced only while
        # under half of the oldest event is gone (read from the buffer itself: nothing
        # public tells a referenced tuple from a live one).
        skip, pending = m._head_skip, m._events
        assert not skip or 2 * skip < len(pending[0].keys), (skip, len(pending[0].keys))


def _stored(m: CPUOffloadManager, *numbers: int) -> None:
    keys = [make_key(n.to_bytes(8, "little") + bytes(24), 0) for n in numbers]
    assert m.prepare_store(keys) is not None
    m.complete_store(keys)


def test_check_mode_reports_a_buffer_past_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """M3 at run time, at the event that crosses the bound (kills: the oldest keys never
    dropped, and the drop skipped for an excess of one key)."""
    m = CPUOffloadManager(64, check=True, max_pending_events=4)
    _stored(m, 0, 1, 2, 3)
    assert m.checked["M3"] == 1
    monkeypatch.setattr(m, "_drop_oldest", lambda excess: None)
    with pytest.raises(InvariantViolation, match="holds 5 live entries") as caught:
        _stored(m, 4)
    assert caught.value.ids == ["M3"]


def test_check_mode_reports_a_dropped_head_kept_past_half(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """M3 on the lazy cut: a drop that counts the oldest keys as gone but never cuts or
    pops them keeps half an event's dropped keys referenced (kills a cut that never
    fires, as when it is compared with a longer event than the oldest)."""
    m = CPUOffloadManager(64, check=True, max_pending_events=8)
    _stored(m, *range(8))  # one 8-key event, at the limit

    def count_only(excess: int) -> None:
        m._event_keys -= excess
        m._head_skip += excess

    monkeypatch.setattr(m, "_drop_oldest", count_only)
    _stored(m, 8, 9, 10)  # 3 of the oldest 8 dropped: under half, allowed
    with pytest.raises(InvariantViolation, match="4 dropped entries of its oldest unit of 8"):
        _stored(m, 11)


def test_a_drain_counts_the_keys_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """M3 at ``take_events``: the keys the events reference against the counts (kills a
    live count that drifts from the events, which would let the buffer pass its bound)."""
    m = CPUOffloadManager(64, check=True, max_pending_events=8)
    _stored(m, 0, 1, 2)
    m._event_keys -= 1
    with pytest.raises(InvariantViolation, match="references 3 entries"):
        m.take_events()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_hashes_with_a_suffix_read_and_touch_as_their_keys(policy: str) -> None:
    """``lookup_hashes``/``touch_hashes`` (the scheduler's path: a group's hashes and its
    suffix) answer and reorder exactly as ``lookup_many``/``touch`` of the keys, in the
    group the suffix names. Kills: the suffix dropped from the read or the touch, and the
    touch routed to another group's pool."""
    hashes = [b"h%02d" % i for i in range(6)]
    by_keys, by_hashes = (CPUOffloadManager([4, 4], policy) for _ in range(2))
    for m in (by_keys, by_hashes):
        for group in (0, 1):
            keys = [make_key(h, group) for h in hashes[:4]]
            m.prepare_store(keys)
            m.complete_store(keys[:3])
    for group in (1, 0):
        suffix = make_key(b"", group)
        keys = [h + suffix for h in hashes]
        assert by_hashes.lookup_hashes(hashes, suffix) == by_keys.lookup_many(keys) == \
            [Status.HIT] * 3 + [Status.PENDING] + [Status.MISS] * 2
        by_keys.touch(keys[0:2])
        by_hashes.touch_hashes(hashes[0:2], suffix)
    for m in (by_keys, by_hashes):
        for group in (0, 1):
            m.complete_store([make_key(hashes[3], group)])
            # One more key each: the victim is the policy's choice, so it shows the order.
            assert m.prepare_store([make_key(hashes[5], group)]) is not None
    assert by_keys.take_events() == by_hashes.take_events()
    assert [by_hashes.state_of(make_key(h, g)) for g in (0, 1) for h in hashes] == \
        [by_keys.state_of(make_key(h, g)) for g in (0, 1) for h in hashes]


@pytest.mark.parametrize("call", ["lookup_hashes", "touch_hashes"])
@pytest.mark.parametrize("hashes,suffix", [
    ("h", b"\0\0\0\0"), ([b"h", 3], b"\0\0\0\0"), ([b"h", b"hh"], b"\0\0\0\0"),
    ([b"h" * 65], b"\0\0\0\0"), ([b"h"], "\0\0\0\0"), ([b"h"], b"\0\0\0"), ([b"h"], None)])
def test_bad_hashes_or_suffix_are_refused_and_change_nothing(
        call: str, hashes: object, suffix: object) -> None:
    m = CPUOffloadManager(4)
    keys = [make_key(b"a", 0), make_key(b"b", 0)]
    m.prepare_store(keys)
    m.complete_store(keys)
    before = m.policy.order() if isinstance(m.policy, LRUPolicy) else None
    with pytest.raises((ArgumentTypeError, ArgumentRangeError)):
        getattr(m, call)(hashes, suffix)
    assert m.policy.order() == before


def test_a_subclass_that_records_reads_and_touches_sees_the_hashes_path() -> None:
    """A tier subclass that overrides ``lookup_many``/``touch`` (to record or to read
    elsewhere) is asked through them, with the keys assembled, not bypassed."""
    seen: list[tuple[str, list[Key]]] = []

    class Recording(CPUOffloadManager):
        def lookup_many(self, keys: Sequence[Key]) -> list[Status]:
            seen.append(("lookup_many", list(keys)))
            return super().lookup_many(keys)

        def touch(self, keys: Sequence[Key]) -> None:
            seen.append(("touch", list(keys)))
            super().touch(keys)

    m = Recording(4)
    suffix = make_key(b"", 0)
    m.lookup_hashes([b"x", b"y"], suffix)
    m.touch_hashes([b"y"], suffix)
    assert seen == [("lookup_many", [b"x" + suffix, b"y" + suffix]),
                    ("touch", [b"y" + suffix])]


def test_a_policy_subclass_that_overrides_touch_sees_the_hashes_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: LRU's touch_hashes went straight to its native order, past a
    subclass's ``touch``. It now goes through the override, with the keys made."""
    seen: list[list[Key]] = []

    class Recording(LRUPolicy):
        def touch(self, keys: Sequence[Key]) -> None:
            seen.append(list(keys))
            super().touch(keys)

    monkeypatch.setitem(cpu_module.POLICIES, "recording", Recording)
    m = CPUOffloadManager(4, "recording")
    suffix = make_key(b"", 0)
    m.touch_hashes([b"x", b"y"], suffix)
    assert seen == [[b"x" + suffix, b"y" + suffix]]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_hashes_in_a_list_subclass_are_taken_as_a_list(policy: str) -> None:
    """Review finding: a list subclass passed the argument check and then reached a C
    helper that takes exact lists only (a bare ValueError). The checked copy is used."""

    class Hashes(list):  # type: ignore[type-arg]
        pass

    m = CPUOffloadManager(4, policy)
    keys = [make_key(b"a", 0), make_key(b"b", 0)]
    m.prepare_store(keys)
    m.complete_store(keys)
    suffix = make_key(b"", 0)
    assert m.lookup_hashes(Hashes([b"a", b"c"]), suffix) == [Status.HIT, Status.MISS]
    m.touch_hashes(Hashes([b"a"]), suffix)
    assert m.state_of(keys[0]) == "ready"
