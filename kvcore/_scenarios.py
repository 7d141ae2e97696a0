"""Directed scenarios: short scripted runs for rules random workloads reach only rarely.

Each drives a scheduler and manager through the public hooks, with checks on, on a tiny
layout of its own. ``kvcore check`` runs them before the random battery, so a mutant of a
rarely exercised rule (a lookup while jobs are in flight, a draft group re-verified after
another group shrinks the boundary) is still caught within the CI budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
)
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, make_key

Factory = Callable[..., OffloadScheduler]


def _hashes(n: int, salt: int = 0) -> tuple[bytes, ...]:
    return tuple(f"h{salt}:{i}".encode() for i in range(n))


def _store_ready(manager: CPUOffloadManager, keys: list[bytes]) -> None:
    out = manager.prepare_store(keys)
    if out is not None:
        manager.complete_store(list(out.keys_to_store))


def lookup_with_store_in_flight(factory: Factory) -> None:
    """J1: a preempted request asks again while its store is in flight.

    Its GPU prefix cache covers the chunks being written, so no key it reads is PENDING;
    only the job table can say "wait".
    """
    cfg = OffloadConfig((GroupSpec(GroupKind.FULL, 16),), hash_block_tokens=16,
                        num_gpu_blocks=64, num_cpu_blocks=32)
    sched = factory(cfg, CPUOffloadManager(32, check=True), check=True)
    sched.add_request(RequestInfo("a", 64, _hashes(4)))
    sched.lookup("a", 0, 64)
    plan = sched.build_step(StepInput((ScheduledRequest("a", 32, 0, 64, ((1, 2),)),),
                                      allocated_ids=frozenset({1, 2})))
    assert_true(bool(plan.stores), "the first prefill chunk should be stored")
    sched.build_step(StepInput(preempted=("a",)))
    sched.lookup("a", 32, 64)


def draft_reverified_after_shrink(factory: Factory) -> None:
    """E3: a draft group verified first is re-verified when a later group shrinks the
    boundary below it, extra chunk included."""
    groups = (GroupSpec(GroupKind.FULL, 16, is_draft=True), GroupSpec(GroupKind.MAMBA, 16))
    cfg = OffloadConfig(groups, hash_block_tokens=16, num_gpu_blocks=64, num_cpu_blocks=64,
                        speculative=True)
    manager = CPUOffloadManager(64, check=True)
    sched = factory(cfg, manager, check=True)
    hashes = _hashes(8)
    _store_ready(manager, [make_key(h, 0) for h in hashes])
    _store_ready(manager, [make_key(hashes[i], 1) for i in (0, 1, 2, 3, 4)])
    sched.add_request(RequestInfo("a", 128, hashes))
    sched.lookup("a", 0, 128)


def stale_window_block_after_refused_store(factory: Factory) -> None:
    """Stale blocks: a window chunk whose store was refused (no room) is not stored later
    from a block the engine has since re-allocated."""
    groups = (GroupSpec(GroupKind.FULL, 4), GroupSpec(GroupKind.SLIDING, 4, window_tokens=4))
    cfg = OffloadConfig(groups, hash_block_tokens=4, num_gpu_blocks=16, num_cpu_blocks=4)
    manager = CPUOffloadManager(4, check=True)
    sched = factory(cfg, manager, check=True)
    _store_ready(manager, [make_key(h, 0) for h in _hashes(4, salt=9)])
    pin = [make_key(h, 0) for h in _hashes(4, salt=9)]
    manager.prepare_load(pin)
    sched.add_request(RequestInfo("a", 8, _hashes(2)))
    sched.lookup("a", 0, 8)
    sched.build_step(StepInput((ScheduledRequest("a", 8, 0, 8, ((1, 2), (3, 4))),),
                               allocated_ids=frozenset({1, 2, 3, 4})))
    manager.complete_load(pin)
    plan = sched.build_step(StepInput((ScheduledRequest("a", 1, 8, 9, ((5,), (5,))),),
                                      allocated_ids=frozenset({3, 5})))
    for store in plan.stores:
        window = store.groups[1]
        assert_true(3 not in window.gpu_block_ids,
                    "GPU block 3 was freed and re-allocated, yet stored under its old key")
        sched.worker_output([WorkerReport(0, store.job_id)])


class ScenarioFailure(AssertionError):
    """A directed scenario saw behaviour the spec forbids (outside the runtime checks)."""


def assert_true(condition: bool, message: str) -> None:
    if not condition:
        raise ScenarioFailure(message)


SCENARIOS: tuple[Callable[[Factory], None], ...] = (
    lookup_with_store_in_flight,
    draft_reverified_after_shrink,
    stale_window_block_after_refused_store,
)


def run_scenarios(factory: Any = None) -> None:
    """Run every scenario; the first failure propagates."""
    for scenario in SCENARIOS:
        scenario(factory or OffloadScheduler)
