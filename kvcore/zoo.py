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

from kvcore.manager._cpu import CPUOffloadManager
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
from kvcore.scheduler._lookup import Convergence
from kvcore.scheduler._rules import GroupOffer
from kvcore.scheduler._state import GroupKeys, Job, JobTable, StaleWindows
from kvcore.spec.errors import InvariantViolation
from kvcore.spec.invariants import Skip, TraceEntry, Violation
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import PENDING, GroupKind, GroupSpec, OffloadConfig, Status

Factory = Callable[..., OffloadScheduler]


def _always(_cfg: OffloadConfig) -> bool:
    return True


@dataclass(frozen=True)
class Mutant:
    """A re-created bug: where it came from, the layouts that show it, how to apply it.

    ``expect`` is the check that must catch it (an invariant id, or ``integrity``);
    ``applies`` says whether the bug can change behaviour on a layout at all (else the
    mutant is reported "n/a on this layout"); ``layouts`` are the presets (or zoo
    layouts, ``LAYOUTS``) it is run on when the user names none. ``at_runtime``: the
    catch must come from a hook's own check (what ``KVCORE_CHECK=1`` gives an engine),
    not from a harness beside it; False where only a harness can see the bug (a
    scheduler told a failed copy succeeded cannot know better; wrong bytes show only
    when read back). ``needs_stores``: the bug acts on what was stored (a store, a job,
    a load, a hit, an eviction, an event); on a layout that stores nothing
    (``max_offload_tokens = 0``) it cannot change behaviour, so it is n/a there.
    """

    name: str
    origin: str
    layouts: tuple[str, ...]
    expect: str
    apply: Callable[[], contextlib.AbstractContextManager[Factory | None]]
    applies: Callable[[OffloadConfig], bool] = _always
    at_runtime: bool = True
    needs_stores: bool = True

    def can_matter(self, cfg: OffloadConfig) -> bool:
        """Whether the bug can change behaviour on ``cfg`` (else it is reported n/a)."""
        return (not self.needs_stores or cfg.max_offload_tokens != 0) and self.applies(cfg)


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
                     is_hit: Any, extra_chunks: Any = None, max_tokens: int | None = None
                     ) -> Any:
            return original(cfg, computed, num_tokens, num_keys, is_hit,
                            lambda g, n: rule(cfg, g, n), max_tokens=max_tokens)
        with mock.patch.object(_sched, "converge", converge):
            yield None
    return apply


def _lookup_hit_patch(mode: str) -> Callable[[], Any]:
    """The lookup's PENDING rule broken: ``as-hit`` answers with PENDING read as HIT (no
    second run); ``as-miss`` with PENDING read as MISS; ``any-unknown`` answers PENDING
    whenever a scanned key is unknown, even when the answer cannot change (vLLM 0.33).
    Stateless, so one lookup's answer never leaks into another's."""
    def _lookup_hit(self: OffloadScheduler, req: Any, computed: int, num_tokens: int,
                    max_tokens: int | None = None
                    ) -> tuple[Any, Any, None]:
        statuses: dict[tuple[int, int], Status] = {}

        def status(group: int, idx: int) -> Status:
            if (group, idx) not in statuses:
                statuses[(group, idx)] = self.manager.lookup(req.keys[group][idx])
            return statuses[(group, idx)]
        num_keys = [len(k) for k in req.keys]
        hits = (Status.HIT,) if mode == "as-miss" else (Status.HIT, Status.PENDING)
        # The module's name, not _lookup's: a patched loop (another mutant) is seen too.
        conv = _sched.converge(  # type: ignore[attr-defined]
            self.config, computed, num_tokens, num_keys, lambda g, i: status(g, i) in hits,
            max_tokens=max_tokens)
        if mode == "any-unknown" and Status.PENDING in statuses.values():
            return PENDING, conv, None  # no reader: the touch derives its keys
        if conv.hit > 0 and self._being_loaded(req, computed, conv.hit):
            return PENDING, conv, None
        return conv.hit, conv, None
    return _method_patch(OffloadScheduler, "_lookup_hit", lambda _orig: _lookup_hit)


def _converge_patch(*, min_per_group: bool = False, rearm_on_draft_shrink: bool = True,
                    reverify_mamba: bool = True) -> Callable[[], Any]:
    """kvcore's convergence loop with one of vLLM 0.33's rules put back (a differential
    run against its lookup showed each): the one-chunk minimum checked per group against
    that group's own chunk when it is visited, so a group visited before the last shrink
    is never re-checked; re-verification only after a non-draft group shrinks the
    boundary; Mamba groups never re-verified, so a shrink leaves the hit off their chunk."""
    def converge(cfg: OffloadConfig, computed: int, num_tokens: int, num_keys: Any,
                 is_hit: Any, extra_chunks: Any = None, max_tokens: int | None = None
                 ) -> Convergence:
        min_new = max(g.tokens_per_chunk for g in cfg.groups)
        boundary = _rules.lookup_limit(cfg, num_tokens)
        if max_tokens is not None:
            boundary = min(boundary, computed + max_tokens)
        for i, g in enumerate(cfg.groups):
            boundary = min(boundary, max(num_keys[i] - g.extra_chunks, 0) * g.tokens_per_chunk)
        trace: list[TraceEntry] = []
        floor0 = min(g.tokens_per_chunk for g in cfg.groups) if min_per_group else min_new
        if boundary - computed < floor0:
            return Convergence(0, ())
        order = _lookup.lookup_order(cfg)
        verified_at: dict[int, int] = {}
        armed = dict.fromkeys(order, True)  # whether a draft group pops at its next visit
        pending = list(order)
        for _ in range(boundary - computed + 2):
            shrunk_by_plain = False
            for group in pending:
                g = cfg.groups[group]
                extra = g.extra_chunks if armed[group] else 0
                armed[group] = rearm_on_draft_shrink
                result, query = _lookup.largest_supported(
                    g, group, boundary, computed, num_keys[group], is_hit, extra)
                trace.append(TraceEntry(group, boundary, query, result, extra))
                floor = g.tokens_per_chunk if min_per_group else min_new
                if result - computed < floor:
                    return Convergence(0, tuple(trace))
                shrunk_by_plain |= result < boundary and not g.is_draft
                boundary = result
                verified_at[group] = boundary
            if shrunk_by_plain:
                armed = dict.fromkeys(order, True)
            pending = [g for g in order if verified_at[g] > boundary
                       and _lookup._needs_reverify(cfg.groups[g])
                       and (reverify_mamba or cfg.groups[g].kind is not GroupKind.MAMBA)]
            if not pending:
                return Convergence(boundary - computed, tuple(trace))
        raise InvariantViolation([Violation("E3", "lookup convergence loop exceeded its "
                                            "bound", {"computed": computed})])

    @contextlib.contextmanager
    def apply() -> Iterator[None]:
        with mock.patch.object(_sched, "converge", converge):
            yield None
    return apply


# -- jobs, fence, copies -----------------------------------------------------------------


def _method_patch(target: Any, name: str, make: Callable[[Any], Any]) -> Callable[[], Any]:
    @contextlib.contextmanager
    def apply() -> Iterator[None]:
        with mock.patch.object(target, name, make(getattr(target, name))):
            yield None
    return apply


def _events_never_dropped(_original: Any) -> Any:
    """The buffer past its bound keeps every event (nothing drops the oldest)."""
    def _drop_oldest(self: CPUOffloadManager, excess: int) -> None:
        pass
    return _drop_oldest


def _failed_counted_as_done(original: Any) -> Any:
    def _complete(self: OffloadScheduler, job: Any, *args: Any) -> None:
        job.failed = False
        original(self, job, *args)
    return _complete


def _no_stale_zeroing(_original: Any) -> Any:
    def zero_stale(self: StaleWindows, *_args: Any) -> None:
        return None
    return zero_stale


def _reset_forgets_stale_blocks(original: Any) -> Any:
    """After a reset every table position counts as placed now: a block that went stale
    behind the store cursor is no longer seen as stale when the cursor restarts at 0."""
    def reset(self: OffloadScheduler) -> tuple[int, ...]:
        flush: tuple[int, ...] = original(self)
        for req in self._reqs.values():
            for placed in req.placed:
                if placed.steps:  # one run from position 0, placed now
                    del placed.starts[1:], placed.steps[1:]
                    placed.steps[0] = self._stale.step
        return flush
    return reset


def _pins_ignored(original: Any) -> Any:
    """The victim walk no longer sees the pins (the count guard still does)."""
    def _choose(self: CPUOffloadManager, *args: Any) -> Any:
        pins, self._pins = self._pins, {}
        try:
            return original(self, *args)
        finally:
            self._pins = pins
    return _choose


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
    def lookup(self: OffloadScheduler, request_id: str, computed: int, num_tokens: int, *,
               max_tokens: int | None = None) -> Any:
        req = self._reqs.get(request_id)
        saved = set(req.jobs) if req is not None else set()
        if req is not None:
            req.jobs.clear()
        try:
            return original(self, request_id, computed, num_tokens, max_tokens=max_tokens)
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


def _store_ignores_loads(original: Any) -> Any:
    def _store_step(self: OffloadScheduler, req: Any, sr: ScheduledRequest) -> Any:
        loads = {j for j in req.jobs if self._jobs.jobs[j].plan.kind is JobKind.LOAD}
        req.jobs -= loads
        try:
            return original(self, req, sr)
        finally:
            req.jobs |= loads
    return _store_step


def _keys_without_group(original: Any) -> Any:
    """Every group's keys made as group 0's: the chunk hash alone names the bytes."""
    def __init__(self: GroupKeys, hashes: Any, hashes_per_chunk: int, _group: int) -> None:
        original(self, hashes, hashes_per_chunk, 0)
    return __init__


def _load_starts_late(original: Any) -> Any:
    """A load's first block one past the first unfilled one (none when that is the end)."""
    def first_unfilled(table: Any, valid_blocks: int, end: int) -> int:
        return min(int(original(table, valid_blocks, end)) + 1, end)
    return first_unfilled


def _first_report_settles(_original: Any) -> Any:
    def settled(self: Job, _num_workers: int) -> bool:
        return True
    return settled


@contextlib.contextmanager
def _factory(cls: type[OffloadScheduler]) -> Iterator[Factory]:
    yield cls


def _all_groups_draft(cfg: OffloadConfig, group: int, _n: int) -> int:
    return 1


def _double_pop(cfg: OffloadConfig, group: int, _n: int) -> int:
    return 2 if cfg.groups[group].is_draft else 0


def _pop_once_only(cfg: OffloadConfig, group: int, n: int) -> int:
    return 1 if cfg.groups[group].is_draft and n == 0 else 0


def _two_draft_windows() -> OffloadConfig:
    """Two draft window groups of one chunk each (an MTP model whose drafter has two
    window caches), beside full attention: a draft group may shrink another's boundary."""
    groups = (GroupSpec(GroupKind.FULL, 16, name="attn"),
              GroupSpec(GroupKind.SLIDING, 16, window_tokens=16, is_draft=True, name="swa1"),
              GroupSpec(GroupKind.SLIDING, 16, blocks_per_chunk=2, window_tokens=32,
                        is_draft=True, name="swa2"))
    return OffloadConfig(groups, hash_block_tokens=16, num_gpu_blocks=8192,
                         num_cpu_blocks=16384, speculative=True, name="two-draft-windows")


def _mamba_and_window() -> OffloadConfig:
    """Full attention, Mamba state per 64 tokens and a 32-token window of 16-token chunks:
    the window group, verified after the Mamba group, can shrink the boundary off a Mamba
    chunk end."""
    groups = (GroupSpec(GroupKind.FULL, 16, name="attn"),
              GroupSpec(GroupKind.MAMBA, 64, name="ssm"),
              GroupSpec(GroupKind.SLIDING, 16, window_tokens=32, name="swa"))
    return OffloadConfig(groups, hash_block_tokens=16, num_gpu_blocks=8192,
                         num_cpu_blocks=16384, name="mamba-and-window")


# Layouts the zoo runs on besides the presets: each shows a mutant no preset can.
LAYOUTS: dict[str, Callable[[], OffloadConfig]] = {
    "two-draft-windows": _two_draft_windows,
    "mamba-and-window": _mamba_and_window,
}


def _has_draft(cfg: OffloadConfig) -> bool:
    return any(g.is_draft for g in cfg.groups)


def _has_plain(cfg: OffloadConfig) -> bool:
    return any(not g.is_draft for g in cfg.groups)


def _several_groups(cfg: OffloadConfig) -> bool:
    return len(cfg.groups) > 1


def _has_window(cfg: OffloadConfig) -> bool:
    return any(g.kind is not GroupKind.FULL for g in cfg.groups)


def _draft_window_kept(cfg: OffloadConfig) -> bool:
    return any(g.is_draft and _rules.keep_rule(cfg, i) is not None
               for i, g in enumerate(cfg.groups))


def _draft_then_other(cfg: OffloadConfig) -> bool:
    """A draft group verified before another group, which may then shrink its boundary."""
    order = _lookup.lookup_order(cfg)
    return any(cfg.groups[g].is_draft for g in order[:-1])


def _chunk_sizes_differ(cfg: OffloadConfig) -> bool:
    return len({g.tokens_per_chunk for g in cfg.groups}) > 1


def _two_drafts(cfg: OffloadConfig) -> bool:
    return sum(g.is_draft for g in cfg.groups) >= 2


def _mamba_shrunk_off_chunk(cfg: OffloadConfig) -> bool:
    """A Mamba group verified before a group whose chunk is smaller than its own."""
    order = _lookup.lookup_order(cfg)
    for pos, g in enumerate(order):
        spec = cfg.groups[g]
        if spec.kind is GroupKind.MAMBA and any(
                cfg.groups[h].tokens_per_chunk < spec.tokens_per_chunk
                for h in order[pos + 1:]):
            return True
    return False


V4 = "deepseek-v4-mtp"

MUTANTS: tuple[Mutant, ...] = (
    Mutant("draft-tail-stored", "vllm#44780 (before #44784): draft groups treated as "
           "ordinary, so the volatile tail is stored", ("llama3-eagle3", V4),
           "E1", _offer_patch(_draft_as_ordinary), _has_draft),
    Mutant("store-cursor-hole", "vllm#44784: the cursor jumps over the held-back chunk",
           ("llama3-eagle3", V4), "E2", _offer_patch(_cursor_jumps_hold_back), _has_draft),
    Mutant("all-groups-draft-fallback", "vllm#52735: every group treated as draft, which "
           "zeroed hybrid Mamba hits", ("qwen3-next-mtp", V4), "E3",
           _pop_patch(_all_groups_draft), _has_plain),
    Mutant("window-store-keeps-w", "vllm#53951: a draft window group keeps W chunks per "
           "segment, never the extra one its lookup needs", (V4,), "E2",
           _offer_patch(_window_keeps_w), _draft_window_kept),
    Mutant("double-pop", "a draft group's extra chunk popped twice per verification",
           ("llama3-eagle3", V4), "E3", _pop_patch(_double_pop), _has_draft),
    Mutant("pop-not-rearmed", "the pop is not re-armed after another group shrinks the "
           "boundary", (V4, "qwen3-next-mtp"), "E3", _pop_patch(_pop_once_only),
           _draft_then_other),
    Mutant("failed-transfer-counted", "dynamo#15079: a failed transfer counted as done",
           ("gpt-oss", V4), "X1",
           _method_patch(OffloadScheduler, "_complete", _failed_counted_as_done),
           at_runtime=False),
    Mutant("unchecked-block-id", "vllm#44780: an out-of-range block id reaches the copy",
           ("gpt-oss", V4), "B1", _method_patch(_store, "build_store", _unchecked_block_id)),
    Mutant("finished-stores-unwritten", "vllm#54288: a finished request stores tokens "
           "whose KV was never written", ("llama3-eagle3", V4), "integrity",
           lambda: _factory(_FinishStoresUnwritten), _has_draft, at_runtime=False),
    Mutant("stale-window-block-stored", "vllm: a freed, re-allocated window block stored "
           "under its old key", ("gpt-oss", V4), "integrity",
           _method_patch(StaleWindows, "zero_stale", _no_stale_zeroing),
           _has_window, at_runtime=False),
    Mutant("reset-restores-stale-blocks", "kvcore (found by the simulator): after reset, "
           "stale window blocks behind the cursor are stored again", ("gpt-oss", V4),
           "integrity", _method_patch(OffloadScheduler, "reset", _reset_forgets_stale_blocks),
           _has_window, at_runtime=False),
    Mutant("no-fence", "a store's source block reused before the store is waited on",
           ("gpt-oss", V4), "F1", _method_patch(JobTable, "jobs_reading", _no_fence)),
    Mutant("pending-read-as-hit", "PENDING keys treated as hits: a lookup answers before "
           "the data is ready", ("gpt-oss", V4), "L2", _lookup_hit_patch("as-hit")),
    Mutant("pending-read-as-miss", "PENDING keys treated as misses: a lookup answers "
           "short instead of waiting for a store about to land", ("gpt-oss", V4), "L2",
           _lookup_hit_patch("as-miss")),
    Mutant("lookup-while-jobs", "a lookup answered while the request's jobs are in flight",
           ("llama3-eagle3", V4), "J1",
           _method_patch(OffloadScheduler, "lookup", _lookup_ignores_jobs)),
    Mutant("store-while-loading", "a store issued while the same request's load is in "
           "flight (it reads blocks the load is still writing)", ("gpt-oss", V4), "J1",
           _method_patch(OffloadScheduler, "_store_step", _store_ignores_loads)),
    Mutant("keys-without-group", "hybrid offload keyed by the block hash alone: two "
           "groups' chunks that end on the same hash share one key, so one group is "
           "served the other's bytes", ("gpt-oss", V4), "K1",
           _method_patch(GroupKeys, "__init__", _keys_without_group), _several_groups,
           needs_stores=False),
    Mutant("load-starts-late", "a load planned from one block past the first unfilled "
           "one: the request is told that block holds its prefix, and it holds stale "
           "bytes", ("gpt-oss", V4), "L3",
           _method_patch(_rules, "first_unfilled", _load_starts_late)),
    Mutant("first-report-settles", "a job settled on the first of several TP workers' "
           "reports while the others still copy (slots freed, keys served early)",
           ("gpt-oss", V4), "J2", _method_patch(Job, "settled", _first_report_settles)),
    Mutant("pinned-key-evicted", "an eviction walk that skips the call's own keys but not "
           "the pinned ones: a slot a load is still reading is freed and rewritten",
           ("gpt-oss", V4), "M1", _method_patch(CPUOffloadManager, "_choose", _pins_ignored)),
    Mutant("event-buffer-unbounded", "a tier's event buffer that keeps every event while "
           "nobody drains it: memory grows with each store and eviction", ("gpt-oss", V4),
           "M3", _method_patch(CPUOffloadManager, "_drop_oldest", _events_never_dropped)),
    Mutant("min-chunk-before-last-shrink", "vLLM 0.33: the one-chunk minimum checked per "
           "group when visited, so a later shrink below the largest chunk is served",
           (V4, "mamba-and-window"), "L1", _converge_patch(min_per_group=True),
           _chunk_sizes_differ),
    Mutant("rearm-only-on-plain-shrink", "vLLM 0.33: the pop re-armed only when a non-draft "
           "group shrinks the boundary (two window-1 draft groups)", ("two-draft-windows",),
           "E3", _converge_patch(rearm_on_draft_shrink=False), _two_drafts),
    Mutant("pending-when-any-unknown", "vLLM 0.33: PENDING whenever a scanned key is "
           "unknown, even when no answer for it changes the hit", ("gpt-oss", V4), "L2",
           _lookup_hit_patch("any-unknown"), _several_groups),
    Mutant("mamba-hit-not-rounded", "vLLM 0.33: Mamba groups not re-verified after a "
           "shrink, so the hit ends off a Mamba chunk", ("mamba-and-window",), "L1",
           _converge_patch(reverify_mamba=False), _mamba_shrunk_off_chunk),
)


def layout(name: str) -> OffloadConfig:
    """A preset or a zoo layout by name."""
    from kvcore.presets import PRESETS, preset
    if name in PRESETS:
        return preset(name)
    return LAYOUTS[name]()
