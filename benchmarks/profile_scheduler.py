"""Where a decode step and a cold lookup spend their time: cProfile over the benchmark's
own engine loop (``bench_scheduler.Engine``), so the profile is of the work it times.

``bench_scheduler.py --profile`` prints one step; this prints several steps (one step's
profile is mostly noise at a few ms) and splits the step into its parts (the workers'
completions, ``build_step``; the rest of ``step`` is building the ScheduledRequests) by
thread CPU time, so a change can be measured on the part it targets.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scheduler import Engine


def parts(eng: Engine, steps: int) -> dict[str, float]:
    """Mean ms per step of the decode step's parts, as the benchmark times it: the
    scheduler's ``worker_output`` and ``build_step`` outside the admission (timed apart,
    its jobs' completion included); ``step`` also holds building the ScheduledRequests."""
    sched = eng.sched
    spent = dict.fromkeys(("worker_output", "build_step"), 0.0)
    admitting = [False]
    wrapped = {"worker_output": (sched, "worker_output"), "build_step": (sched, "build_step")}
    originals = {name: getattr(obj, attr) for name, (obj, attr) in wrapped.items()}
    admit, complete = eng.prefill, eng.complete

    def timed(name: str):  # type: ignore[no-untyped-def]
        fn = originals[name]
        part = name

        def run(*a, **k):  # type: ignore[no-untyped-def]
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                if not admitting[0]:
                    spent[part] += time.thread_time() - t0
        return run

    def prefill(live):  # type: ignore[no-untyped-def]
        admitting[0] = True
        admit(live)

    def completed():  # type: ignore[no-untyped-def]
        # Engine.step completes the admission's jobs right after its prefill.
        try:
            complete()
        finally:
            admitting[0] = False

    for name, (obj, attr) in wrapped.items():
        setattr(obj, attr, timed(name))
    eng.prefill = prefill  # type: ignore[method-assign]
    eng.complete = completed  # type: ignore[method-assign]
    try:
        whole = [eng.step() for _ in range(steps)]
    finally:
        for _name, (obj, attr) in wrapped.items():
            delattr(obj, attr)
        del eng.prefill, eng.complete
    out = {k: v * 1e3 / steps for k, v in spent.items()}
    out["step"] = statistics.mean(whole) * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", default="dsv4", choices=["dsv4", "llama"])
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    t0 = time.perf_counter()
    eng = Engine(args.layout, args.context, args.requests, check=args.check)
    print(f"setup {time.perf_counter() - t0:.1f} s, {eng.bytes_per_hash:.0f} B/hash block")
    for _ in range(3):
        eng.step()
    print("parts (ms/step):", {k: round(v, 3) for k, v in parts(eng, args.steps).items()})
    prof = cProfile.Profile()
    admit = eng.prefill

    def unprofiled_prefill(live):  # type: ignore[no-untyped-def]
        # The admission is timed apart by the benchmark; keep it out of the profile too.
        prof.disable()
        try:
            admit(live)
        finally:
            prof.enable()

    complete = eng.complete

    def unprofiled_complete():  # type: ignore[no-untyped-def]
        # The admission's jobs complete inside it (Engine.step): out of the profile too.
        prof.disable()
        try:
            complete()
        finally:
            prof.enable()

    eng.prefill = unprofiled_prefill  # type: ignore[method-assign]
    eng.complete = unprofiled_complete  # type: ignore[method-assign]
    prof.runcall(lambda: [eng.step() for _ in range(args.steps)])
    del eng.prefill, eng.complete
    print(f"-- profile: {args.steps} decode steps (admission left out) --")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    cold, warm = eng.lookups(5)
    print(f"lookup cold {cold:.2f} ms, warm {warm:.2f} ms")
    prof = cProfile.Profile()
    prof.runcall(lambda: eng.lookups(3))
    print("-- profile: 3 cold + warm lookups --")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
