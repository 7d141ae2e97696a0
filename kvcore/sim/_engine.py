"""A deterministic engine: the worked example of wiring kvcore into an inference engine.

Per step, in the order a real engine runs them: deliver the workers' (late) reports, free
blocks that left a window, schedule running requests (decode first, then chunked
prefill) and admit waiting ones (lookup, allocate, ``after_alloc``), ``build_step``,
wait for the flushed jobs, start loads, run the "forward pass" (write KV), start stores,
sample tokens. Every GPU block's bytes are a function of its prefix, so a wrong load is
caught when it completes; with checks on, every hook also checks the spec's invariants.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore._checks import FAILING_CLOSE_SECONDS, JOB_SECONDS, enforce
from kvcore.manager import CPUOffloadManager, cpu_capacities
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
)
from kvcore.sim import _kv
from kvcore.sim._hostile import Hostile
from kvcore.sim._lockstep import paired
from kvcore.sim._shadow import KeysOnlyTier, ShadowedManager
from kvcore.sim._workload import PromptSource, SimOptions, speculative_off
from kvcore.spec.errors import ConfigError, KVCoreError
from kvcore.spec.invariants import FailureRecord, TransferOutcomeRecord
from kvcore.spec.plans import TransferPlan, sub_block_position
from kvcore.spec.types import GroupKind, OffloadConfig, Status, cdiv
from kvcore.transfer import TransferEngine
from kvcore.transfer._stream import NO_FAULT, injected_fault

# The largest CPU tier (in chunks) the simulator shadows with the reference manager.
SHADOW_MAX_CHUNKS = 8192
# The simulator's GPU pool, in bytes. Its blocks hold only the byte check's pattern
# (``layers`` x ``row_elems`` int64s per block and group), but torch allocates and zeroes
# all of them up front: 64 groups of 2**24 blocks (both within their limits) asked for
# 64 GiB and crashed. 2 GiB holds the largest pool num_gpu_blocks allows (2**24 blocks)
# for two groups.
SIM_MAX_GPU_BYTES = 2 << 30


class IntegrityError(AssertionError):
    """A loaded block does not hold the bytes of the prefix it was loaded for."""


class NotSettled(RuntimeError):
    """A run still had requests or jobs after ``max_steps`` steps: a liveness failure
    (``kvcore`` exit code 3), not a crash."""


@dataclass(frozen=True)
class EngineScheduledRequest(ScheduledRequest):
    """An engine's own ScheduledRequest type (``SimOptions.own_step_type``): served the
    same as kvcore's, through the Python path."""


@dataclass
class SimRequest:
    """The engine's view of one request."""

    index: int
    request_id: str
    tokens: list[int]
    prompt_len: int
    max_new: int
    hashes: list[bytes] = field(default_factory=list)
    state: str = "waiting"
    computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    final_upto: list[int] = field(default_factory=list)
    freed_upto: list[int] = field(default_factory=list)
    load_boundary: int = 0
    store_cap: int | None = None  # RequestInfo.max_offload_tokens
    abort_pending: bool = False
    # Preempted and not scheduled since: its next step re-sends the whole table with
    # ``resumed`` set, as an engine resuming a preempted request does.
    resumed: bool = False
    # Hashes of tokens sampled since its last step, sent in the next step's
    # ``ScheduledRequest.new_hashes`` (when the request was drawn to send them that way).
    step_hashes: bool = False
    unsent: list[bytes] = field(default_factory=list)


@dataclass
class SimCounters:
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    preemptions: int = 0
    resets: int = 0
    prompt_tokens: int = 0
    loaded_tokens: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    loads_verified: int = 0
    blocks_verified: int = 0


class HarnessLimit(ConfigError):
    """The simulator cannot serve the layout with its own options: a pool too small for
    one request, or options the layout refuses. A limit of the harness, not kvcore
    refusing an engine's call, so ``kvcore check`` reports it as a crash (never X2)."""


def request_blocks(config: OffloadConfig, opts: SimOptions) -> int:
    """An upper bound on the GPU blocks one simulated request holds at once: a FULL
    group's whole table; a window group's blocks from its reach before the step to the
    step's end, twice over (its floor trails the computed tokens by a step or two). The
    longest request: the context, a shared prefix's extra tokens (< 32), or an aligned
    prompt padded up to one whole chunk and a token (``PromptSource.aligned``: past the
    context where a chunk is longer), then the new tokens and a few draft tokens."""
    prompt = opts.context_tokens + 32
    if opts.aligned_prompt_rate:
        prompt = max(prompt, max(g.tokens_per_chunk for g in config.groups) + 1)
    tokens = prompt + opts.max_new_tokens + 8
    total = 0
    for g in config.groups:
        whole = cdiv(tokens, g.tokens_per_block)
        if g.kind is GroupKind.FULL or not g.window_tokens:
            total += whole
        else:
            span = g.window_tokens + g.extra_retained_tokens + opts.prefill_budget + \
                2 * g.tokens_per_chunk
            total += min(whole, 2 * cdiv(span, g.tokens_per_block))
    return total


def two_request_pool(config: OffloadConfig, opts: SimOptions) -> int:
    """The GPU pool ``opts`` asks for, raised where needed to hold two of its requests at
    once (``request_blocks``): the fixed pools of ``kvcore check`` are sized for blocks of
    16 tokens or so, and with 1-token blocks one request needed more than all of one."""
    pool = opts.num_gpu_blocks or config.num_gpu_blocks
    return max(pool, 2 * request_blocks(config, opts) + 1)


def check_gpu_pool(config: OffloadConfig, options: SimOptions) -> None:
    """Refuse, before torch allocates it, a GPU pool past ``SIM_MAX_GPU_BYTES``: a
    ``HarnessLimit`` (exit 2) naming the size and the most blocks that fit, not torch's
    out-of-memory error from deep inside the set-up (a crash, exit 4)."""
    elem = torch.iinfo(torch.int64).bits // 8  # the pool's dtype (``Simulator.gpu``)
    per_block = len(config.groups) * options.layers * options.row_elems * elem
    need = config.num_gpu_blocks * per_block
    if need > SIM_MAX_GPU_BYTES:
        raise HarnessLimit("num_gpu_blocks", f"the simulator's GPU pool of "
                           f"{config.num_gpu_blocks} blocks x {len(config.groups)} groups x "
                           f"{per_block // len(config.groups)} bytes (its {options.layers} "
                           f"layers' pattern) would take {need} bytes, past its limit of "
                           f"{SIM_MAX_GPU_BYTES} ({SIM_MAX_GPU_BYTES >> 30} GiB); lower "
                           f"num_gpu_blocks to at most {SIM_MAX_GPU_BYTES // per_block} for "
                           "this layout (the simulator needs only the blocks its requests "
                           "hold at once)")


def _check_device(device: object) -> None:
    """``cpu``, or ``cuda``/``cuda:N`` where torch has that device: said here, not by
    torch's own error halfway through setting up."""
    if device == "cpu":
        return
    if not isinstance(device, str) or not (device == "cuda" or device.startswith("cuda:")):
        raise ConfigError("device", f"device={device!r}: use 'cpu' or 'cuda' ('cuda:N')")
    index = 0 if device == "cuda" else device[5:]
    if not (isinstance(index, int) or index.isdigit()):
        raise ConfigError("device", f"device={device!r}: use 'cpu' or 'cuda' ('cuda:N')")
    if not torch.cuda.is_available() or int(index) >= torch.cuda.device_count():
        raise ConfigError("device", f"device={device!r}, but torch sees "
                          f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
                          " CUDA devices; use device='cpu'")


class Simulator:
    """Runs one seeded workload through the real scheduler, manager and transfer engine."""

    def __init__(self, config: OffloadConfig, options: SimOptions, *,
                 check: bool = True, device: str = "cpu",
                 scheduler_factory: Any = None) -> None:
        if not isinstance(config, OffloadConfig):
            raise ConfigError("config", f"is a {type(config).__name__}; pass an OffloadConfig "
                              "(kvcore.presets.preset or kvcore.load_config)")
        if not isinstance(options, SimOptions):
            raise ConfigError("options", f"is a {type(options).__name__}; pass a SimOptions")
        _check_device(device)
        self.options = opts = options.drawn()
        overrides: dict[str, Any] = {"num_workers": opts.num_workers}
        if opts.prompt_only:
            overrides["prompt_only"] = True
        if opts.max_offload_tokens is not None:
            # The tighter of the two caps: a layout's own cap stays when it is smaller (the
            # option used to be dropped whenever the layout had one).
            mine = config.max_offload_tokens
            overrides["max_offload_tokens"] = (opts.max_offload_tokens if mine is None
                                               else min(mine, opts.max_offload_tokens))
        if opts.num_gpu_blocks is not None:
            overrides["num_gpu_blocks"] = opts.num_gpu_blocks
        if opts.num_cpu_blocks is not None:
            overrides["num_cpu_blocks"] = opts.num_cpu_blocks
        if opts.max_pending_events is not None:
            overrides["max_pending_events"] = opts.max_pending_events
        from dataclasses import replace
        if opts.speculative_off:
            config = speculative_off(config) or config
        try:
            self.config = cfg = replace(config, **overrides)
        except ConfigError as exc:
            raise HarnessLimit(exc.field, f"the simulator's options do not fit this layout: "
                               f"{exc}") from exc
        check_gpu_pool(cfg, opts)
        self.rng = random.Random(f"sim:{opts.seed}")
        policy = opts.policy or "lru"
        # With checks on, the tier runs in lock step with the reference manager (M2); the
        # reference is quadratic by design, so only for tiers the size kvcore check uses.
        shadow = check and cfg.num_cpu_blocks <= SHADOW_MAX_CHUNKS
        tier = KeysOnlyTier if opts.keys_only_tier else ShadowedManager
        self.manager: Any = tier(cpu_capacities(cfg), policy, check=True,
                                 max_pending_events=cfg.max_pending_events) \
            if shadow else CPUOffloadManager.for_config(cfg, policy, check=check)
        # Checks the simulator makes itself, outside the code under test (X1, X2, R1).
        self.checked: dict[str, int] = {}
        factory = scheduler_factory or OffloadScheduler
        self.scheduler: OffloadScheduler = factory(cfg, self.manager, check=check)
        if opts.lockstep:
            self.scheduler = paired(self.scheduler, cfg, self.checked)  # type: ignore[assignment]
        if opts.hostile:
            self.scheduler = Hostile(  # type: ignore[assignment]
                self.scheduler, random.Random(f"hostile:{opts.seed}"), self.checked)
        self.gpu = [[torch.zeros((cfg.num_gpu_blocks, opts.row_elems), dtype=torch.int64,
                                 device=device) for _ in range(opts.layers)]
                    for _ in cfg.groups]
        stream = opts.seed % (1 << 64) if opts.simulate_stream and device == "cpu" else None
        # Injected device errors: which jobs fail is the seed's and the job id's to say
        # (``injected_fault``), so the check below knows without asking the engine.
        self._stream_seed = stream or 0
        self._fault_rate = opts.stream_fault_rate if stream is not None else 0.0
        self.transfer = TransferEngine(cfg, self.gpu, simulate_stream=stream,
                                       simulate_faults=self._fault_rate)
        self.free_ids: list[int] = list(range(cfg.num_gpu_blocks - 1, 0, -1))
        self.prompts = PromptSource(self.rng, opts.context_tokens, opts.shared_prefix_rate,
                                    opts.aligned_prompt_rate,
                                    max(g.tokens_per_chunk for g in cfg.groups))
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.reqs: dict[str, SimRequest] = {}
        self.reports: list[tuple[int, WorkerReport]] = []
        self.load_plans: dict[int, TransferPlan] = {}
        self.counters = SimCounters()
        self.created = 0
        self.step_no = 0
        self.spec_tokens = opts.spec_tokens if cfg.speculative else 0
        self.store_plans: dict[int, TransferPlan] = {}
        self.failed_jobs: set[int] = set()
        self.force_preempt: set[str] = set()
        self.requeued: list[str] = []
        self.check = check
        for _ in range(min(opts.requests, opts.max_running + 2)):
            self.add_request()

    # -- requests ------------------------------------------------------------------------

    def add_request(self, tokens: list[int] | None = None) -> str:
        """A new request (a fresh prompt with a shared prefix unless ``tokens`` given)."""
        tokens = self.prompts.prompt() if tokens is None else tokens
        idx = self.created
        self.created += 1
        req = SimRequest(idx, f"r{idx}", list(tokens), len(tokens),
                         self.rng.randrange(1, self.options.max_new_tokens + 1))
        self._reset_tables(req)
        hbt = self.config.hash_block_tokens
        req.hashes = _kv.chain_hashes(req.tokens, 0, b"", hbt, len(req.tokens) // hbt)
        cap = None
        if self.options.request_cap_rate and self.rng.random() < self.options.request_cap_rate:
            cap = self.rng.randrange(0, req.prompt_len + 1)
        req.store_cap = cap
        req.step_hashes = bool(self.options.step_hashes_rate) and \
            self.rng.random() < self.options.step_hashes_rate
        rate = self.options.skip_reading_rate
        skip = bool(rate) and self.rng.random() < rate
        self.scheduler.add_request(RequestInfo(req.request_id, req.prompt_len,
                                               tuple(req.hashes), max_offload_tokens=cap,
                                               skip_reading=skip))
        self.reqs[req.request_id] = req
        self.waiting.append(req)
        self.counters.prompt_tokens += req.prompt_len
        return req.request_id

    def _reset_tables(self, req: SimRequest) -> None:
        n = len(self.config.groups)
        req.tables = [[] for _ in range(n)]
        req.final_upto = [0] * n
        req.freed_upto = [0] * n

    def _floor(self, group: int, resume: int) -> int:
        """First block position a group still needs when computation resumes at ``resume``."""
        g = self.config.groups[group]
        if g.kind is GroupKind.SLIDING:
            return max(0, (resume - g.reach_tokens) // g.tokens_per_block)
        if g.kind is GroupKind.MAMBA:
            return max(0, resume // g.tokens_per_block - 1)
        return 0

    def _free_blocks(self, req: SimRequest, group: int, upto: int) -> None:
        table = req.tables[group]
        for pos in range(req.freed_upto[group], min(upto, len(table))):
            if table[pos]:
                self.free_ids.append(table[pos])
                table[pos] = 0
        req.freed_upto[group] = max(req.freed_upto[group], upto)

    def _release(self, req: SimRequest) -> None:
        for group in range(len(self.config.groups)):
            self._free_blocks(req, group, len(req.tables[group]))
        self._reset_tables(req)

    def _allocate(self, req: SimRequest, upto_tokens: int, resume: int,
                  allocated: set[int]) -> list[tuple[int, ...]] | None:
        """Extend every table to cover ``upto_tokens``; None (nothing taken) if the pool is dry."""
        plan: list[tuple[int, int]] = []
        need = 0
        for group, g in enumerate(self.config.groups):
            start, end = len(req.tables[group]), cdiv(upto_tokens, g.tokens_per_block)
            floor = self._floor(group, resume)
            plan.append((start, end))
            need += sum(1 for pos in range(start, end) if pos >= floor)
        if need > len(self.free_ids):
            return None
        new: list[tuple[int, ...]] = []
        for group, (start, end) in enumerate(plan):
            floor = self._floor(group, resume)
            ids = tuple(self.free_ids.pop() if pos >= floor else 0 for pos in range(start, end))
            allocated.update(i for i in ids if i)
            req.tables[group].extend(ids)
            req.freed_upto[group] = max(req.freed_upto[group], min(floor, end))
            new.append(ids)
        return new

    def _check_servable(self, req: SimRequest, upto_tokens: int, resume: int) -> None:
        """Refuse a pool too small for ``req`` alone, which no preemption can cure: it would
        be admitted, preempted and re-admitted until ``max_steps`` (20,000 steps of nothing).
        The count is what ``_allocate`` must hold at once: every table position from the
        group's floor to ``upto_tokens``, whoever holds the rest of the pool."""
        alone = sum(cdiv(upto_tokens, g.tokens_per_block) - min(
            self._floor(group, resume), cdiv(upto_tokens, g.tokens_per_block))
            for group, g in enumerate(self.config.groups))
        usable = self.config.num_gpu_blocks - 1
        if alone > usable:
            raise HarnessLimit("num_gpu_blocks", f"request {req.request_id} needs {alone} GPU "
                              f"blocks at once at token {upto_tokens} ({len(self.config.groups)}"
                              f" groups), more than the pool's {usable} (block 0 is the null "
                              "block); raise num_gpu_blocks, or shorten the prompts "
                              "(--context) and --max-new-tokens")

    # -- the step ------------------------------------------------------------------------

    def done(self) -> bool:
        return not (self.waiting or self.running or self.reports or self.load_plans
                    or self.scheduler.has_pending_work())

    def run(self) -> SimCounters:
        """Step until every request finished and every job settled (bounded)."""
        while not self.done():
            if self.step_no >= self.options.max_steps:
                raise NotSettled(f"simulation did not settle in {self.options.max_steps} "
                                 "steps (liveness)")
            self.step()
        self.close()
        return self.counters

    def close(self, failing: bool = False) -> None:
        """Close the transfer engine within ``JOB_SECONDS``. A worker that does not stop
        is X2 with checks on (a valid plan never carried out), named instead of hanging
        the run; after another failure (``failing``) it is left behind, and nothing close
        raises hides that failure."""
        if failing:
            with contextlib.suppress(Exception):
                self.transfer.close(timeout=FAILING_CLOSE_SECONDS)
            return
        try:
            self.transfer.close(timeout=JOB_SECONDS)
        except TimeoutError as exc:
            if not self.check:
                raise
            late = self.transfer.in_flight() or [-1]
            enforce([TransferOutcomeRecord(job, 1, False, 0, f"close: {exc}") for job in late],
                    self.checked)

    def step(self) -> None:
        self.step_no += 1
        self.counters.steps += 1
        self._deliver_reports()
        self._maybe_reset()
        if self.options.preempt_rate and self.running \
                and self.rng.random() < self.options.preempt_rate:
            self.preempt(self.rng.choice(self.running).request_id)
        if self.options.events_rate and self.rng.random() < self.options.events_rate:
            self.scheduler.take_events()
        allocated: set[int] = set()
        scheduled: list[tuple[SimRequest, int, tuple[tuple[int, ...], ...]]] = []
        preempted: list[str] = [r for r in self.requeued if self.reqs[r].state != "done"]
        self.requeued.clear()
        self._free_out_of_window()
        self._schedule_running(scheduled, preempted, allocated)
        self._admit(scheduled, allocated, preempted)
        # A request that got no block this step is sent with no block lists at all, as an
        # engine whose step output has none for it does (both forms mean "nothing new").
        kind = EngineScheduledRequest if self.options.own_step_type else ScheduledRequest
        step = StepInput(tuple(kind(r.request_id, n, r.computed, len(r.tokens),
                                    ids if any(ids) or r.resumed else (),
                                    tuple(r.unsent), resumed=r.resumed)
                               for r, n, ids in scheduled),
                         tuple(preempted), frozenset(allocated))
        for r, _, _ in scheduled:
            r.resumed = False
        plan = self.scheduler.build_step(step)
        for r, _, _ in scheduled:
            r.unsent.clear()
        self._wait(plan.flush)
        for load in plan.loads:
            self._submit(load)
        for r, n, _ in scheduled:
            self._forward(r, n)
        frontiers = {r.request_id: min(r.computed + n, len(r.tokens)) for r, n, _ in scheduled}
        for store in plan.stores:
            if self.check:
                self._check_storable(store, frontiers.get(store.request_id))
            self.store_plans[store.job_id] = store
            self._submit(store)
        for r, n, _ in scheduled:
            self._sample(r, n)
        self._collect()
        self._maybe_abort()

    def _free_out_of_window(self) -> None:
        for req in self.running:
            for group, g in enumerate(self.config.groups):
                if g.kind is not GroupKind.FULL:
                    self._free_blocks(req, group, self._floor(group, req.computed))

    def _schedule_running(self, scheduled: list[Any], preempted: list[str],
                          allocated: set[int]) -> None:
        budget = self.options.prefill_budget
        for req in list(self.running):
            if req.request_id in self.force_preempt and req.state == "running":
                self._preempt(req, preempted)
        self.force_preempt.clear()
        for req in list(self.running):
            if req.state != "running":
                continue
            remaining = len(req.tokens) - req.computed
            if remaining > 1:
                n = self._prefill_size(remaining, budget)
                if n <= 0:
                    continue
                budget -= n
                upto = req.computed + n
            else:
                n = 1 + self.spec_tokens
                upto = req.computed + n
            ids = self._allocate(req, upto, req.computed, allocated)
            while ids is None and self._preempt_one(req, preempted, scheduled):
                ids = self._allocate(req, upto, req.computed, allocated)
            if ids is None:
                self._check_servable(req, upto, req.computed)
                self._preempt(req, preempted)
                continue
            scheduled.append((req, n, tuple(ids)))

    def _prefill_size(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        align = self.config.mamba_align_tokens
        if align is not None and n < remaining:
            n -= n % align
        return n

    def _preempt_one(self, keep: SimRequest, preempted: list[str],
                     scheduled: list[Any]) -> bool:
        """Preempt the newest other running request to free its blocks. One already
        scheduled this step leaves the step (an engine unschedules it: its blocks are
        gone, so the step must not name them)."""
        for victim in reversed(self.running):
            if victim is not keep and victim.state == "running" \
                    and victim.request_id not in preempted:
                scheduled[:] = [entry for entry in scheduled if entry[0] is not victim]
                self._preempt(victim, preempted)
                return True
        return False

    def _preempt(self, req: SimRequest, preempted: list[str]) -> None:
        if req.unsent:  # its next lookup reads them: they cannot wait for a step
            self.scheduler.add_hashes(req.request_id, list(req.unsent))
            req.unsent.clear()
        self.counters.preemptions += 1
        preempted.append(req.request_id)
        req.resumed = True
        self._release(req)
        req.computed = 0
        req.state = "waiting"
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _admit(self, scheduled: list[Any], allocated: set[int], preempted: list[str]) -> None:
        for req in list(self.waiting):
            if len(self.running) >= self.options.max_running:
                return
            if req.request_id in preempted:
                continue  # preempted this step: it waits at least one step
            cached = self._gpu_cached(req)
            cap = self._lookup_cap(req, cached)
            if cap is None:  # no keyword: the bug zoo's lookups take no cap
                hit = self.scheduler.lookup(req.request_id, cached, len(req.tokens))
            else:
                hit = self.scheduler.lookup(req.request_id, cached, len(req.tokens),
                                            max_tokens=cap)
            if not isinstance(hit, int):
                continue
            resume = cached + hit
            first = self._prefill_size(len(req.tokens) - cached, self.options.prefill_budget)
            upto = resume if hit else cached + max(first, 1)
            ids = self._allocate(req, upto, resume, allocated)
            if ids is None:
                self._check_servable(req, upto, resume)
                return
            self.waiting.remove(req)
            self.running.append(req)
            self._fill_cached(req, cached)
            req.computed = cached
            valid = [cached // g.tokens_per_block for g in self.config.groups]
            plan = self.scheduler.after_alloc(req.request_id, req.tables, valid, cached, hit)
            if plan is not None:
                req.state = "loading"
                req.load_boundary = resume
                self.load_plans[plan.job_id] = plan
                scheduled.append((req, 0, tuple(ids)))
                continue
            req.state = "running"
            scheduled.append((req, first, tuple(ids)))

    def _gpu_cached(self, req: SimRequest) -> int:
        """Tokens the engine's own GPU prefix cache covers at admission (drawn per request):
        a multiple of every block and chunk size, below the last token."""
        rate = self.options.gpu_cache_rate
        if not rate or self.rng.random() >= rate:
            return 0
        unit = math.lcm(self.config.hash_block_tokens, self.config.mamba_align_tokens or 1,
                        *(g.tokens_per_chunk for g in self.config.groups))
        return unit * self.rng.randrange(0, (len(req.tokens) - 1) // unit + 1)

    def _lookup_cap(self, req: SimRequest, cached: int) -> int | None:
        """The cap this admission's lookup passes (drawn per lookup), or None: no cap."""
        rate = self.options.lookup_cap_rate
        if not rate or self.rng.random() >= rate:
            return None
        return self.rng.randrange(0, len(req.tokens) - cached + 1)

    def _fill_cached(self, req: SimRequest, cached: int) -> None:
        """The GPU-cached blocks hold their final bytes, as the engine computed them."""
        hbt = self.config.hash_block_tokens
        for group, g in enumerate(self.config.groups):
            end = cached // g.tokens_per_block
            table = req.tables[group]
            for pos in range(end):
                if table[pos]:
                    prefix = req.hashes[(pos + 1) * g.tokens_per_block // hbt - 1]
                    for layer, t in enumerate(self.gpu[group]):
                        t[table[pos]].fill_(_kv.final_value(prefix, group, layer))
            req.final_upto[group] = end

    # -- the forward pass and sampling ------------------------------------------------------

    def _forward(self, req: SimRequest, n: int) -> None:
        """Write KV for the step: final bytes for finished blocks, junk for the rest.

        A draft group's chunk at the write frontier is rewritten by the drafter every
        step, so it holds junk until the frontier has moved a whole chunk past it.
        """
        if n == 0:
            return
        frontier = min(req.computed + n, len(req.tokens))
        written = req.computed + n
        hbt = self.config.hash_block_tokens
        for group, g in enumerate(self.config.groups):
            tpb = g.tokens_per_block
            final_end = frontier // tpb
            if g.is_draft:
                final_end = min(final_end, max(frontier // g.tokens_per_chunk - 1, 0)
                                * g.blocks_per_chunk)
            table = req.tables[group]
            for pos in range(req.final_upto[group], final_end):
                if table[pos]:
                    prefix = req.hashes[(pos + 1) * tpb // hbt - 1]
                    for layer, t in enumerate(self.gpu[group]):
                        t[table[pos]].fill_(_kv.final_value(prefix, group, layer))
            req.final_upto[group] = max(req.final_upto[group], final_end)
            junk = _kv.junk_value(self.step_no, req.index, group)
            for pos in range(final_end, min(cdiv(written, tpb), len(table))):
                if table[pos]:
                    for t in self.gpu[group]:
                        t[table[pos]].fill_(junk)
            # Rewritten positions are not final any more (a drafter may rewrite a chunk that
            # a load had just filled); they are finalised again once the frontier passes.
            req.final_upto[group] = min(req.final_upto[group], final_end)

    def _check_storable(self, store: TransferPlan, frontier: int | None) -> None:
        """From outside: a store holds only chunks inside the storable prefix U (the
        frontier capped by prompt_only, max_offload_tokens and the request's own cap), and
        only for a request scheduled this step. Beyond U the engine asked for nothing to
        be kept (a decode cache, a budget), so such a chunk is a broken promise."""
        req = self.reqs[store.request_id]
        if frontier is None:
            raise IntegrityError(f"store job {store.job_id} for request {req.request_id}, "
                                 "which was not scheduled this step")
        cfg = self.config
        limit = min(frontier, req.store_cap if req.store_cap is not None else frontier,
                    cfg.max_offload_tokens if cfg.max_offload_tokens is not None else frontier,
                    req.prompt_len if cfg.prompt_only else frontier)
        for group, gt in enumerate(store.groups):
            if not gt.gpu_block_ids:
                continue
            g = cfg.groups[group]
            end = (gt.block_index + len(gt.gpu_block_ids)) * g.tokens_per_block
            if end > limit:
                raise IntegrityError(f"store job {store.job_id} group {group} holds tokens up "
                                     f"to {end}, beyond the storable prefix U={limit} of "
                                     f"request {req.request_id}")

    def _sample(self, req: SimRequest, n: int) -> None:
        if n == 0 or req.state != "running":
            return
        if req.computed + n < len(req.tokens):
            req.computed += n
            return
        decoding = len(req.tokens) - req.computed == 1 and n > 1
        accepted = sum(1 for _ in range(n - 1) if self.rng.random() < self.options.accept_rate) \
            if decoding else 0
        new = self.prompts.tokens(1 + accepted)
        req.computed = len(req.tokens) + accepted
        req.tokens.extend(new)
        hbt = self.config.hash_block_tokens
        have = len(req.hashes)
        more = len(req.tokens) // hbt - have
        if more > 0:
            prev = req.hashes[-1] if req.hashes else b""
            fresh = _kv.chain_hashes(req.tokens, have, prev, hbt, more)
            req.hashes.extend(fresh)
            if req.step_hashes:
                req.unsent.extend(fresh)
            else:
                self.scheduler.add_hashes(req.request_id, fresh)
        if len(req.tokens) - req.prompt_len >= req.max_new:
            self._finish(req)

    def _finish(self, req: SimRequest, aborted: bool = False) -> None:
        self.scheduler.request_finished(req.request_id)
        self._release(req)
        req.state = "done"
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if aborted:
            self.counters.aborted += 1
        else:
            self.counters.finished += 1
        if self.created < self.options.requests:
            if not aborted and self.rng.random() < self.options.follow_up_rate:
                self.add_request(self.prompts.aligned(
                    req.tokens + self.prompts.tokens(self.rng.randrange(1, 48))))
            else:
                self.add_request()

    # -- workers ----------------------------------------------------------------------------

    def _collect(self) -> None:
        """Turn finished transfers into per-worker reports, late, shuffled, sometimes failed."""
        opts = self.options
        workers = self.config.num_workers
        # Copies run on the transfer thread; waiting for this step's jobs here keeps the
        # run deterministic, and report delays below stand in for real asynchrony.
        self._wait(list(self.store_plans) + list(self.load_plans))
        for result in sorted(self.transfer.poll(), key=lambda r: r.job_id):
            if self.check:
                plan = self.store_plans.get(result.job_id) or self.load_plans[result.job_id]
                injected = injected_fault(self._stream_seed, result.job_id,
                                          self._fault_rate) != NO_FAULT
                enforce([TransferOutcomeRecord(result.job_id, self._plan_bytes(plan),
                                               result.success, result.bytes, result.error,
                                               injected=injected)], self.checked)
            bad_worker = self.rng.randrange(workers) if (
                not result.success or self.rng.random() < (opts.fail_rate or 0.0)) else -1
            for worker in range(workers):
                delay = 1
                while self.rng.random() < (opts.delay_rate or 0.0) and delay < 6:
                    delay += 1
                report = WorkerReport(worker, result.job_id, worker != bad_worker,
                                      result.bytes, result.seconds)
                if worker == bad_worker:
                    self.failed_jobs.add(result.job_id)
                self.reports.append((self.step_no + delay, report))
        self.rng.shuffle(self.reports)

    def _wait(self, job_ids: Any) -> None:
        """Wait for jobs; with checks on, one not reported within ``JOB_SECONDS`` is X2
        (a valid plan the engine never carried out), named instead of hanging the run."""
        ids = list(job_ids)
        try:
            self.transfer.wait(ids, timeout=JOB_SECONDS)
        except TimeoutError as exc:
            if not self.check:
                raise
            # The jobs still in flight; if none is by now (it finished just after the
            # deadline), every job waited for. A wait for no job at all that times out is
            # the engine's fault too: recorded as job -1, so it is named, not a crash.
            late = sorted(set(self.transfer.in_flight()) & set(ids) or set(ids)) or [-1]
            plans = {**self.store_plans, **self.load_plans}
            enforce([TransferOutcomeRecord(job, self._plan_bytes(plans[job]) if job in plans
                                           else 1, False, 0,
                                           f"not reported after {JOB_SECONDS:.0f} s: {exc}")
                     for job in late], self.checked)
            raise

    def _submit(self, plan: TransferPlan) -> None:
        """Hand a plan to the copy engine; with checks on, a refusal of a plan the scheduler
        built with its checks on is X2 (the engine must carry out every valid plan)."""
        try:
            self.transfer.submit(plan)
        except KVCoreError as exc:
            if not self.check:
                raise
            enforce([TransferOutcomeRecord(plan.job_id, self._plan_bytes(plan), False, 0,
                                           f"{type(exc).__name__}: {exc}")], self.checked)
            raise

    def _plan_bytes(self, plan: TransferPlan) -> int:
        """The bytes a plan moves, counted from the simulator's own GPU tensors."""
        return sum(len(grp.gpu_block_ids) * sum(t[0].nbytes for t in self.gpu[g])
                   for g, grp in enumerate(plan.groups))

    def deliver_reports_now(self) -> None:
        """Deliver every outstanding report at once, as fast workers would, without
        running a step (directed scenarios use it to finish a request with no jobs)."""
        self._wait(list(self.store_plans) + list(self.load_plans))
        if self.reports:
            self.step_no = max(self.step_no, max(when for when, _ in self.reports))
        self._deliver_reports()

    def _deliver_reports(self) -> None:
        due = [r for when, r in self.reports if when <= self.step_no]
        self.reports = [(w, r) for w, r in self.reports if w > self.step_no]
        if not due:
            return
        out = self.scheduler.worker_output(due)
        for request_id in out.finished_loads:
            self._load_done(request_id, ok=True)
        for failure in out.failed_loads:
            self.counters.failed_loads += 1
            self._load_done(failure.request_id, ok=False)
        self.counters.failed_stores += len(out.failed_stores)
        if self.check:
            self._check_failures(out.completed, {f.job_id for f in out.failed_loads})
        for job_id in out.completed:
            self.load_plans.pop(job_id, None)
            self.store_plans.pop(job_id, None)
            self.failed_jobs.discard(job_id)

    def _check_failures(self, completed: tuple[int, ...], reported: set[int]) -> None:
        """X1, checked by the engine: a job any worker failed never becomes a hit."""
        failed_loads: set[int] = set()
        status: dict[bytes, Status] = {}
        for job_id in completed:
            if job_id not in self.failed_jobs:
                continue
            if job_id in self.store_plans:
                for key in self.store_plans[job_id].keys:
                    status[key] = self.manager.lookup(key)
            else:
                failed_loads.add(job_id)
        if status or failed_loads:
            enforce([FailureRecord(status, frozenset(failed_loads), frozenset(reported))],
                    self.checked)

    def _load_done(self, request_id: str, ok: bool) -> None:
        req = self.reqs[request_id]
        plan = next(p for p in self.load_plans.values() if p.request_id == request_id)
        self.load_plans.pop(plan.job_id)
        if ok:
            self.verify_load(req, plan)
            self.counters.loaded_tokens += req.load_boundary - req.computed
            req.computed = min(req.load_boundary, len(req.tokens) - 1)
            for group, g in enumerate(self.config.groups):
                req.final_upto[group] = req.computed // g.tokens_per_block
        else:
            # A failed load is never read as if loaded: the request gives its blocks back
            # and waits to be admitted again (its next lookup decides anew).
            self._release(req)
            req.computed = 0
            req.state = "waiting"
            self.running.remove(req)
            self.waiting.appendleft(req)
            self.requeued.append(req.request_id)
            if req.abort_pending:
                self._finish(req, aborted=True)
            return
        req.state = "running"
        if req.abort_pending:
            self._finish(req, aborted=True)

    def verify_load(self, req: SimRequest, plan: TransferPlan) -> None:
        """Every loaded block holds exactly the bytes of the prefix it stands for."""
        hbt = self.config.hash_block_tokens
        for group, gt in enumerate(plan.groups):
            g = self.config.groups[group]
            for i, gpu_id in enumerate(gt.gpu_block_ids):
                pos = gt.block_index + i
                prefix = req.hashes[(pos + 1) * g.tokens_per_block // hbt - 1]
                for layer, t in enumerate(self.gpu[group]):
                    want = _kv.final_value(prefix, group, layer)
                    if not bool((t[gpu_id] == want).all()):
                        chunk, sub = sub_block_position(i, gt.block_index, g.blocks_per_chunk)
                        raise IntegrityError(
                            f"request {req.request_id} group {group} layer {layer}: GPU block "
                            f"{gpu_id} (position {pos}, chunk slot {gt.cpu_slots[chunk]} "
                            f"sub-block {sub}) holds {int(t[gpu_id][0])}, expected {want}")
                self.counters.blocks_verified += 1
        self._verify_coverage(req)
        self.counters.loads_verified += 1

    def _verify_coverage(self, req: SimRequest) -> None:
        """Every block the request is told is loaded holds its key's bytes, whatever the plan
        said: per group, each real block from the first unfilled one (none were valid) up to
        the one holding token ``load_boundary - 1``. A load that skips a block leaves it
        zero or stale, and the request would compute on it."""
        hbt = self.config.hash_block_tokens
        for group, g in enumerate(self.config.groups):
            table = req.tables[group]
            for pos in range(min(cdiv(req.load_boundary, g.tokens_per_block), len(table))):
                gpu_id = table[pos]
                if not gpu_id:
                    continue
                prefix = req.hashes[(pos + 1) * g.tokens_per_block // hbt - 1]
                for layer, t in enumerate(self.gpu[group]):
                    want = _kv.final_value(prefix, group, layer)
                    if not bool((t[gpu_id] == want).all()):
                        raise IntegrityError(
                            f"request {req.request_id} group {group} layer {layer}: GPU block "
                            f"{gpu_id} (position {pos}) is told loaded up to token "
                            f"{req.load_boundary} but holds {int(t[gpu_id][0])}, not the "
                            f"bytes of its key ({want})")

    # -- faults -----------------------------------------------------------------------------

    def _maybe_abort(self) -> None:
        rate = self.options.abort_rate or 0.0
        for req in list(self.running) + list(self.waiting):
            if self.rng.random() < rate:
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; one still loading is aborted once its load lands."""
        req = self.reqs[request_id]
        if req.state == "loading":
            req.abort_pending = True
        elif req.state != "done":
            self._finish(req, aborted=True)

    def preempt(self, request_id: str) -> None:
        """Preempt a running request at the next step (as memory pressure would)."""
        self.force_preempt.add(request_id)

    def _maybe_reset(self) -> None:
        if self.rng.random() < (self.options.reset_rate or 0.0):
            self.reset()

    def reset(self) -> None:
        """The engine resets its prefix cache: kvcore drops the CPU tier and every job."""
        self.counters.resets += 1
        flush = self.scheduler.reset()
        self._wait(flush)
        for plan in list(self.load_plans.values()):
            # The reset dropped the load job; its bytes did land (we waited), so the
            # request continues as if the load completed.
            self._load_done(plan.request_id, ok=True)
        self.load_plans.clear()
        self.store_plans.clear()
        self.failed_jobs.clear()
