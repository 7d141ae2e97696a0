"""Directed scenarios: short scripted runs, on the user's layout, for rules that random
workloads reach only rarely.

Each drives a scheduler and manager through the public hooks, with checks on, on the
layout under test shrunk to a small GPU and CPU pool; the manager runs in lock step with
the reference manager (M2). ``kvcore check`` runs them before
the random battery, so a mutant of a rarely exercised rule (a lookup while jobs are in
flight, a store issued during a load, a draft group re-verified after another group
shrinks the boundary, a hit below one chunk, PENDING read as a miss, a lookup at the
edge of its arguments, an eviction choosing several victims) is caught within the CI
budget. The lookup scenario puts crafted tier contents in front of the lookup:
the tier may hold any chunks (another engine stored them, the keep rule changed, a
store was evicted half way), and the answer must be the spec's whatever it holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import random
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

from kvcore.manager import CPUOffloadManager, cpu_capacities
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
)
from kvcore.sim._engine import SHADOW_MAX_CHUNKS, HarnessLimit
from kvcore.sim._shadow import ShadowedManager
from kvcore.sim._workload import speculative_off
from kvcore.spec.errors import BadReportError
from kvcore.spec.types import (
    MAX_GPU_BLOCKS,
    PENDING,
    GroupKind,
    OffloadConfig,
    Status,
    StoreLevel,
    cdiv,
    group_keys,
    make_key,
)

Factory = Callable[..., OffloadScheduler]

# Crafted lookups per layout, and the longest request they use (in units of every chunk
# size, or of the widest window): enough for every rule to matter, small enough for the
# spec's exhaustive hit.
LOOKUP_CASES = 120
LOOKUP_MAX_UNITS = 3
# The crafted lookups' longest request, in chunks of all groups (``request_chunks``): the
# spec's exhaustive hit, which the scheduler's check computes at every lookup, tests each
# chunk end against each group's chunks, so a case costs about the square of it. 8192
# chunks take about 30 s on a busy 2-core machine; a window reaching further is looked
# up over requests this long, where it binds no more than in the simulations' prompts
# (``kvcore._check.check_context``), instead of for hours (or, for a 2**24-token window
# of 1-token blocks, in 23 GB).
LOOKUP_MAX_CHUNKS = 8192
# What the stale-block scenario, which must see blocks leave a window, may hold: its
# requests' block hashes and GPU ids (``stale_blocks_items``), each some hundred bytes
# and ten microseconds across the scheduler, the tier and the checks: at the bound about
# 200 MB and 10 s on a busy 2-core machine. A layout whose window needs more is refused
# up front (``check_fits``) as a limit of the harness.
DIRECTED_MAX_ITEMS = 1 << 20


# Where the running scenarios add their checks' counts (``tallied``); None: nowhere.
_TALLY: ContextVar[dict[str, int] | None] = ContextVar("kvcore_scenario_tally", default=None)


@contextlib.contextmanager
def tallied(into: dict[str, int]) -> Iterator[None]:
    """Add the counts of every check the scenarios run inside this block to ``into``, so
    the battery's table includes them (the tier-churn scenario evicts on any layout)."""
    token = _TALLY.set(into)
    try:
        yield
    finally:
        _TALLY.reset(token)


def _count(checked: dict[str, int]) -> None:
    into = _TALLY.get()
    if into is not None:
        for key, n in checked.items():
            into[key] = into.get(key, 0) + n


class ScenarioFailure(AssertionError):
    """A directed scenario saw behaviour the spec forbids (outside the runtime checks);
    ``id`` is the check it stands for (``integrity``: bytes stored under a wrong key)."""

    def __init__(self, message: str, id: str = "integrity") -> None:
        super().__init__(message)
        self.id = id


def assert_true(condition: bool, message: str, id: str = "integrity") -> None:
    if not condition:
        raise ScenarioFailure(message, id)


def _hashes(n: int, salt: int = 0) -> tuple[bytes, ...]:
    # One length for every hash, as one engine's hash function gives (the scheduler
    # refuses a second length).
    return tuple(hashlib.blake2b(f"h{salt}:{i}".encode(), digest_size=16).digest()
                 for i in range(n))


def unit_tokens(cfg: OffloadConfig) -> int:
    """The smallest token count that is a whole number of every group's chunks."""
    return math.lcm(cfg.hash_block_tokens, cfg.mamba_align_tokens or 1,
                    *(g.tokens_per_chunk for g in cfg.groups))


# Units of tokens a scenario's requests hold at once, at most (two requests of a few
# units, one resumed): ``small``'s GPU pool holds this many, whatever the block size.
SCENARIO_UNITS = 16


def small(cfg: OffloadConfig, cpu: int = 4096, gpu: int | None = None) -> OffloadConfig:
    """The scenarios' config: one worker, a tier of ``cpu`` chunks per group and a GPU
    pool of ``gpu`` blocks, by default 4096 or, for large chunks, ``SCENARIO_UNITS``
    units' worth of blocks (a fixed 4096 handed out ids past the pool on a layout of
    16,384-token chunks: the harness's own bad call, reported as kvcore's X2)."""
    if gpu is None:
        unit = unit_tokens(cfg)
        need = SCENARIO_UNITS * sum(cdiv(unit, g.tokens_per_block) for g in cfg.groups) + 2
        gpu = min(max(4096, need), MAX_GPU_BLOCKS)
    return replace(cfg, num_gpu_blocks=gpu, num_cpu_blocks=cpu, num_workers=1)


def _ids(cfg: OffloadConfig, tokens: int, first: int, resume: int = 0
         ) -> tuple[tuple[int, ...], ...]:
    """Distinct GPU ids from ``first`` covering ``tokens`` in every group; a window
    group's blocks before what it needs when computing resumes at ``resume`` are null,
    as the engine leaves them."""
    out: list[tuple[int, ...]] = []
    for g in cfg.groups:
        n = cdiv(tokens, g.tokens_per_block)
        floor = 0
        if g.kind is GroupKind.SLIDING:
            floor = max(0, (resume - g.reach_tokens) // g.tokens_per_block)
        elif g.kind is GroupKind.MAMBA:
            floor = max(0, resume // g.tokens_per_block - 1)
        out.append((0,) * min(floor, n) + tuple(range(first, first + n - min(floor, n))))
        first += n
    return tuple(out)


def _allocated(tables: tuple[tuple[int, ...], ...]) -> frozenset[int]:
    """The GPU ids a step hands out for ``tables`` (its nulls are no allocation)."""
    return frozenset(i for t in tables for i in t if i)


def _checked_tier(cfg: OffloadConfig) -> CPUOffloadManager:
    """kvcore's tier for ``cfg`` (its pools, its event bound) with its own checks on, as
    an engine's with ``KVCORE_CHECK=1``, whatever the environment says.

    The lock-step scenarios compare the tier's stats with the reference's after every
    hook (R1). With the tier's checks off, a tier bug surfaced there first, as R1, where
    the tier's own check (M1, M3) would have named it at the call: on a layout with
    ``max_pending_events = 0`` a buffer that never drops was named R1 (events_dropped 0
    against the reference's 6), and the M3 canary read as a dead check."""
    return CPUOffloadManager.for_config(cfg, check=True)


def _store_ready(manager: Any, keys: list[bytes]) -> None:
    out = manager.prepare_store(keys)
    if out is not None:
        manager.complete_store(list(out.keys_to_store))


def _prefill_with_store(factory: Factory, cfg: OffloadConfig, manager: Any
                        ) -> tuple[OffloadScheduler, int, Any] | None:
    """A request of four units whose first three are prefilled: the step stores them."""
    unit = unit_tokens(cfg)
    n = 4 * unit
    sched = factory(cfg, manager, check=True)
    sched.add_request(RequestInfo("a", n, _hashes(n // cfg.hash_block_tokens)))
    sched.lookup("a", 0, n)
    ids = _ids(cfg, 3 * unit, 1)
    plan = sched.build_step(StepInput((ScheduledRequest("a", 3 * unit, 0, n, ids),),
                                      allocated_ids=_allocated(ids)))
    if not plan.stores:
        return None  # the layout stores nothing here (e.g. max_offload_tokens=0)
    return sched, 3 * unit, plan


def _report_stores(sched: Any, cfg: OffloadConfig, plan: Any) -> None:
    """Every worker reports every store job of ``plan`` as done."""
    sched.worker_output([WorkerReport(w, job.job_id) for job in plan.stores
                         for w in range(cfg.num_workers)])


def _stored_in_lock_step(factory: Factory, cfg: OffloadConfig
                         ) -> tuple[OffloadScheduler, int] | None:
    """``_prefill_with_store`` in lock step on kvcore's tier, its stores reported done:
    (scheduler, tokens stored), or None where the layout stores nothing there."""
    got = _prefill_with_store(_lockstepped(factory), cfg, _checked_tier(cfg))
    if got is None:
        return None
    sched, done, plan = got
    _report_stores(sched, cfg, plan)
    return sched, done


def _lockstepped(factory: Factory) -> Factory:
    """``factory``'s scheduler in lock step with the reference (R1 on every hook)."""
    from kvcore.sim._lockstep import paired

    def make(cfg: OffloadConfig, manager: Any, check: bool = True) -> Any:
        return paired(factory(cfg, manager, check=check), cfg)
    return make  # type: ignore[return-value]


def lookup_with_store_in_flight(factory: Factory, config: OffloadConfig) -> None:
    """J1: a preempted request asks again while its store is in flight.

    Its GPU prefix cache covers the chunks being written, so no key it reads is PENDING;
    only the job table can say "wait".
    """
    cfg = small(config)
    got = _prefill_with_store(_lockstepped(factory), cfg, ShadowedManager(cpu_capacities(cfg)))
    if got is None:
        return
    sched, done, _ = got
    # In lock step: the preemption's plan must flush the store still reading its blocks,
    # as the reference's does (R1), before the lookup is told to wait.
    sched.build_step(StepInput(preempted=("a",)))
    sched.lookup("a", done, 4 * unit_tokens(cfg))


def lookup_of_a_prefix_being_written(factory: Factory, config: OffloadConfig) -> None:
    """L2: a request looks up a prompt whose every key another request is still storing.

    Every block the lookup reads is PENDING and nothing else, the commonest case in an
    engine (two requests with one prompt, the first's prefill store in flight): the
    answer is PENDING, never a hit on keys not yet written. Crafted lookups mix PENDING
    with other statuses in most blocks they read; this one does not.
    """
    cfg = small(config, cpu=1 << 16)
    n = 4 * unit_tokens(cfg)
    hashes = _hashes(n // cfg.hash_block_tokens, salt=7)
    for computed in (0, unit_tokens(cfg)):
        manager = CPUOffloadManager.for_config(cfg, check=True)
        for group in range(len(cfg.groups)):
            manager.prepare_store(group_keys(cfg, group, hashes))
        sched = factory(cfg, manager, check=True)
        sched.add_request(RequestInfo("b", n, hashes))
        got = sched.lookup("b", computed, n)
        assert_true(got is PENDING,
                    f"a lookup of {n} tokens ({computed} computed) whose every key is "
                    f"being written answered {got!r}, not PENDING", "L2")


def reset_with_a_finished_request_storing(factory: Factory, config: OffloadConfig) -> None:
    """R1 and bounded memory: a request finishes while its prefill store is in flight and
    the engine then resets its prefix cache. The reset drops the request (the lock step
    compares the tracked requests after every hook, so one kept for good is named), the
    workers' late report for the discarded job is ignored, and a new request is served
    as by the reference."""
    cfg = small(config)
    got = _prefill_with_store(_lockstepped(factory), cfg, _checked_tier(cfg))
    if got is None:
        return
    sched, _, plan = got
    sched.request_finished("a")
    sched.reset()
    _report_stores(sched, cfg, plan)
    n = 4 * unit_tokens(cfg)
    sched.add_request(RequestInfo("b", n, _hashes(n // cfg.hash_block_tokens)))
    sched.lookup("b", 0, n)


def edge_lookups(factory: Factory, config: OffloadConfig) -> None:
    """R1 at the edges of a lookup's arguments, each valid: everything computed on the
    GPU (``computed_tokens == num_tokens``), a cap of 0 and caps at each boundary the
    stored prefix has, and none, on a second request whose prefix the tier holds (the
    first request's stored prefill); then an allocation whose every block is valid on
    the GPU, and a load from block id 1. The lock step names an edge one side refuses,
    or an answer past the cap."""
    cfg = small(config)
    got = _stored_in_lock_step(factory, cfg)
    if got is None:
        return
    sched, done = got
    unit = unit_tokens(cfg)
    n = 4 * unit
    sched.add_request(RequestInfo("b", n, _hashes(n // cfg.hash_block_tokens)))
    sched.lookup("b", n, n)
    for cap in (0, unit - 1, unit, done, n):
        sched.lookup("b", 0, n, max_tokens=cap)
    sched.lookup("b", unit, n, max_tokens=0)
    # Every block of the table valid on the GPU (valid_blocks == its length), no load.
    ids = _ids(cfg, unit, 1, resume=unit)
    sched.after_alloc("b", ids, [len(t) for t in ids], unit, 0)
    hit = sched.lookup("b", 0, n)
    if isinstance(hit, int) and hit:
        # Ids from 1, the smallest there is: the load's range starts at block 1 of the
        # first group (nothing is valid on the GPU).
        sched.after_alloc("b", _ids(cfg, hit, 1, resume=hit), [0] * len(cfg.groups), 0, hit)


def store_during_load(factory: Factory, config: OffloadConfig) -> None:
    """J1 at job creation: a request whose load is in flight is given no store job.

    The engine's GPU prefix cache holds the first unit (absent from the tier) and the
    tier the rest; the engine counts the loading request's hit as computed (vLLM does).
    At the request store level the cursor still stands at 0, so the cached unit looks
    storable: a store job now would sit beside the load. Run at both store levels.
    """
    unit = unit_tokens(config)
    n = 4 * unit
    for level in (StoreLevel.REQUEST, config.store_level):
        cfg = replace(small(config), store_level=level)
        manager = ShadowedManager(cpu_capacities(cfg))
        hashes = _hashes(n // cfg.hash_block_tokens, salt=3)
        for group, g in enumerate(cfg.groups):
            _store_ready(manager, group_keys(cfg, group, hashes)[unit // g.tokens_per_chunk:])
        sched = factory(cfg, manager, check=True)
        sched.add_request(RequestInfo("a", n, hashes))
        hit = sched.lookup("a", unit, n)
        if not isinstance(hit, int) or hit == 0:
            continue
        ids = _ids(cfg, unit + hit, 1, resume=unit + hit)
        valid = [unit // g.tokens_per_block for g in cfg.groups]
        sched.after_alloc("a", ids, valid, unit, hit)
        sched.build_step(StepInput((ScheduledRequest("a", 0, unit + hit, n, ids),),
                                   allocated_ids=_allocated(ids)))


def draft_reverified_after_shrink(factory: Factory, config: OffloadConfig) -> None:
    """E3: a draft group verified first is re-verified when a later group shrinks the
    boundary below it, extra chunk included. Every group holds four units of chunks but
    the last group in lookup order, which holds a unit less; a second lookup starts one
    unit in (the GPU prefix cache covers it)."""
    cfg = small(config)
    if not any(g.is_draft for g in cfg.groups):
        return
    from kvcore.scheduler._lookup import lookup_order
    last = lookup_order(cfg)[-1]
    unit = unit_tokens(cfg)
    n = 4 * unit + cfg.hash_block_tokens
    hashes = _hashes(n // cfg.hash_block_tokens, salt=5)
    manager = ShadowedManager(cpu_capacities(cfg))
    for group in range(len(cfg.groups)):
        keys = group_keys(cfg, group, hashes)
        if group == last:
            keys = keys[:(3 * unit) // cfg.groups[group].tokens_per_chunk]
        _store_ready(manager, keys)
    sched = factory(cfg, manager, check=True)
    sched.add_request(RequestInfo("a", n, hashes))
    sched.lookup("a", 0, n)
    sched.lookup("a", unit, n)


def window_reverified_after_shrink(factory: Factory, config: OffloadConfig) -> None:
    """L1: a window group verified at a boundary is verified again when a later group
    shrinks it. The window holds only the chunks it needs at four units; the last group
    in lookup order holds three units. At three units the window lacks the chunks before
    it, so the hit must fall below three units; a loop that kept the window's first
    verification would answer three."""
    cfg = small(config)
    from kvcore.scheduler._lookup import lookup_order
    from kvcore.scheduler._rules import needed_chunks
    order = lookup_order(cfg)
    windows = [i for i in order[:-1] if cfg.groups[i].kind is GroupKind.SLIDING
               and not cfg.groups[i].is_draft]
    if not windows:
        return
    window, last = windows[0], order[-1]
    unit = unit_tokens(cfg)
    n = 5 * unit  # room past four units for a draft group's extra chunk
    hashes = _hashes(n // cfg.hash_block_tokens, salt=9)
    manager = ShadowedManager(cpu_capacities(cfg))
    for group, g in enumerate(cfg.groups):
        keys = group_keys(cfg, group, hashes)
        if group == last:
            keys = keys[:(3 * unit) // g.tokens_per_chunk]
        elif group == window:
            need = needed_chunks(g, 4 * unit, 0)
            keys = keys[need[0]:need[1]] if need is not None else keys
        _store_ready(manager, keys)
    sched = factory(cfg, manager, check=True)
    sched.add_request(RequestInfo("a", n, hashes))
    sched.lookup("a", 0, n)


def stale_window_block_after_refused_store(factory: Factory, config: OffloadConfig) -> None:
    """Stale blocks: window blocks the engine freed and handed out again are not stored
    under their old keys, whether the store was refused (no room) and is retried, or a
    reset moved the cursor back behind them. A window too wide for the scenario's budget
    is refused (``check_fits``: ``kvcore check`` asks before its first stage)."""
    windows = [i for i, g in enumerate(config.groups) if g.kind is not GroupKind.FULL]
    if not windows:
        return
    check_fits(config)
    for refused in (True, False):
        _stale_blocks_once(factory, config, windows, refused)


# Keys the refused-store run pins in a tier just their size, so the tier is full.
STALE_PINS = 64


def stale_blocks_unit(config: OffloadConfig) -> int:
    """The stale-block scenario's unit: a whole number of every group's chunks, wider than
    every window's reach, so blocks leave the window within its three-unit request."""
    base = unit_tokens(config)
    reach = max((g.reach_tokens for g in config.groups if g.kind is not GroupKind.FULL),
                default=0)
    return base * max(1, cdiv(reach + 1, base))


def request_items(config: OffloadConfig, tokens: int) -> int:
    """What a request of ``tokens`` tokens holds in the directed scenarios, as one count:
    its block hashes and its GPU block ids in every group. Their memory and time grow
    with it."""
    return tokens // config.hash_block_tokens + sum(cdiv(tokens, g.tokens_per_block)
                                                    for g in config.groups)


def request_chunks(config: OffloadConfig, tokens: int) -> int:
    """The whole chunks of every group in a request of ``tokens`` tokens."""
    return sum(tokens // g.tokens_per_chunk for g in config.groups)


def tokens_within(config: OffloadConfig, items: int) -> int:
    """About the longest request whose ``request_items`` stay within ``items``."""
    per_token = 1 / config.hash_block_tokens + sum(1 / g.tokens_per_block
                                                   for g in config.groups)
    return int(items / per_token)


def stale_blocks_items(config: OffloadConfig) -> int:
    """An upper bound on what the stale-block scenario holds at once: its three-unit
    request's hashes and ids, the window floors of two units it computes, and the few
    pinned keys' hashes; at most the items of five units."""
    return request_items(config, 5 * stale_blocks_unit(config))


def check_fits(config: OffloadConfig) -> None:
    """Refuse, before any scenario runs, a layout whose window the stale-block scenario
    cannot move blocks out of within ``DIRECTED_MAX_ITEMS``.

    The scenario needs a request longer than the window's reach, so its cost grows with
    ``window_tokens`` over ``tokens_per_block`` and cannot be capped without testing
    nothing: a 2**24-token window of 1-token blocks asked for 23 GB and was killed. That
    is a limit of ``kvcore check``'s harness, not a fault of kvcore, so it is a
    ``HarnessLimit`` (a usage error, exit 2) that names the field, never an invariant
    failure, a crash or an out-of-memory kill."""
    windows = [i for i, g in enumerate(config.groups) if g.kind is not GroupKind.FULL]
    if not windows:
        return
    items = stale_blocks_items(config)
    if items <= DIRECTED_MAX_ITEMS:
        return
    widest = max(windows, key=lambda i: config.groups[i].reach_tokens)
    g = config.groups[widest]
    unit = stale_blocks_unit(config)
    fits = max(0, tokens_within(config, DIRECTED_MAX_ITEMS) // 5 - unit_tokens(config))
    field = "window_tokens" if g.kind is GroupKind.SLIDING else "tokens_per_block"
    raise HarnessLimit(
        f"groups[{widest}].{field}",
        f"kvcore check's stale-block scenario must see GPU blocks leave this group's "
        f"window (reach {g.reach_tokens} tokens), which takes requests of up to five "
        f"{unit}-token units: about {items} block hashes and GPU ids, past the directed "
        f"stage's fixed budget of {DIRECTED_MAX_ITEMS} (memory and time grow with it); "
        f"at these block sizes a reach of about {fits} tokens fits: check this layout "
        "with a smaller window_tokens (and extra_retained_tokens), or with larger "
        "tokens_per_block and hash_block_tokens")


def stale_blocks_gpu(config: OffloadConfig) -> int:
    """The stale-block scenario's GPU pool: every id it hands out (the first step's two
    units, then one more unit, in every group; ids from 1) and the null block, and at
    least kvcore's small pool."""
    handed_out = sum(cdiv(3 * stale_blocks_unit(config), g.tokens_per_block)
                     for g in config.groups)
    return max(4096, 1 + handed_out)


def stale_blocks_cpu(config: OffloadConfig) -> int:
    """The stale-block scenario's tier, in slots per group: every chunk of its three-unit
    request in the group with the most (after a reset the whole request is offered
    again, beside what it stored before), and at least kvcore's small tier."""
    return max(4096, max(cdiv(3 * stale_blocks_unit(config), g.tokens_per_chunk)
                         for g in config.groups))


def _stale_blocks_once(factory: Factory, config: OffloadConfig, windows: list[int],
                       refused: bool) -> None:
    unit = stale_blocks_unit(config)
    # The keys pinned to fill the tier: the first STALE_PINS of another prefix, group 0's
    # first. Its hashes stop where group 0 alone gives them all (four units' worth made a
    # window-sized unit cost four times over, for 64 keys).
    hbt = config.hash_block_tokens
    other = _hashes(min(4 * unit, STALE_PINS * config.groups[0].tokens_per_chunk) // hbt,
                    salt=9)
    pin = [k for group in range(len(config.groups))
           for k in group_keys(config, group, other)][:STALE_PINS]
    # The scenario's own pools, sized from what it hands out and stores: the unit grows
    # with the window, past kvcore's small 4096-block pool from a 16K-token window of
    # 16-token blocks on, and past its 4096-slot tier from a 32K-token one, where every
    # store was refused for room and no stale block could be offered (``stale_blocks_gpu``,
    # ``stale_blocks_cpu``). The refused run's tier is the pinned keys' own, so it is full.
    cfg = small(config, cpu=len(pin) if refused else stale_blocks_cpu(config),
                gpu=stale_blocks_gpu(config))
    # The reference manager beside kvcore's tier (M2) is quadratic by design: only for a
    # tier the size the simulator shadows too. What this scenario judges is the blocks a
    # store reads; a wider tier runs with its own checks on.
    manager: Any = ShadowedManager(cpu_capacities(cfg)) \
        if cfg.num_cpu_blocks <= SHADOW_MAX_CHUNKS else _checked_tier(cfg)
    if refused:
        _store_ready(manager, pin)
        manager.prepare_load(pin)  # the tier is full, nothing evictable: stores refused
    sched = factory(cfg, manager, check=True)
    n, total = 2 * unit, 3 * unit
    sched.add_request(RequestInfo("a", total, _hashes(total // cfg.hash_block_tokens)))
    sched.lookup("a", 0, total)
    ids = _ids(cfg, n, 1)
    first = sched.build_step(StepInput((ScheduledRequest("a", n, 0, total, ids),),
                                       allocated_ids=frozenset(i for t in ids for i in t)))
    if refused:
        manager.complete_load(pin)
    else:
        sched.worker_output([WorkerReport(0, s.job_id) for s in first.stores])
    # The engine frees the window blocks that left the window by the end of this step
    # and hands them to another request; request "a" gets fresh blocks for its next unit.
    floors = _ids(cfg, n, 0, resume=total)
    reused = frozenset(ids[i][p] for i in windows for p, b in enumerate(floors[i]) if not b)
    more = _ids(cfg, unit, 1 + sum(len(t) for t in ids))
    plans = [sched.build_step(StepInput((ScheduledRequest("a", unit, n, total, more),),
                                        allocated_ids=reused | {b for t in more for b in t}))]
    if not refused:
        # A reset moves the cursor back to 0: the next step offers every chunk again.
        sched.worker_output([WorkerReport(0, s.job_id) for s in plans[0].stores])
        sched.reset()
        plans.append(sched.build_step(StepInput((ScheduledRequest("a", 0, total, total),))))
    for plan in plans:
        for store in plan.stores:
            for group in windows:
                stale = reused & set(store.groups[group].gpu_block_ids)
                assert_true(not stale, f"group {group}: GPU blocks {sorted(stale)[:4]} were "
                            "freed and re-allocated, yet stored under their old keys")
            if sched.job_in_flight(store.job_id):
                sched.worker_output([WorkerReport(0, store.job_id)])


def finished_then_follow_ups(factory: Factory, config: OffloadConfig) -> None:
    """Integrity after finish: A is prefilled to one token short of two units, samples
    the token that completes them (it has no KV yet) and is aborted once its stores
    landed; B extends A by a unit and C shares B's extension. Every load must bring back
    the bytes a prefill computed, never a chunk stored from A's unwritten tail.

    n/a where the layout's ``max_offload_tokens`` is below B's three-unit prompt (0 above
    all: it stores nothing): what may be stored is then the layout's choice, and the
    run's loads, which the scenario demands so that its byte check is not vacuous, may
    rightly be none. From three units up the cap binds on nothing the follow-ups can
    load (C shares only B's prompt, A's two units lie inside it), so the run loads
    exactly what an uncapped one does."""
    from kvcore.sim import SimOptions, Simulator
    unit = unit_tokens(config)
    if config.max_offload_tokens is not None and config.max_offload_tokens < 3 * unit:
        return
    # The scenario's own pool, as every other stage has: the layout's num_gpu_blocks is
    # the engine's, and one too small for three units would stop the run, not test it.
    longest = 3 * unit + 16  # C: two units, one more, new tokens and draft tokens
    gpu = min(MAX_GPU_BLOCKS, max(4096, 1 + 2 * sum(cdiv(longest, g.tokens_per_block)
                                                    for g in config.groups)))
    opts = SimOptions(seed=0, requests=0, context_tokens=unit, max_new_tokens=8,
                      prefill_budget=4 * unit, max_running=1, fail_rate=0.0,
                      delay_rate=0.0, abort_rate=0.0, reset_rate=0.0, num_workers=1,
                      num_gpu_blocks=gpu, num_cpu_blocks=4096, policy="lru")
    sim = Simulator(config, opts, check=True, scheduler_factory=factory)
    try:
        a = sim.reqs[sim.add_request(sim.prompts.tokens(2 * unit - 1))]
        sim.step()
        sim.deliver_reports_now()
        sim.abort(a.request_id)
        _settle(sim)
        b = sim.reqs[sim.add_request(a.tokens + sim.prompts.tokens(unit))]
        _settle(sim)
        sim.add_request(b.tokens[:len(a.tokens) + unit] + sim.prompts.tokens(unit))
        _settle(sim)
        assert_true(sim.counters.loads_verified > 0, "follow-ups loaded nothing")
        sim.close()  # bounded: a worker that does not stop is X2, not a hang
    finally:
        sim.close(failing=True)  # a no-op once closed above


def _settle(sim: Any, limit: int = 2000) -> None:
    for _ in range(limit):
        if sim.done():
            return
        sim.step()
    raise AssertionError(f"directed run did not settle in {limit} steps")


def crafted_lookups(factory: Factory, config: OffloadConfig) -> None:
    """L1/L2/E3/E4 on crafted tier contents: every lookup answer must be the spec's.

    Each case gives every group its own covered prefix with holes and WRITING keys, a
    GPU-cached start (computed tokens) and a length, so groups shrink each other's
    boundary (re-verification, one pop per cycle), hits fall below one chunk of the
    largest group, unknown keys decide the answer or do not, and, in some cases, a
    second request is loading chunks the first would read. The settled cases (no key
    WRITING, nothing loading) come first, so a wrong hit is named by L1/E3/E4 before a
    case with unknown keys can name it by L2. A speculative layout is asked again with its
    draft groups dropped (``speculative_off``), where the rules the draft group's extra
    chunk shadows near a prompt's end (the N - 1 limit above all) decide the hit.
    """
    _crafted_lookups(factory, config)
    without = speculative_off(config)
    if without is not None:
        _crafted_lookups(factory, without)


def _crafted_lookups(factory: Factory, config: OffloadConfig) -> None:
    rng = random.Random(f"lookups:{config.name}:{len(config.groups)}")
    unit = unit_tokens(config)
    cfg = small(config, cpu=1 << 16)
    hbt = cfg.hash_block_tokens
    reach = max(g.reach_tokens + g.tokens_per_chunk for g in cfg.groups)
    longest = LOOKUP_MAX_UNITS * max(unit, reach)
    if request_chunks(cfg, longest) > LOOKUP_MAX_CHUNKS:
        # A window reaching past the budget: requests as long as the budget allows (and
        # at least the units every case needs); see LOOKUP_MAX_CHUNKS.
        per_token = sum(1 / g.tokens_per_chunk for g in cfg.groups)
        longest = max(LOOKUP_MAX_UNITS * unit, int(LOOKUP_MAX_CHUNKS / per_token))
    for case in range(LOOKUP_CASES):
        settled = case < LOOKUP_CASES // 2
        n = rng.choice([rng.randrange(1, longest) + hbt,
                        unit * rng.randrange(1, longest // unit + 2)])
        hashes = _hashes(n // hbt, salt=100 + case)
        manager = CPUOffloadManager.for_config(cfg, check=True)
        hole = rng.choice([0.0, 0.05, 0.2])
        writing = 0.0 if settled else rng.choice([0.02, 0.1, 0.3])
        for group in range(len(cfg.groups)):
            keys = group_keys(cfg, group, hashes)
            end = rng.choice([len(keys), len(keys), rng.randrange(len(keys) + 1)])
            ready: list[bytes] = []
            pending: list[bytes] = []
            for key in keys[:end]:
                r = rng.random()
                if r < hole:
                    continue
                (pending if r < hole + writing else ready).append(key)
            _store_ready(manager, ready)
            manager.prepare_store(pending)
        sched = factory(cfg, manager, check=True)
        if not settled and rng.random() < 0.4:
            _other_request_loading(sched, cfg, hashes, n)
        sched.add_request(RequestInfo("a", n, hashes))
        computed = rng.choice([0, 0, rng.randrange(0, n + 1) // hbt * hbt])
        sched.lookup("a", computed, n)


def _other_request_loading(sched: OffloadScheduler, cfg: OffloadConfig,
                           hashes: tuple[bytes, ...], n: int) -> None:
    """Request "b" with the same prefix looks up and starts loading what it hits."""
    sched.add_request(RequestInfo("b", n, hashes))
    hit = sched.lookup("b", 0, n)
    if isinstance(hit, int) and hit > 0:
        ids = _ids(cfg, hit, 1, resume=hit)
        sched.after_alloc("b", ids, [0] * len(cfg.groups), 0, hit)


# Operations per policy in the tier-churn scenario, and its tier's slots per group: small,
# so that most stores evict and several victims are chosen at once.
CHURN_OPS = 600
# The churn tier's event buffer: small, so the events it drops between its occasional
# drains keep M3's per-event check busy in the directed stage (which the canaries run,
# with however few seeds) and not only in the pressure profile's simulations.
CHURN_EVENTS = 8
CHURN_SLOTS = 6


def tier_churn(factory: Factory, config: OffloadConfig) -> None:
    """M1/M2 on a small tier of each policy under churn: stores of one to four keys into
    a full tier (several victims in one choice, where ARC moves from T1 to T2 half way),
    touches that promote keys and hit ghosts (ARC's p moves both ways), loads that pin
    (some keys twice, released one load at a time),
    failed stores, completions that also list READY, repeated and absent keys (the tier
    must leave them alone), events taken now and then from a buffer of
    ``CHURN_EVENTS`` keys (so it drops, M3), and at the end a store whose only
    evictable keys are its own. Every answer and every victim is the
    reference manager's, through the shadow; no scheduler is involved."""
    del factory  # the tier alone
    rng = random.Random(f"churn:{config.name}:{len(config.groups)}")
    keys = [make_key(hashlib.sha256(b"churn%d" % i).digest()[:16], 0) for i in range(24)]
    for policy in ("lru", "arc"):
        manager = ShadowedManager([CHURN_SLOTS] * len(config.groups), policy,
                                  max_pending_events=CHURN_EVENTS)
        pinned: list[list[bytes]] = []
        for _ in range(CHURN_OPS):
            op = rng.random()
            if op < 0.45:
                batch = rng.sample(keys, rng.randint(1, 4))
                out = manager.prepare_store(batch)
                if out is not None and out.keys_to_store:
                    done = list(out.keys_to_store)
                    if rng.random() < 0.3:
                        # A key READY before this store (first, so a tier that marks it
                        # again emits a second stored event), one listed twice, and one
                        # absent: the tier leaves all three alone.
                        absent = next(k for k in keys if manager.lookup(k) is Status.MISS)
                        done = [k for k in batch if k not in done][:1] + done + done[:1] + \
                            [absent]
                    manager.complete_store(done, rng.random() > 0.1)
            elif op < 0.75:
                manager.touch(rng.sample(keys, rng.randint(1, 6)))
            elif op < 0.9:
                ready = [k for k in rng.sample(keys, 4) if manager.lookup(k) is Status.HIT]
                if ready and not pinned:
                    # Sometimes pinned twice (two loads of one key, as two requests
                    # sharing a prefix make): the first release must keep it pinned.
                    for _ in range(rng.choice((1, 1, 2))):
                        manager.prepare_load(ready)
                        pinned.append(ready)
                elif pinned:
                    manager.complete_load(pinned.pop())
            else:
                manager.take_events()
        while pinned:
            manager.complete_load(pinned.pop())
        _nearly_all_pinned(manager, keys[:CHURN_SLOTS + 1])
        _count(manager.checked)


def _nearly_all_pinned(manager: ShadowedManager, keys: list[bytes]) -> None:
    """A full tier with all but two keys pinned by loads, then a store of those two and
    one new key: by count two keys are evictable for the one slot it needs, but both are
    the store's own (protected), so the policy's walk comes back empty-handed and the
    store is refused, a path churn alone never met (the manager's count shortcut answers
    first whenever fewer keys are unpinned). A store of the new key alone then evicts
    one of the two; every answer as the reference's."""
    fill, new = keys[:CHURN_SLOTS], keys[CHURN_SLOTS]
    out = manager.prepare_store(fill)
    if out is not None and out.keys_to_store:
        manager.complete_store(list(out.keys_to_store), True)
    ready = [k for k in fill if manager.lookup(k) is Status.HIT]
    free, held = ready[:2], ready[2:]
    if held:
        manager.prepare_load(held)
    manager.prepare_store([*free, new])
    out = manager.prepare_store([new])
    if out is not None and out.keys_to_store:
        manager.complete_store(list(out.keys_to_store), True)
    if held:
        manager.complete_load(held)


def long_hash_chain(factory: Factory, config: OffloadConfig) -> None:
    """R1 on the keys of a long hash chain. A request whose hashes arrive after its
    prompt (chunked prefill hands them over step by step) keeps them in frozen segments
    of ``SEGMENT`` hashes (``HashChain``); every other stage runs prompts short enough
    that no chain grows past its prompt's own tuple. Here one step brings two and a half
    segments of hashes: its store must offer the keys the reference derives, a second
    request with the same hashes as its prompt is served as by the reference, and so is
    the first when, preempted, it asks again over its own chain."""
    from kvcore.scheduler._state import SEGMENT
    unit, hbt = unit_tokens(config), config.hash_block_tokens
    n = (cdiv((2 * SEGMENT + SEGMENT // 2) * hbt, unit) + 1) * unit
    # A later step of three more units: its hashes land after the frozen segments, so
    # its keys are read across the last segment and the tail (a slip in where the tail
    # is cut only shows there).
    extra = 3 * unit
    ids = _ids(config, n, 1)
    blocks = 1 + sum(len(t) for t in ids)  # the next free id
    grown: list[tuple[int, ...]] = []
    for g, table in zip(config.groups, ids, strict=True):
        count = cdiv(n + extra, g.tokens_per_block) - len(table)
        grown.append(tuple(range(blocks, blocks + count)))
        blocks += count
    cfg = small(config, cpu=max(4096, 2 * blocks), gpu=blocks + 1)
    sched = _lockstepped(factory)(cfg, _checked_tier(cfg), check=True)
    hashes = _hashes((n + extra) // hbt, salt=11)
    first = unit // hbt  # the prompt's own tuple holds one unit's hashes; the rest follow
    sched.add_request(RequestInfo("a", n, hashes[:first]))
    sched.lookup("a", 0, unit)
    plan = sched.build_step(StepInput(
        (ScheduledRequest("a", n, 0, n, ids, hashes[first:n // hbt]),),
        allocated_ids=_allocated(ids)))
    _report_stores(sched, cfg, plan)
    plan = sched.build_step(StepInput(
        (ScheduledRequest("a", extra, n, n + extra, tuple(grown), hashes[n // hbt:]),),
        allocated_ids=_allocated(tuple(grown))))
    _report_stores(sched, cfg, plan)
    hashes = hashes[:n // hbt]
    sched.add_request(RequestInfo("b", n, hashes))
    sched.lookup("b", 0, n)
    # Preempted, "a" asks again: its lookup reads its own chain's segments in strides
    # (``HashChain.strided``), where its store read them key by key.
    sched.build_step(StepInput(preempted=("a",)))
    sched.lookup("a", 0, n + extra)


def failed_load_in_lock_step(factory: Factory, config: OffloadConfig) -> None:
    """X1 and R1 on a load that fails. Request "a" stores its prefill; "b", with the same
    prefix, loads it, and one worker reports the load failed. The output must name the
    failure and the scheduler's stats count it as the reference's do (an engine's
    metrics read them; the seeded runs make a few loads each, so their injected failures
    seldom meet one); then "b", given the failure, asks again and is answered as by the
    reference."""
    cfg = small(config)
    got = _stored_in_lock_step(factory, cfg)
    if got is None:
        return
    sched, _ = got
    n = 4 * unit_tokens(cfg)
    hashes = _hashes(n // cfg.hash_block_tokens)
    _other_request_loading(sched, cfg, hashes, n)
    loads = sched.build_step(StepInput()).loads
    reports = [WorkerReport(w, job.job_id, success=w != 0)
               for job in loads for w in range(cfg.num_workers)]
    # Each side on its own, so that a failure left out of the output is named X1 first
    # (what it is), and only then is the rest, stats included, held to the reference.
    pair: Any = sched  # a Lockstep
    out = pair.impl.worker_output(reports)
    assert_true(len(out.failed_loads) == len(loads),
                f"X1: {len(loads)} loads failed, the output names {len(out.failed_loads)}", "X1")
    pair.compare("worker_output", out, pair.model.worker_output(reports))
    sched.lookup("b", 0, n)


def scheduled_and_preempted(factory: Factory, config: OffloadConfig) -> None:
    """R1 on a step that schedules a request and preempts it too (an engine that preempts
    a request after scheduling it in the same step): its blocks are dropped with it and
    it stores nothing, in the C pass that applies the step's blocks as in the Python one
    (which an engine's own ScheduledRequest type takes). Each with the scheduler's own
    checks on and off (the quiet fast path)."""
    from kvcore.sim._engine import EngineScheduledRequest
    unit = unit_tokens(config)
    n = 4 * unit
    for check, kind in itertools.product((True, False),
                                         (ScheduledRequest, EngineScheduledRequest)):
        cfg = small(config)
        sched = _lockstepped(factory)(cfg, _checked_tier(cfg), check=check)
        sched.add_request(RequestInfo("a", n, _hashes(n // cfg.hash_block_tokens, salt=5)))
        sched.add_request(RequestInfo("b", n, _hashes(n // cfg.hash_block_tokens, salt=6)))
        sched.lookup("a", 0, n)
        sched.lookup("b", 0, n)
        a = _ids(cfg, 3 * unit, 1)
        b = _ids(cfg, 3 * unit, 1 + sum(len(t) for t in a))
        sched.build_step(StepInput((kind("a", 3 * unit, 0, n, a), kind("b", 3 * unit, 0, n, b)),
                                   preempted=("a",), allocated_ids=_allocated(a + b)))


def lookup_beside_another_load(factory: Factory, config: OffloadConfig) -> None:
    """R1 on a lookup while another request's load is in flight. Requests "a" and "d"
    store two different prefixes; "b" loads "a"'s, and while that load runs "c" asks for
    "d"'s: it is served as by the reference (a hit, not PENDING: only a chunk being
    loaded makes a reader wait), and so is "e" with "a"'s prefix (PENDING: the chunks it
    would read are being loaded). Engines look requests up beside running loads every
    step; the seeded runs' few loads seldom overlap a lookup."""
    n = 4 * unit_tokens(config)
    request = sum(len(t) for t in _ids(config, n, 1))  # ids a whole request may hold
    # "a" and "b" share ids from 1 (b's load fills blocks a's store has read); "d" takes
    # the ids past them: a pool of 2 requests' worth, at least kvcore's small one.
    cfg = small(config, gpu=max(4096, 2 * request + 2))
    got = _stored_in_lock_step(factory, cfg)
    if got is None:
        return
    sched, done = got
    other = _hashes(n // cfg.hash_block_tokens, salt=9)
    sched.add_request(RequestInfo("d", n, other))
    sched.lookup("d", 0, n)
    first = 1 + request  # past "a"'s and "b"'s ids
    ids = _ids(cfg, done, first)
    _report_stores(sched, cfg, sched.build_step(StepInput(
        (ScheduledRequest("d", done, 0, n, ids),), allocated_ids=_allocated(ids))))
    _other_request_loading(sched, cfg, _hashes(n // cfg.hash_block_tokens), n)
    sched.build_step(StepInput())
    sched.add_request(RequestInfo("c", n, other))
    sched.lookup("c", 0, n)
    sched.add_request(RequestInfo("e", n, _hashes(n // cfg.hash_block_tokens)))
    sched.lookup("e", 0, n)


class _ShortHashes(CPUOffloadManager):
    """kvcore's tier, its hash batch read one status short."""

    def lookup_hashes(self, hashes: Any, suffix: bytes) -> list[Status]:
        return list(super().lookup_hashes(hashes, suffix))[:-1]


class _ShortKeys(CPUOffloadManager):
    """A tier with whole keys only (no hash batches), its batch read one status short."""

    lookup_hashes = None  # type: ignore[assignment]
    touch_hashes = None  # type: ignore[assignment]

    def lookup_many(self, keys: Any) -> list[Status]:
        return list(super().lookup_many(keys))[:-1]


def short_tier_answers(factory: Factory, config: OffloadConfig) -> None:
    """A1 on a tier that answers one status short, read by hash batches and by whole
    keys: the lookup must raise ``BadReportError`` naming the call that broke the
    contract: an engine's own tier with a bug in its batch read is told which one."""
    n = 4 * unit_tokens(config)
    cfg = small(config)
    for tier, call in ((_ShortHashes, "lookup_hashes"), (_ShortKeys, "lookup_many")):
        sched = factory(cfg, tier(list(cpu_capacities(cfg))), check=True)
        sched.add_request(RequestInfo("a", n, _hashes(n // cfg.hash_block_tokens)))
        raised: BaseException | None = None
        try:
            sched.lookup("a", 0, n)
        except Exception as exc:  # judged below: which class, which call it names
            raised = exc
        assert_true(isinstance(raised, BadReportError) and call in str(raised),
                    f"a tier whose {call} answers one status short: the lookup raised "
                    f"{type(raised).__name__ if raised else 'nothing'} ({raised}), not a "
                    f"BadReportError naming {call}", "A1")


SCENARIOS: tuple[Callable[[Factory, OffloadConfig], None], ...] = (
    lookup_with_store_in_flight,
    lookup_of_a_prefix_being_written,
    reset_with_a_finished_request_storing,
    edge_lookups,
    store_during_load,
    draft_reverified_after_shrink,
    window_reverified_after_shrink,
    stale_window_block_after_refused_store,
    finished_then_follow_ups,
    crafted_lookups,
    tier_churn,
    long_hash_chain,
    failed_load_in_lock_step,
    scheduled_and_preempted,
    lookup_beside_another_load,
    short_tier_answers,
)


def run_scenarios(config: OffloadConfig, factory: Any = None) -> None:
    """Run every scenario on ``config``; the first failure propagates."""
    for scenario in SCENARIOS:
        scenario(factory or OffloadScheduler, config)
