"""The vLLM names the connector uses, loaded once, with an install hint if vLLM is absent.

They are loaded through ``importlib`` so that kvcore's type check does not depend on
whether (or which) vLLM is installed: every vLLM object is ``Any`` to mypy, and the
adapter's own logic is typed against kvcore's types.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

TESTED_VLLM = "0.33.0"
INSTALL_HINT = ("kvcore.integrations.vllm needs vLLM: install it with `pip install "
                "kvcore[vllm]` (see docs/vllm.md for a CPU-only, --no-deps recipe)")


def _load(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:  # vllm missing, or one of the modules it imports
        raise ImportError(f"{INSTALL_HINT}; importing {name} failed: {e}") from e


_base = _load("vllm.distributed.kv_transfer.kv_connector.v1.base")
_metrics = _load("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
_events = _load("vllm.distributed.kv_events")
_iface = _load("vllm.v1.kv_cache_interface")
_utils = _load("vllm.v1.core.kv_cache_utils")
_hit_source = _load("vllm.v1.metrics.cache_hit_source")

KVConnectorBase_V1: Any = _base.KVConnectorBase_V1
KVConnectorMetadata: Any = _base.KVConnectorMetadata
KVConnectorWorkerMetadata: Any = _base.KVConnectorWorkerMetadata
KVConnectorRole: Any = _base.KVConnectorRole
KVConnectorTransferResults: Any = _base.KVConnectorTransferResults
SupportsHMA: Any = _base.SupportsHMA
KVConnectorStats: Any = _metrics.KVConnectorStats
KVConnectorPromMetrics: Any = _metrics.KVConnectorPromMetrics
BlockStored: Any = _events.BlockStored
BlockRemoved: Any = _events.BlockRemoved
FullAttentionSpec: Any = _iface.FullAttentionSpec
SlidingWindowSpec: Any = _iface.SlidingWindowSpec
MambaSpec: Any = _iface.MambaSpec
UniformTypeKVCacheSpecs: Any = _iface.UniformTypeKVCacheSpecs
resolve_kv_cache_block_sizes: Any = _utils.resolve_kv_cache_block_sizes
resolve_dcp_kv_block_size: Any = _utils.resolve_dcp_kv_block_size
# The events' hash form (an int of the hash's last 8 bytes by default, as vLLM's own block
# pool and OffloadingConnector publish it; the bytes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
maybe_convert_block_hash: Any = _utils.maybe_convert_block_hash
CacheHitSource: Any = _hit_source.CacheHitSource


def layer_specs(spec: Any) -> list[Any]:
    """The per-layer specs behind a group spec (a uniform-type wrapper holds several)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return list(spec.kv_cache_specs.values())
    return [spec]
