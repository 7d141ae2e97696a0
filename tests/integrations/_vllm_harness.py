"""A small vLLM-shaped engine loop over real vLLM objects, for the connector's tests.

vLLM's own connector tests drive a real ``Scheduler``; that needs a model config (a hub
download), which CI cannot have. This harness plays the scheduler's part instead and
builds what the connector receives exactly as vLLM's scheduler builds it: real
``Request`` objects (with vLLM's block hasher), ``KVCacheBlocks`` of ``KVCacheBlock``,
``SchedulerOutput`` with ``NewRequestData``/``CachedRequestData``, and
``KVConnectorOutput`` carrying the workers' metadata. The worker side runs on CPU
tensors in FlashAttention's ``(2, num_blocks, block, heads, head)`` shape; every written
block holds bytes that are a function of its prefix hash, so a wrong load is caught.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvcore.integrations.vllm import KvcoreConnector
from kvcore.integrations.vllm._compat import KVConnectorRole

BLOCK = 4
HEADS, HEAD = 2, 4
init_none_hash(sha256)


def attention(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32, **kw)


@dataclass
class SpecStandIn:
    """vLLM's SpeculativeConfig needs a draft model's HF config; the connector reads only
    these two members of it."""

    method: str = "mtp"
    parallel_drafting: bool = False
    num_speculative_tokens: int = 1

    def use_eagle_block_drop(self) -> bool:
        return self.method in ("eagle", "eagle3", "mtp")


def vllm_config(extra: dict[str, Any], *, spec: str | None = None) -> VllmConfig:
    kt = KVTransferConfig(kv_connector="KvcoreConnector",
                          kv_connector_module_path="kvcore.integrations.vllm",
                          kv_role="kv_both", kv_connector_extra_config=extra)
    cfg = VllmConfig(kv_transfer_config=kt, device_config=DeviceConfig(device="cpu"),
                     cache_config=CacheConfig(block_size=BLOCK))
    if spec is not None:
        object.__setattr__(cfg, "speculative_config", SpecStandIn(spec))
    return cfg


def kv_cache_config(num_blocks: int, groups: list[KVCacheGroupSpec]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def block_value(prefix_hash: bytes, layer: str, plane: int) -> float:
    digest = hashlib.blake2b(prefix_hash + layer.encode() + bytes([plane]), digest_size=3)
    return float(int.from_bytes(digest.digest(), "big") + 1)


@dataclass
class Live:
    """The engine's view of one request: its blocks per group and what is computed."""

    request: Request
    tables: list[list[int]]
    computed: int = 0
    state: str = "waiting"
    hit: int = 0


@dataclass
class Harness:
    """Scheduler-role and worker-role connectors, a block pool, and the KV tensors."""

    config: VllmConfig
    kv_config: KVCacheConfig
    spec_tokens: int = 0
    sched: KvcoreConnector = field(init=False)
    worker: KvcoreConnector = field(init=False)
    kv: dict[str, torch.Tensor] = field(init=False)
    free: list[int] = field(init=False)
    live: dict[str, Live] = field(default_factory=dict)
    step_no: int = 0
    last_meta: Any = None
    loads_verified: int = 0
    blocks_verified: int = 0
    # Called with the step's metadata once the worker's jobs are submitted and drained,
    # before their results are read: a test makes its misuse of a worker hook there.
    after_drain: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        self.sched = KvcoreConnector(self.config, KVConnectorRole.SCHEDULER, self.kv_config)
        self.worker = KvcoreConnector(self.config, KVConnectorRole.WORKER, self.kv_config)
        n = self.kv_config.num_blocks
        self.kv = {name: torch.zeros((2, n, BLOCK, HEADS, HEAD))
                   for g in self.kv_config.kv_cache_groups for name in g.layer_names}
        self.worker.register_kv_caches(self.kv)
        self.free = list(range(n - 1, 0, -1))

    @property
    def groups(self) -> list[KVCacheGroupSpec]:
        return list(self.kv_config.kv_cache_groups)

    def new_request(self, rid: str, tokens: list[int], max_tokens: int = 8) -> Live:
        req = Request(rid, tokens, SamplingParams(max_tokens=max_tokens), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.sched.on_new_request(req)
        live = Live(req, [[] for _ in self.groups])
        self.live[rid] = live
        return live

    def alloc(self, live: Live, upto: int) -> tuple[list[int], ...]:
        new: list[list[int]] = []
        for table in live.tables:
            ids = [self.free.pop() for _ in range(-(-upto // BLOCK) - len(table))]
            table.extend(ids)
            new.append(ids)
        return tuple(new)

    def blocks(self, live: Live) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([KVCacheBlock(b, is_null=b == 0) for b in t]
                                   for t in live.tables))

    def release(self, live: Live) -> None:
        for table in live.tables:
            self.free.extend(table)
        live.tables = [[] for _ in self.groups]

    # -- admission ---------------------------------------------------------------------------

    def admit(self, live: Live, local: int = 0) -> int | None:
        """vLLM's waiting-queue path: lookup, allocate, update_state_after_alloc."""
        hit, is_async = self.sched.get_num_new_matched_tokens(live.request, local)
        if hit is None:
            return None
        assert is_async == (hit > 0)
        self.alloc(live, local + hit if hit else 0)
        self.sched.update_state_after_alloc(live.request, self.blocks(live), hit)
        live.hit = hit
        live.state = "loading" if hit else "waiting"
        return hit

    # -- one engine step ---------------------------------------------------------------------

    def step(self, work: dict[str, int], *, preempted: frozenset[str] = frozenset(),
             deliver: bool = True, fail_loads: bool = False) -> KVConnectorOutput:
        """Schedule ``work`` (request -> tokens), run both sides, return the worker output."""
        self.step_no += 1
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData.make_empty()
        spec_tokens: dict[str, list[int]] = {}
        for rid, n in work.items():
            live = self.live[rid]
            decoding = live.computed >= live.request.num_prompt_tokens
            tokens = n + (self.spec_tokens if decoding else 0)
            fresh = live.state in ("waiting", "loaded")
            ids = self.alloc(live, live.computed + tokens)
            if decoding and self.spec_tokens:
                spec_tokens[rid] = [7] * self.spec_tokens
                live.request.spec_token_ids = list(spec_tokens[rid])  # as vLLM's drafter
            live.request.num_computed_tokens = live.computed
            if fresh:
                new_reqs.append(NewRequestData.from_request(
                    live.request, tuple(list(t) for t in live.tables)))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(ids if any(ids) else None)
                cached.num_computed_tokens.append(live.computed)
                cached.num_output_tokens.append(live.request.num_output_tokens)
                cached.new_token_ids.append([])
            live.state = "running"
            work[rid] = tokens
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(work), total_num_scheduled_tokens=sum(work.values()),
            scheduled_spec_decode_tokens=spec_tokens, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[],
            preempted_req_ids=set(preempted))
        meta = self.sched.build_connector_meta(out)
        self.last_meta = meta
        for plan in meta.stores:  # no store may cover an unverified draft token
            length = self.live[plan.request_id].request.num_tokens
            for gt in plan.groups:
                assert gt.block_index + len(gt.gpu_block_ids) <= length // BLOCK, plan
        return self._run_worker(meta, work, deliver, fail_loads)

    def _run_worker(self, meta: Any, work: dict[str, int], deliver: bool,
                    fail_loads: bool) -> KVConnectorOutput:
        w = self.worker
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        if fail_loads:  # a load whose source slot is out of range fails in the copy engine
            meta.loads = tuple(_broken(p) for p in meta.loads)
        w.start_load_kv(None)
        for rid, n in work.items():
            self.forward(self.live[rid], n)
        w.wait_for_save()
        assert w.worker is not None
        w.worker.drain(timeout=60)
        if self.after_drain is not None:
            self.after_drain(meta)
        results = w.get_transfer_results(set())
        output = KVConnectorOutput(finished_recving=results.finished_recving,
                                   failed_recving=results.failed_recving,
                                   invalid_block_ids=w.get_block_ids_with_load_errors(),
                                   kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        for load in meta.loads:
            if load.request_id not in output.failed_recving:
                self.verify_load(load)
        if deliver:
            self.sched.update_connector_output(output)
        for rid in output.finished_recving or ():
            live = self.live[rid]
            ok = rid not in output.failed_recving
            live.computed = min(live.hit, live.request.num_tokens - 1) if ok else 0
            live.state = "loaded"
            if not ok:
                self.release(live)
                live.state = "waiting"
        return output

    def forward(self, live: Live, n: int) -> None:
        """Write final KV for every block the step completes; a draft group's block at the
        frontier is rewritten by the drafter, so it holds junk until the next one is full."""
        frontier = min(live.computed + n, live.request.num_tokens)
        hashes = live.request.block_hashes
        written = -(-(live.computed + n) // BLOCK)
        for g, group in enumerate(self.groups):
            final = frontier // BLOCK - (1 if group.is_eagle_group else 0)
            for pos in range(min(written, len(live.tables[g]))):
                block_id = live.tables[g][pos]
                for name in group.layer_names:
                    for plane in (0, 1):
                        value = (block_value(hashes[pos], name, plane) if pos < final
                                 else -float(self.step_no))
                        self.kv[name][plane, block_id].fill_(value)
        self.sample(live, n)

    def sample(self, live: Live, n: int) -> None:
        req = live.request
        if live.computed + n < req.num_tokens:
            live.computed += n
            return
        decoding = live.computed >= req.num_prompt_tokens
        accepted = 1 if decoding and n > 1 else 0  # one draft token accepted per step
        req.spec_token_ids = []
        req.append_output_token_ids([100 + self.step_no + i for i in range(1 + accepted)])
        live.computed = req.num_tokens - 1

    def verify_load(self, load: Any) -> None:
        """Every loaded block holds the bytes of the prefix it stands for."""
        live = self.live[load.request_id]
        hashes = live.request.block_hashes
        for g, gt in enumerate(load.groups):
            group = self.groups[self.sched.options.group_ids[g]]
            for i, block_id in enumerate(gt.gpu_block_ids):
                pos = gt.block_index + i
                for name in group.layer_names:
                    for plane in (0, 1):
                        want = block_value(hashes[pos], name, plane)
                        got = self.kv[name][plane, block_id]
                        assert bool((got == want).all()), (load.request_id, g, pos, name)
                self.blocks_verified += 1
        self.loads_verified += 1

    def finish(self, live: Live) -> None:
        tables = tuple(list(t) for t in live.tables)
        assert self.sched.request_finished_all_groups(live.request, tables) == (False, None)
        self.release(live)
        live.state = "done"


def _broken(plan: Any) -> Any:
    from dataclasses import replace
    groups = tuple(replace(g, cpu_slots=tuple(1 << 30 for _ in g.cpu_slots))
                   for g in plan.groups)
    return replace(plan, groups=groups)
