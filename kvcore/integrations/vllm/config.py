"""vLLM's KV-cache layout and speculative set-up, translated into a kvcore ``OffloadConfig``.

The connector offloads every prefix-cacheable group vLLM has (so no group bounds a hit,
and vLLM's ``max_num_new_tokens`` cap is never needed for kvcore's own groups). Each
vLLM spec maps to one kvcore group kind; anything kvcore cannot describe exactly is a
``ConfigError`` that says what to set, never a silent fallback.

CPU capacity: ``cpu_bytes`` is this worker rank's pinned-memory budget. ``num_cpu_blocks``
is slots per group: the transfer engine gives every group's tensors ``num_cpu_blocks``
chunk rows and the manager has one pool of that many slots per group, so
``num_cpu_blocks = cpu_bytes // (sum over groups of the bytes one chunk of that group
takes on this rank)``, or given directly (``num_cpu_blocks``), as it must be where the
processes would compute different counts (``_slots``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcore.integrations.vllm import _compat as v
from kvcore.spec.errors import ConfigError
from kvcore.spec.types import (
    MAX_BLOCKS_PER_CHUNK,
    MAX_CPU_BLOCKS,
    GroupKind,
    GroupSpec,
    OffloadConfig,
)

POLICIES = ("lru", "arc")
KNOWN_KEYS = frozenset({"cpu_bytes", "num_cpu_blocks", "eviction_policy", "check",
                        "blocks_per_chunk", "draft_kv_elsewhere", "draft_groups",
                        "offload_prompt_only"})


@dataclass(frozen=True)
class ConnectorOptions:
    """What the connector needs beyond the ``OffloadConfig``.

    ``group_ids`` maps kvcore group ``i`` to vLLM's KV-cache group ``group_ids[i]``;
    ``layer_names[i]`` are that group's layers (the worker registers their tensors).
    ``chunk_bytes[i]`` is one chunk of group ``i`` on this rank, in bytes.
    """

    config: OffloadConfig
    group_ids: tuple[int, ...]
    layer_names: tuple[tuple[str, ...], ...]
    chunk_bytes: tuple[int, ...]
    eviction_policy: str
    check: bool
    rank: int


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key}",
                          f"{key}={value!r} must be true or false")
    return value


def _positive_int(extra: Mapping[str, Any], key: str, default: int | None) -> int:
    value = extra.get(key, default)
    if value is None:
        raise ConfigError(f"kv_connector_extra_config.{key}",
                          f"{key} is required: set cpu_bytes to this rank's pinned CPU "
                          "budget in bytes, e.g. {\"cpu_bytes\": 8589934592} for 8 GiB, "
                          "or num_cpu_blocks to the CPU chunk slots per group")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config.{key}",
                          f"{key}={value!r} must be a positive int")
    return value


def group_kind(index: int, spec: Any) -> tuple[GroupKind, int | None, int]:
    """(kind, window_tokens, extra_retained_tokens) of vLLM group ``index``."""
    kinds = {_kind_of(index, s) for s in v.layer_specs(spec)}
    if len(kinds) != 1:
        raise ConfigError(f"kv_cache_groups[{index}]",
                          f"the group mixes layer kinds {sorted(map(str, kinds))}; kvcore "
                          "offloads a group only if all its layers attend the same way")
    return kinds.pop()


def _kind_of(index: int, spec: Any) -> tuple[GroupKind, int | None, int]:
    if isinstance(spec, v.SlidingWindowSpec):
        return GroupKind.SLIDING, int(spec.sliding_window), int(spec.extra_retained_tokens)
    if isinstance(spec, v.MambaSpec):
        mode = getattr(spec, "mamba_cache_mode", "align")
        if mode != "align":
            # Without prefix caching vLLM keeps one state per request (its block is the
            # whole model length), not one per block: there is nothing per chunk to
            # offload, and the hash size it implies would be blamed on kvcore's own fields.
            raise ConfigError(f"kv_cache_groups[{index}]",
                              f"MambaSpec with mamba_cache_mode={mode!r} caches no state per "
                              "block; enable prefix caching (--enable-prefix-caching), which "
                              "makes it 'align'")
        return GroupKind.MAMBA, None, 0
    if type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec") and isinstance(
            spec, v.FullAttentionSpec) and spec.attention_chunk_size is None:
        # A full-attention spec keeps every block even when its layer has a window, so
        # serving it as FULL is exact.
        return GroupKind.FULL, None, 0
    raise ConfigError(f"kv_cache_groups[{index}]",
                      f"{type(spec).__name__} has no kvcore group kind (FULL, SLIDING or "
                      "MAMBA); run without kvcore offloading for this model")


def _bytes_per_block(group: Any) -> int:
    """One block of the group on this rank."""
    spec = group.kv_cache_spec
    if isinstance(spec, v.UniformTypeKVCacheSpecs):
        return int(spec.page_size_bytes)
    return int(spec.page_size_bytes) * len(group.layer_names)


def _uneven_pages(group: Any) -> bool:
    """Whether the group's layers have different page sizes. vLLM hands its scheduler
    only the first layer's spec of such a group (``generate_scheduler_kv_cache_config``),
    so the scheduler's bytes per block (first page x layers) differ from a worker's."""
    spec = group.kv_cache_spec
    if not isinstance(spec, v.UniformTypeKVCacheSpecs):
        return False
    return len({int(s.page_size_bytes) for s in v.layer_specs(spec)}) > 1


def _slots(extra: Mapping[str, Any], vllm_config: Any, kv_cache_config: Any,
           offloaded: tuple[int, ...], chunk_bytes: list[int]) -> int:
    """``num_cpu_blocks``: given, or ``cpu_bytes`` over this rank's bytes per slot.

    The scheduler hands out slot numbers and every worker must have every slot, so the
    count must come out the same in every process. From ``cpu_bytes`` it does only where
    every process sees the same bytes per slot: not under pipeline parallelism (a stage
    holds its own layers, and vLLM splits them unevenly), and not for a group whose
    layers differ in page size (see ``_uneven_pages``). There the count must be given.
    """
    if extra.get("num_cpu_blocks") is not None:
        if extra.get("cpu_bytes") is not None:
            raise ConfigError("kv_connector_extra_config.num_cpu_blocks",
                              "cpu_bytes and num_cpu_blocks are both set; set one: "
                              "num_cpu_blocks (slots per group, the same on every rank) or "
                              "cpu_bytes (this rank's pinned budget)")
        slots = _positive_int(extra, "num_cpu_blocks", None)
        if slots > MAX_CPU_BLOCKS:
            raise ConfigError("kv_connector_extra_config.num_cpu_blocks",
                              f"num_cpu_blocks={slots} is over the limit of {MAX_CPU_BLOCKS} "
                              "slots per group")
        return slots
    per_slot = sum(chunk_bytes)
    stages = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    uneven = [g for g in offloaded if _uneven_pages(kv_cache_config.kv_cache_groups[g])]
    if stages > 1 or uneven:
        why = (f"with pipeline parallelism (pipeline_parallel_size={stages}) each stage "
               "holds its own layers" if stages > 1 else
               f"the layers of KV-cache group {uneven[0]} differ in page size and vLLM's "
               "scheduler sees only the first one's")
        raise ConfigError("kv_connector_extra_config.num_cpu_blocks",
                          f"{why}, so cpu_bytes would give the scheduler and the ranks "
                          "different slot counts (stores to slots a rank lacks fail for "
                          "good); set num_cpu_blocks instead of cpu_bytes: slots per group, "
                          f"the same on every rank (each slot takes {per_slot} bytes of "
                          "pinned memory on this rank)")
    cpu_bytes = _positive_int(extra, "cpu_bytes", None)
    num_cpu_blocks = cpu_bytes // per_slot
    if num_cpu_blocks < 1:
        raise ConfigError("kv_connector_extra_config.cpu_bytes",
                          f"cpu_bytes={cpu_bytes} holds no chunk: one chunk of every group "
                          f"takes {per_slot} bytes on this rank; set at least that")
    if num_cpu_blocks > MAX_CPU_BLOCKS:  # the config would blame num_cpu_blocks, unset here
        raise ConfigError("kv_connector_extra_config.cpu_bytes",
                          f"cpu_bytes={cpu_bytes} makes {num_cpu_blocks} chunk slots per group, "
                          f"over the limit of {MAX_CPU_BLOCKS}; is it a byte count of this "
                          "rank's budget (not the whole host's, not bits)?")
    return num_cpu_blocks


def _draft_groups(vllm_config: Any, kv_cache_config: Any, offloaded: tuple[int, ...],
                  extra: Mapping[str, Any]) -> tuple[bool, frozenset[int], bool]:
    """(speculative, vLLM ids of draft groups, draft_kv_elsewhere)."""
    spec_cfg = vllm_config.speculative_config
    volatile = spec_cfg is not None and bool(spec_cfg.use_eagle_block_drop())
    elsewhere = _flag(extra, "draft_kv_elsewhere", False)
    if elsewhere and extra.get("draft_groups"):
        raise ConfigError("kv_connector_extra_config.draft_kv_elsewhere",
                          "draft_kv_elsewhere=true says the drafter's KV is in no offloaded "
                          f"group, but draft_groups={extra['draft_groups']!r} names one; "
                          "set one of them")
    if "draft_groups" in extra:
        given = extra["draft_groups"]
        if not isinstance(given, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x in offloaded for x in given):
            raise ConfigError("kv_connector_extra_config.draft_groups",
                              f"draft_groups={given!r} must list vLLM KV-cache group ids "
                              f"among the offloaded groups {list(offloaded)}")
        drafts = frozenset(given)
    else:
        drafts = frozenset(
            gid for gid in offloaded
            if kv_cache_config.kv_cache_groups[gid].is_eagle_group
            or any(s.is_draft for s in v.layer_specs(
                kv_cache_config.kv_cache_groups[gid].kv_cache_spec)))
    if not volatile:
        # vLLM does not drop the drafter's trailing block here (a separate draft model,
        # draft_model or dflash, whose KV depends on the prefix alone; or EAGLE/MTP with
        # the block drop disabled, where vLLM itself reuses that block), yet it may still
        # mark the drafter's layers as draft. The groups are offloaded as ordinary ones,
        # as vLLM serves them; only draft options the user set contradict it.
        if (drafts and "draft_groups" in extra) or elsewhere:
            key = "draft_kv_elsewhere" if elsewhere else "draft_groups"
            method = None if spec_cfg is None else getattr(spec_cfg, "method", None)
            raise ConfigError(f"kv_connector_extra_config.{key}",
                              f"{key} is set, but vLLM does not drop the drafter's "
                              f"trailing block (speculative method {method!r}: "
                              "use_eagle_block_drop() is False), so it serves every group "
                              f"as ordinary KV and so does kvcore; remove {key}")
        return False, frozenset(), False
    if not drafts and not elsewhere:
        raise ConfigError("kv_connector_extra_config.draft_groups",
                          f"speculative method {spec_cfg.method!r} writes draft KV, but no "
                          "offloaded KV-cache group is marked as holding the drafter's "
                          "layers; set \"draft_groups\": [<vLLM group id>] for the group "
                          "holding them, or \"draft_kv_elsewhere\": true if the drafter's "
                          "KV is in no offloaded group")
    return True, drafts, elsewhere and not drafts


def translate(vllm_config: Any, kv_cache_config: Any) -> ConnectorOptions:
    """Build the ``OffloadConfig`` and options from vLLM's config objects."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None:
        raise ConfigError("kv_transfer_config", "is not set; pass --kv-transfer-config with "
                          "kv_connector KvcoreConnector")
    extra: Mapping[str, Any] = transfer.kv_connector_extra_config or {}
    if not isinstance(extra, Mapping) or any(type(k) is not str for k in extra):
        raise ConfigError("kv_connector_extra_config", f"is {type(extra).__name__} "
                          f"{str(extra)[:60]}; pass a dict of option names to values, e.g. "
                          '{"cpu_bytes": 8000000000}')
    if kv_cache_config is None or not hasattr(kv_cache_config, "kv_cache_groups"):
        raise ConfigError("kv_cache_config", f"is {type(kv_cache_config).__name__}; the "
                          "connector needs vLLM's KVCacheConfig of the engine")
    unknown = sorted(set(extra) - KNOWN_KEYS)
    if unknown:
        raise ConfigError("kv_connector_extra_config",
                          f"unknown keys {unknown}; known: {sorted(KNOWN_KEYS)}")
    if kv_cache_config.hisparse_host_num_blocks is not None:
        raise ConfigError("kv_cache_config", "HiSparse host caches are not supported by "
                          "kvcore's connector; turn HiSparse off or use OffloadingConnector")
    policy = extra.get("eviction_policy", "lru")
    if policy not in POLICIES:
        raise ConfigError("kv_connector_extra_config.eviction_policy",
                          f"eviction_policy={policy!r}; choose one of {list(POLICIES)}")
    offloaded = tuple(kv_cache_config.prefix_cacheable_group_ids)
    if not offloaded:
        raise ConfigError("kv_cache_groups", "no prefix-cacheable KV-cache group to offload; "
                          "enable prefix caching (--enable-prefix-caching)")
    bpc = _positive_int(extra, "blocks_per_chunk", 1)
    if bpc > MAX_BLOCKS_PER_CHUNK:  # named here: the byte check below would blame cpu_bytes
        raise ConfigError("kv_connector_extra_config.blocks_per_chunk",
                          f"blocks_per_chunk={bpc} exceeds {MAX_BLOCKS_PER_CHUNK}; a chunk is "
                          "1..64 GPU blocks in practice")
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    _, hash_tokens = v.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    speculative, drafts, elsewhere = _draft_groups(vllm_config, kv_cache_config, offloaded,
                                                   extra)
    groups: list[GroupSpec] = []
    chunk_bytes: list[int] = []
    for gid in offloaded:
        group = kv_cache_config.kv_cache_groups[gid]
        kind, window, retained = group_kind(gid, group.kv_cache_spec)
        tpb = int(v.resolve_dcp_kv_block_size(group.kv_cache_spec, dcp))
        groups.append(GroupSpec(kind, tpb, bpc, window_tokens=window, is_draft=gid in drafts,
                                extra_retained_tokens=retained, name=f"vllm-group-{gid}"))
        chunk_bytes.append(_bytes_per_block(group) * bpc)
    empty = [gid for gid, n in zip(offloaded, chunk_bytes, strict=True) if n <= 0]
    if empty:
        raise ConfigError("kv_cache_groups", f"group {empty[0]} has no KV bytes on this rank "
                          "(no layers, or layers of size 0), so its chunks cannot be copied; "
                          "under pipeline parallelism a rank may hold none of a group's "
                          "layers, which kvcore's connector does not support yet")
    num_cpu_blocks = _slots(extra, vllm_config, kv_cache_config, offloaded, chunk_bytes)
    config = OffloadConfig(tuple(groups), hash_block_tokens=int(hash_tokens),
                           num_gpu_blocks=int(kv_cache_config.num_blocks),
                           num_cpu_blocks=num_cpu_blocks,
                           num_workers=int(vllm_config.parallel_config.world_size),
                           prompt_only=_flag(extra, "offload_prompt_only", False),
                           speculative=speculative, draft_kv_elsewhere=elsewhere,
                           name="vllm")
    return ConnectorOptions(config, offloaded,
                            tuple(tuple(kv_cache_config.kv_cache_groups[g].layer_names)
                                  for g in offloaded),
                            tuple(chunk_bytes), policy, _flag(extra, "check", False),
                            int(vllm_config.parallel_config.rank))
