"""Scheduler cost under the work an engine does: decode steps that store, recycle GPU ids,
preempt, finish and admit requests; cold and warm lookups of long prompts.

Workload per configuration (layout x context): ``--requests`` requests (256) decode 1 +
2 speculative tokens per step, all drafts accepted. Request i starts i tokens later, so
every step some request crosses a chunk end of every group and stores. GPU ids come from
one pool: sliding-window blocks that leave the window go back to it, and every id handed
out this step is passed as ``allocated_ids`` (so stale window positions are zeroed and
stores still reading a reused id are flushed). The workers complete the previous step's
jobs at the start of the next one. Each step also preempts one request (it resumes the
next step with a rebuilt table), finishes one and admits a request with the finished
one's prompt (lookup, load, then decode). Timings are thread CPU time
(``time.thread_time``), because the machine is shared.

Per configuration the benchmark prints mean / p50 / p99 of the step, the garbage
collector's share of it (``gc ms``: collections that landed inside the timed decode part,
mean per step; they are in the step figures too), the mean of steps
in which more than the usual number of requests store (the storing-step ratio is their
mean over the mean of steps storing fewer), the work counters per step (stores, keys
stored, flushes, loads), and the cold lookup (``add_request`` plus ``lookup`` of a fresh
128K prompt whose prefix is in the tier: keys derived inside the timed span) and the warm
one (a second lookup of the same request), with the hit it answered. The workers report
every job before the probes, so the probe's prefix is READY: a probe while its stores are
in flight answers PENDING, a deferral, which is not the cost of a lookup. Memory, measured
over the set-up in two phases, as vLLM holds it: the engine first builds every prompt's
block hashes and keeps them (``Request.block_hashes``: ``hash B`` is their RSS per hash
block), then admits the requests; ``B/hash`` is kvcore's part of the second phase's RSS
growth (the growth less the engine's block tables: 4-byte arrays, so their size is
exact) per hash block tracked, kvcore's references to the engine's hashes included;
``RSS MB`` is both phases together, everything. Only the first configuration's figures
(the SUMMARY's) are clean.

vLLM: when ``vllm`` is importable (``--no-vllm`` skips it), the same workload also runs
through vLLM's own ``OffloadingConnectorScheduler`` (``benchmarks/_vllm_baseline.py``), in
the same process, step for step interleaved with kvcore's (a busy machine slows both
alike), with ``offload_prompt_only=False`` so both store decode chunks. vLLM's offloading
manager is replaced by a near-free mock (per group, a dict of the last keys stored, as many
as kvcore's tier has slots, so both hit and miss alike) while kvcore keeps its real LRU
manager, so the ratios favour vLLM. A second table prints vLLM's figures and the ratios
vLLM / kvcore (> 1: kvcore is faster): decode mean per step, cold and warm lookup; the
SUMMARY adds ``decode_vs_vllm_128k`` and ``lookup_vs_vllm_128k`` (cold) for the first
configuration (DeepSeek-V4 at the longest context).

The admission (finish, add, lookup, load, prefill store and the completion of its jobs)
is timed apart from the decode part on both sides, since its cost follows the prompt
length by nature. The decode part is the scheduler's work: the completions of the last
step's jobs and the step itself (kvcore: building each ``ScheduledRequest``, whose
checks are kvcore's, and ``build_step``; vLLM: ``build_connector_meta``). The engine's own
bookkeeping (the ``Pool``'s block tables and the synthetic hashes) is the same code on
both sides and is not timed in the decode part (the admission span holds it, on both
sides alike); nor are the workers' reports (kvcore's ``WorkerReport``s, vLLM's
``KVConnectorOutput``), which the workers build.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import statistics
import time
from array import array
from dataclasses import dataclass, field, replace
from typing import Any

from kvcore.manager import CPUOffloadManager
from kvcore.presets import preset
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
)
from kvcore.spec.types import GroupKind, OffloadConfig, cdiv

SPEC_TOKENS = 2
LAYOUTS = {"dsv4": "deepseek-v4-mtp", "llama": "llama3-eagle3"}
HASH_PAD = bytes(24)  # hashes are 32 bytes, like vLLM's sha256 block hashes


def hash_of(seed: int, index: int) -> bytes:
    return seed.to_bytes(4, "little") + index.to_bytes(4, "little") + HASH_PAD


class GcClock:
    """Thread CPU seconds the cyclic garbage collector has run so far (all generations),
    from ``gc.callbacks``, on the clock the steps are timed with: a collection lands in
    whichever span allocates when it is due (and walks both sides' objects: one heap),
    so the decode figures include the collections that land in them, printed beside."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.total += time.thread_time() - self._start


GC = GcClock()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Live:
    """The engine's view of one running request."""

    rid: str
    seed: int
    tokens: int  # accepted tokens; all but the last are computed
    # 4-byte int arrays, as an engine's block tables are (vLLM's are int32), so the memory
    # figure is not the benchmark's own Python ints: their bytes are exact and subtracted.
    tables: list[array[int]] = field(default_factory=list)
    hashed: int = 0  # hash blocks handed to the scheduler so far
    # The prompt's block hashes, kept by the engine as vLLM's Request.block_hashes is (the
    # scheduler refers to the same objects).
    prompt_hashes: tuple[bytes, ...] = ()
    freed: list[int] = field(default_factory=lambda: [0] * 8)  # window blocks freed


class Pool:
    """The engine's GPU block pool and block tables (the same code for kvcore and vLLM).

    Ids are recycled: freed ids go back to ``free`` and are handed out again first; every
    id handed out since the last step is in ``allocated``.
    """

    def __init__(self, cfg: OffloadConfig) -> None:
        self.cfg = cfg
        # A 4-byte array, not a list: the free list holds millions of ids at 128K, and as
        # a list every full garbage collection walked them, in kvcore's timed spans too.
        self.free: array[int] = array("i")
        self.next_gpu = 1
        self.allocated: set[int] = set()

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                out.append(self.free.pop())
            else:
                out.append(self.next_gpu)
                self.next_gpu += 1
        self.allocated.update(out)
        return out

    def grow(self, live: Any, upto: int, free_window: bool = True
             ) -> tuple[tuple[int, ...], ...]:
        """New blocks so every group covers ``upto`` tokens; window blocks that left the
        window return to the pool (the engine frees them once the step that computed them
        is over, so a prefill's blocks are freed at the next decode step)."""
        new = []
        for group, g in enumerate(self.cfg.groups):
            table = live.tables[group]
            old = len(table)
            ids = self.take(cdiv(upto, g.tokens_per_block) - old)
            table.extend(ids)
            if free_window and g.kind is not GroupKind.FULL and g.window_tokens is not None:
                keep = cdiv(g.window_tokens, g.tokens_per_block) + 2
                for pos in range(live.freed[group], len(table) - keep):
                    if table[pos]:
                        self.free.append(table[pos])
                        table[pos] = 0
                live.freed[group] = max(live.freed[group], len(table) - keep)
            new.append(tuple(table[old:]))
        return tuple(new)

    def null_before(self, live: Any, hit: int) -> tuple[tuple[int, ...], ...]:
        """A request admitted with a hit allocates null window blocks before the window
        that ends at the hit (the engine computes nothing there)."""
        for group, g in enumerate(self.cfg.groups):
            if g.kind is GroupKind.FULL or g.window_tokens is None:
                continue
            table = live.tables[group]
            for pos in range(max(0, (hit - g.window_tokens) // g.tokens_per_block)):
                if table[pos]:
                    self.free.append(table[pos])
                    table[pos] = 0
        return tuple(tuple(t) for t in live.tables)

    def resume_tables(self, live: Any, upto: int) -> tuple[tuple[int, ...], ...]:
        """A preempted request's rebuilt tables: full groups get every block, window
        groups only the window's (null blocks before it), as an engine allocates them."""
        for group, g in enumerate(self.cfg.groups):
            n = cdiv(upto, g.tokens_per_block)
            if g.kind is GroupKind.FULL or g.window_tokens is None:
                live.tables[group] = array("i", self.take(n))
            else:
                keep = min(n, cdiv(g.window_tokens, g.tokens_per_block) + 2)
                live.tables[group] = array("i", [0] * (n - keep) + self.take(keep))
                live.freed[group] = n - keep
        return tuple(tuple(t) for t in live.tables)

    def release(self, live: Any) -> None:
        for table in live.tables:
            self.free.extend(i for i in table if i)
        live.tables = [array("i") for _ in self.cfg.groups]
        live.freed = [0] * 8


class Engine:
    """A minimal engine loop around one ``OffloadScheduler``."""

    def __init__(self, layout: str, context: int, requests: int, check: bool) -> None:
        base = preset(LAYOUTS[layout])
        self.cfg: OffloadConfig = replace(base, num_gpu_blocks=1 << 24, num_cpu_blocks=1 << 17)
        self.manager = CPUOffloadManager.for_config(self.cfg, check=check)
        self.sched = OffloadScheduler(self.cfg, self.manager, check=check)
        self.hbt = self.cfg.hash_block_tokens
        self.pool = Pool(self.cfg)
        self.pending: list[WorkerReport] = []
        self.live: dict[str, Live] = {}
        self.counter = 0
        self.preempted: str | None = None
        self.work = {"stores": 0, "keys": 0, "flushes": 0, "loads": 0, "storing_reqs": 0}
        rss0 = rss_bytes()
        waiting = [Live(f"r{i}", i, context - i) for i in range(requests)]
        for live in waiting:
            live.prompt_hashes = self.hashes(live, 0, live.tokens)
        rss1 = rss_bytes()
        for live in waiting:
            # Admit one request at a time and complete its stores, so the tier's LRU can
            # evict older chunks instead of refusing while everything is still WRITING.
            self.prefill(live)
            self.sched.worker_output(self.pending)
            self.pending = []
        self.hash_blocks = sum(live.hashed for live in self.live.values())
        grown = rss_bytes() - rss1
        # The engine's own state is its hashes (the first phase) and its block tables
        # (exact: 4 bytes an id); the rest of the admission's growth is kvcore's.
        self.engine_bytes = sum(len(t) * t.itemsize for live in self.live.values()
                                for t in live.tables)
        self.bytes_per_hash = (grown - self.engine_bytes) / max(self.hash_blocks, 1)
        self.hash_bytes_per_block = (rss1 - rss0) / max(self.hash_blocks, 1)
        self.rss_growth = rss_bytes() - rss0

    # -- requests -------------------------------------------------------------------------

    def hashes(self, live: Live, start: int, tokens: int) -> tuple[bytes, ...]:
        return tuple(hash_of(live.seed, i) for i in range(start, tokens // self.hbt))

    def new_hashes(self, live: Live) -> tuple[bytes, ...]:
        if live.hashed == 0:  # admission: the prompt's hashes, which the engine keeps
            if not live.prompt_hashes:
                live.prompt_hashes = self.hashes(live, 0, live.tokens)
            live.hashed = len(live.prompt_hashes)
            return live.prompt_hashes
        out = self.hashes(live, live.hashed, live.tokens)
        live.hashed += len(out)
        return out

    def prefill(self, live: Live) -> None:
        """Admit a request: lookup, load what hits, compute the rest and store it."""
        sched = self.sched
        sched.add_request(RequestInfo(live.rid, live.tokens, self.new_hashes(live)))
        hit = sched.lookup(live.rid, 0, live.tokens)
        hit = hit if isinstance(hit, int) else 0
        live.tables = [array("i") for _ in self.cfg.groups]
        blocks = self.pool.grow(live, live.tokens, free_window=False)
        if hit:
            blocks = self.pool.null_before(live, hit)
            plan = sched.after_alloc(live.rid, blocks, [0] * len(blocks), 0, hit)
            if plan is not None:
                self.work["loads"] += 1
        self.live[live.rid] = live
        todo = live.tokens - hit
        sr = ScheduledRequest(live.rid, todo, hit, live.tokens, blocks)
        self.settle(sched.build_step(StepInput((sr,), (), frozenset(self.pool.allocated))))
        self.pool.allocated.clear()

    def settle(self, plan: object) -> None:
        jobs = plan.stores + plan.loads  # type: ignore[attr-defined]
        self.pending.extend(WorkerReport(0, j.job_id) for j in jobs)

    def step(self) -> float:
        """One engine step; returns the thread CPU time of its decode part in seconds: the
        completions, building the step's ``ScheduledRequest``s and ``build_step``. The
        admission (finish, add, lookup, load, prefill store and its completion) goes to
        ``admit_s``; the engine's own bookkeeping (block tables, hashes) is not timed, on
        either side."""
        sched = self.sched
        gc0, start = GC.total, time.thread_time()
        sched.worker_output(self.pending)
        elapsed = time.thread_time() - start
        self.gc_s = GC.total - gc0
        self.pending = []
        self.counter += 1
        admit = time.thread_time()
        order = list(self.live.values())
        # Finish one request and admit its prompt again under a new id (prefix reuse);
        # its jobs complete within the admission, as on the vLLM side.
        done = order[self.counter % len(order)]
        if done.rid != self.preempted:
            sched.request_finished(done.rid)
            self.pool.release(done)
            del self.live[done.rid]
            self.prefill(Live(f"{done.rid.split('.')[0]}.{self.counter}", done.seed,
                              done.tokens))
            self.complete()
        self.admit_s = time.thread_time() - admit
        resumed, self.preempted = self.preempted, order[(self.counter * 7) % len(order)].rid
        if self.preempted == done.rid:
            self.preempted = None
        todo = []
        for live in self.live.values():
            if live.rid == self.preempted:
                self.pool.release(live)
                continue
            n = live.tokens
            is_resumed = live.rid == resumed
            if is_resumed:
                blocks = self.pool.resume_tables(live, n + SPEC_TOKENS)
            else:
                blocks = self.pool.grow(live, n + SPEC_TOKENS)
            todo.append((live.rid, n, blocks, self.new_hashes(live), is_resumed))
            live.tokens = n + 1 + SPEC_TOKENS
        pre = (self.preempted,) if self.preempted else ()
        gc0, start = GC.total, time.thread_time()
        # allocated_ids is kvcore's input alone (vLLM's connector takes none): timed here.
        allocated = frozenset(self.pool.allocated)
        step = tuple(ScheduledRequest(rid, 1 + SPEC_TOKENS, n - 1, n, blocks, hashes,
                                      resumed=is_resumed)
                     for rid, n, blocks, hashes, is_resumed in todo)
        plan = sched.build_step(StepInput(step, pre, allocated))
        elapsed += time.thread_time() - start
        self.gc_s += GC.total - gc0
        self.pool.allocated.clear()
        self.settle(plan)
        self.work["stores"] += len(plan.stores)
        self.work["keys"] += sum(len(p.keys) for p in plan.stores)
        self.work["flushes"] += len(plan.flush)
        self.last_stores = len(plan.stores)
        return elapsed

    def probe(self) -> tuple[int, int]:
        """(seed, tokens) of the prompt every lookup probe asks for: the latest admitted
        request's, whose chunks are in the tier."""
        donor = list(self.live.values())[-1]
        return donor.seed, donor.tokens - 1

    def complete(self) -> None:
        """The workers report every job handed out so far (as between two steps)."""
        self.sched.worker_output(self.pending)
        self.pending = []

    def lookup_once(self, seed: int, tokens: int, k: int) -> tuple[float, float, object]:
        """(cold, warm) seconds and the hit: a fresh request's first lookup, keys derived
        inside the timed span (``add_request`` is in it), then its second lookup."""
        hashes = tuple(hash_of(seed, i) for i in range(tokens // self.hbt))
        rid = f"probe{k}"
        start = time.thread_time()
        self.sched.add_request(RequestInfo(rid, tokens, hashes))
        hit = self.sched.lookup(rid, 0, tokens)
        cold = time.thread_time() - start
        start = time.thread_time()
        self.sched.lookup(rid, 0, tokens)
        warm = time.thread_time() - start
        self.sched.request_finished(rid)
        return cold, warm, hit

    def lookups(self, repeats: int) -> tuple[float, float]:
        """Median (cold, warm) lookup in ms of a fresh request with a tracked prompt."""
        self.complete()
        runs = [self.lookup_once(*self.probe(), k) for k in range(repeats)]
        return (statistics.median(r[0] for r in runs) * 1e3,
                statistics.median(r[1] for r in runs) * 1e3)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(times: list[float], stores: list[int], requests: int) -> dict[str, float]:
    """mean / p50 / p99 in ms, us per request, and the storing-step ratio of one side."""
    mid = statistics.median(stores)
    heavy = [t for t, s in zip(times, stores, strict=True) if s > mid] or times
    light = [t for t, s in zip(times, stores, strict=True) if s <= mid] or times
    return {"mean": statistics.mean(times) * 1e3, "p50": pct(times, 0.5) * 1e3,
            "p99": pct(times, 0.99) * 1e3, "us_req": statistics.mean(times) * 1e6 / requests,
            "storing_ratio": statistics.mean(heavy) / statistics.mean(light)}


def run_config(layout: str, context: int, args: argparse.Namespace,
               clean: bool) -> dict[str, Any]:
    """One layout x context: kvcore and (when importable) vLLM, step for step. Only the
    first (``clean``) set-up's RSS growth is a measurement: later ones reuse pages the
    process already holds (and can even come out negative), so they print "-"."""
    eng = Engine(layout, context, args.requests, check=args.check)
    up = None
    if args.vllm:
        up = args.vllm.VllmEngine(eng.cfg, context, args.requests, Pool(eng.cfg),
                                       hash_of, SPEC_TOKENS)
    sides = [eng] if up is None else [eng, up]
    for _ in range(3):  # warm up: the first steps settle the admission stores
        for side in sides:
            side.step()
    for side in sides:
        side.work = dict.fromkeys(side.work, 0)
    loads0 = eng.sched.stats().loads
    times: list[list[float]] = [[] for _ in sides]
    stores: list[list[int]] = [[] for _ in sides]
    admits, gcs = [], []
    for _ in range(args.steps):  # interleaved: a busy machine slows both alike
        for i, side in enumerate(sides):
            times[i].append(side.step())
            stores[i].append(side.last_stores)
        admits.append(eng.admit_s)
        gcs.append(eng.gc_s)
    # The probe asks for the latest admitted prompt once its stores have landed (a
    # lookup while they are in flight answers PENDING, which is not the cost measured).
    for side in sides:
        side.complete()
    probes = [[side.lookup_once(*eng.probe(), k) for side in sides]
              for k in range(args.lookups)]
    hit = probes[0][0][2]
    steps = args.steps
    out: dict[str, Any] = summarize(times[0], stores[0], args.requests)
    cold = statistics.median(p[0][0] for p in probes) * 1e3
    warm = statistics.median(p[0][1] for p in probes) * 1e3
    out |= {"layout": LAYOUTS[layout], "admit": statistics.mean(admits) * 1e3,
            "gc": statistics.mean(gcs) * 1e3,
            "cold": cold, "warm": warm, "hit": hit,
            "bph": eng.bytes_per_hash, "rss_mb": eng.rss_growth / 2**20,
            "hash_bph": eng.hash_bytes_per_block,
            "stores": eng.work["stores"] / steps, "keys": eng.work["keys"] / steps,
            "flushes": eng.work["flushes"] / steps,
            "loads": (eng.sched.stats().loads - loads0) / steps}
    print(f"| {LAYOUTS[layout]:16} | {context:>7} | {out['mean']:6.2f} | {out['p50']:6.2f} | "
          f"{out['p99']:6.2f} | {out['us_req']:6.1f} | {out['gc']:5.2f} | {out['admit']:6.2f} | "
          f"{out['storing_ratio']:5.2f} | "
          f"{out['stores']:6.1f} | {out['keys']:7.1f} | {out['flushes']:5.1f} | "
          f"{out['loads']:4.1f} | {cold:7.2f} | {warm:6.2f} | {hit!s:>7} | "
          + (f"{out['bph']:6.0f} | {out['hash_bph']:6.0f} | {out['rss_mb']:7.0f} |" if clean
             else "     - |      - |       - |"),
          flush=True)
    if up is not None:
        vout = summarize(times[1], stores[1], args.requests)
        vout |= {k: v / steps for k, v in up.work.items()}
        vout["cold"] = statistics.median(p[1][0] for p in probes) * 1e3
        vout["warm"] = statistics.median(p[1][1] for p in probes) * 1e3
        vout["hit"] = probes[0][1][2]
        out["vllm"] = vout
    if args.profile and context == max(args.contexts):
        profile(eng)
    return out


def print_vllm(vllm: Any, res: dict[tuple[str, int], dict[str, Any]]) -> None:
    """vLLM's side of every configuration and the ratios (vLLM / kvcore: > 1 means kvcore
    is faster)."""
    print(f"vLLM {vllm.VERSION} OffloadingConnectorScheduler, same workload, "
          "interleaved; its manager is a near-free mock (per group a dict of the last "
          "num_cpu_blocks keys stored), kvcore's is its real LRU manager")
    print("| layout           | context | vLLM mean ms | p50 | p99 | kvcore mean ms | decode x | "
          "vLLM cold ms | cold x | vLLM warm ms | warm x | hit | stores | keys | flush | load |")
    for (layout, context), r in res.items():
        v = r["vllm"]
        print(f"| {LAYOUTS[layout]:16} | {context:>7} | {v['mean']:8.2f} | {v['p50']:6.2f} | "
              f"{v['p99']:6.2f} | {r['mean']:8.2f} | {v['mean'] / r['mean']:5.1f} | "
              f"{v['cold']:8.2f} | {v['cold'] / r['cold']:5.1f} | {v['warm']:8.2f} | "
              f"{v['warm'] / r['warm']:5.1f} | {v['hit']!s:>7} | {v['stores']:6.1f} | "
              f"{v['keys']:7.1f} | "
              f"{v['flushes']:5.1f} | {v['loads']:4.1f} |")


def profile(eng: Engine) -> None:
    """cProfile of one engine step (its admission included: the decode part alone is too
    small to read beside it) and of one cold lookup (``add_request`` and ``lookup`` only:
    the probe's hashes are made before), top entries by own time."""
    eng.complete()
    seed, tokens = eng.probe()
    hashes = tuple(hash_of(seed, i) for i in range(tokens // eng.hbt))

    def cold() -> None:
        eng.sched.add_request(RequestInfo("profiled", tokens, hashes))
        eng.sched.lookup("profiled", 0, tokens)

    for name, fn in (("engine step", eng.step), ("cold lookup", cold)):
        prof = cProfile.Profile()
        prof.runcall(fn)
        print(f"-- profile: one {name} --")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    eng.sched.request_finished("profiled")


def load_vllm() -> Any:
    """The vLLM side (benchmarks/_vllm_baseline.py), or None when vLLM is not importable."""
    try:
        import _vllm_baseline
    except ImportError as exc:
        print(f"vLLM is not importable ({exc}); kvcore's figures alone")
        return None
    return _vllm_baseline


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, help="running requests (256; --quick: 64)")
    p.add_argument("--steps", type=int, help="timed steps (20)")
    p.add_argument("--lookups", type=int, default=3)
    p.add_argument("--contexts", type=int, nargs="+",
                   help="context lengths (8192 32768 131072; --quick: 2048 8192)")
    p.add_argument("--layouts", nargs="+", default=["dsv4", "llama"], choices=LAYOUTS)
    p.add_argument("--quick", action="store_true", help="64 requests, 2K/8K, 20 steps")
    p.add_argument("--check", action="store_true", help="runtime invariant checks on")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM side")
    args = p.parse_args()
    args.vllm = None if args.no_vllm else load_vllm()
    for name, full, quick in (("requests", 256, 64), ("steps", 20, 20),
                              ("contexts", [8192, 32768, 131072], [2048, 8192])):
        if getattr(args, name) is None:  # given values win over --quick's
            setattr(args, name, quick if args.quick else full)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}; {args.requests} requests decoding "
          f"1+{SPEC_TOKENS} tokens/step, {args.steps} steps, thread CPU time")
    print("| layout           | context | mean ms | p50 | p99 | us/req | gc ms | admit ms | "
          "store x | "
          "stores | keys | flush | load | cold ms | warm ms | hit | B/hash | hash B | RSS MB |")
    # Longest context first: the RSS growth of the first set-up is the honest memory
    # figure (later set-ups reuse pages the process already holds).
    runs = [(lay, c) for lay in args.layouts for c in sorted(args.contexts, reverse=True)]
    res = {run: run_config(*run, args, clean=i == 0) for i, run in enumerate(runs)}
    if args.vllm is not None:
        print_vllm(args.vllm, res)
    top = max(args.contexts)
    nan = {"cold": float("nan")}
    dsv4 = res.get(("dsv4", top))
    first = dsv4 or next(iter(res.values()))
    llama = res.get(("llama", top), nan)
    if top != 131072 or dsv4 is None:
        # The keys keep their names; say which run their figures come from instead.
        print(f"note: the SUMMARY's 128k figures are at context {top}; decode and memory "
              f"from {first.get('layout', 'the first layout run')}, a layout not run is nan")
    print(f"SUMMARY decode_us_per_req_128k={first['us_req']:.1f} "
          f"storing_step_ratio={max(r['storing_ratio'] for r in res.values()):.2f} "
          f"lookup_cold_ms_128k_dsv4={(dsv4 or nan)['cold']:.2f} "
          f"lookup_cold_ms_128k_llama={llama['cold']:.2f} "
          f"bytes_per_hash_block={first['bph']:.0f} "
          f"setup_rss_mb={first['rss_mb']:.0f}" + vllm_summary(first))


def vllm_summary(first: dict[str, Any]) -> str:
    """The SUMMARY's vLLM keys, for the first configuration, only when vLLM ran."""
    if "vllm" not in first:
        return ""
    v = first["vllm"]
    return (f" decode_vs_vllm_128k={v['mean'] / first['mean']:.1f}"
            f" lookup_vs_vllm_128k={v['cold'] / first['cold']:.1f}")


if __name__ == "__main__":
    main()
