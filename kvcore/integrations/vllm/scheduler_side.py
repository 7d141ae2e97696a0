"""The connector's scheduler half: vLLM's scheduler hooks, translated into kvcore's hooks.

vLLM hands over its own ``Request``, ``KVCacheBlocks``, ``SchedulerOutput`` and
``KVConnectorOutput`` objects; this module turns each into kvcore's plain inputs
(``RequestInfo``, block tables, ``StepInput``, ``WorkerReport``) and back. Every decision
is ``OffloadScheduler``'s; the state kept here is only what vLLM does not repeat: the
hashes already passed on, the local hit seen at lookup, and the GPU ids allocated
between two ``build_connector_meta`` calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from kvcore.integrations.vllm import _compat as v
from kvcore.integrations.vllm.config import ConnectorOptions
from kvcore.integrations.vllm.metadata import KvcoreConnectorMetadata, KvcoreWorkerMetadata
from kvcore.integrations.vllm.metrics import check_counts
from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import OffloadScheduler
from kvcore.scheduler._validate import check_allocated
from kvcore.spec.errors import (
    ArgumentRangeError,
    ArgumentTypeError,
    BadStepError,
    UnknownRequestError,
)
from kvcore.spec.hooks import OutputResult, RequestInfo, ScheduledRequest, StepInput
from kvcore.spec.types import PENDING, Key, key_hash

MEDIUM = "CPU"


class KvcoreConnectorStats(v.KVConnectorStats):  # type: ignore[misc]
    """kvcore's scheduler counters, as vLLM's connector stats (summed when aggregated)."""

    def reset(self) -> None:
        self.data: dict[str, int] = {}

    def aggregate(self, other: Any) -> KvcoreConnectorStats:
        if not isinstance(other, KvcoreConnectorStats):
            raise ArgumentTypeError("KvcoreConnectorStats.aggregate", "other", other,
                                    "KvcoreConnectorStats", "aggregate stats of "
                                    "KvcoreConnector only")
        # Both sides checked before either changes: a bad count halfway through left
        # the target half summed.
        mine = check_counts("KvcoreConnectorStats.aggregate", self.data)
        theirs = check_counts("KvcoreConnectorStats.aggregate", other.data)
        for name, value in theirs.items():
            mine[name] = mine.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(check_counts("KvcoreConnectorStats.reduce", self.data))

    def is_empty(self) -> bool:
        return not any(check_counts("KvcoreConnectorStats.is_empty", self.data).values())


class SchedulerSide:
    """Owns the ``OffloadScheduler`` and its CPU tier for one vLLM engine."""

    def __init__(self, options: ConnectorOptions) -> None:
        self.options = options
        cfg = options.config
        self.manager = CPUOffloadManager.for_config(cfg, options.eviction_policy,
                                                    check=options.check)
        self.scheduler = OffloadScheduler(cfg, self.manager, check=options.check)
        self._requests: dict[str, Any] = {}
        self._hashes_sent: dict[str, int] = {}
        self._local_hit: dict[str, int] = {}
        self._allocated: set[int] = set()
        self._reset_flush: tuple[int, ...] = ()
        # Live requests kvcore does not track: each arrived while an earlier request with
        # its id had finished with stores still in flight (see on_new_request).
        self._untracked: set[str] = set()
        self._reported_stats: dict[str, int] = {}
        self.last_output = OutputResult()

    # -- requests --------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        rid = request.request_id
        # vLLM's block hashes are bytes; they pass unconverted, so anything else is
        # refused by name (bytes(8) would be eight zero bytes: every such request's keys
        # would collide).
        if not isinstance(request.block_hashes, list | tuple):
            raise ArgumentTypeError("on_new_request", "request.block_hashes",
                                    request.block_hashes, "list of bytes",
                                    "enable prefix caching, which gives each request its "
                                    "block hashes")
        hashes = tuple(request.block_hashes)
        params = request.kv_transfer_params
        if params is not None and not isinstance(params, dict):
            raise ArgumentTypeError("on_new_request", "kv_transfer_params", params,
                                    "dict or None", "pass the request's parameters as a dict")
        # A cap the client sent is checked like every other count (RequestInfo names it);
        # an engine that serves untrusted clients validates it where it accepts requests.
        cap = (params or {}).get("max_offload_tokens")
        info = RequestInfo(rid, request.num_prompt_tokens, hashes, cap,
                           bool(request.skip_reading_prefix_cache))  # checks its fields
        if rid not in self._requests and (rid in self._untracked or self._held(rid)):
            # vLLM reuses an id once the old request has left its scheduler, but kvcore
            # keeps a finished request until its stores settle. Refusing the arrival
            # would end the engine (vLLM does not catch it): this request runs without
            # offloading instead (no lookup hit, no stores), and the next one with the id
            # after the stores settle is tracked again.
            self._untracked.add(rid)
            return
        self.scheduler.add_request(info)
        self._requests[rid] = request
        self._hashes_sent[rid] = len(hashes)

    def _held(self, rid: str) -> bool:
        """Whether kvcore still holds a request of this id (finished, jobs in flight):
        O(1), where ``tracked_requests`` copies every id."""
        try:
            self.scheduler.jobs_of(rid)
        except UnknownRequestError:
            return False
        return True

    def _sync_hashes(self, request: Any) -> None:
        """Pass on the block hashes vLLM computed since the last call (tokens were added)."""
        rid = request.request_id
        sent = self._hashes_sent[rid]
        if len(request.block_hashes) > sent:
            self.scheduler.add_hashes(rid, list(request.block_hashes[sent:]))
            self._hashes_sent[rid] = len(request.block_hashes)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   max_num_new_tokens: int | None = None
                                   ) -> tuple[int | None, bool]:
        rid = request.request_id
        fresh = rid not in self._requests and rid not in self._untracked
        if fresh:
            self.on_new_request(request)
        if rid in self._untracked:
            return 0, False
        try:
            self._sync_hashes(request)
            hit = self.scheduler.lookup(rid, num_computed_tokens, request.num_tokens,
                                        max_tokens=max_num_new_tokens)
        except Exception:
            if fresh:  # a refused first lookup leaves nothing tracked (it changes nothing)
                self._forget(rid)
            raise
        if hit is PENDING or not isinstance(hit, int):
            return None, False
        self._local_hit[request.request_id] = num_computed_tokens
        return hit, hit > 0

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Queue the load (if any) and remember the ids vLLM just allocated. The ids are
        recorded only once the call is accepted: a refused call must not make the next
        step flush the jobs reading them."""
        rid = request.request_id
        if rid not in self._requests and rid not in self._untracked:
            raise UnknownRequestError(f"update_state_after_alloc: request {rid!r} was never "
                                      "looked up (get_num_new_matched_tokens)")
        per_group = getattr(blocks, "blocks", None)
        if not isinstance(per_group, list | tuple):
            raise ArgumentTypeError("update_state_after_alloc", "blocks", blocks,
                                    "KVCacheBlocks", "pass the blocks vLLM's KV cache "
                                    "manager allocated")
        if len(per_group) <= max(self.options.group_ids):
            raise BadStepError(f"update_state_after_alloc: blocks holds {len(per_group)} "
                               "block lists, but the KV-cache config has groups up to "
                               f"{max(self.options.group_ids)}; pass one list per group")
        tables = [[int(b.block_id) for b in per_group[gid]] for gid in self.options.group_ids]
        new = [int(b.block_id) for group in per_group for b in group if b.block_id]
        # Checked now, not at the next step: ids kept here go into that step's
        # allocated_ids, and one out of range would make every later step refuse it.
        if new:
            check_allocated(self.options.config, frozenset(new),
                            where="update_state_after_alloc", name="blocks")
        if rid in self._untracked:
            if num_external_tokens != 0:
                raise ArgumentRangeError(
                    "update_state_after_alloc", "num_external_tokens", num_external_tokens,
                    "0: the lookup of this request answered 0 (it runs without offloading)",
                    "pass the number get_num_new_matched_tokens returned")
            self._allocated.update(new)  # its blocks may be read by the old id's stores
            return
        if num_external_tokens != 0:
            local = self._local_hit.get(rid, 0)
            valid = [local // g.tokens_per_block for g in self.options.config.groups]
            self.scheduler.after_alloc(rid, tables, valid, local, num_external_tokens)
        self._allocated.update(new)

    # -- the step --------------------------------------------------------------------------

    def _group_ids(self, block_ids: Any) -> tuple[tuple[int, ...], ...]:
        if block_ids is None:
            return ()
        return tuple(tuple(int(b) for b in block_ids[gid]) for gid in self.options.group_ids)

    def step_input(self, out: Any) -> StepInput:
        """kvcore's view of a ``SchedulerOutput`` (counts from before the step)."""
        scheduled: list[ScheduledRequest] = []
        allocated = set(self._allocated)
        rows: list[tuple[str, Any, int, bool]] = [
            (r.req_id, r.block_ids, r.num_computed_tokens, True)
            for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        rows += [(rid, ids, computed, rid in cached.resumed_req_ids)
                 for rid, ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                               cached.num_computed_tokens, strict=True)]
        for rid, block_ids, computed, whole in rows:
            if rid in self._untracked:
                for group in block_ids or ():
                    allocated.update(b for b in group if b)
                continue
            if rid not in self._requests:
                raise BadStepError(f"request {rid!r} was scheduled but the connector never "
                                   "saw it arrive (on_new_request)")
            request = self._requests[rid]
            self._sync_hashes(request)
            ids = self._group_ids(block_ids)
            for group in block_ids or ():
                allocated.update(b for b in group if b)
            # num_tokens counts prompt and accepted output only: vLLM keeps unverified
            # draft tokens in spec_token_ids, outside all_token_ids.
            scheduled.append(ScheduledRequest(rid, int(out.num_scheduled_tokens.get(rid, 0)),
                                              int(computed), int(request.num_tokens),
                                              ids, (), whole))
        for copy in out.kv_cache_block_copies or ():
            allocated.add(int(copy.dst_block_id))
        preempted = tuple(sorted(r for r in (out.preempted_req_ids or ())
                                 if r in self._requests))
        return StepInput(tuple(scheduled), preempted, frozenset(allocated))

    def build_connector_meta(self, out: Any) -> KvcoreConnectorMetadata:
        if not hasattr(out, "scheduled_new_reqs") or not hasattr(out, "scheduled_cached_reqs"):
            raise ArgumentTypeError("build_connector_meta", "scheduler_output", out,
                                    "SchedulerOutput", "pass vLLM's SchedulerOutput")
        plan = self.scheduler.build_step(self.step_input(out))
        self._allocated.clear()
        flush = tuple(sorted(set(plan.flush) | set(self._reset_flush)))
        self._reset_flush = ()
        return KvcoreConnectorMetadata(plan.loads, plan.stores, flush)

    def update_connector_output(self, output: Any) -> OutputResult:
        if not hasattr(output, "kv_connector_worker_meta"):
            raise ArgumentTypeError("update_connector_output", "output", output,
                                    "KVConnectorOutput", "pass vLLM's KVConnectorOutput")
        meta = output.kv_connector_worker_meta
        if meta is None:
            return OutputResult()
        if not isinstance(meta, KvcoreWorkerMetadata):
            raise BadStepError(f"worker metadata is {type(meta).__name__}, not "
                               "KvcoreWorkerMetadata; every rank must run KvcoreConnector")
        self.last_output = self.scheduler.worker_output(meta.reports)
        return self.last_output

    # -- endings ----------------------------------------------------------------------------

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """GPU blocks are freed at once: stores still reading them are fenced."""
        rid = request.request_id
        self._untracked.discard(rid)
        if rid in self._requests:
            self._forget(rid)
        return False, None

    def _forget(self, rid: str) -> None:
        self.scheduler.request_finished(rid)
        for table in (self._requests, self._hashes_sent, self._local_hit):
            table.pop(rid, None)

    def reset_cache(self) -> bool:
        """Drop the CPU tier; the next step's metadata makes the workers wait for every job."""
        self._reset_flush = tuple(sorted(set(self._reset_flush) | set(self.scheduler.reset())))
        return True

    def take_events(self, group_ids: tuple[int, ...]) -> Iterable[Any]:
        for event in self.scheduler.take_events():
            # In vLLM's published form, so that a router matches these CPU-tier blocks
            # with the GPU blocks vLLM's own events announce for the same prefix.
            block_hash = v.maybe_convert_block_hash(key_hash(Key(event.key)))
            if event.removed:
                yield v.BlockRemoved(block_hashes=[block_hash], medium=MEDIUM,
                                     group_idx=group_ids[event.group])
            else:
                yield v.BlockStored(block_hashes=[block_hash], parent_block_hash=None,
                                    token_ids=[], block_size=0, lora_id=None, medium=MEDIUM,
                                    lora_name=None, group_idx=group_ids[event.group])

    def get_stats(self) -> KvcoreConnectorStats | None:
        """Counters since the last call (vLLM logs intervals)."""
        now = {k: val for k, val in asdict(self.scheduler.stats()).items()
               if isinstance(val, int)}
        delta = {k: val - self._reported_stats.get(k, 0) for k, val in now.items()}
        self._reported_stats = now
        stats = KvcoreConnectorStats(data=delta)
        return None if stats.is_empty() else stats
