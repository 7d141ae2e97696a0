"""The bug zoo: known upstream bugs re-created as small, isolated patches of kvcore.

Each mutant is a context manager that patches one name in one implementation module (or
swaps in a subclass) for the duration of a check, and never touches the shipped code
path otherwise. ``kvcore check --mutants`` runs the CI battery under each and expects it
to fail: a mutant that survives means the checks have a blind spot.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any
from unittest import mock

from kvcore.scheduler import (
    OffloadScheduler,
    ScheduledRequest,
    StepInput,
    StepPlan,
    _lookup,
    _rules,
    _store,
)
from kvcore.scheduler import scheduler as _sched
from kvcore.scheduler._rules import GroupOffer
from kvcore.scheduler._state import JobTable
from kvcore.spec.invariants import Skip
from kvcore.spec.plans import GroupTransfer, TransferPlan
from kvcore.spec.types import OffloadConfig

Factory = Callable[..., OffloadScheduler]


@dataclass(frozen=True)
class Mutant:
    """A re-created bug: where it came from, the layouts that show it, how to apply it."""

    name: str
    origin: str
    presets: tuple[str, ...]
    expect: str
    apply: Callable[[], contextlib.AbstractContextManager[Factory | None]]


# -- store rules -------------------------------------------------------------------------


def _offer_patch(wrap: Callable[..., GroupOffer]) -> Callable[[], Any]:
    @contextlib.contextmanager
    def apply() -> Iterator[None]:
        original = _rules.group_offer
        with mock.patch.object(_store, "group_offer", functools.partial(wrap, original)):
            yield None
    return apply


def _draft_as_ordinary(original: Any, cfg: OffloadConfig, group: int, *args: Any) -> GroupOffer:
    plain = replace(cfg, groups=tuple(replace(g, is_draft=False) for g in cfg.groups),
                    speculative=False)
    return original(plain, group, *args)  # type: ignore[no-any-return]


def _cursor_jumps_hold_back(original: Any, cfg: OffloadConfig, group: int, cursor: int,
                            frontier: int, storable: int, table: Any) -> GroupOffer:
    offer: GroupOffer = original(cfg, group, cursor, frontier, storable, table)
    end = storable // cfg.groups[group].tokens_per_chunk
    if cfg.groups[group].is_draft and end > offer.new_cursor:
        return replace(offer, new_cursor=end)
    return offer


def _window_keeps_w(original: Any, cfg: OffloadConfig, group: int, *args: Any) -> GroupOffer:
    offer: GroupOffer = original(cfg, group, *args)
    rule = _rules.keep_rule(cfg, group)
    g = cfg.groups[group]
    if rule is None or not g.is_draft:
        return offer
    a = rule[0]
    window = g.window_chunks or 1
    keep = tuple(c for c in offer.offered if c % a >= a - window)
    skipped = dict(offer.skipped)
    skipped.update({c: Skip.UNREACHABLE for c in offer.offered if c not in keep})
    return replace(offer, offered=keep, skipped=skipped)


# -- lookup rules ------------------------------------------------------------------------


def _pop_patch(rule: Callable[[OffloadConfig, int, int], int]) -> Callable[[], Any]:
    @contextlib.contextmanager
    def apply() -> Iterator[None]:
        original = _lookup.converge

        def converge(cfg: OffloadConfig, computed: int, num_tokens: int, num_keys: Any,
                     is_hit: Any, extra_chunks: Any = None) -> Any:
            return original(cfg, computed, num_tokens, num_keys, is_hit,
                            lambda g, n: rule(cfg, g, n))
        with mock.patch.object(_sched, "converge", converge):
            yield None
    return apply


@contextlib.contextmanager
def _pending_as_hit() -> Iterator[None]:
    original = _lookup.converge
    calls: list[int] = []

    def converge(cfg: OffloadConfig, computed: int, num_tokens: int, num_keys: Any,
                 is_hit: Any, extra_chunks: Any = None) -> Any:
        calls.append(1)
        if len(calls) % 2 == 0:  # the pessimistic run: answer as the optimistic one did
            return converge.last  # type: ignore[attr-defined]
        converge.last = original(  # type: ignore[attr-defined]
            cfg, computed, num_tokens, num_keys, is_hit)
        return converge.last  # type: ignore[attr-defined]
    with mock.patch.object(_sched, "converge", converge):
        yield None


# -- jobs, fence, copies -----------------------------------------------------------------


def _method_patch(target: Any, name: str, make: Callable[[Any], Any]) -> Callable[[], Any]:
    @contextlib.contextmanager
    def apply() -> Iterator[None]:
        with mock.patch.object(target, name, make(getattr(target, name))):
            yield None
    return apply


def _failed_counted_as_done(original: Any) -> Any:
    def _complete(self: OffloadScheduler, job: Any, *args: Any) -> None:
        job.failed = False
        original(self, job, *args)
    return _complete


def _no_stale_zeroing(_original: Any) -> Any:
    def _zero(self: OffloadScheduler, allocated: frozenset[int]) -> None:
        return None
    return _zero


def _stale_zeroing_ahead_of_cursor_only(_original: Any) -> Any:
    def _zero(self: OffloadScheduler, allocated: frozenset[int]) -> None:
        for gpu_id in allocated:
            for req, group, pos in self._window_index.pop(gpu_id, None) or ():
                table = req.tables[group]
                bpc = self.config.groups[group].blocks_per_chunk
                if pos < len(table) and table[pos] == gpu_id and pos >= req.cursors[group] * bpc:
                    table[pos] = 0
    return _zero


def _no_fence(_original: Any) -> Any:
    def jobs_reading(self: JobTable, ids: frozenset[int]) -> set[int]:
        return set()
    return jobs_reading


def _unchecked_block_id(original: Any) -> Any:
    def build_store(cfg: OffloadConfig, *args: Any) -> Any:
        built = original(cfg, *args)
        groups = list(built.plan.groups)
        for i, gt in enumerate(groups):
            if gt.gpu_block_ids:
                ids = (cfg.num_gpu_blocks, *gt.gpu_block_ids[1:])
                groups[i] = GroupTransfer(ids, gt.block_index, gt.cpu_slots, gt.keys)
                break
        plan = TransferPlan(built.plan.job_id, built.plan.kind, built.plan.request_id,
                            tuple(groups))
        return replace(built, plan=plan)
    return build_store


def _lookup_ignores_jobs(original: Any) -> Any:
    def lookup(self: OffloadScheduler, request_id: str, computed: int, num_tokens: int) -> Any:
        req = self._reqs.get(request_id)
        saved = set(req.jobs) if req is not None else set()
        if req is not None:
            req.jobs.clear()
        try:
            return original(self, request_id, computed, num_tokens)
        finally:
            if req is not None:
                req.jobs.update(saved)
    return lookup


class _FinishStoresUnwritten(OffloadScheduler):
    """vllm#54288: at finish, store up to num_tokens although the last token has no KV."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._finish_stores: list[TransferPlan] = []

    def request_finished(self, request_id: str) -> None:
        req = self._reqs.get(request_id)
        if req is not None and not req.jobs:
            n = min([len(req.hashes) * self.config.hash_block_tokens] +
                    [len(t) * g.tokens_per_block
                     for t, g in zip(req.tables, self.config.groups, strict=True)])
            plan = self._store_step(req, ScheduledRequest(request_id, 0, n, n))
            if plan is not None:
                self._finish_stores.append(plan)
        super().request_finished(request_id)

    def build_step(self, step: StepInput) -> StepPlan:
        plan = super().build_step(step)
        extra, self._finish_stores = tuple(self._finish_stores), []
        return replace(plan, stores=plan.stores + extra)


@contextlib.contextmanager
def _factory(cls: type[OffloadScheduler]) -> Iterator[Factory]:
    yield cls


def _all_groups_draft(cfg: OffloadConfig, group: int, _n: int) -> int:
    return 1


def _double_pop(cfg: OffloadConfig, group: int, _n: int) -> int:
    return 2 if cfg.groups[group].is_draft else 0


def _pop_once_only(cfg: OffloadConfig, group: int, n: int) -> int:
    return 1 if cfg.groups[group].is_draft and n == 0 else 0


MUTANTS: tuple[Mutant, ...] = (
    Mutant("draft-tail-stored", "vllm#44780 (before #44784): draft groups treated as "
           "ordinary, so the volatile tail is stored", ("llama3-eagle3", "deepseek-v4-mtp"),
           "E1", _offer_patch(_draft_as_ordinary)),
    Mutant("store-cursor-hole", "vllm#44784: the cursor jumps over the held-back chunk",
           ("llama3-eagle3", "deepseek-v4-mtp"), "E2", _offer_patch(_cursor_jumps_hold_back)),
    Mutant("all-groups-draft-fallback", "vllm#52735: every group treated as draft, which "
           "zeroed hybrid Mamba hits", ("qwen3-next-mtp",), "E3",
           _pop_patch(_all_groups_draft)),
    Mutant("window-store-keeps-w", "vllm#53951: a draft window group keeps W chunks per "
           "segment, never the extra one its lookup needs", ("deepseek-v4-mtp",), "E2",
           _offer_patch(_window_keeps_w)),
    Mutant("double-pop", "a draft group's extra chunk popped twice per verification",
           ("llama3-eagle3", "deepseek-v4-mtp"), "E3", _pop_patch(_double_pop)),
    Mutant("pop-not-rearmed", "the pop is not re-armed after another group shrinks the "
           "boundary", ("deepseek-v4-mtp", "qwen3-next-mtp"), "E3",
           _pop_patch(_pop_once_only)),
    Mutant("failed-transfer-counted", "dynamo#15079: a failed transfer counted as done",
           ("gpt-oss", "llama3-eagle3"), "X1",
           _method_patch(OffloadScheduler, "_complete", _failed_counted_as_done)),
    Mutant("unchecked-block-id", "vllm#44780: an out-of-range block id reaches the copy",
           ("gpt-oss",), "B1", _method_patch(_store, "build_store", _unchecked_block_id)),
    Mutant("finished-stores-unwritten", "vllm#54288: a finished request stores tokens "
           "whose KV was never written", ("llama3-eagle3", "deepseek-v3-mtp"), "E1",
           lambda: _factory(_FinishStoresUnwritten)),
    Mutant("stale-window-block-stored", "vllm: a freed, re-allocated window block stored "
           "under its old key", ("gpt-oss", "gemma3"), "integrity",
           _method_patch(OffloadScheduler, "_zero_stale_window_blocks", _no_stale_zeroing)),
    Mutant("reset-restores-stale-blocks", "kvcore (found by the simulator): after reset, "
           "stale window blocks behind the cursor are stored again", ("gpt-oss",),
           "integrity", _method_patch(OffloadScheduler, "_zero_stale_window_blocks",
                                      _stale_zeroing_ahead_of_cursor_only)),
    Mutant("no-fence", "a store's source block reused before the store is waited on",
           ("gpt-oss", "deepseek-v4-mtp"), "F1",
           _method_patch(JobTable, "jobs_reading", _no_fence)),
    Mutant("pending-read-as-hit", "PENDING keys treated as hits: a lookup answers before "
           "the data is ready", ("gpt-oss", "llama3-eagle3"), "L2", _pending_as_hit),
    Mutant("lookup-while-jobs", "a lookup answered while the request's jobs are in flight",
           ("llama3-eagle3", "gpt-oss"), "J1",
           _method_patch(OffloadScheduler, "lookup", _lookup_ignores_jobs)),
)
