"""Registration: the constructor's checks, the CPU tier's buffers, the region table.

Functions of the config and the tensors alone, so that ``TransferEngine`` keeps only what
lives as long as the engine: its regions, its queue and its worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore import _cuda, _native
from kvcore._cuda import cuda_available, cuda_unavailable_reason
from kvcore._native import Region
from kvcore.manager._capacity import group_capacity
from kvcore.spec.errors import ConfigError
from kvcore.spec.hooks import own_items
from kvcore.spec.types import OffloadConfig

from ._memory import (
    _bad,
    _check_buffer,
    _check_disjoint,
    _Pool,
    _pool_of,
    _Registered,
    check_pools,
)

MAX_QUEUED_JOBS = 4096  # submit() blocks beyond this; the worker always drains the queue
# Jobs submitted and not yet handed out by poll() (in flight, queued, or finished with the
# result waiting): wait() leaves results for poll(), so a caller that waits and never
# polls would keep every result (200-330 bytes each) for good. Past this, submit refuses
# (CallOrderError) until poll() is called: backpressure, never a dropped result.
MAX_UNPOLLED_JOBS = 1 << 16
MAX_QUEUED_JOBS_LIMIT = 1 << 20  # the bound on max_queued_jobs itself (memory is per job)


def cpu_capacity(config: OffloadConfig, group: int) -> int:
    """CPU chunk rows the tier holds for ``group``: its slot ids are 0..capacity-1.

    Capacities are per group (a slot holds one chunk of one group), so the pinned bytes are
    exactly the sum over groups of capacity x bytes per chunk. The number comes from
    ``kvcore.manager._capacity.group_capacity``, the function ``CPUOffloadManager.for_config``
    sizes its pools with, so the engine and the manager cannot disagree about a pool.
    """
    return group_capacity(config, group)


def snapshot(lists: object) -> object:
    """A list of lists (``gpu_tensors``, a ``cpu_buffer`` list) read once, as plain tuples,
    and used from then on: a list subclass whose ``__len__`` disagreed with its items got
    past the count checks and failed later with a bare IndexError. Anything else is
    returned as it is, for the checks to refuse."""
    if isinstance(lists, torch.Tensor) or not isinstance(lists, (list, tuple)):
        return lists
    return tuple(own_items(x) if isinstance(x, (list, tuple)) else x  # type: ignore[arg-type]
                 for x in own_items(lists))  # type: ignore[arg-type]


def _check_options(config: object, gpu_tensors: object, pin_memory: object,
                   cuda_method: object, max_queued_jobs: object,
                   simulate_stream: object, simulate_faults: object) -> None:
    """The constructor's arguments other than the tensors themselves: types and ranges."""
    if not isinstance(config, OffloadConfig):
        raise _bad("config", f"must be an OffloadConfig, not {type(config).__name__}")
    if isinstance(gpu_tensors, torch.Tensor) or not isinstance(gpu_tensors, (list, tuple)):
        raise _bad("gpu_tensors", f"must be a list with one list of tensors per group, not "
                                  f"{type(gpu_tensors).__name__}")
    if len(gpu_tensors) != len(config.groups):
        raise _bad("gpu_tensors", f"has {len(gpu_tensors)} groups but the config has "
                                  f"{len(config.groups)}; pass one list of tensors per group",
                   value=len(gpu_tensors), bound=len(config.groups))
    if not isinstance(cuda_method, str) or cuda_method not in _cuda.METHODS:
        raise _bad("cuda_method", f"{cuda_method!r} is not one of {sorted(_cuda.METHODS)}")
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise _bad("pin_memory", f"{pin_memory!r} must be True, False or None (auto)")
    if type(max_queued_jobs) is not int \
            or not 1 <= max_queued_jobs <= MAX_QUEUED_JOBS_LIMIT:
        raise _bad("max_queued_jobs", f"{max_queued_jobs!r} must be an int in "
                                      f"1..{MAX_QUEUED_JOBS_LIMIT}")
    if simulate_stream is not None and (type(simulate_stream) is not int
                                        or not 0 <= simulate_stream < 1 << 64):
        raise _bad("simulate_stream", f"{simulate_stream!r} must be None or a seed, an int "
                                      "in 0..2**64-1")
    if isinstance(simulate_faults, bool) or not isinstance(simulate_faults, (int, float)) \
            or not 0.0 <= simulate_faults <= 1.0:  # NaN fails the range test too
        raise _bad("simulate_faults", f"{simulate_faults!r} must be a share of jobs, a number "
                                      "in 0..1")
    if simulate_faults > 0.0 and simulate_stream is None:
        raise _bad("simulate_faults", f"is {simulate_faults!r} but there is no stand-in stream "
                                      "to fail copies on: pass simulate_stream (a seed) too")



def tier_capacities(config: OffloadConfig) -> tuple[int, ...]:
    """Every group's slot count, read once per engine through ``kvcore.transfer``.

    The name is looked up on the package at call time, so ``kvcore.transfer.cpu_capacity``
    stays the one place the engine reads capacities from (the tier tests override it
    there), even though this module defines it.
    """
    from kvcore import transfer
    return tuple(transfer.cpu_capacity(config, g) for g in range(len(config.groups)))


def common_device(gpu_tensors: Sequence[Sequence[torch.Tensor]]) -> torch.device:
    """The one device every GPU tensor lives on (cpu stands in for a GPU without CUDA)."""
    devices = {t.device for ts in gpu_tensors if isinstance(ts, (list, tuple))
               for t in ts if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise _bad("gpu_tensors", f"live on several devices {sorted(map(str, devices))}; "
                                  "one TransferEngine serves one device")
    device = next(iter(devices), torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        raise _bad("gpu_tensors", f"are on {device}; only cpu and cuda are supported")
    if device.type == "cuda" and not cuda_available():
        raise _bad("gpu_tensors", f"are on {device} but kvcore's CUDA library is "
                                  f"unavailable: {cuda_unavailable_reason()}")
    return device


def gpu_pools(cfg: OffloadConfig, gpu_tensors: Sequence[Sequence[torch.Tensor]],
              device: torch.device) -> list[list[_Pool]]:
    """Every GPU tensor checked (layout, device, block count, storage bounds)."""
    out: list[list[_Pool]] = []
    for g, tensors in enumerate(gpu_tensors):
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise _bad(f"gpu_tensors[{g}]", "must be a non-empty list of tensors (one per "
                                            "layer, or one packed tensor); a group "
                                            "without tensors would store no bytes")
        pools = [_pool_of(t, f"gpu_tensors[{g}][{k}]", device)
                 for k, t in enumerate(tensors)]
        for p in pools:
            if p.rows != cfg.num_gpu_blocks:
                raise _bad(p.where, f"has {p.rows} blocks but num_gpu_blocks="
                                    f"{cfg.num_gpu_blocks}; dim 0 must be the block id",
                           value=p.rows, bound=cfg.num_gpu_blocks)
        out.append(pools)
    _check_disjoint([p for pools in out for p in pools])  # writable: at register()
    return out


def _chunk_bytes(cfg: OffloadConfig, pools: list[list[_Pool]], g: int) -> list[int]:
    """Bytes of one CPU chunk of each of group ``g``'s tensors."""
    bpc = cfg.groups[g].blocks_per_chunk
    return [bpc * p.row_bytes for p in pools[g]]


def _allocate_tier(nbytes: int, group: int, chunks: int, pin: bool) -> torch.Tensor:
    """Group ``group``'s CPU tier, or a ConfigError naming what was asked: torch's own
    error says neither the field nor that a tier of this many chunks was the request
    (a config may allow 2**28 chunks that no host can hold), and pinning needs a GPU."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    except RuntimeError as exc:
        if pin and not torch.cuda.is_available():
            raise ConfigError("pin_memory", "page-locked memory needs a CUDA device, and "
                              "torch sees none; pass pin_memory=False (or None: auto)") \
                from None
        raise ConfigError("num_cpu_blocks", f"group {group}'s CPU tier of {chunks} chunks "
                          f"({nbytes} bytes{', pinned' if pin else ''}) could not be "
                          f"allocated ({str(exc).splitlines()[0][:120]}); lower "
                          "num_cpu_blocks (vLLM: cpu_bytes)") from None


def cpu_buffers(cfg: OffloadConfig, pools: list[list[_Pool]], capacities: Sequence[int],
                cpu_buffer: object, pin: bool) -> list[torch.Tensor]:
    """One flat uint8 buffer per group: carved from the engine's, or allocated here.

    Group g needs ``capacities[g]`` chunks per tensor and nothing more; a single engine
    buffer holds the groups back to back, in group order.
    """
    needs = [capacities[g] * sum(_chunk_bytes(cfg, pools, g)) for g in range(len(pools))]
    if cpu_buffer is None:
        return [_allocate_tier(n, g, capacities[g], pin) for g, n in enumerate(needs)]
    if isinstance(cpu_buffer, torch.Tensor):
        flat = _check_buffer(cpu_buffer, "cpu_buffer", sum(needs), pin)
        starts = [sum(needs[:g]) for g in range(len(needs))]
        return [flat[a:a + n] for a, n in zip(starts, needs, strict=True)]
    if not isinstance(cpu_buffer, (list, tuple)) or len(cpu_buffer) != len(needs):
        raise _bad("cpu_buffer", f"must be one uint8 tensor or a list of {len(needs)} "
                                 "(one per group)")
    return [_check_buffer(b, f"cpu_buffer[{g}]", n, pin)
            for g, (b, n) in enumerate(zip(cpu_buffer, needs, strict=True))]


def register(cfg: OffloadConfig, device: torch.device, pools: list[list[_Pool]],
             capacities: Sequence[int], buffers: list[torch.Tensor]
             ) -> tuple[list[list[_Registered]], list[Region]]:
    """Carve each GPU tensor's CPU twin out of its group's buffer; lay out the regions."""
    gpu_flags = _native.REGION_REFUSE_ROW0
    if device.type == "cuda":
        gpu_flags |= _native.REGION_DEVICE
    groups: list[list[_Registered]] = []
    regions: list[Region] = []
    cpu_pools: list[_Pool] = []
    for g, group_pools in enumerate(pools):
        rows, at = capacities[g], 0
        regs: list[_Registered] = []
        for k, (p, chunk) in enumerate(zip(group_pools, _chunk_bytes(cfg, pools, g),
                                           strict=True)):
            cpu = buffers[g][at:at + rows * chunk].view(rows, chunk)
            at += rows * chunk
            cpu_pool = _pool_of(cpu, f"cpu tier [{g}][{k}]", torch.device("cpu"))
            cpu_pools.append(cpu_pool)
            regions.append(p.region(gpu_flags))
            regions.append(cpu_pool.region(0))
            regs.append(_Registered(p.tensor, cpu, p.row_bytes, len(regions) - 2,
                                    len(regions) - 1, p, cpu_pool))
        groups.append(regs)
    check_pools([p for group_pools in pools for p in group_pools] + cpu_pools)
    return groups, regions
