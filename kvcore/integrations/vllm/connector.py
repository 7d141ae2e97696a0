"""``KvcoreConnector``: vLLM's KV-connector interface (0.33.x) over kvcore.

vLLM builds one instance per process: the scheduler's (role SCHEDULER) runs
``SchedulerSide``, each worker's (role WORKER) runs ``WorkerSide``. The configuration is
translated once, identically on both sides, from vLLM's own config objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvcore.integrations.vllm import _compat as v
from kvcore.integrations.vllm.config import translate
from kvcore.integrations.vllm.metadata import KvcoreConnectorMetadata, KvcoreWorkerMetadata
from kvcore.integrations.vllm.metrics import KvcorePromMetrics
from kvcore.integrations.vllm.scheduler_side import KvcoreConnectorStats, SchedulerSide
from kvcore.integrations.vllm.worker_side import WorkerSide
from kvcore.spec.errors import ArgumentTypeError, CallOrderError

# vLLM's layout whose per-layer view has the block id first and each block's bytes
# contiguous: what kvcore's copy descriptors address.
REQUIRED_LAYOUT = "LBHNC"


def _meta(where: str, meta: Any) -> KvcoreConnectorMetadata:
    if meta is None:
        raise CallOrderError(where, "no step metadata is bound; vLLM binds it "
                             "(bind_connector_metadata) before the step's worker hooks")
    if not isinstance(meta, KvcoreConnectorMetadata):
        raise ArgumentTypeError(where, "kv_connector_metadata", meta,
                                "KvcoreConnectorMetadata", "every process must run "
                                "KvcoreConnector")
    return meta


class KvcoreConnector(v.KVConnectorBase_V1, v.SupportsHMA):  # type: ignore[misc]
    """KV offloading to a CPU tier with kvcore's scheduler, manager and copy engine."""

    # vLLM's per-source prefix-cache-hit metric: kvcore's hits come from host memory.
    _cache_hit_source = v.CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.options = translate(vllm_config, kv_cache_config)
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == v.KVConnectorRole.SCHEDULER:
            self.sched = SchedulerSide(self.options)
        else:
            self.worker = WorkerSide(self.options)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is a future miss, not lost data

    def _s(self) -> SchedulerSide:
        if self.sched is None:
            raise CallOrderError("KvcoreConnector", "a scheduler-side hook was called on a "
                                 "worker-side connector")
        return self.sched

    def _w(self) -> WorkerSide:
        if self.worker is None:
            raise CallOrderError("KvcoreConnector", "a worker-side hook was called on a "
                                 "scheduler-side connector")
        return self.worker

    def _bound(self) -> Any:
        """The bound step metadata, or None (vLLM's getter asserts, with no message)."""
        return getattr(self, "_connector_metadata", None)

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._w().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._w().handle_preemptions(_meta("handle_preemptions", kv_connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._w().start_load_kv(_meta("start_load_kv", self._bound()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole-request and asynchronous (the request waits)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # stores are submitted once, after the forward pass

    def wait_for_save(self) -> None:
        self._w().wait_for_save(_meta("wait_for_save", self._bound()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self._w().get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self._w().get_transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KvcoreWorkerMetadata | None:
        return self.worker.build_worker_meta() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return REQUIRED_LAYOUT

    # -- scheduler side --------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._s().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   max_num_new_tokens: int | None = None
                                   ) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens,
                                                    max_num_new_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvcoreConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._s().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self.sched is not None and self.sched.scheduler.has_pending_work()

    def take_events(self) -> Iterable[Any]:
        return list(self._s().take_events(self.options.group_ids))

    def reset_cache(self) -> bool | None:
        return self._s().reset_cache()

    def get_kv_connector_stats(self) -> KvcoreConnectorStats | None:
        return self.sched.get_stats() if self.sched is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KvcoreConnectorStats:
        if data is not None and not isinstance(data, dict):
            raise ArgumentTypeError("build_kv_connector_stats", "data", data, "dict or None",
                                    "pass the stats' data dict as vLLM serialised it")
        return KvcoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KvcorePromMetrics:
        return KvcorePromMetrics(vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)
