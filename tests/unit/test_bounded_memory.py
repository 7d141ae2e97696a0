"""Bounded memory (issue 8, item 7): what only grew is now bounded by what is live.

Goal: (1) the manager's pending events hold at most ``max_pending_events`` keys, the
oldest dropped first and counted in ``stats().events_dropped`` (manager and scheduler),
identically in the implementation (LRU and ARC) and the reference manager; (2) the
scheduler's stale-window marks (one placement step per window-table position, one
allocation step per GPU id) follow the live tables, so a finished request is not kept
alive and repeated lookups do not pile up marks; (3) the cap is a validated config field.

Method: exact scenarios for the buffer; for the marks, the refinement suite's fake
engine runs many requests with window groups to the end (and through resets and
preemptions), checking the marks against the live tables after every step.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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


def check_stale_marks(s: OffloadScheduler) -> None:
    """Window tables' placement runs start at position 0, at strictly increasing
    positions within the table and strictly increasing steps that never run ahead of the
    scheduler's step (at most one run per step: the marks are bounded by the steps that
    placed ids, not by the table's length); FULL tables have none."""
    step = s._stale.step
    assert len(s._stale.allocated_at) <= WINDOWS.num_gpu_blocks
    for rid in s.tracked_requests():
        req = s._reqs[rid]
        for g, (table, placed) in enumerate(zip(req.tables, req.placed, strict=True)):
            window = WINDOWS.groups[g].kind is not GroupKind.FULL
            starts, steps = list(placed.starts), list(placed.steps)
            assert len(starts) == len(steps)
            if not window or not table:
                assert not starts
                continue
            assert starts[0] == 0
            assert all(a < b for a, b in itertools.pairwise(starts))
            assert starts[-1] < len(table)
            assert all(a < b for a, b in itertools.pairwise(steps))
            assert 0 < steps[-1] <= step


def test_stale_marks_follow_the_live_tables_and_nothing_outlives_a_request() -> None:
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
            check_stale_marks(s)
        if round_ == 2:
            e.reset()
    assert not s.tracked_requests()
    assert not s._reqs
    assert s.stats().events_dropped > 0  # 16-key buffer, never drained here


def test_repeated_lookups_do_not_grow_the_stale_marks() -> None:
    """A waiting request looked up again and again, its tables sent whole each time
    (the engine's resend after a lookup): one mark per table slot, never more."""
    s = OffloadScheduler(WINDOWS, CPUOffloadManager(24), check=False)
    e = Engine(WINDOWS, s, prefill_chunk=4)
    rid = e.arrive(list(range(20)), 4)
    e.admit(rid)
    e.step()
    for _ in range(5):
        s.lookup(rid, 0, 20)  # forgets the tables; the engine resends them whole
        e.reqs[rid].resend = True
        e.step()
        check_stale_marks(s)  # one mark per slot of the resent tables, not one per send
        assert sum(len(p.steps) for p in s._reqs[rid].placed) > 0
    s.request_finished(rid)
    e.deliver([(j, w, True) for j, w in e.pending_reports()])
    assert rid not in s.tracked_requests()


def test_stale_means_allocated_after_placed() -> None:
    """An id is stale where it was placed before the step that allocated it again; one
    placed in the very step that allocated it is fresh, and so is an id never allocated."""
    from array import array

    from kvcore.scheduler._state import Placements, StaleWindows

    stale = StaleWindows()
    stale.advance(frozenset({5, 6}))          # step 1: 5 and 6 handed out
    table = array("i", [5, 6, 7, 0])
    placed = Placements()
    placed.place(0, 1)                        # all placed at step 1
    stale.zero_stale(table, placed, 0, 4)
    assert list(table) == [5, 6, 7, 0]        # allocated in the step they were placed
    stale.advance(frozenset({6, 9}))          # step 2: 6 handed out again
    placed.place(len(table), 2)               # ... and placed again at step 2
    table.append(6)
    stale.zero_stale(table, placed, 0, 2)     # only the range asked for is zeroed
    assert list(table) == [5, 0, 7, 0, 6]
    stale.advance(frozenset({5}))             # step 3
    stale.zero_stale(table, placed, 0, 5)
    assert list(table) == [0, 0, 7, 0, 6]     # 7: never allocated again; 6 at 4: fresh
    stale.advance(frozenset({6}))             # step 4: 6 stale at position 4 too
    stale.zero_stale(table, placed, 4, 9)     # a range past the end is clipped
    assert list(table) == [0, 0, 7, 0, 0]
    assert len(stale.allocated_at) == 10      # grows to the largest id, no further


def test_a_layout_without_window_groups_stamps_no_ids() -> None:
    """Only window tables are ever checked for stale ids, so a scheduler over FULL groups
    alone keeps no stamps (none of the 8,192 ids a resumed request hands out), while its
    steps still count; one window group (here Mamba) turns stamping on."""
    from dataclasses import replace

    from kvcore.presets import preset
    from kvcore.scheduler import StepInput

    full = replace(preset("llama3-eagle3"), num_gpu_blocks=1 << 14)
    hybrid = replace(preset("qwen3-next-mtp"), num_gpu_blocks=1 << 14)
    for cfg, stamps in ((full, 0), (hybrid, 8192)):
        assert all(g.kind is GroupKind.FULL for g in cfg.groups) == (stamps == 0)
        s = OffloadScheduler(cfg, CPUOffloadManager.for_config(cfg))
        s.build_step(StepInput(allocated_ids=frozenset(range(1, 8193))))
        s.build_step(StepInput())
        assert s._stale.step == 2
        assert len(s._stale.allocated_at) == (stamps + 1 if stamps else 0)


@st.composite
def _placement_history(draw: st.DrawFn) -> tuple[list[tuple[frozenset[int], list[int]]],
                                                  tuple[int, int]]:
    """Steps, each allocating some ids and appending some of them (or older ones) to one
    window table; then a range to zero."""
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        allocated = frozenset(draw(st.lists(st.integers(1, 9), max_size=4)))
        appended = draw(st.lists(st.integers(0, 9), max_size=5))
        steps.append((allocated, appended))
    total = sum(len(a) for _, a in steps)
    lo = draw(st.integers(0, total + 1))
    return steps, (lo, draw(st.integers(lo, total + 2)))


@given(_placement_history())
@settings(max_examples=300, deadline=None)
def test_placement_runs_zero_what_per_position_stamps_would(
        history: tuple[list[tuple[frozenset[int], list[int]]], tuple[int, int]]) -> None:
    """The run-length placements give ``zero_stale`` the answers a stamp per position
    gives, on ranges that start and end inside runs, span several, or run past the end
    (kills: the bisection landing one run late, a run's end read from its own start,
    the next run starting one position late, a stale test of ``>=``)."""
    from array import array

    from kvcore.scheduler._state import Placements, StaleWindows

    steps, (lo, hi) = history
    stale, table, placed = StaleWindows(), array("i"), Placements()
    stamps: list[int] = []
    allocated_at: dict[int, int] = {}
    for allocated, appended in steps:
        stale.advance(allocated)
        for gpu_id in allocated:
            allocated_at[gpu_id] = stale.step
        if appended:
            placed.place(len(table), stale.step)
            table.extend(appended)
            stamps.extend([stale.step] * len(appended))
    want = [0 if lo <= pos < hi and gpu_id and allocated_at.get(gpu_id, 0) > stamps[pos]
            else gpu_id for pos, gpu_id in enumerate(table)]
    stale.zero_stale(table, placed, lo, hi)
    assert list(table) == want


def test_placements_in_one_step_share_one_run() -> None:
    """A window table placed twice in one step (appended, then appended again before the
    step ends) keeps one run for that step: a run per call would grow 16 bytes a call
    for nothing. Mutant: the new step compared with the first run's, not the last's (held-
    out seed 39 m13: every step after the first then added a run per call)."""
    from kvcore.scheduler._state import Placements

    placed = Placements()
    for first, step in ((0, 1), (4, 1), (5, 2), (6, 2), (9, 2), (10, 3)):
        placed.place(first, step)
    assert list(placed.starts) == [0, 5, 10] and list(placed.steps) == [1, 2, 3]
