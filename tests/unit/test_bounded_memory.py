"""Bounded memory (issue 8, item 7): what only grew is now bounded by what is live.

Goal: (1) the manager's pending events hold at most ``max_pending_events`` keys, the
oldest dropped first and counted in ``stats().events_dropped`` (manager and scheduler),
identically in the implementation (LRU and ARC) and the reference manager; (2) the
scheduler's window index holds entries only for the tables of tracked requests, so a
finished request is not kept alive and repeated lookups do not pile up entries; (3) the
cap is a validated config field.

Method: exact scenarios for the buffer; for the index, the refinement suite's fake
engine runs many requests with window groups to the end (and through resets and
preemptions), then the index is compared with what the live tables hold.
"""

from __future__ import annotations

from typing import Any

import pytest
from refinement._engine import Engine

from kvcore.manager import CPUOffloadManager, ManagerEvent
from kvcore.scheduler import OffloadScheduler
from kvcore.spec.errors import ConfigError
from kvcore.spec.manager_model import ReferenceManager
from kvcore.spec.types import (
    DEFAULT_MAX_PENDING_EVENTS,
    MAX_PENDING_EVENTS,
    GroupKind,
    GroupSpec,
    OffloadConfig,
    make_key,
)

MANAGERS = {
    "lru": lambda cap: CPUOffloadManager(8, "lru", check=True, max_pending_events=cap),
    "arc": lambda cap: CPUOffloadManager(8, "arc", check=True, max_pending_events=cap),
    "model": lambda cap: ReferenceManager(8, cap),
}
K = [make_key(b"key-%d" % i, 0) for i in range(12)]


@pytest.mark.parametrize("kind", sorted(MANAGERS))
def test_event_buffer_drops_the_oldest_keys_and_counts_them(kind: str) -> None:
    m = MANAGERS[kind](3)
    m.prepare_store(K[:2])
    m.complete_store(K[:2])
    m.prepare_store(K[2:4])
    m.complete_store(K[2:4])  # 4 keys pending, cap 3: K[0] goes
    assert m.stats().events_dropped == 1
    m.prepare_store(K[4:8])  # fills the tier (capacity 8), 4 keys in one event
    m.complete_store(K[4:8])
    assert m.stats().events_dropped == 5
    assert m.take_events() == [ManagerEvent(tuple(K[5:8]), removed=False)]
    m.prepare_store(K[8:10])  # evicts K[0], K[1] (least recent): one removed event
    assert m.take_events() == [ManagerEvent((K[0], K[1]), removed=True)]
    m.reset()  # a reset drops pending events by design: not counted as dropped
    assert m.stats().events_dropped == 5


@pytest.mark.parametrize("kind", sorted(MANAGERS))
def test_a_zero_cap_keeps_no_events(kind: str) -> None:
    m = MANAGERS[kind](0)
    m.prepare_store(K[:3])
    m.complete_store(K[:3])
    assert m.take_events() == [] and m.stats().events_dropped == 3


def test_default_cap_is_the_config_default() -> None:
    cfg = OffloadConfig((GroupSpec(GroupKind.FULL, 4),), 4, 16, 8)
    assert cfg.max_pending_events == DEFAULT_MAX_PENDING_EVENTS
    m = CPUOffloadManager(8)
    for i in range(3):
        m.prepare_store(K[i:i + 1])
        m.complete_store(K[i:i + 1])
    assert len(m.take_events()) == 3 and m.stats().events_dropped == 0


@pytest.mark.parametrize("bad", [-1, MAX_PENDING_EVENTS + 1, True, 2.0, "64", None])
def test_cap_is_validated(bad: Any) -> None:
    groups = (GroupSpec(GroupKind.FULL, 4),)
    with pytest.raises(ConfigError) as caught:
        OffloadConfig(groups, 4, 16, 8, max_pending_events=bad)
    assert caught.value.field == "max_pending_events"
    with pytest.raises(ConfigError):
        CPUOffloadManager(8, max_pending_events=bad)
    with pytest.raises(ConfigError):
        ReferenceManager(8, bad)


WINDOWS = OffloadConfig((GroupSpec(GroupKind.FULL, 2),
                         GroupSpec(GroupKind.SLIDING, 2, window_tokens=4),
                         GroupSpec(GroupKind.MAMBA, 2)),
                        hash_block_tokens=2, num_gpu_blocks=120, num_cpu_blocks=24,
                        num_workers=2, max_pending_events=16)


def live_window_entries(s: OffloadScheduler) -> set[tuple[str, int, int, int]]:
    """(request, group, position, id) of every real id in a tracked window table."""
    return {(rid, g, pos, gpu_id) for rid in s.tracked_requests()
            for g, table in enumerate(s._reqs[rid].tables)
            if WINDOWS.groups[g].kind is not GroupKind.FULL
            for pos, gpu_id in enumerate(table) if gpu_id}


def index_entries(s: OffloadScheduler) -> list[tuple[str, int, int, int]]:
    return [(req.request_id, g, pos, gpu_id) for gpu_id, entries in s._window_index.items()
            for req, g, pos in entries]


def test_window_index_holds_only_live_tables_and_empties_when_all_finish() -> None:
    s = OffloadScheduler(WINDOWS, CPUOffloadManager(
        24, check=True, max_pending_events=WINDOWS.max_pending_events), check=True)
    e = Engine(WINDOWS, s, prefill_chunk=4)
    for round_ in range(6):
        for i in range(4):
            e.arrive([(round_ + i * j) % 7 for j in range(14)], 6)
        for n in range(40):
            for rid in e.waiting():
                e.admit(rid)
            running = e.running()
            e.step((running[0],) if n == 3 and running else ())
            e.deliver([(j, w, True) for j, w in e.pending_reports()])
            entries = index_entries(s)
            # No duplicates, nothing of an untracked request, only ids the tables hold
            # (entries for positions zeroed as stale may linger until re-allocation).
            assert len(entries) == len(set(entries))
            assert {r for r, *_ in entries} <= s.tracked_requests()
            assert set(entries) >= live_window_entries(s)
        if round_ == 2:
            e.reset()
    assert not s.tracked_requests()
    assert s._window_index == {}
    assert s.stats().events_dropped > 0  # 16-key buffer, never drained here


def test_repeated_lookups_do_not_grow_the_window_index() -> None:
    """A waiting request looked up again and again, its tables sent whole each time
    (the engine's resend after a lookup): the index keeps one entry per table slot."""
    s = OffloadScheduler(WINDOWS, CPUOffloadManager(24), check=False)
    e = Engine(WINDOWS, s, prefill_chunk=4)
    rid = e.arrive(list(range(20)), 4)
    e.admit(rid)
    e.step()
    for _ in range(5):
        s.lookup(rid, 0, 20)  # forgets the tables; the engine resends them whole
        e.reqs[rid].resend = True
        e.step()
        entries = index_entries(s)
        assert len(entries) == len(set(entries)) > 0
        assert set(entries) == live_window_entries(s)
    s.request_finished(rid)
    e.deliver([(j, w, True) for j, w in e.pending_reports()])
    assert s._window_index == {}
