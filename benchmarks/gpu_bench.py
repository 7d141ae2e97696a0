"""gpu_bench: kvcore's CUDA copy paths against the PCIe ceiling and a per-block torch loop.

Goal (issue 4), predicted before measuring (copy-perf.md sections 5 and 8):
- at 2 MiB blocks every kvcore path reaches >= 80% of the measured host<->device ceiling;
- at <= 32 KiB blocks and N = 4096 the best kvcore path beats a per-block torch
  ``copy_(non_blocking=True)`` loop by >= 10x (the loop pays ~5-10 us of Python+driver per
  block; the batched API ~0.5 us per descriptor; the SM kernel one launch per 512 blocks);
- the batched copy works through both driver ABIs (12.8's 9 arguments, 13.0's 8);
- hostile descriptors are refused before anything is enqueued and device memory is unchanged.

Baseline and ceiling in the same process: one large pinned<->device copy each way (the
denominator), and the torch loop. Timing: CUDA events around each call on a side stream
(solo latency: submit plus completion), one warm-up, the median of REPS repetitions,
payloads verified outside the timed window. The library is driven through ctypes so this
script needs only torch and the built ``native/build/libkvcore_cuda.so`` (no cffi).

Run: ``python benchmarks/gpu_bench.py [--json out.json] [--quick]``; the last line is
``SUMMARY key=value ...``. ``benchmarks/run_gpu.sh`` builds, tests and runs it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REPS = 5
SIZES = (8 << 10, 32 << 10, 128 << 10, 2 << 20)
COUNTS = (16, 256, 4096)
POOL_BYTES = 1 << 30
MAX_PAYLOAD = 512 << 20
LOOP_MAX_BLOCKS = 4096


def header_constants() -> dict[str, int]:
    """KVC_* integer constants of both headers (so this script never drifts from them)."""
    out: dict[str, int] = {}
    for name in ("kvcore_copy.h", "kvcore_copy_cuda.h"):
        text = (ROOT / "native" / name).read_text()
        out.update({m[1]: int(m[2]) for m in re.finditer(r"#define\s+(KVC_\w+)\s+(-?\d+)", text)})
    return out


K = header_constants()


class Region(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("base", "size_bytes", "row_stride_bytes",
                                                "row_bytes", "num_rows", "flags")]


class Error(ctypes.Structure):
    _fields_ = [("index", ctypes.c_int64), ("value", ctypes.c_int64), ("bound", ctypes.c_int64),
                ("side", ctypes.c_int32), ("status", ctypes.c_int32)]


class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in (
        "device", "driver_version", "runtime_version", "batch_abi", "unified_addressing",
        "can_use_host_pointer", "async_engine_count", "multiprocessor_count")]


class Lib:
    """The CUDA library through ctypes (which, like cffi, releases the GIL in calls)."""

    def __init__(self, path: Path, device: int) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.kvc_status_text.restype = ctypes.c_char_p
        self.ctx = ctypes.c_void_p()
        err = Error()
        status = self.lib.kvc_cuda_open(ctypes.c_int32(device), ctypes.byref(self.ctx),
                                        ctypes.byref(err))
        if status:
            raise RuntimeError(f"kvc_cuda_open: {self.text(status)} (cuda error {err.value})")

    def text(self, status: int) -> str:
        return str(self.lib.kvc_status_text(status).decode())

    def info(self) -> dict[str, int]:
        info = Info()
        self.lib.kvc_cuda_get_info(self.ctx, ctypes.byref(info))
        return {field[0]: int(getattr(info, field[0])) for field in Info._fields_}

    def copy(self, regions: ctypes.Array[Region], table: torch.Tensor, stream: int,
             method: int, ctas: int = 0) -> Error:
        """Validate and enqueue; returns the error record (status 0 = enqueued)."""
        err = Error()
        err.status = self.lib.kvc_cuda_copy(
            self.ctx, regions, ctypes.c_uint64(len(regions)), ctypes.c_void_p(table.data_ptr()),
            ctypes.c_uint64(table.shape[0]), ctypes.c_uint64(stream), ctypes.c_int32(method),
            ctypes.c_int32(ctas), ctypes.byref(err))
        return err


def regions_of(host: torch.Tensor, device: torch.Tensor) -> ctypes.Array[Region]:
    """Region 0: the pinned host pool; region 1: the device pool (row 0 = null block)."""
    arr = (Region * 2)()
    for i, (t, flags) in enumerate(((host, 0), (device, K["KVC_REGION_DEVICE"]
                                                 | K["KVC_REGION_REFUSE_ROW0"]))):
        arr[i] = Region(t.data_ptr(), t.numel() * t.element_size(), t.stride(0),
                        t.shape[1], t.shape[0], flags)
    return arr


def timed(fn: Callable[[], None], stream: torch.cuda.Stream, reps: int) -> dict[str, float]:
    """Median GPU-event seconds (submit + completion) and median CPU submit seconds."""
    gpu, cpu = [], []
    for rep in range(reps + 1):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(stream)
        t0 = time.perf_counter()
        fn()
        submit = time.perf_counter() - t0
        end.record(stream)
        end.synchronize()
        if rep:  # rep 0 is the warm-up
            gpu.append(start.elapsed_time(end) / 1e3)
            cpu.append(submit)
    return {"seconds": statistics.median(gpu), "submit_seconds": statistics.median(cpu)}


def ceilings(host: torch.Tensor, device: torch.Tensor, stream: torch.cuda.Stream,
             reps: int) -> dict[str, float]:
    """One large contiguous copy each way, and device-to-device: the denominators (GB/s)."""
    n = min(MAX_PAYLOAD, host.numel() // 2)
    h, d = host.view(-1), device.view(-1)
    pairs = {"h2d": (d[:n], h[:n]), "d2h": (h[:n], d[:n]), "d2d": (d[n:2 * n], d[:n])}
    out = {}
    for name, (dst, src) in pairs.items():
        def fn(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        out[name] = n / timed(fn, stream, reps)["seconds"] / 1e9
    return out


def methods(info: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The kvcore arms this driver offers: name -> (method, kernel CTAs)."""
    arms = {"per_copy": (K["KVC_CUDA_PER_COPY"], 0), "kernel": (K["KVC_CUDA_KERNEL"], 0),
            "kernel16": (K["KVC_CUDA_KERNEL"], 16)}
    if info["batch_abi"]:
        arms["batch"] = (K["KVC_CUDA_BATCH"], 0)
    if info["batch_abi"] and info["driver_version"] >= 12080:
        arms["batch_v12080"] = (K["KVC_CUDA_BATCH_V12080"], 0)
    return arms


class Cell:
    """One (block size, count, direction): pools viewed as rows, random ids, one table."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor, size: int, count: int,
                 h2d: bool, gen: torch.Generator) -> None:
        rows_h, rows_d = host.numel() // size, device.numel() // size
        self.size, self.h2d = size, h2d
        self.count = min(count, MAX_PAYLOAD // size, rows_d // 2)
        self.host = host.view(-1)[: rows_h * size].view(rows_h, size)
        self.dev = device.view(-1)[: rows_d * size].view(rows_d, size)
        self.host_ids = torch.randperm(rows_h, generator=gen)[: self.count]
        self.dev_ids = torch.randperm(rows_d - 1, generator=gen)[: self.count] + 1
        zeros = torch.zeros(self.count, dtype=torch.int64)
        cols = [zeros, self.host_ids, zeros, zeros + 1, self.dev_ids, zeros] if h2d else \
            [zeros + 1, self.dev_ids, zeros, zeros, self.host_ids, zeros]
        self.table = torch.stack([*cols, zeros + size], dim=1).contiguous()
        self.regions = regions_of(self.host, self.dev)

    def poison(self) -> None:
        if self.h2d:
            self.dev[self.dev_ids.cuda()] = 0
        else:
            self.host[self.host_ids] = 0

    def correct(self) -> bool:
        """Every destination block equals its source (compared on the device)."""
        torch.cuda.synchronize()
        return bool(torch.equal(self.dev[self.dev_ids.cuda()], self.host[self.host_ids].cuda()))

    def torch_loop(self, stream: torch.cuda.Stream) -> Callable[[], None]:
        hl, dl = self.host_ids.tolist(), self.dev_ids.tolist()
        src, dst = (self.host, self.dev) if self.h2d else (self.dev, self.host)
        sl, tl = (hl, dl) if self.h2d else (dl, hl)

        def run() -> None:
            with torch.cuda.stream(stream):
                for s, t in zip(sl, tl, strict=True):
                    dst[t].copy_(src[s], non_blocking=True)
        return run


def enqueue(lib: Lib, cell: Cell, stream: torch.cuda.Stream, method: int,
            ctas: int) -> Callable[[], None]:
    def run() -> None:
        err = lib.copy(cell.regions, cell.table, stream.cuda_stream, method, ctas)
        if err.status:
            raise RuntimeError(f"kvc_cuda_copy: {lib.text(err.status)} at {err.index}")
    return run


def run_cell(lib: Lib, cell: Cell, arms: dict[str, tuple[int, int]],
             stream: torch.cuda.Stream, reps: int) -> dict[str, dict[str, float]]:
    """Verify then time every arm of one cell; a wrong or refused arm is recorded, not fatal."""
    out: dict[str, dict[str, float]] = {}
    for name, (method, ctas) in arms.items():
        cell.poison()
        err = lib.copy(cell.regions, cell.table, stream.cuda_stream, method, ctas)
        if err.status or not cell.correct():
            out[name] = {"error": float(err.status or -1)}
            continue
        out[name] = timed(enqueue(lib, cell, stream, method, ctas), stream, reps)
    if cell.count <= LOOP_MAX_BLOCKS:
        cell.poison()
        loop = cell.torch_loop(stream)
        loop()
        if cell.correct():
            out["torch_loop"] = timed(loop, stream, reps)
    for v in out.values():
        if "seconds" in v:
            v["gbs"] = cell.count * cell.size / v["seconds"] / 1e9
    return out


def safety(lib: Lib, stream: torch.cuda.Stream) -> dict[str, bool]:
    """Hostile descriptors on real device memory: each refused with its status, no byte moved."""
    rows, size = 64, 8192
    host = torch.randint(1, 256, (rows, size), dtype=torch.uint8).pin_memory()
    pageable = torch.randint(1, 256, (rows, size), dtype=torch.uint8)
    dev = torch.zeros((rows, size), dtype=torch.uint8, device="cuda")
    good = [0, 1, 0, 1, 1, 0, size]
    cases = {  # name: (descriptor field overrides, stream, method, host tensor, status)
        "device id = row count": ({4: rows}, None, "KVC_CUDA_AUTO", host, "KVC_E_ROW_RANGE"),
        "null device block": ({4: 0}, None, "KVC_CUDA_AUTO", host, "KVC_E_NULL_ROW"),
        "negative host id": ({1: -1}, None, "KVC_CUDA_BATCH", host, "KVC_E_ROW_RANGE"),
        "huge host id": ({1: 2**62}, None, "KVC_CUDA_KERNEL", host, "KVC_E_ROW_RANGE"),
        "size beyond the row": ({6: size + 1}, None, "KVC_CUDA_PER_COPY", host, "KVC_E_SIZE"),
        "offset overflow": ({5: 2**63 - 8}, None, "KVC_CUDA_AUTO", host, "KVC_E_OFFSET"),
        "legacy default stream": ({}, 0, "KVC_CUDA_AUTO", host, "KVC_E_DEFAULT_STREAM"),
        "per-thread stream": ({}, 2, "KVC_CUDA_AUTO", host, "KVC_E_DEFAULT_STREAM"),
        "pageable host, kernel": ({}, None, "KVC_CUDA_KERNEL", pageable, "KVC_E_PAGEABLE"),
    }
    out = {}
    for name, (changes, handle, method, src, expected) in cases.items():
        descs = [list(good) for _ in range(4)]
        for field, value in changes.items():
            descs[2][field] = value
        table = torch.tensor(descs, dtype=torch.int64)
        err = lib.copy(regions_of(src, dev), table,
                       stream.cuda_stream if handle is None else handle, K[method])
        torch.cuda.synchronize()
        out[name] = err.status == K[expected] and int(dev.count_nonzero()) == 0
    return out


def engine_check() -> str:
    """TransferEngine end to end on CUDA (needs kvcore installed, i.e. cffi present)."""
    try:
        from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
        from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
        from kvcore.transfer import TransferEngine
    except ImportError as exc:
        return f"skipped ({exc})"
    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL, 16, blocks_per_chunk=2),),
                        hash_block_tokens=16, num_gpu_blocks=64, num_cpu_blocks=16)
    for method in ("auto", "per_copy", "kernel"):
        kv = torch.randint(-2**15, 2**15, (64, 2, 16, 64), dtype=torch.int16, device="cuda")
        before = kv.clone()
        with TransferEngine(cfg, [[kv]], cuda_method=method) as engine:
            engine.submit(TransferPlan(1, JobKind.STORE, "r",
                                       (GroupTransfer((3, 4, 5), 0, (1, 6)),)))
            engine.submit(TransferPlan(2, JobKind.LOAD, "r",
                                       (GroupTransfer((20, 21), 1, (1, 6)),)))
            engine.submit(TransferPlan(3, JobKind.LOAD, "r", (GroupTransfer((99,), 0, (1,)),)))
            res = {r.job_id: r.success for r in engine.wait([1, 2, 3], timeout=120)}
        torch.cuda.synchronize()
        if res != {1: True, 2: True, 3: False} or not torch.equal(kv[20:22], before[4:6]):
            return f"FAILED with cuda_method={method}: {res}"
    return "ok"


@dataclass
class Row:
    direction: str
    size: int
    count: int
    arms: dict[str, dict[str, float]]


def sweep(lib: Lib, arms: dict[str, tuple[int, int]], host: torch.Tensor,
          device: torch.Tensor, stream: torch.cuda.Stream, reps: int,
          counts: tuple[int, ...]) -> list[Row]:
    """Every (direction, block size, count) cell; one progress line per cell."""
    gen = torch.Generator().manual_seed(20261129)
    rows: list[Row] = []
    for direction in ("h2d", "d2h"):
        for size in SIZES:
            for count in counts:
                cell = Cell(host, device, size, count, direction == "h2d", gen)
                row = Row(direction, size, cell.count, run_cell(lib, cell, arms, stream, reps))
                rows.append(row)
                print(f"  {direction} {size >> 10:>5} KiB x {cell.count:>4}: " + " ".join(
                    f"{k}={v.get('gbs', float('nan')):.1f}" for k, v in row.arms.items()),
                    flush=True)
    return rows


def verdict(rows: list[Row], ceil: dict[str, float]) -> dict[str, float]:
    """The short table (printed last): largest N per size, best kvcore arm, ratios."""
    print("\nverdict (largest N per size; best kvcore arm; ratios measured in this run):")
    print(f"{'dir':>4} {'block':>8} {'N':>5} {'best arm':>13} {'GB/s':>6} {'%ceil':>6} "
          f"{'vs loop':>8}")
    summary: dict[str, float] = {}
    for row in rows:
        largest = max(r.count for r in rows if r.size == row.size)
        if row.size not in (8 << 10, 32 << 10, 2 << 20) or row.count != largest:
            continue
        ours = {k: v["gbs"] for k, v in row.arms.items() if k != "torch_loop" and "gbs" in v}
        best = max(ours, key=ours.__getitem__) if ours else "none"
        gbs = ours.get(best, 0.0)
        pct = 100 * gbs / ceil[row.direction]
        loop = row.arms.get("torch_loop", {}).get("gbs")
        vs = gbs / loop if loop else float("nan")
        print(f"{row.direction:>4} {row.size:>8} {row.count:>5} {best:>13} {gbs:6.1f} "
              f"{pct:6.1f} {vs:8.1f}")
        tag = f"{row.direction}_{row.size >> 10}k"
        summary[f"{tag}_pct_ceiling"] = pct
        summary[f"{tag}_vs_torch_loop"] = vs
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="gpu_bench.json", help="where to write all samples")
    parser.add_argument("--quick", action="store_true", help="fewer counts and repetitions")
    parser.add_argument("--lib", default=os.environ.get(
        "KVCORE_CUDA_LIB", str(ROOT / "native" / "build" / "libkvcore_cuda.so")))
    args = parser.parse_args(argv)
    print(__doc__.split("Run:")[0].strip(), "\n", flush=True)
    if not torch.cuda.is_available():
        print("SUMMARY gpu=0 reason=torch_sees_no_cuda_device")
        return 2
    lib = Lib(Path(args.lib), torch.cuda.current_device())
    info = lib.info()
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.total_memory >> 30} GiB; torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}); kvcore cuda info {info}", flush=True)
    reps = 3 if args.quick else REPS
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    t0 = time.perf_counter()
    host = torch.randint(1, 256, (POOL_BYTES,), dtype=torch.uint8).pin_memory()
    device = torch.randint(1, 256, (POOL_BYTES,), dtype=torch.uint8, device="cuda")
    print(f"pools: {POOL_BYTES >> 20} MiB pinned host, {POOL_BYTES >> 20} MiB device "
          f"(allocated and pinned in {time.perf_counter() - t0:.1f} s)", flush=True)
    ceil = ceilings(host, device, stream, reps)
    print("ceilings GB/s: " + " ".join(f"{k}={v:.1f}" for k, v in ceil.items()), flush=True)
    arms = methods(info)
    rows = sweep(lib, arms, host, device, stream, reps, COUNTS[::2] if args.quick else COUNTS)
    safe = safety(lib, stream)
    print("safety: " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in safe.items()))
    engine = engine_check()
    print(f"TransferEngine on CUDA: {engine}")
    Path(args.json).write_text(json.dumps({"info": info, "ceilings": ceil,
                                           "rows": [asdict(r) for r in rows],
                                           "safety": safe, "engine": engine}, indent=1))
    summary = verdict(rows, ceil)
    summary.update({"h2d_ceiling_gbs": ceil["h2d"], "d2h_ceiling_gbs": ceil["d2h"],
                    "batch_abi": info["batch_abi"], "safety_ok": float(all(safe.values())),
                    "engine_ok": float(engine == "ok")})
    print(f"wall: {time.perf_counter() - t0:.0f} s; full samples in {args.json}")
    print("SUMMARY " + " ".join(f"{k}={v:.3g}" for k, v in summary.items()))
    engine_fine = engine == "ok" or engine.startswith("skipped")
    return 0 if all(safe.values()) and engine_fine else 1


if __name__ == "__main__":
    sys.exit(main())
