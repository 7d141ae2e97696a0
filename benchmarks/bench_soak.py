"""Soak: does memory stay flat over 10^5 engine steps when nobody drains the events?

Goal. Issue 8 found two things that only grew: the manager's events (about 94 bytes per
stored chunk, for an engine that never calls ``take_events``) and the scheduler's window
index (finished requests kept alive through it). With the event buffer capped at
``max_pending_events`` keys and the index pruned on finish, reset and table rebuilds,
traced memory after the warm-up must stop growing: ``mem_growth_ratio`` (mean traced
memory over the last quarter of the run / over the second quarter) should be <= 1.1.

What runs. The real ``OffloadScheduler`` and ``CPUOffloadManager`` (checks off, as in
production) under a small engine loop written here: requests arrive all the time with
prompts that share prefixes (so lookups hit and loads happen), are admitted up to
``--running`` at a time with every block allocated up front, prefill in chunks, decode
one token a step, finish and free their blocks (handed out again later, so stale window
blocks are zeroed through the index). Worker reports come the step after a job is
issued. ``take_events`` is called every ``--drain-every`` steps (default 0: never). No
bytes move: no ``TransferEngine``, so this soaks the scheduler's and the manager's
memory, not the copy path's. The layout is a FULL group and a SLIDING window group.

Back of the envelope. About ``--running`` x 2 groups / 16 tokens = 1 stored key per
decode step plus prefill chunks and evictions, so a 16384-key event cap is full after
about 10^4 steps, well inside the first quarter.

Memory is sampled ``--samples`` times with ``tracemalloc`` (traced bytes), each sample
after ``gc.collect()``, which also empties CPython's free lists.

Output: a ``SUMMARY`` line (see ``main``). About 4 minutes on a loaded 2-core box
(440 steps/s under tracemalloc).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import statistics
import time
import tracemalloc
from collections import deque
from dataclasses import dataclass, field

from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
)
from kvcore.spec.types import PENDING, GroupKind, GroupSpec, OffloadConfig, cdiv

TPB = 16  # tokens per block and per hash block
PREFILL = 128  # prefill chunk, tokens
BASES = 8  # distinct base prompts requests take prefixes of


@dataclass
class Req:
    """The engine's view of one request."""

    rid: str
    prompt: int
    total: int  # prompt + tokens it will generate
    hashes: list[bytes]
    tables: list[list[int]] = field(default_factory=list)
    computed: int = 0
    length: int = 0  # tokens so far (prompt, then prompt + generated)
    sent_hashes: int = 0
    resend: bool = True
    loading: int | None = None


class Soak:
    """The engine loop; ``step`` is one engine step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.cfg = OffloadConfig(
            (GroupSpec(GroupKind.FULL, TPB), GroupSpec(GroupKind.SLIDING, TPB,
                                                       window_tokens=4 * TPB)),
            hash_block_tokens=TPB, num_gpu_blocks=4096, num_cpu_blocks=args.cpu_chunks,
            num_workers=1, max_pending_events=args.max_events)
        manager = CPUOffloadManager.for_config(self.cfg, check=False,
                                               max_pending_events=self.cfg.max_pending_events)
        self.sched = OffloadScheduler(self.cfg, manager, check=False)
        self.rng = random.Random(args.seed)
        self.args = args
        self.free = list(range(self.cfg.num_gpu_blocks - 1, 0, -1))
        self.base_hashes = [self._chain(b"base%d" % b, 1024 // TPB) for b in range(BASES)]
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reports: list[int] = []  # jobs to report next step
        self.created = self.finished = self.events_taken = 0

    @staticmethod
    def _chain(seed: bytes, n: int, prev: bytes = b"") -> list[bytes]:
        out = []
        for i in range(n):
            prev = hashlib.blake2b(prev + seed + i.to_bytes(4, "little"),
                                   digest_size=16).digest()
            out.append(prev)
        return out

    def arrive(self) -> None:
        prompt = self.rng.randrange(64, 513)
        base = self.base_hashes[self.rng.randrange(BASES)]
        rid = f"r{self.created}"
        self.created += 1
        req = Req(rid, prompt, prompt + self.rng.randrange(8, 97), list(base[:prompt // TPB]))
        req.length = prompt
        req.sent_hashes = len(req.hashes)
        self.sched.add_request(RequestInfo(rid, prompt, tuple(req.hashes)))
        self.waiting.append(req)

    def admit(self, allocated: set[int]) -> None:
        while self.waiting and len(self.running) < self.args.running:
            req = self.waiting[0]
            hit = self.sched.lookup(req.rid, 0, req.prompt)
            if hit is PENDING:
                return
            blocks = cdiv(req.total, TPB)
            if len(self.free) < 2 * blocks:
                return
            # The window group gets null blocks below what its window reaches at the hit.
            skip = max(0, (hit - self.cfg.groups[1].reach_tokens) // TPB)
            req.tables = [[self.free.pop() for _ in range(blocks)],
                          [0] * skip + [self.free.pop() for _ in range(blocks - skip)]]
            allocated.update(i for t in req.tables for i in t if i)
            self.waiting.popleft()
            self.running.append(req)
            plan = self.sched.after_alloc(req.rid, req.tables, (0, 0), 0, hit)
            req.resend = True
            if plan is not None:
                req.loading, req.computed = plan.job_id, hit

    def scheduled(self, req: Req) -> ScheduledRequest:
        n = min(PREFILL, req.prompt - req.computed) if req.computed < req.prompt else 1
        if req.computed >= req.prompt:
            req.length += 1
            if req.length % TPB == 0:
                prev = req.hashes[-1] if req.hashes else b""
                req.hashes += self._chain(req.rid.encode(), 1, prev)
        new_ids = tuple(tuple(t) for t in req.tables) if req.resend else ((), ())
        hashes = tuple(req.hashes[req.sent_hashes:])
        req.sent_hashes, req.resend = len(req.hashes), False
        return ScheduledRequest(req.rid, n, req.computed, req.length, new_ids, hashes)

    def step(self) -> None:
        out = self.sched.worker_output([WorkerReport(0, j, bytes=4096) for j in self.reports])
        done = set(out.completed)
        for req in self.running:
            if req.loading in done:
                req.loading = None
        allocated: set[int] = set()
        if len(self.waiting) < self.args.running and self.rng.random() < self.args.arrival:
            self.arrive()  # a bounded queue: the engine's own memory stays flat
        self.admit(allocated)
        batch = [(req, self.scheduled(req)) for req in self.running if req.loading is None]
        plan = self.sched.build_step(StepInput(tuple(sr for _, sr in batch), (),
                                               frozenset(allocated)))
        self.reports = [p.job_id for p in (*plan.loads, *plan.stores)]
        for req, sr in batch:
            req.computed += sr.scheduled_tokens
            if req.computed >= req.total:
                self.finish(req)

    def finish(self, req: Req) -> None:
        self.sched.request_finished(req.rid)
        self.running.remove(req)
        for table in req.tables:
            self.free.extend(i for i in table if i)
        self.finished += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--running", type=int, default=8, help="requests running at once")
    p.add_argument("--arrival", type=float, default=0.3, help="arrivals per step")
    p.add_argument("--cpu-chunks", type=int, default=2048)
    p.add_argument("--max-events", type=int, default=16_384)
    p.add_argument("--drain-every", type=int, default=0, help="0: never call take_events")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    soak = Soak(args)
    every = max(1, args.steps // args.samples)
    tracemalloc.start()
    samples: list[int] = []
    start = time.perf_counter()
    for n in range(1, args.steps + 1):
        soak.step()
        if args.drain_every and n % args.drain_every == 0:
            soak.events_taken += len(soak.sched.take_events())
        if n % every == 0:
            # A full collection also empties CPython's free lists (tuples, lists, dicts
            # kept for reuse), which tracemalloc counts as allocated: without it the
            # samples swing by megabytes with no trend.
            gc.collect()
            samples.append(tracemalloc.get_traced_memory()[0])
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    q = len(samples) // 4
    ratio = statistics.fmean(samples[3 * q:]) / statistics.fmean(samples[q:2 * q])
    s, m = soak.sched.stats(), soak.sched.manager.stats()
    print(f"steps/s={args.steps / seconds:.0f} requests={soak.created} "
          f"finished={soak.finished} traced_kib: q2={statistics.fmean(samples[q:2 * q]) / 1024:.0f}"
          f" q4={statistics.fmean(samples[3 * q:]) / 1024:.0f} peak={peak / 1024:.0f}")
    print(f"SUMMARY steps={args.steps} mem_growth_ratio={ratio:.3f} (traced memory, last "
          f"quarter / second quarter; target <= 1.1) events_dropped={s.events_dropped} "
          f"events_taken={soak.events_taken} stores={s.stores} loads={s.loads} "
          f"chunks_stored={s.chunks_stored} chunks_loaded={s.chunks_loaded} "
          f"keys={m.used} evictions={m.evictions} "
          f"window_index={len(soak.sched._window_index)} "
          f"tracked={len(soak.sched.tracked_requests())}")


if __name__ == "__main__":
    main()
