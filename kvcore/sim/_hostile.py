"""Bad calls among the simulator's valid traffic (A1): ``kvcore check``'s "bad calls" stage.

``Hostile`` stands between the simulator and the scheduler. Before a share of the real
hook calls it makes one bad twin of that call, built from the real arguments with one
thing made wrong in a way no state can excuse: an unknown or duplicate request, a
negative or bool count, computed tokens past the end, a GPU id outside the pool, a null
in a FULL group or one of its blocks at two positions, an allocated id that cannot
exist, a table for the wrong number of groups, a report from a worker that does not
exist or for a job never issued, a second report from one worker, a hash of the wrong
type or length, a hook on a request the engine finished, tokens past the hashes given,
a load asked for while the request's own jobs run, more valid blocks than a table holds,
a step that is not a ``StepInput``, a report or a reset for a load ``after_alloc``
queued but no step has handed to the workers yet. The twin must raise a kvcore argument
error and leave the scheduler, its tier and the tier's policy exactly as they were (a
deep ``snapshot``); then the real call goes through. Bounded: at most one twin per real
call, about three in ten calls, at most ``limit`` (60) in a run beyond each kind's
first; of the twins a call offers, one of the kinds bounced least so far (a kind never
bounced yet always is).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from kvcore._checks import enforce
from kvcore.scheduler import RequestInfo, ScheduledRequest, StepInput, WorkerReport
from kvcore.sim._snapshot import snapshot
from kvcore.spec.errors import BlockIdError, InvariantViolation, KVCoreError
from kvcore.spec.invariants import BadCallRecord
from kvcore.spec.lookup import served_chunks as spec_served_chunks
from kvcore.spec.types import MAX_HASH_BYTES, GroupKind

Twin = tuple[str, Callable[[], object]]


class Hostile:
    """The scheduler's hooks, each preceded now and then by a bad twin that must bounce."""

    def __init__(self, impl: Any, rng: random.Random, counts: dict[str, int], *,
                 rate: float = 0.3, limit: int = 60) -> None:
        self.impl = impl
        self.rng = rng
        self.counts = counts
        self.rate = rate
        self.left = limit
        self.used: dict[str, int] = {}
        # Twins whose one bad block id is known (``_id_twin``): name -> (that id, the
        # start of the argument its error must name, "" when any).
        self.bad_ids: dict[str, tuple[int, str]] = {}
        # Twins whose error must name one argument, or say one phrase (``_arg_twin``):
        # name -> (that argument or None, that phrase or None).
        self.arguments: dict[str, tuple[str | None, str | None]] = {}
        cfg = impl.config
        self.top = cfg.num_gpu_blocks
        self.full = [g for g, spec in enumerate(cfg.groups) if spec.kind is GroupKind.FULL]
        self.workers = cfg.num_workers
        self.skipping: set[str] = set()  # requests added with skip_reading
        self.finished: set[str] = set()  # requests the engine finished
        # The job ids after_alloc queued since the last build_step: until that step hands
        # them to the workers, a report for one or a reset must be refused.
        self.queued: list[int] = []
        self.queued_for: list[str] = []  # their requests
        # The length of the hashes the scheduler has taken so far (read from the calls
        # that went through, not from the scheduler): once set, hashes of another length
        # must be refused (HashError) however consistent they are among themselves.
        self.hash_len: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.impl, name)

    # -- the bounce ------------------------------------------------------------------------

    def _bounce(self, twins: list[Twin]) -> None:
        # A kind of twin not bounced yet always is, outside the limit (when one applies
        # only now and then, a skipping request's load, the odds alone could miss it for
        # a whole run, and the kinds every call offers would spend the limit before it
        # came up: a window block before the verified chunks on gpt-oss did); the others
        # at ``rate``, within ``limit``.
        if not twins:
            return
        if all(name in self.used for name, _ in twins):
            if self.left <= 0 or self.rng.random() >= self.rate:
                return
            self.left -= 1
        # The kind bounced least so far: a twin that applies only now and then (a resumed
        # table) is not starved by the ones every call offers.
        least = min(self.used.get(name, 0) for name, _ in twins)
        name, call = self.rng.choice([t for t in twins if self.used.get(t[0], 0) == least])
        self.used[name] = self.used.get(name, 0) + 1
        before = snapshot(self.impl)
        raised: BaseException | None = None
        try:
            call()
        except InvariantViolation:
            raise  # a check inside kvcore fired on the way: that is its own failure
        except Exception as exc:  # judged by the predicate: which class, and what changed
            raised = exc
        changed = snapshot(self.impl) != before
        enforce([BadCallRecord(name, type(raised).__name__ if raised else None,
                               isinstance(raised, KVCoreError), changed,
                               self._says(name, raised))], self.counts)

    def _id_twin(self, name: str, bad_id: int, call: Callable[[], object],
                 argument: str = "") -> Twin:
        """A twin whose one fault is the block id ``bad_id`` (the null block or the pool's
        size): its error must name that id and the range it breaks, and where the fault
        sits in one request's tables, an argument starting with ``argument``."""
        self.bad_ids[name] = (bad_id, argument)
        return name, call

    def _arg_twin(self, name: str, argument: str | None, call: Callable[[], object], *,
                  says: str | None = None) -> Twin:
        """A twin whose one fault is the value of ``argument``: its error must name it
        (a refusal for another reason, the tier's, would hide a rule that let it by) and,
        given ``says``, say that (the range a value breaks)."""
        self.arguments[name] = (argument, says)
        return name, call

    def _says(self, name: str, raised: BaseException | None) -> str:
        """What a refused argument's or block id's error gets wrong ("" if right): the
        argument it names; for a block id also the id and the range it gives,
        1..num_gpu_blocks-1 (0..num_gpu_blocks-1 past the pool)."""
        if name in self.arguments and raised is not None:
            want, says = self.arguments[name]
            # An argument error names an argument; a ConfigError the config field to fix.
            argument = getattr(raised, "argument", None) or getattr(raised, "field", None)
            if want is not None and argument != want:
                return f"names {argument!r}; the fault is in {want}"
            if says is not None and says not in str(raised):
                return f"does not say {says!r}"
            return ""
        known = self.bad_ids.get(name)
        if known is None or raised is None:
            return ""
        value, argument = known
        if not isinstance(raised, BlockIdError):
            return f"raised {type(raised).__name__}; a bad block id is a BlockIdError"
        bound = f"1..{self.top - 1}" if value == 0 else f"..{self.top - 1}"
        if raised.value != value or bound not in raised.bound:
            return (f"says {raised.argument}={raised.value!r} outside {raised.bound!r}; "
                    f"the bad id is {value}, the range {bound}")
        if not str(raised.argument).startswith(argument):
            return f"names {raised.argument!r}; the bad id is in {argument}..."
        return ""

    def _tables(self, tables: Any, group: int, value: object, index: int = 0
                ) -> tuple[tuple[Any, ...], ...]:
        """``tables`` with ``value`` at ``index`` of ``group``'s (an empty one gets it)."""
        out = [tuple(t) for t in tables]
        row = list(out[group]) or [value]
        row[index] = value
        out[group] = tuple(row)
        return tuple(out)

    def _repeated(self, tables: Any) -> tuple[tuple[Any, ...], ...] | None:
        """``tables`` with a FULL group's second id made its first (one block at two
        positions), where a FULL group has two ids or more; else None."""
        for g in self.full:
            if len(tables[g]) >= 2:
                return self._tables(tables, g, tables[g][0], 1)
        return None

    def _finished_twins(self, hook: str, call: Callable[[str], object]) -> list[Twin]:
        """``call`` on a request the engine finished whose jobs are still in flight (it
        stays tracked until they settle): refused as if gone, since its blocks are freed."""
        gone = sorted(self.finished & self.impl.tracked_requests())
        if not gone:
            return []
        return [self._arg_twin(f"{hook}: a finished request", None,
                               partial(call, gone[0]), says="was finished")]

    # -- the hooks -------------------------------------------------------------------------

    def add_request(self, info: RequestInfo) -> None:
        s = self.impl
        tracked = sorted(s.tracked_requests())
        twins: list[Twin] = [
            ("add_request: negative prompt", lambda: s.add_request(replace(info,
                                                                            prompt_tokens=-1))),
            ("add_request: not a RequestInfo", lambda: s.add_request(
                (info.request_id, info.prompt_tokens))),
        ]
        if info.block_hashes:
            h = info.block_hashes[0]
            twins.append(("add_request: hash one byte longer", lambda: s.add_request(
                replace(info, block_hashes=(h + b"\0", *info.block_hashes[1:])))))
            # One hash alone, a str of the hash's length: the C scan reads only the first
            # item's type before the others', so one item is its own case.
            twins.append(("add_request: one hash, a str", lambda: s.add_request(
                replace(info, block_hashes=(h.decode("latin-1"),)))))  # type: ignore[arg-type]
        if tracked:
            twins.append(("add_request: a tracked id", lambda: s.add_request(
                replace(info, request_id=tracked[0]))))
        if info.block_hashes and self._longer_hashes:
            longer = tuple(h + b"\0" for h in info.block_hashes)
            twins.append(self._arg_twin(
                "add_request: every hash one byte longer than the scheduler's",
                "len(block_hashes[0])", lambda: s.add_request(replace(info,
                                                                      block_hashes=longer)),
                says=self.HASH_LENGTH))
        self._bounce(twins)
        s.add_request(info)
        self._took(info.block_hashes)
        if info.skip_reading:
            self.skipping.add(info.request_id)

    def add_hashes(self, request_id: str, hashes: Any) -> None:
        s = self.impl
        twins: list[Twin] = [
            ("add_hashes: unknown request", lambda: s.add_hashes("no-such-request", hashes)),
            ("add_hashes: str hashes", lambda: s.add_hashes(request_id,
                                                           [h.hex() for h in hashes])),
            ("add_hashes: one hash, a str", lambda: s.add_hashes(
                request_id, [hashes[0].decode("latin-1")])),
        ]
        if hashes:
            twins += self._finished_twins("add_hashes", lambda rid: s.add_hashes(rid, hashes))
            if self._longer_hashes:
                longer = [h + b"\0" for h in hashes]
                twins.append(self._arg_twin(
                    "add_hashes: every hash one byte longer than the scheduler's",
                    "len(hashes[0])", lambda: s.add_hashes(request_id, longer),
                    says=self.HASH_LENGTH))
        self._bounce(twins if hashes else [])
        s.add_hashes(request_id, hashes)
        self._took(hashes)

    # What a refusal of hashes of another length says (``_validate.hash_length``).
    HASH_LENGTH = "the length of every hash this scheduler has seen"

    def _took(self, hashes: Any) -> None:
        if hashes and self.hash_len is None:
            self.hash_len = len(hashes[0])

    @property
    def _longer_hashes(self) -> bool:
        """Whether the longer-hash twins apply: the scheduler has a hash length, and one
        byte more is still a length a hook takes (at ``MAX_HASH_BYTES`` the hook's own
        check would refuse it as too long, before the scheduler's length is asked)."""
        return self.hash_len is not None and self.hash_len < MAX_HASH_BYTES

    def lookup(self, request_id: str, computed: int, num_tokens: int, **cap: Any) -> Any:
        s = self.impl
        twins: list[Twin] = [
            ("lookup: unknown request", lambda: s.lookup("no-such-request", computed,
                                                        num_tokens)),
            ("lookup: negative computed", lambda: s.lookup(request_id, -1, num_tokens)),
            ("lookup: computed past the end", lambda: s.lookup(request_id, num_tokens + 1,
                                                              num_tokens)),
            ("lookup: bool tokens", lambda: s.lookup(request_id, computed, True)),
            ("lookup: bytes id", lambda: s.lookup(request_id.encode(), computed, num_tokens)),
            # The queries take ids too: an unhashable one must be a kvcore error, not the
            # dict's TypeError.
            ("jobs_of: the id in a list", lambda: s.jobs_of([request_id])),
            ("lookup: negative max_tokens", lambda: s.lookup(request_id, computed, num_tokens,
                                                            max_tokens=-1)),
            ("lookup: float max_tokens", lambda: s.lookup(request_id, computed, num_tokens,
                                                         max_tokens=1.0)),
            # One hash block past every hash given (the simulator sends a request's
            # hashes before its lookup): the chunks there have no keys yet.
            self._arg_twin("lookup: tokens past its hashes", None, lambda: s.lookup(
                request_id, computed, num_tokens + s.config.hash_block_tokens),
                says="but only"),
        ]
        twins += self._finished_twins("lookup", lambda rid: s.lookup(rid, 0, 0))
        self._bounce(twins)
        return s.lookup(request_id, computed, num_tokens, **cap)

    def after_alloc(self, request_id: str, tables: Any, valid: Any, computed: int,
                    load_tokens: int) -> Any:
        s = self.impl
        twins: list[Twin] = [
            ("after_alloc: unknown request", lambda: s.after_alloc(
                "no-such-request", tables, valid, computed, load_tokens)),
            ("after_alloc: negative load", lambda: s.after_alloc(
                request_id, tables, valid, computed, -1)),
            ("after_alloc: load is not the hit", lambda: s.after_alloc(
                request_id, tables, valid, computed, load_tokens + 10**6)),
            ("after_alloc: one token past the hit", lambda: s.after_alloc(
                request_id, tables, valid, computed, load_tokens + 1)),
            ("after_alloc: one table too many", lambda: s.after_alloc(
                request_id, (*tables, tables[0]), (*valid, 0), computed, load_tokens)),
            self._id_twin("after_alloc: id past the pool", self.top, lambda: s.after_alloc(
                request_id, self._tables(tables, 0, self.top), valid, computed, load_tokens)),
            ("after_alloc: bool id", lambda: s.after_alloc(
                request_id, self._tables(tables, 0, True), valid, computed, load_tokens)),
            self._arg_twin("after_alloc: more valid blocks than the table holds",
                           "valid_blocks[0]", lambda: s.after_alloc(
                request_id, tables, (len(tables[0]) + 1, *valid[1:]), computed,
                load_tokens)),
        ]
        if request_id in self.skipping and load_tokens == 0:
            # Its lookup answered 0 without reading the tier: no load may follow it.
            twins.append(self._arg_twin(
                "after_alloc: a load for a request that skips reading", "load_tokens",
                lambda: s.after_alloc(request_id, tables, valid, computed, 1)))
        # (With no load the tables are never planned from: a hole there is no fault.)
        hole = self._window_hole(tables, valid, computed + load_tokens) if load_tokens > 0 \
            else None
        if hole is not None:
            twins.append(self._arg_twin(
                "after_alloc: null inside a window group's load range", None,
                lambda: s.after_alloc(request_id, hole, valid, computed, load_tokens),
                says="null block inside the load range"))
        retained = self._retained(tables, valid, computed, load_tokens) \
            if load_tokens > 0 else None
        if retained is not None:
            table, group, lo = retained
            twins.append(self._arg_twin(
                "after_alloc: a window group's block before the chunks its lookup verified",
                f"groups[{group}].extra_retained_tokens",
                lambda: s.after_alloc(request_id, table, valid, computed, load_tokens),
                says=f"verified chunks from {lo} only"))
        repeated = self._repeated(tables)
        if repeated is not None:
            twins.append(self._arg_twin(
                "after_alloc: a FULL group's block twice", None,
                lambda: s.after_alloc(request_id, repeated, valid, computed, load_tokens),
                says="repeats one"))
        if self.full:
            twins.append(self._id_twin("after_alloc: null in a FULL group", 0,
                                       lambda: s.after_alloc(
                request_id, self._tables(tables, self.full[0], 0), valid, computed,
                load_tokens)))
        self._bounce(twins)
        plan = s.after_alloc(request_id, tables, valid, computed, load_tokens)
        if plan is not None:
            self.queued.append(plan.job_id)
            self.queued_for.append(plan.request_id)
        return plan

    def _retained(self, tables: Any, valid: Any, computed: int, load_tokens: int) -> Any:
        """(tables, group, first verified chunk) with a real block put just before the
        chunks a window group's lookup verified, where the table holds a null there: an
        engine that keeps more than ``window_tokens`` before the boundary without saying
        so (``extra_retained_tokens``). Its load would fill a block the lookup never
        read; the error must name that field and the first chunk verified (the spec's
        ``served_chunks``, not kvcore's). None where no group has such a position."""
        cfg = self.impl.config
        boundary = computed + load_tokens
        for g, spec in enumerate(cfg.groups):
            served = spec_served_chunks(spec, boundary, computed)
            table = tuple(tables[g])
            if spec.kind is GroupKind.FULL or served is None or not served[0]:
                continue
            first_block = served[0] * spec.blocks_per_chunk
            at = first_block - 1  # the block just before the verified chunks
            end = -(-boundary // spec.tokens_per_block)
            if not valid[g] <= at < len(table) or table[at] or first_block >= end:
                continue
            real = next((i for i in table[first_block:end] if i), 0)
            if real:
                return self._tables(tables, g, real, at), g, served[0]
        return None

    def _window_hole(self, tables: Any, valid: Any, boundary: int) -> Any:
        """``tables`` with the last block a window (or Mamba) group loads made null, where
        that group loads two blocks or more (so its first loaded block stays first): null
        blocks are allowed before a window, never inside what is loaded."""
        cfg = self.impl.config
        for g, spec in enumerate(cfg.groups):
            table = tuple(tables[g])
            end = -(-boundary // spec.tokens_per_block)
            if spec.kind is GroupKind.FULL or not 0 < end <= len(table) or valid[g] >= end:
                continue
            start = next((i for i in range(valid[g], end) if table[i]), end)
            if end - start >= 2:
                return self._tables(tables, g, 0, end - 1)
        return None

    def build_step(self, step: StepInput) -> Any:
        self._bounce(self._step_twins(step))
        self.queued, self.queued_for = [], []
        plan = self.impl.build_step(step)
        for sr in step.requests:
            self._took(sr.new_hashes)
        return plan

    def _step_twins(self, step: StepInput) -> list[Twin]:
        s, reqs = self.impl, step.requests
        twins: list[Twin] = [
            self._id_twin("build_step: allocated id 0", 0, lambda: s.build_step(
                replace(step, allocated_ids=step.allocated_ids | {0}))),
            self._id_twin("build_step: allocated id past the pool", self.top,
                          lambda: s.build_step(replace(
                              step, allocated_ids=step.allocated_ids | {self.top}))),
            ("build_step: unknown preempted", lambda: s.build_step(
                replace(step, preempted=(*step.preempted, "no-such-request")))),
            ("build_step: unknown request", lambda: s.build_step(replace(step, requests=(
                *reqs, ScheduledRequest("no-such-request", 1, 0, 1))))),
            self._arg_twin("build_step: not a StepInput", "step",
                           lambda: s.build_step(tuple(reqs)))]
        busy = sorted(r for r in s.tracked_requests() - self.finished if s.jobs_of(r))
        if busy:
            # A load asked for while the request's own jobs run (its lookup would be
            # PENDING, J1): the load would race its store.
            empty = tuple(() for _ in s.config.groups)
            zeros = tuple(0 for _ in s.config.groups)
            twins.append(self._arg_twin(
                "after_alloc: a load while the request's jobs run", None,
                lambda: s.after_alloc(busy[0], empty, zeros, 0, 1),
                says="has jobs in flight"))
        if self.queued:
            # Between after_alloc and the step that hands its load to the workers: a
            # report for that load would unpin the slots it reads, a reset would drop a
            # load whose blocks the engine was promised.
            job = self.queued[0]
            twins += [
                self._arg_twin("worker_output: a load after_alloc queued, before its step",
                               None, lambda: s.worker_output([WorkerReport(0, job)]),
                               says="queued by after_alloc"),
                self._arg_twin("reset: between after_alloc and build_step", None, s.reset,
                               says="between after_alloc and build_step")]
            loading = self.queued_for[0]
            if loading not in step.preempted:
                # Preempted by the step that hands its load out: the load would be
                # submitted into the blocks preemption frees.
                twins.append(self._arg_twin(
                    "build_step: preempting a request whose load it hands out", None,
                    lambda: s.build_step(replace(step, preempted=(*step.preempted, loading))),
                    says="preempted"))
        if reqs:
            first = reqs[0]
            # The last one twice: an error must name it, not the first it meets.
            last = reqs[-1]
            twins.append(self._arg_twin("build_step: one request twice", "requests",
                                        lambda: s.build_step(replace(step,
                                                                     requests=(*reqs, last))),
                                        says=f"request {last.request_id!r} appears twice"))
            # One hash block more than the hashes given (the simulator sends each
            # completed block's hash with the step that completes it).
            more = replace(first, num_tokens=first.num_tokens + s.config.hash_block_tokens)
            twins.append(self._arg_twin(
                "build_step: tokens past its hashes", None, lambda: s.build_step(replace(
                    step, requests=(more, *reqs[1:]))), says="but only"))
            ids = first.new_block_ids
            if ids and any(ids):
                g = next(i for i, t in enumerate(ids) if t)
                twins.append(self._id_twin("build_step: new id past the pool", self.top,
                                           lambda: s.build_step(
                    replace(step, requests=(replace(first, new_block_ids=self._tables(
                        ids, g, self.top)), *reqs[1:]))),
                    f"{first.request_id}.new_block_ids[{g}]"))
                twins.append(("build_step: tables for one group too many", lambda: s.build_step(
                    replace(step, requests=(replace(first, new_block_ids=(*ids, ids[g])),
                                            *reqs[1:])))))
        # The first request with a FULL group's new id, that id made the null block: the
        # C pass that vouches for most steps must refuse it as the Python checks do.
        nulled = next(((k, g) for k, sr in enumerate(reqs) for g in self.full
                       if len(sr.new_block_ids) > g and sr.new_block_ids[g]), None)
        if nulled is not None:
            at, full = nulled
            holder = reqs[at]
            # Built now: the names a lambda would read are reused below.
            null_step = replace(step, requests=(*reqs[:at], replace(
                holder, new_block_ids=self._tables(holder.new_block_ids, full, 0)),
                *reqs[at + 1:]))
            twins.append(self._id_twin(
                "build_step: null in a FULL group's new ids", 0,
                lambda: s.build_step(null_step), f"{holder.request_id}.new_block_ids[{full}]"))
        # The first request with new hashes, each one byte longer than the scheduler's.
        hashed = next((k for k, sr in enumerate(reqs) if sr.new_hashes), None)
        if hashed is not None and self._longer_hashes:
            sr = reqs[hashed]
            longer = replace(sr, new_hashes=tuple(h + b"\0" for h in sr.new_hashes))
            twins.append(self._arg_twin(
                "build_step: new hashes one byte longer than the scheduler's",
                f"len({sr.request_id}.new_hashes[0])", lambda: s.build_step(replace(
                    step, requests=(*reqs[:hashed], longer, *reqs[hashed + 1:]))),
                says=self.HASH_LENGTH))
        # The first request with a FULL group's two new ids, that group's id repeated.
        found = next(((k, r) for k, sr in enumerate(reqs) if sr.new_block_ids
                      and (r := self._repeated(sr.new_block_ids)) is not None), None)
        if found is not None:
            k, repeated = found
            twins.append(self._arg_twin(
                "build_step: a FULL group's new block twice", None,
                lambda: s.build_step(replace(step, requests=(
                    *reqs[:k], replace(reqs[k], new_block_ids=repeated), *reqs[k + 1:]))),
                says="repeats one"))
        twins += self._short_resume(step)
        return twins

    def _short_resume(self, step: StepInput) -> list[Twin]:
        """A resumed request whose re-sent table lacks the block holding its last
        computed token (a resumed table replaces the old one whole)."""
        s, cfg = self.impl, self.impl.config
        for k, sr in enumerate(step.requests):
            if not sr.resumed or not sr.new_block_ids or sr.request_id in step.preempted:
                continue
            frontier = min(sr.computed_tokens + sr.scheduled_tokens, sr.num_tokens)
            for g, ids in enumerate(sr.new_block_ids):
                need = -(-frontier // cfg.groups[g].tokens_per_block)
                if need and len(ids) >= need:
                    tables = list(sr.new_block_ids)
                    tables[g] = ids[:need - 1]
                    short = replace(sr, new_block_ids=tuple(tables))
                    reqs = (*step.requests[:k], short, *step.requests[k + 1:])
                    bad = replace(step, requests=reqs)
                    return [("build_step: resumed table one block short",
                             partial(s.build_step, bad))]
        return []

    def worker_output(self, reports: Any) -> Any:
        s, reports = self.impl, list(reports)
        twins: list[Twin] = [
            ("worker_output: a job never issued", lambda: s.worker_output(
                [*reports, WorkerReport(0, 2**40)])),
            ("worker_output: not a list", lambda: s.worker_output(5)),
            ("worker_output: a tuple among the reports", lambda: s.worker_output(
                [*reports, (0, 1, True, 0, 0.0)])),
        ]
        live = {j for rid in s.tracked_requests() for j in s.jobs_of(rid)}
        mine = [r for r in reports if r.job_id in live]  # reports for reset jobs are ignored
        if mine:
            r = mine[0]
            twins += [
                self._arg_twin("worker_output: a worker that does not exist", None,
                               lambda: s.worker_output([*reports,
                                                        replace(r, worker=self.workers)]),
                               says=f"0..{self.workers - 1}"),
                ("worker_output: the same report twice", lambda: s.worker_output(
                    [*reports, r])),
            ]
        self._bounce(twins)
        return s.worker_output(reports)

    def request_finished(self, request_id: str) -> None:
        s = self.impl
        self._bounce([("request_finished: unknown request",
                       lambda: s.request_finished("no-such-request"))])
        s.request_finished(request_id)
        self.finished.add(request_id)
