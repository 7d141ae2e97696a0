"""bench_copy: kvcore's validated C block copy against a swap_blocks-style torch op, on CPU.

The baseline is what an engine without kvcore would run: one torch gather/scatter over the
flattened pools, ``index_select`` of the source blocks then ``index_copy_`` into the
destination (the CPU shape of vLLM's ``swap_blocks``; it copies every byte twice). GB/s of
kvcore and of that baseline are printed at every block size (4 KiB, 64 KiB and 2 MiB among
them), with their ratio. Also: one contiguous memcpy of the same bytes (the ceiling, >= 0.7x
of it at 256 KiB), the validation pass alone (<= 2% of the copy at 4 KiB, so it stays on),
a copy split over two threads (does a second thread pay for large jobs on this machine?),
and ``TransferEngine`` running N jobs submitted back to back against the same N jobs
submitted one at a time, each waited for (the overlap of one job's checks with the last
one's copy).

Method: source and destination pools several times larger than the last-level cache,
seeded random block ids (distinct destinations), payload verified outside the timed window,
caches flushed before every timed call, arms interleaved (ABAB...). Ratios use the best of
the repetitions (interference from other processes on a shared VM only ever adds time);
the median ratio is printed beside it as the spread. Every verdict is a ratio measured in
this run; absolute GB/s are printed for context only and never gated.

Run: ``python benchmarks/bench_copy.py [--quick]`` (about 40 s; --quick for a smoke run).
The last line is ``SUMMARY key=value ...``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Idle OpenMP workers sleep instead of spinning: on a 2-vCPU VM a spinning worker steals the
# core (or hyperthread) the single-threaded arms run on. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from kvcore import _native
from kvcore._native import DescriptorTable, Region, RegionTable
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
from kvcore.transfer import TransferEngine

SIZES = (512, 4096, 32768, 65536, 262144, 2097152)
TARGETS = {"vs_swap_4k": ">= 1", "vs_swap_64k": ">= 1", "vs_swap_2m": ">= 1",
           "large_vs_memcpy": ">= 0.7", "validation_share": "<= 0.02"}
SEED = 20261129


def llc_bytes() -> int:
    """The largest cache the OS reports (the pools must not fit in it)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for entry in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KM")) * scale)
    return best or (32 << 20)


def print_header(pool_bytes: int, quick: bool) -> None:
    print(__doc__.split("Method:")[0].strip())
    print()
    print("Back-of-the-envelope ceiling: a gather reads and writes each byte once, like one")
    print("memcpy, so the best a gather of random blocks can do is the single contiguous")
    print("memcpy measured below (DRAM-bound, ~5-20 GB/s on one core). The swap_blocks-style")
    print("baseline (index_select into a temporary, then index_copy_) moves every byte twice,")
    print("so kvcore's single pass should approach 2x of it once blocks are large enough that")
    print("per-block costs vanish; at 4 KiB both pay per-block overheads.")
    print()
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"llc={llc_bytes() >> 20} MiB python={platform.python_version()} "
          f"torch={torch.__version__} torch_threads={torch.get_num_threads()}")
    print(f"pools: 2 x {pool_bytes >> 20} MiB (src, dst); seed={SEED}; quick={quick}; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; load average "
          f"{os.getloadavg()[0]:.1f} (others' work on this machine adds noise)")
    print()


@dataclass
class Case:
    """One block size: pools, ids, the kvcore tables and the baselines' index tensors."""

    size: int
    src: torch.Tensor
    dst: torch.Tensor
    src_ids: torch.Tensor
    dst_ids: torch.Tensor
    regions: RegionTable
    table: DescriptorTable
    tmp: torch.Tensor


def make_case(src_pool: torch.Tensor, dst_pool: torch.Tensor, size: int, count: int,
              gen: torch.Generator) -> Case:
    rows = src_pool.numel() // size
    src, dst = src_pool[: rows * size].view(rows, size), dst_pool[: rows * size].view(rows, size)
    src_ids = torch.randperm(rows, generator=gen)[:count]
    dst_ids = torch.randperm(rows, generator=gen)[:count]
    regions = RegionTable([Region(src.data_ptr(), rows * size, size, size, rows),
                           Region(dst.data_ptr(), rows * size, size, size, rows)])
    zeros = torch.zeros(count, dtype=torch.int64)
    table = torch.stack([zeros, src_ids, zeros, zeros + 1, dst_ids, zeros,
                         zeros + size], dim=1).contiguous()
    return Case(size, src, dst, src_ids, dst_ids, regions,
                DescriptorTable.from_address(table.data_ptr(), count, table),
                torch.empty((count, size), dtype=torch.uint8))


def verify(case: Case) -> None:
    """Outside the timed window: copied blocks equal their sources, others untouched."""
    case.dst[case.dst_ids] = 0
    guard = [i for i in range(min(64, case.dst.shape[0])) if i not in set(case.dst_ids.tolist())]
    before = case.dst[guard].clone()
    _native.copy(case.regions, case.table)
    assert torch.equal(case.dst[case.dst_ids], case.src[case.src_ids]), "copy is wrong"
    assert torch.equal(case.dst[guard], before), "copy touched other blocks"


def arms(case: Case) -> dict[str, Callable[[], None]]:
    """Every timed arm for one block size; each moves the same count x size bytes."""
    count = int(case.src_ids.numel())
    src, dst, tmp = case.src, case.dst, case.tmp
    nbytes = count * case.size
    # The baseline sees the pools as int64 rows (every size here is a multiple of 8): its
    # fastest element type, as a bf16 or fp8 engine pool would not be.
    wide_src, wide_dst, wide_tmp = (t.view(torch.int64) for t in (src, dst, tmp))
    half = count // 2
    first = DescriptorTable(case.table.cdata, half, case.table)
    second = DescriptorTable(case.table.cdata + half, count - half, case.table)

    def swap_blocks() -> None:
        torch.index_select(wide_src, 0, case.src_ids, out=wide_tmp)
        wide_dst.index_copy_(0, case.dst_ids, wide_tmp)

    def memcpy() -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)

    def two_threads() -> None:
        """All of it validated first (no byte moves for a bad table), then two halves."""
        _native.validate(case.regions, case.table)
        helper = threading.Thread(target=_native.copy, args=(case.regions, second))
        helper.start()
        _native.copy(case.regions, first)
        helper.join()

    return {
        "kvcore": lambda: _native.copy(case.regions, case.table),
        "kvcore_validate": lambda: _native.validate(case.regions, case.table),
        "kvcore_plain": lambda: _native.copy(case.regions, case.table, flags=_native.COPY_PLAIN),
        "kvcore_no_nt": lambda: _native.copy(case.regions, case.table,
                                             flags=_native.COPY_NO_STREAM),
        "kvcore_nt": lambda: _native.copy(case.regions, case.table, flags=_native.COPY_STREAM),
        "kvcore_2threads": two_threads,
        "swap_blocks": swap_blocks,
        "memcpy": memcpy,
    }


def interleaved(fns: dict[str, Callable[[], None]], reps: int,
                flush: torch.Tensor) -> dict[str, list[float]]:
    """Median seconds per arm; arms alternate within each repetition (ABAB...).

    Before every timed call the caches are flushed by writing a buffer twice the LLC, so
    no arm profits from blocks the previous arm left in cache (the pools model DRAM).
    """
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: page in, prime the allocator
        fn()
    names = list(fns)
    for rep in range(reps):
        # Rotate the order every repetition so no arm always runs first (or after another).
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn = fns[name]
            flush.fill_(rep & 0xFF)
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


Timings = dict[str, list[float]]


def run(pool_bytes: int, reps: int, payload_bytes: int) -> dict[int, tuple[int, Timings]]:
    gen = torch.Generator().manual_seed(SEED)
    src_pool = torch.randint(1, 256, (pool_bytes,), dtype=torch.uint8, generator=gen)
    dst_pool = torch.randint(1, 256, (pool_bytes,), dtype=torch.uint8, generator=gen)
    flush = torch.empty(2 * llc_bytes(), dtype=torch.uint8)
    results: dict[int, tuple[int, Timings]] = {}
    for size in SIZES:
        count = max(8, min(8192, payload_bytes // size))
        case = make_case(src_pool, dst_pool, size, count, gen)
        verify(case)
        results[size] = (count, interleaved(arms(case), reps, flush))
    return results


def ratio(t: Timings, num: str, den: str, pick: Callable[[list[float]], float] = min) -> float:
    """Time of arm ``num`` over time of arm ``den`` (> 1: ``den`` is faster)."""
    return pick(t[num]) / pick(t[den])


def pair(t: Timings, num: str, den: str) -> str:
    """Best-of-reps ratio, with the ratio of medians in brackets as the spread."""
    return f"{ratio(t, num, den):6.2f} [{ratio(t, num, den, statistics.median):4.1f}]"


def report(results: dict[int, tuple[int, Timings]]) -> dict[str, float]:
    """One row per block size: best-of-reps GB/s, ratios (median ratio in brackets)."""
    print(f"{'block':>8} {'N':>5} | {'kvcore':>6} {'swap':>6} {'memcpy':>6} {'2thr':>6} GB/s"
          f" | {'swap/kv':>13} {'kv vs mcpy':>13} {'2thr/kv':>13} {'valid/kv':>8} | ns/blk"
          f" | {'plain':>5} {'no-NT':>5} {'NT':>5} (time / kvcore)")
    for size, (n, t) in results.items():
        gbs = {k: n * size / min(t[k]) / 1e9 for k in ("kvcore", "swap_blocks", "memcpy",
                                                        "kvcore_2threads")}
        print(f"{size:>8} {n:>5} | {gbs['kvcore']:6.2f} {gbs['swap_blocks']:6.2f} "
              f"{gbs['memcpy']:6.2f} {gbs['kvcore_2threads']:6.2f}      | "
              f"{pair(t, 'swap_blocks', 'kvcore')} {pair(t, 'memcpy', 'kvcore')} "
              f"{pair(t, 'kvcore_2threads', 'kvcore')} "
              f"{ratio(t, 'kvcore_validate', 'kvcore'):8.4f} | "
              f"{min(t['kvcore']) / n * 1e9:6.0f} | {ratio(t, 'kvcore_plain', 'kvcore'):5.2f} "
              f"{ratio(t, 'kvcore_no_nt', 'kvcore'):5.2f} {ratio(t, 'kvcore_nt', 'kvcore'):5.2f}")
    return {
        "vs_swap_4k": ratio(results[4096][1], "swap_blocks", "kvcore"),
        "vs_swap_64k": ratio(results[65536][1], "swap_blocks", "kvcore"),
        "vs_swap_2m": ratio(results[2097152][1], "swap_blocks", "kvcore"),
        "large_vs_memcpy": ratio(results[262144][1], "memcpy", "kvcore"),
        "validation_share": ratio(results[4096][1], "kvcore_validate", "kvcore"),
        "two_threads_2m": ratio(results[2097152][1], "kvcore", "kvcore_2threads"),
    }


def engine_jobs(block: int, ids: int, jobs: int, reps: int) -> tuple[float, float]:
    """Best wall seconds of (serial, back to back) for ``jobs`` store jobs of ``ids``
    blocks each through one TransferEngine (four tensors per group, as per-layer pools)."""
    blocks = 1 + ids * jobs
    cfg = OffloadConfig((GroupSpec(GroupKind.FULL, 16),), hash_block_tokens=16,
                        num_gpu_blocks=blocks, num_cpu_blocks=ids * jobs)
    pools = [[torch.randint(0, 255, (blocks, block), dtype=torch.uint8) for _ in range(4)]]
    plans = [TransferPlan(j, JobKind.STORE, "r", (GroupTransfer(
        tuple(range(1 + j * ids, 1 + (j + 1) * ids)), 0,
        tuple(range(j * ids, (j + 1) * ids))),)) for j in range(jobs)]
    serial, b2b = [], []
    with TransferEngine(cfg, pools) as engine:
        for _ in range(reps):
            start = time.perf_counter()
            for plan in plans:
                engine.submit(plan)
                engine.wait([plan.job_id])
            serial.append(time.perf_counter() - start)
            start = time.perf_counter()
            for plan in plans:
                engine.submit(plan)
            engine.drain()
            b2b.append(time.perf_counter() - start)
            results = engine.poll()
            if not all(r.success for r in results) or len(results) != 2 * jobs:
                raise RuntimeError(f"a benchmark job failed: {results[:2]}")
    return min(serial), min(b2b)


def report_jobs(reps: int) -> float:
    """Serial vs back-to-back wall time of N engine jobs per block size; the 4 KiB ratio."""
    print(f"TransferEngine, 32 store jobs of 4 tensors: wall ms (best of {reps})")
    print(f"{'block':>8} {'ids/job':>7} | {'serial':>8} {'back2back':>9} | serial/b2b")
    out = 0.0
    for block, ids in ((4096, 16), (65536, 16), (2 << 20, 4)):
        serial, b2b = engine_jobs(block, ids, 32, reps)
        print(f"{block:>8} {ids:>7} | {serial * 1e3:8.2f} {b2b * 1e3:9.2f} | "
              f"{serial / b2b:6.2f}")
        out = out or serial / b2b
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small pools, few reps (smoke)")
    args = parser.parse_args(argv)
    pool_bytes = (64 << 20) if args.quick else max(256 << 20, 8 * llc_bytes())
    reps = 3 if args.quick else 11
    print_header(pool_bytes, args.quick)
    start = time.perf_counter()
    summary = report(run(pool_bytes, reps, payload_bytes=32 << 20))
    print()
    summary["jobs_serial_vs_b2b_4k"] = report_jobs(reps)
    print()
    print("targets: " + " ".join(f"{k} {v}" for k, v in TARGETS.items()))
    print(f"wall: {time.perf_counter() - start:.1f} s")
    print("SUMMARY " + " ".join(f"{k}={v:.3f}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
