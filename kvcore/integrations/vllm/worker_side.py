"""The connector's worker half: vLLM's KV tensors registered with kvcore's TransferEngine.

Per step, in vLLM's order: ``handle_preemptions`` waits for the flushed jobs before the
forward pass writes any block; ``start_load_kv`` submits the loads; ``wait_for_save``
(after the forward pass) submits the stores, so they copy this step's KV;
``get_finished`` turns finished jobs into this rank's ``WorkerReport``s and vLLM's
finished-receiving set. A failed load is reported to vLLM as a failed receive (and, with
one KV-cache group, as invalid block ids), which sends the request down vLLM's
recompute path; kvcore never reads a failed load as a hit.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.integrations.vllm import _compat as v
from kvcore.integrations.vllm.config import ConnectorOptions
from kvcore.integrations.vllm.metadata import KvcoreConnectorMetadata, KvcoreWorkerMetadata
from kvcore.spec.errors import ArgumentRangeError, ArgumentTypeError, CallOrderError, ConfigError
from kvcore.spec.hooks import WorkerReport
from kvcore.spec.plans import JobKind, TransferPlan
from kvcore.transfer import TransferEngine
from kvcore.transfer._plans import check_plan


def block_major_views(name: str, t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """The tensor as views whose dim 0 is the GPU block id, each row one block's bytes.

    Accepted: ``(num_blocks, ...)`` (vLLM's block-contiguous layouts); ``(2, num_blocks,
    ...)`` (FlashAttention's K and V planes: two views); ``(num_blocks * r, ...)`` (kernel
    blocks splitting a manager block: grouped back to ``num_blocks`` rows).
    """
    if t.dim() >= 1 and t.shape[0] == num_blocks:
        return [t]
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return [t[0], t[1]]
    if t.dim() >= 1 and num_blocks > 0 and t.shape[0] % num_blocks == 0:
        return [t.view(num_blocks, -1, *t.shape[1:])]
    raise ConfigError(f"kv_caches[{name!r}]",
                      f"shape {tuple(t.shape)} has no block dimension of {num_blocks} "
                      "blocks; use a block-major KV layout (VLLM_KV_CACHE_LAYOUT=LBHNC)")


def _plans_of(where: str, plans: object) -> tuple[TransferPlan, ...]:
    """A step's loads or stores, each a TransferPlan the engine would take, with a job id
    a report can carry (1 and up) and a request id, no id twice: checked whole before
    any is submitted (one refused halfway left the earlier ones running unrecorded, and
    a job id 0 ran and then could not be reported, losing the reports beside it)."""
    if not isinstance(plans, tuple | list):
        raise ArgumentTypeError(where, "plans", plans, "a tuple of TransferPlan",
                                "bind the metadata build_connector_meta returned")
    batch = tuple(check_plan(plan) for plan in plans)
    seen: set[int] = set()
    for i, plan in enumerate(batch):
        if plan.job_id < 1 or type(plan.request_id) is not str or plan.job_id in seen:
            raise ArgumentRangeError(where, f"plans[{i}]", plan.job_id,
                                     "a job id of 1 or more, once per step, with a str "
                                     "request id", "bind the metadata build_connector_meta "
                                     "returned")
        seen.add(plan.job_id)
    return batch


class WorkerSide:
    """One rank's transfer engine, and the reports it owes the scheduler."""

    def __init__(self, options: ConnectorOptions) -> None:
        self.options = options
        self.transfer: TransferEngine | None = None
        self._plans: dict[int, TransferPlan] = {}
        self._reports: list[WorkerReport] = []
        self._failed_requests: set[str] = set()
        self._failed_blocks: set[int] = set()
        # Loads an engine finished before shutdown() closed it: vLLM hears of them at the
        # next get_finished (of the engine registered after it).
        self._recving_owed: set[str] = set()
        # The step metadata whose loads / stores were submitted last: vLLM calls each hook
        # once per step, and a second call would submit every job again (one reference
        # each, so nothing grows).
        self._loads_of: KvcoreConnectorMetadata | None = None
        self._stores_of: KvcoreConnectorMetadata | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.transfer is not None:
            # A second engine would leave the first one's jobs unpolled: their reports
            # never reach the scheduler and their requests' prefixes stay in flight.
            raise CallOrderError("register_kv_caches", "the KV caches are registered "
                                 "already; call shutdown() before registering new ones")
        if not isinstance(kv_caches, dict):
            raise ConfigError("kv_caches", f"is a {type(kv_caches).__name__}; pass vLLM's "
                              "dict of layer name -> KV tensor")
        cfg = self.options.config
        per_group: list[list[torch.Tensor]] = []
        for names in self.options.layer_names:
            views: list[torch.Tensor] = []
            seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
            for name in names:
                if name not in kv_caches:
                    raise ConfigError(f"kv_caches[{name!r}]", "a layer of an offloaded group "
                                      "has no KV tensor; register every layer")
                if not isinstance(kv_caches[name], torch.Tensor):
                    raise ConfigError(f"kv_caches[{name!r}]", f"is a "
                                      f"{type(kv_caches[name]).__name__}, not a torch.Tensor")
                for view in block_major_views(name, kv_caches[name], cfg.num_gpu_blocks):
                    ident = (view.data_ptr(), tuple(view.shape), tuple(view.stride()))
                    if ident not in seen:  # layers sharing one KV buffer copy it once
                        seen.add(ident)
                        views.append(view)
            per_group.append(views)
        self.transfer = TransferEngine(cfg, per_group)

    def _engine(self) -> TransferEngine:
        if self.transfer is None:
            raise CallOrderError("WorkerSide", "register_kv_caches was not called before "
                                 "the first step (or shutdown() came before this one)")
        return self.transfer

    def handle_preemptions(self, meta: KvcoreConnectorMetadata) -> None:
        if meta.flush:
            self._engine().wait(meta.flush)

    def start_load_kv(self, meta: KvcoreConnectorMetadata) -> None:
        self._submit("start_load_kv", meta, meta.loads, self._loads_of)
        self._loads_of = meta

    def wait_for_save(self, meta: KvcoreConnectorMetadata) -> None:
        self._submit("wait_for_save", meta, meta.stores, self._stores_of)
        self._stores_of = meta

    def _submit(self, where: str, meta: KvcoreConnectorMetadata,
                plans: object, last: KvcoreConnectorMetadata | None) -> None:
        """Submit one step's plans once. A repeat, for the same metadata or for a job this
        rank still holds, is refused before any plan is submitted: run twice, a job is
        reported twice and the scheduler refuses both reports. Every plan's own types
        are checked before the first is submitted, so a refused step submits nothing
        and leaves no job this rank would wait for or report."""
        engine = self._engine()
        batch = _plans_of(where, plans)
        again = [p.job_id for p in batch if p.job_id in self._plans]
        if batch and (meta is last or again):
            raise CallOrderError(where, f"this step's jobs {again or [p.job_id for p in batch]}"
                                 " were submitted already; vLLM calls it once per step")
        for plan in batch:
            engine.submit(plan)
            self._plans[plan.job_id] = plan

    def get_finished(self) -> tuple[set[str], set[str]]:
        recving, _failed = self._finished()
        return set(), recving

    def _finished(self) -> tuple[set[str], set[str]]:
        """The loads finished since the last call, and those of them that failed. Each
        call hands out every failure it has: a caller of the older ``get_finished`` alone
        (which has no failed set) must not leave a record per failed load for good."""
        recving = self._collect(self._engine().poll()) | self._recving_owed
        self._recving_owed = set()
        failed, self._failed_requests = self._failed_requests, set()
        return recving, failed

    def _collect(self, results: list[Any]) -> set[str]:
        """Reports for finished jobs; the requests whose loads they were."""
        finished_recving: set[str] = set()
        for result in results:
            self._reports.append(WorkerReport(self.options.rank, result.job_id,
                                              result.success, result.bytes, result.seconds))
            plan = self._plans.pop(result.job_id, None)
            if plan is None or plan.kind is not JobKind.LOAD:
                continue
            finished_recving.add(plan.request_id)
            if not result.success:
                self._failed_requests.add(plan.request_id)
                if len(plan.groups) == 1:
                    self._failed_blocks.update(plan.groups[0].gpu_block_ids)
        return finished_recving

    def get_transfer_results(self) -> Any:
        recving, failed = self._finished()
        return v.KVConnectorTransferResults(finished_recving=recving, failed_recving=failed)

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def build_worker_meta(self) -> KvcoreWorkerMetadata | None:
        if not self._reports:
            return None
        meta = KvcoreWorkerMetadata(tuple(self._reports))
        self._reports = []
        return meta

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every job this rank submitted (shutdown, tests)."""
        if self.transfer is not None:
            self.transfer.wait(list(self._plans), timeout)

    def shutdown(self) -> None:
        """Close the engine once its jobs finish; their reports are still owed to the
        scheduler (``build_worker_meta``), and its loads to vLLM (``get_finished``):
        dropped, a store's keys stay WRITING and a load's request waits forever."""
        if self.transfer is not None:
            engine = self.transfer
            engine.close()
            self.transfer = None
            self._recving_owed |= self._collect(engine.poll())
