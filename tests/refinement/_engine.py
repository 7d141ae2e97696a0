"""A small fake engine that drives the scheduler hooks the way an inference engine does.

No bytes move: a GPU block is an id from a small LIFO pool (freed ids come back first, so
re-allocation, stale window blocks and fence flushes happen within a few steps), and a
job is "in flight" until the test delivers its workers' reports. Every action is an
explicit method with explicit choices, so a Hypothesis rule or a scenario test can say
exactly what happens: ``arrive``, ``admit`` (lookup, allocate, ``after_alloc``), ``step``
(free blocks that left a window, schedule chunked prefill or MTP decode, allocate,
``build_step``, run the forward pass, sample), ``deliver`` (worker reports), ``abort``,
``reset``.

Engine behaviour worth knowing, as in vLLM: a SLIDING group frees the blocks its window
no longer reaches and a MAMBA group every block before its last state block, and both
get null (0) ids for positions outside the reach when a request is admitted; FULL blocks
are freed only when the request ends or is preempted. A lookup makes the scheduler forget
the request's block tables, so the next step that schedules it sends the whole table. A
request aborted while its load is in flight keeps its blocks until the load settles.

The ``Witness`` checks safety from the engine's side, without trusting the scheduler's
own records: a store reads only blocks that still hold the chunk it stores (owner check,
against stale window blocks) and whose KV the step writes; a draft group's volatile
chunk is never stored (E1); a block handed out again is never the source of a store that
has not been waited on (F1); loads fill blocks the request owns, and every block below
the boundary the request is told it holds that is not yet valid (L3); a job completes exactly
when all workers have reported it (J2); a load reads only CPU sub-blocks that the
completed store of its key wrote (integrity, at the granularity of sub-blocks).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

from kvcore.scheduler import RequestInfo, ScheduledRequest, StepInput, WorkerReport
from kvcore.spec.invariants import LoadCoverageRecord, l3_load_covers_every_block
from kvcore.spec.plans import JobKind, TransferPlan, sub_block_position
from kvcore.spec.types import GroupKind, OffloadConfig, cdiv, group_keys

Owner = tuple[str, int, int]  # (request id, group, block position)


def chain_hashes(tokens: list[int], start: int, prev: bytes, block_tokens: int) -> list[bytes]:
    """Chained hashes of the complete hash blocks of ``tokens`` from block ``start`` on."""
    out: list[bytes] = []
    for i in range(start, len(tokens) // block_tokens):
        chunk = tokens[i * block_tokens:(i + 1) * block_tokens]
        prev = hashlib.blake2b(prev + bytes(t % 256 for t in chunk), digest_size=8).digest()
        out.append(prev)
    return out


def next_token(tokens: list[int]) -> int:
    """The "sampled" token: a function of the context, so equal prefixes continue equally."""
    return (sum(tokens[-3:]) * 7 + len(tokens)) % 5


@dataclass
class Req:
    """The engine's view of one request."""

    rid: str
    tokens: list[int]
    prompt_len: int
    max_len: int
    hashes: list[bytes]
    tables: list[list[int]]
    sent: list[int]
    sent_hashes: int
    state: str = "waiting"  # waiting | loading | running | finished
    computed: int = 0
    resend: bool = True  # the scheduler forgot the tables (lookup): send them whole
    resumed: bool = False
    was_preempted: bool = False
    load_job: int | None = None
    load_from: int = 0
    load_to: int = 0
    held: bool = False  # finished while loading: blocks kept until the load settles
    freed_upto: list[int] = field(default_factory=list)


def sub_blocks(config: OffloadConfig, plan: TransferPlan) -> dict[bytes, set[int]]:
    """The CPU sub-blocks of each key a plan copies (the copy path's sequential mapping)."""
    out: dict[bytes, set[int]] = {}
    for group, gt in enumerate(plan.groups):
        bpc = config.groups[group].blocks_per_chunk
        for i in range(len(gt.gpu_block_ids)):
            chunk, sub = sub_block_position(i, gt.block_index, bpc)
            out.setdefault(gt.keys[chunk], set()).add(sub)
    return out


class WitnessError(AssertionError):
    """The engine saw a safety rule broken (independently of the scheduler's checks)."""


class Engine:
    """Drives ``sched`` (an ``OffloadScheduler``, the reference model, or both in lockstep)."""

    def __init__(self, config: OffloadConfig, sched: Any, *, prefill_chunk: int = 8,
                 spec_tokens: int = 0) -> None:
        self.config = config
        self.sched = sched
        self.prefill_chunk = prefill_chunk
        self.spec_tokens = spec_tokens if config.speculative else 0
        self.free: list[int] = list(range(config.num_gpu_blocks - 1, 0, -1))
        self.owner: dict[int, Owner] = {}
        self.reqs: dict[str, Req] = {}
        self.order: list[str] = []  # admitted requests (loading or running), oldest first
        self.allocated: set[int] = set()  # ids handed out since the last step
        self.preempted: list[str] = []
        self.queued_loads: list[TransferPlan] = []
        self.live: dict[int, TransferPlan] = {}  # jobs the scheduler has in flight
        self.unreported: dict[int, set[int]] = {}
        self.reported: dict[int, set[int]] = {}
        self.waited: set[int] = set()
        self.stale: list[tuple[int, int]] = []  # (job, worker) of jobs dropped by reset
        self.settled: set[int] = set()
        self.next_job_id = 1
        self.stale_below = 1
        self.created = 0
        self.last_plan: Any = None
        self.writing: dict[int, dict[bytes, set[int]]] = {}  # store job -> key -> sub-blocks
        self.written: dict[bytes, set[int]] = {}  # READY key -> sub-blocks its store wrote

    # -- geometry ----------------------------------------------------------------------------

    def floor(self, group: int, resume: int) -> int:
        """The first block position a group still needs when computing resumes at ``resume``."""
        g = self.config.groups[group]
        if g.kind is GroupKind.SLIDING:
            return max(0, (resume - g.reach_tokens) // g.tokens_per_block)
        if g.kind is GroupKind.MAMBA:
            return max(0, resume // g.tokens_per_block - 1)
        return 0

    def local_unit(self) -> int:
        """Local GPU prefix hits come in multiples of every group's block size."""
        return math.lcm(*(g.tokens_per_block for g in self.config.groups))

    def _take(self, req: Req, group: int, pos: int) -> int:
        gpu_id = self.free.pop()
        self.owner[gpu_id] = (req.rid, group, pos)
        self.allocated.add(gpu_id)
        return gpu_id

    def _free_upto(self, req: Req, group: int, upto: int) -> None:
        table = req.tables[group]
        for pos in range(req.freed_upto[group], min(upto, len(table))):
            if table[pos]:
                self.free.append(table[pos])
                table[pos] = 0
        req.freed_upto[group] = max(req.freed_upto[group], upto)

    def _release(self, req: Req) -> None:
        for group in range(len(self.config.groups)):
            self._free_upto(req, group, len(req.tables[group]))
        n = len(self.config.groups)
        req.tables, req.sent, req.freed_upto = [[] for _ in range(n)], [0] * n, [0] * n

    def _extend(self, req: Req, upto_tokens: int, resume: int) -> bool:
        """Grow every table to cover ``upto_tokens``; False (nothing taken) if the pool is dry."""
        spans = []
        for group, g in enumerate(self.config.groups):
            start, end = len(req.tables[group]), cdiv(upto_tokens, g.tokens_per_block)
            spans.append((start, end, self.floor(group, resume)))
        if sum(max(0, end - max(start, lo)) for start, end, lo in spans) > len(self.free):
            return False
        for group, (start, end, lo) in enumerate(spans):
            for pos in range(start, end):
                req.tables[group].append(self._take(req, group, pos) if pos >= lo else 0)
            req.freed_upto[group] = max(req.freed_upto[group], min(lo, end))
        return True

    # -- requests ----------------------------------------------------------------------------

    def arrive(self, tokens: list[int], new_tokens: int = 4, *,
               max_offload_tokens: int | None = None, skip_reading: bool = False) -> str:
        """A new request with this prompt; it finishes after ``new_tokens`` more tokens."""
        rid = f"r{self.created}"
        self.created += 1
        n = len(self.config.groups)
        hashes = chain_hashes(tokens, 0, b"", self.config.hash_block_tokens)
        req = Req(rid, list(tokens), len(tokens), len(tokens) + max(new_tokens, 1), hashes,
                  [[] for _ in range(n)], [0] * n, len(hashes), freed_upto=[0] * n)
        self.sched.add_request(RequestInfo(rid, len(tokens), tuple(hashes),
                                           max_offload_tokens, skip_reading))
        self.reqs[rid] = req
        return rid

    def waiting(self) -> list[str]:
        return [r for r, req in self.reqs.items() if req.state == "waiting"]

    def running(self) -> list[str]:
        return [r for r in self.order if self.reqs[r].state == "running"]

    def unfinished(self) -> list[str]:
        return [r for r, req in self.reqs.items() if req.state != "finished"]

    def _sync_hashes(self, req: Req) -> None:
        if req.sent_hashes < len(req.hashes):
            self.sched.add_hashes(req.rid, req.hashes[req.sent_hashes:])
            req.sent_hashes = len(req.hashes)

    def admit(self, rid: str, local_units: int = 0) -> Any:
        """Lookup, allocate and ``after_alloc`` for a waiting request; returns the lookup."""
        req = self.reqs[rid]
        assert req.state == "waiting", req.state
        self._sync_hashes(req)
        unit = self.local_unit()
        computed = min(local_units * unit, (len(req.tokens) - 1) // unit * unit)
        result = self.sched.lookup(rid, computed, len(req.tokens))
        req.resend = True
        if not isinstance(result, int):
            return result
        boundary = computed + result
        if not self._admit_tables(req, computed, boundary if result else computed):
            return result
        valid = [computed // g.tokens_per_block for g in self.config.groups]
        tables = tuple(tuple(t) for t in req.tables)
        plan = self.sched.after_alloc(rid, tables, valid, computed, result)
        self.order.append(rid)
        req.resumed = req.was_preempted
        if plan is None:
            req.state, req.computed = "running", computed
            return result
        self._check_load(req, plan)
        self._check_coverage(plan, tables, valid, computed, result)
        req.state, req.load_job, req.load_from, req.load_to = "loading", plan.job_id, \
            computed, boundary
        self._issue(plan)
        self.queued_loads.append(plan)
        return result

    def _admit_tables(self, req: Req, computed: int, upto: int) -> bool:
        """Tables for a local prefix hit up to ``computed`` plus blocks up to ``upto``."""
        self._release(req)
        if not self._extend(req, computed, computed):
            return False
        if not self._extend(req, upto, upto):
            self._release(req)
            return False
        return True

    def abort(self, rid: str) -> None:
        """The request ends now (the engine frees its blocks, or holds them for a load)."""
        req = self.reqs[rid]
        self.sched.request_finished(rid)
        if req.state == "loading":
            req.held = True
        else:
            self._release(req)
        req.state = "finished"
        if rid in self.order:
            self.order.remove(rid)

    def _preempt(self, req: Req) -> None:
        self.preempted.append(req.rid)
        self._release(req)
        req.state, req.computed, req.resend, req.was_preempted = "waiting", 0, True, True
        self.order.remove(req.rid)

    # -- the step -----------------------------------------------------------------------------

    def step(self, preempt: tuple[str, ...] = (), accept: int = 0) -> Any:
        """One engine step; ``preempt`` names running requests to preempt first."""
        for rid in preempt:
            if self.reqs[rid].state == "running":
                self._preempt(self.reqs[rid])
        for rid in self.running():
            req = self.reqs[rid]
            for group, g in enumerate(self.config.groups):
                if g.kind is not GroupKind.FULL:
                    self._free_upto(req, group, self.floor(group, req.computed))
        scheduled = self._schedule()
        step = StepInput(tuple(sr for _, sr in scheduled), tuple(self.preempted),
                         frozenset(self.allocated))
        plan = self.sched.build_step(step)
        self._check_step(step, plan)
        self.allocated, self.preempted, self.queued_loads = set(), [], []
        self.waited |= set(plan.flush)
        for store in plan.stores:
            self._issue(store)
            self.writing[store.job_id] = sub_blocks(self.config, store)
        for req, sr in scheduled:
            self._advance(req, sr.scheduled_tokens, accept)
        self.last_plan = plan
        return plan

    def _schedule(self) -> list[tuple[Req, ScheduledRequest]]:
        out = []
        for rid in list(self.order):
            req = self.reqs[rid]
            if req.state != "running":
                continue
            n = self._size(req)
            while not self._extend(req, req.computed + n, req.computed):
                later = [r for r in self.running() if self.order.index(r) > self.order.index(rid)]
                self._preempt(self.reqs[later[-1] if later else rid])
                if not later:
                    break
            if req.state != "running":
                continue
            out.append((req, self._scheduled(req, n)))
        return out

    def _size(self, req: Req) -> int:
        remaining = len(req.tokens) - req.computed
        if remaining <= 1:
            return 1 + self.spec_tokens
        n = min(remaining, self.prefill_chunk)
        align = self.config.mamba_align_tokens
        if align is not None and n < remaining:
            n = min(max(align, n - n % align), remaining)
        return n

    def _scheduled(self, req: Req, n: int) -> ScheduledRequest:
        if req.resend:
            new_ids = tuple(tuple(t) for t in req.tables)
        else:
            new_ids = tuple(tuple(t[s:]) for t, s in zip(req.tables, req.sent, strict=True))
        hashes = tuple(req.hashes[req.sent_hashes:])
        sr = ScheduledRequest(req.rid, n, req.computed, len(req.tokens), new_ids, hashes,
                              req.resend and req.resumed)
        req.sent = [len(t) for t in req.tables]
        req.sent_hashes = len(req.hashes)
        req.resend = req.resumed = False
        return sr

    def _advance(self, req: Req, n: int, accept: int) -> None:
        """The forward pass and sampling: ``accept`` draft tokens of a decode step survive."""
        if req.computed + n < len(req.tokens):
            req.computed += n
            return
        decoding = len(req.tokens) - req.computed == 1 and n > 1
        accepted = min(accept, n - 1) if decoding else 0
        old = len(req.tokens)
        for _ in range(1 + accepted):
            req.tokens.append(next_token(req.tokens))
        req.computed = old + accepted
        prev = req.hashes[-1] if req.hashes else b""
        req.hashes.extend(chain_hashes(req.tokens, len(req.hashes), prev,
                                       self.config.hash_block_tokens))
        if len(req.tokens) >= req.max_len:
            self.abort(req.rid)

    # -- workers ------------------------------------------------------------------------------

    def _issue(self, plan: TransferPlan) -> None:
        self.live[plan.job_id] = plan
        self.unreported[plan.job_id] = set(range(self.config.num_workers))
        self.reported[plan.job_id] = set()
        self.next_job_id = max(self.next_job_id, plan.job_id + 1)

    def pending_reports(self) -> list[tuple[int, int]]:
        """(job, worker) pairs not yet reported, live jobs first, then stale ones; a load
        ``after_alloc`` queued has no worker until the ``build_step`` that hands it out."""
        queued = {p.job_id for p in self.queued_loads}
        live = [(j, w) for j in sorted(self.unreported) if j not in queued
                for w in sorted(self.unreported[j])]
        return live + sorted(self.stale)

    def deliver(self, pairs: list[tuple[int, int, bool]]) -> Any:
        """Hand the workers' reports (job, worker, success) to ``worker_output``, in order."""
        reports = [WorkerReport(w, j, ok, bytes=64, seconds=0.0) for j, w, ok in pairs]
        out = self.sched.worker_output(reports)
        for j, w, _ in pairs:
            if j in self.unreported:
                self.unreported[j].discard(w)
                self.reported[j].add(w)
            elif (j, w) in self.stale:
                self.stale.remove((j, w))
        done = {j for j, left in self.unreported.items() if not left}
        if set(out.completed) != done:
            raise WitnessError(f"J2: completed {sorted(out.completed)} but every worker "
                               f"reported exactly {sorted(done)}")
        for j in out.completed:
            del self.live[j], self.unreported[j], self.reported[j]
            self.settled.add(j)
            if j not in out.failed_stores:
                self.written.update(self.writing.pop(j, {}))
        for rid in out.finished_loads:
            self._load_done(self.reqs[rid], ok=True)
        for failure in out.failed_loads:
            self._load_done(self.reqs[failure.request_id], ok=False)
        return out

    def _load_done(self, req: Req, ok: bool) -> None:
        req.load_job = None
        if req.held:
            req.held = False
            self._release(req)
            return
        # A failed load is recomputed from the local prefix into the same blocks.
        req.computed = min(req.load_to, len(req.tokens) - 1) if ok else req.load_from
        req.state = "running"

    def reset(self) -> Any:
        """The engine resets its prefix cache; kvcore drops the CPU tier and every job."""
        flush = self.sched.reset()
        if tuple(flush) != tuple(sorted(self.live)):
            raise WitnessError(f"reset flushed {flush}, jobs in flight {sorted(self.live)}")
        self.waited |= set(flush)
        self.stale += [(j, w) for j in self.unreported for w in self.unreported[j]]
        self.live, self.unreported, self.reported = {}, {}, {}
        self.writing, self.written = {}, {}
        self.stale_below = self.next_job_id
        for req in self.reqs.values():
            if req.load_job is not None:
                self._load_done(req, ok=True)  # waited for: the bytes landed
        return flush

    def run(self, max_steps: int, accept: int = 0) -> None:
        """Admit, step and deliver every report (in order) until nothing is left to do."""
        for _ in range(max_steps):
            if not (self.unfinished() or self.live):
                return
            for rid in self.waiting():
                self.admit(rid)
            self.step((), accept)
            self.deliver([(j, w, True) for j, w in self.pending_reports()])

    # -- the witness ---------------------------------------------------------------------------

    def _check_load(self, req: Req, plan: TransferPlan) -> None:
        for key, subs in sub_blocks(self.config, plan).items():
            unwritten = subs - self.written.get(key, set())
            if unwritten:
                raise WitnessError(f"load {plan.job_id} reads sub-blocks {sorted(unwritten)} "
                                   f"of key {key.hex()[:12]} that no store wrote")
        for group, gt in enumerate(plan.groups):
            for i, gpu_id in enumerate(gt.gpu_block_ids):
                if self.owner.get(gpu_id) != (req.rid, group, gt.block_index + i):
                    raise WitnessError(f"load {plan.job_id} fills GPU block {gpu_id} owned "
                                       f"by {self.owner.get(gpu_id)}")

    def _check_coverage(self, plan: TransferPlan, tables: tuple[tuple[int, ...], ...],
                        valid: list[int], computed: int, hit: int) -> None:
        """L3 from the engine's own inputs: the load fills every block it is told is loaded."""
        violations = l3_load_covers_every_block(LoadCoverageRecord(
            self.config, computed, hit, tables, tuple(valid), plan))
        if violations:
            raise WitnessError(f"L3: {violations[0].message}")

    def _check_step(self, step: StepInput, plan: Any) -> None:
        if list(plan.loads) != self.queued_loads:
            raise WitnessError("build_step's loads are not the loads after_alloc queued")
        for job_id, job in self.live.items():
            if job.kind is not JobKind.STORE or job_id in self.waited:
                continue
            reused = {i for g in job.groups for i in g.gpu_block_ids} & self.allocated
            if reused and job_id not in plan.flush:
                raise WitnessError(f"F1: store {job_id} reads GPU blocks {sorted(reused)} "
                                   "handed out again this step, but is not flushed")
        frontiers = {sr.request_id: min(sr.computed_tokens + sr.scheduled_tokens,
                                        sr.num_tokens) for sr in step.requests}
        for store in plan.stores:
            self._check_store(store, frontiers[store.request_id])

    def _check_store(self, plan: TransferPlan, frontier: int) -> None:
        req = self.reqs[plan.request_id]
        for group, gt in enumerate(plan.groups):
            g = self.config.groups[group]
            index = {k: c for c, k in enumerate(group_keys(self.config, group, req.hashes))}
            chunks = [index[k] for k in gt.keys]
            bpc, o = g.blocks_per_chunk, g.tokens_per_chunk
            first_run = len(gt.gpu_block_ids) - (len(chunks) - 1) * bpc
            positions = [p for n, c in enumerate(chunks)
                         for p in range((c + 1) * bpc - (first_run if n == 0 else bpc),
                                        (c + 1) * bpc)]
            for gpu_id, pos in zip(gt.gpu_block_ids, positions, strict=True):
                if self.owner.get(gpu_id) != (req.rid, group, pos):
                    raise WitnessError(f"store {plan.job_id} group {group}: GPU block "
                                       f"{gpu_id} at position {pos} now belongs to "
                                       f"{self.owner.get(gpu_id)} (stale block)")
            for c in chunks:
                if (c + 1) * o > frontier or (g.is_draft and c >= frontier // o - 1):
                    raise WitnessError(f"store {plan.job_id} group {group}: chunk {c} is not "
                                       f"final at frontier {frontier} (E1)")
