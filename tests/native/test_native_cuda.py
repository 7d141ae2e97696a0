"""The CUDA copy library on a real device: every method agrees, hostile input never reaches it.

Goal: the batched path (both driver ABIs), the per-copy fallback and the SM kernel move the
same bytes as a torch reference between pinned host memory and device memory; bad ids,
the legacy default stream and pageable memory for the kernel are refused before anything is
enqueued, leaving device memory unchanged. Method: random payloads, poisoned destinations,
whole-pool comparisons after a stream synchronize. Without a GPU every test but the compile
check skips with the reason ``kvcore._cuda`` reports.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import _cuda, _native
from kvcore._native import DescriptorTable, Region, RegionTable, Status
from kvcore.spec.errors import KVCopyError

ROWS = 64
ROW_BYTES = 8192


def test_cuda_library_compiles_with_nvcc() -> None:
    """The .cu source must build wherever nvcc exists, GPU or not (cached by source hash)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "native" / "build_cuda.py"
    spec = importlib.util.spec_from_file_location("kvcore_build_cuda_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.find_nvcc() is None and shutil.which("nvcc") is None:
        pytest.skip("nvcc not found; the CUDA library cannot be compiled here")
    assert module.build(required=True) is not None


needs_gpu = pytest.mark.skipif(not _cuda.cuda_available(),
                               reason=f"no CUDA: {_cuda.cuda_unavailable_reason()}")


@pytest.fixture(scope="module")
def copier() -> Iterator[_cuda.CudaCopier]:
    c = _cuda.CudaCopier(torch.cuda.current_device())
    yield c
    c.close()


@pytest.fixture(scope="module")
def stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


def pools(pinned: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.randint(1, 256, (ROWS, ROW_BYTES), dtype=torch.uint8).pin_memory() \
        if pinned else torch.randint(1, 256, (ROWS, ROW_BYTES), dtype=torch.uint8)
    device = torch.zeros((ROWS, ROW_BYTES), dtype=torch.uint8, device="cuda")
    return host, device


def regions_of(*tensors: torch.Tensor) -> RegionTable:
    out = []
    for t in tensors:
        flags = _native.REGION_DEVICE | _native.REGION_REFUSE_ROW0 if t.is_cuda else 0
        out.append(Region(t.data_ptr(), t.numel(), t.stride(0), t.shape[1], t.shape[0], flags))
    return RegionTable(out)


def methods(copier: _cuda.CudaCopier) -> list[int]:
    found = [_cuda.PER_COPY, _cuda.KERNEL]
    abi = copier.info()["batch_abi"]
    if abi:
        found.append(_cuda.BATCH)
    if abi and copier.info()["driver_version"] >= 12080:
        found.append(_cuda.BATCH_V12080)
    return found


@needs_gpu
def test_info_reports_versions(copier: _cuda.CudaCopier) -> None:
    info = copier.info()
    assert info["batch_abi"] in (0, 12080, 13000)
    assert info["driver_version"] >= 12000 and info["multiprocessor_count"] > 0


@needs_gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_every_method_moves_the_same_bytes(copier: _cuda.CudaCopier,
                                           stream: torch.cuda.Stream, direction: str) -> None:
    gen = torch.Generator().manual_seed(1)
    for method in methods(copier):
        host, device = pools()
        if direction == "d2h":
            device.copy_(host.flip(0))
            host.fill_(7)
        src_rows = torch.randperm(ROWS - 1, generator=gen)[:40] + 1
        dst_rows = torch.randperm(ROWS - 1, generator=gen)[:40] + 1
        h2d = direction == "h2d"
        descs = DescriptorTable.pack([
            (0 if h2d else 1, int(s), 0, 1 if h2d else 0, int(d), 0, ROW_BYTES)
            for s, d in zip(src_rows, dst_rows, strict=True)])
        expected = (device if h2d else host).cpu().clone()
        src_now = (host if h2d else device).cpu()
        expected[dst_rows] = src_now[src_rows]
        copier.copy(regions_of(host, device), descs, stream.cuda_stream, method=method)
        stream.synchronize()
        assert torch.equal((device if h2d else host).cpu(), expected), method


@needs_gpu
@pytest.mark.parametrize("handle", [0, 1, 2])
def test_default_stream_is_refused(copier: _cuda.CudaCopier, handle: int) -> None:
    host, device = pools()
    with pytest.raises(KVCopyError) as info:
        copier.copy(regions_of(host, device), DescriptorTable.pack([(0, 1, 0, 1, 1, 0, 64)]),
                    handle)
    assert info.value.code == Status.E_DEFAULT_STREAM


@needs_gpu
def test_kernel_refuses_pageable_host_memory(copier: _cuda.CudaCopier,
                                            stream: torch.cuda.Stream) -> None:
    host, device = pools(pinned=False)
    with pytest.raises(KVCopyError) as info:
        copier.copy(regions_of(host, device), DescriptorTable.pack([(0, 1, 0, 1, 1, 0, 64)]),
                    stream.cuda_stream, method=_cuda.KERNEL)
    assert info.value.code == Status.E_PAGEABLE
    assert int(device.count_nonzero()) == 0


BAD_VALUES = {  # per descriptor field: values that are always out of bounds there
    1: [-1, ROWS, 2**62, -(2**63)],                # source row (host pool; row 0 is valid)
    4: [-1, 0, ROWS, 2**62, -(2**63)],             # destination row (device; 0 is null)
    5: [-1, 1, 2**62, 2**63 - 1],                  # destination offset (size = whole row)
    6: [ROW_BYTES + 1, 0, -5],                     # size
}


@needs_gpu
@settings(max_examples=30, deadline=None)  # each example touches the device; keep it short
@given(st.integers(0, 6), st.sampled_from(sorted(BAD_VALUES)), st.data())
def test_hostile_ids_never_reach_the_device(copier: _cuda.CudaCopier,
                                            stream: torch.cuda.Stream, position: int,
                                            field: int, data: st.DataObject) -> None:
    host, device = pools()
    descs = [[0, r + 1, 0, 1, r + 1, 0, ROW_BYTES] for r in range(7)]
    descs[position][field] = data.draw(st.sampled_from(BAD_VALUES[field]))
    for method in methods(copier):
        with pytest.raises(KVCopyError) as info:
            copier.copy(regions_of(host, device), DescriptorTable.pack(descs),
                        stream.cuda_stream, method=method)
        assert info.value.descriptor_index == position
    stream.synchronize()
    assert int(device.count_nonzero()) == 0


@needs_gpu
def test_events_complete(copier: _cuda.CudaCopier, stream: torch.cuda.Stream) -> None:
    event = copier.event_create()
    copier.event_record(event, stream.cuda_stream)
    copier.event_synchronize(event)
    assert copier.event_done(event)
    copier.event_destroy(event)


@needs_gpu
@pytest.mark.parametrize("method", ["auto", "per_copy", "kernel"])
def test_transfer_engine_round_trip_on_cuda(method: str) -> None:
    from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
    from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
    from kvcore.transfer import TransferEngine

    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL, 16, blocks_per_chunk=2),),
                        hash_block_tokens=16, num_gpu_blocks=32, num_cpu_blocks=8)
    kv = torch.randn((32, 2, 16, 8), dtype=torch.bfloat16, device="cuda")
    bits = kv.view(torch.int16)
    original = bits.clone()
    with TransferEngine(cfg, [[kv]], cuda_method=method) as engine:
        assert engine.cpu_tensor(0, 0).is_pinned()
        engine.submit(TransferPlan(1, JobKind.STORE, "r", (GroupTransfer((3, 4, 5), 0, (1, 6)),)))
        engine.submit(TransferPlan(2, JobKind.LOAD, "r", (GroupTransfer((20, 21), 1, (1, 6)),)))
        engine.submit(TransferPlan(3, JobKind.LOAD, "r", (GroupTransfer((40,), 0, (1,)),)))
        results = {r.job_id: r for r in engine.wait([1, 2, 3], timeout=60)}
    assert results[1].success and results[2].success and not results[3].success
    torch.cuda.synchronize()
    assert torch.equal(bits[20], original[4]) and torch.equal(bits[21], original[5])
    untouched = [i for i in range(32) if i not in (20, 21)]
    assert torch.equal(bits[untouched], original[untouched])


@needs_gpu
def test_overlapping_descriptors_never_reach_the_device(copier: _cuda.CudaCopier,
                                                        stream: torch.cuda.Stream) -> None:
    """Batch and kernel have no order, so two writes of one byte (or a read of a byte the
    call writes) are refused on the host, by every method, before anything is enqueued."""
    host, device = pools()
    tables = {Status.E_DST_OVERLAP: [[0, 1, 0, 1, 5, 0, ROW_BYTES], [0, 2, 0, 1, 5, 0, 64]],
              Status.E_READS_WRITTEN: [[0, 1, 0, 1, 5, 0, ROW_BYTES],
                                       [1, 5, 0, 0, 3, 0, ROW_BYTES]]}
    for status, descs in tables.items():
        for method in methods(copier):
            with pytest.raises(KVCopyError) as info:
                copier.copy(regions_of(host, device), DescriptorTable.pack(descs),
                            stream.cuda_stream, method=method)
            assert (info.value.code, info.value.descriptor_index) == (status, 1)
    stream.synchronize()
    assert int(device.count_nonzero()) == 0


@needs_gpu
def test_transfer_engine_refuses_a_freed_device_pool() -> None:
    """Same storage rule on the CUDA path: a device pool freed with resize_(0) after
    registration fails jobs with KVC_E_STORAGE (nothing enqueued) until it is rebound."""
    from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
    from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
    from kvcore.transfer import TransferEngine

    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL, 16, blocks_per_chunk=1),),
                        hash_block_tokens=16, num_gpu_blocks=16, num_cpu_blocks=4)
    kv = torch.randn((16, 2, 16, 8), device="cuda")
    store = TransferPlan(1, JobKind.STORE, "r", (GroupTransfer((3,), 0, (2,)),))
    with TransferEngine(cfg, [[kv]]) as engine:
        kv.untyped_storage().resize_(0)
        torch.cuda.synchronize()
        with pytest.raises(KVCopyError) as info:
            engine.validate(store)
        assert info.value.code == Status.E_STORAGE
        engine.submit(store)
        (result,) = engine.wait([1], timeout=60)
        assert not result.success and result.bytes == 0
        fresh = torch.randn((16, 2, 16, 8), device="cuda")
        engine.rebind_gpu_tensors([[fresh]])
        engine.submit(TransferPlan(2, JobKind.STORE, "r", (GroupTransfer((3,), 0, (2,)),)))
        assert engine.wait([2], timeout=60)[0].success
        assert torch.equal(engine.cpu_tensor(0, 0)[2], fresh[3].cpu().view(-1).view(torch.uint8))
