"""The CPU tier: per-group slot pools, exact pinned bytes, an engine-provided buffer.

Goal: a slot holds one chunk of one group, so the tier's bytes are exactly the sum over
groups of capacity x bytes per chunk (no row is allocated that no slot can reach, and no
factor of the group count); slot ids are per group; an engine may hand in its own buffer,
which must be exactly that size, and every other buffer is refused. Method: DeepSeek-V4's
four groups (kvcore/presets.py) with MLA-like bytes per block, shrunk to a few blocks;
capacities overridden per group through ``kvcore.transfer.cpu_capacity``, the one place
the engine reads them; stores whose bytes are found at the computed place in the buffer.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvcore import transfer
from kvcore._native import Status
from kvcore.presets import deepseek_v4_mtp
from kvcore.spec.errors import KVCopyError, TransferArgumentError
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import OffloadConfig
from kvcore.transfer import TransferEngine, cpu_capacity

BLOCKS = 6
LATENT = 576 * 2  # bytes per token of an MLA cache entry: 512 latent + 64 rope dims, bf16
# (tensors per group, bytes per token): compressed MLA (2 layers), sliding-window MLA with
# the MTP layer (3), and the two compressor states (1 each).
LAYOUT = ((2, LATENT), (3, LATENT), (1, 4 * LATENT), (1, 2 * LATENT))


def dsv4(num_cpu_blocks: int = 4) -> OffloadConfig:
    return replace(deepseek_v4_mtp(), num_gpu_blocks=BLOCKS, num_cpu_blocks=num_cpu_blocks)


def dsv4_tensors(cfg: OffloadConfig) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    return [[torch.randint(0, 256, (BLOCKS, g.tokens_per_block * per_token), dtype=torch.uint8,
                           generator=gen) for _ in range(n)]
            for g, (n, per_token) in zip(cfg.groups, LAYOUT, strict=True)]


def chunk_bytes(cfg: OffloadConfig, tensors: list[list[torch.Tensor]], g: int) -> int:
    """Bytes of one chunk of group g: blocks_per_chunk blocks of each of its tensors."""
    return cfg.groups[g].blocks_per_chunk * sum(t[0].numel() for t in tensors[g])


def raw(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous tensor."""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def run(engine: TransferEngine, plan: TransferPlan) -> transfer.TransferResult:
    engine.submit(plan)
    (result,) = engine.wait([plan.job_id], timeout=60)
    return result


def store(job: int, g: int, block: int, slot: int, groups: int = 4) -> TransferPlan:
    parts = [GroupTransfer()] * groups
    parts[g] = GroupTransfer((block,), 0, (slot,))
    return TransferPlan(job, JobKind.STORE, "r", tuple(parts))


def test_pinned_bytes_are_capacity_times_chunk_bytes_per_group() -> None:
    cfg = dsv4()
    tensors = dsv4_tensors(cfg)
    with TransferEngine(cfg, tensors) as engine:
        expected = [cpu_capacity(cfg, g) * chunk_bytes(cfg, tensors, g) for g in range(4)]
        assert [engine.pinned_bytes(g) for g in range(4)] == expected
        assert engine.pinned_bytes() == engine.cpu_tier_bytes() == sum(expected)
        for g, ts in enumerate(tensors):
            for k, t in enumerate(ts):
                assert engine.cpu_tensor(g, k).shape == (cfg.num_cpu_blocks, t[0].numel())


def test_per_group_capacities_size_the_tier_and_bound_each_groups_slots(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Capacities come from cpu_capacity() alone: with 4, 1, 2 and 3 slots the tier holds
    exactly those chunks, slot ids are per group, and a slot past its group's pool is refused."""
    caps = (4, 1, 2, 3)
    monkeypatch.setattr(transfer, "cpu_capacity", lambda config, group: caps[group])
    cfg = dsv4(num_cpu_blocks=4)
    tensors = dsv4_tensors(cfg)
    with TransferEngine(cfg, tensors) as engine:
        total = sum(caps[g] * chunk_bytes(cfg, tensors, g) for g in range(4))
        assert engine.pinned_bytes() == total
        assert total < cfg.num_cpu_blocks * sum(chunk_bytes(cfg, tensors, g) for g in range(4))
        for g in range(4):  # the last slot of every group works ...
            assert run(engine, store(10 + g, g, 1 + g, caps[g] - 1)).success
            assert engine.read_cpu_chunk(g, 0, caps[g] - 1) == raw(tensors[g][0][1 + g])
            with pytest.raises(KVCopyError) as info:  # ... and the next one does not exist
                engine.validate(store(20 + g, g, 1, caps[g]))
            assert (info.value.code, info.value.group, info.value.bound) == \
                (Status.E_ROW_RANGE, g, caps[g])
        # Slot 0 of group 0 and slot 0 of group 2 are different memory.
        assert run(engine, store(30, 0, 3, 0)).success and run(engine, store(31, 2, 4, 0)).success
        assert engine.read_cpu_chunk(0, 0, 0) == raw(tensors[0][0][3])
        assert engine.read_cpu_chunk(2, 0, 0) == raw(tensors[2][0][4])


def test_an_engine_buffer_is_used_in_place() -> None:
    """One flat buffer: groups back to back, tensors back to back inside a group; a store
    lands at exactly that offset in the engine's own memory."""
    cfg = dsv4()
    tensors = dsv4_tensors(cfg)
    needs = [cpu_capacity(cfg, g) * chunk_bytes(cfg, tensors, g) for g in range(4)]
    flat = torch.zeros(sum(needs), dtype=torch.uint8)
    with TransferEngine(cfg, tensors, cpu_buffer=flat) as engine:
        assert engine.pinned_bytes() == flat.numel()
        assert run(engine, store(1, 2, 5, 3)).success
        row = tensors[2][0][5]
        at = needs[0] + needs[1] + 3 * row.numel()  # group 2, tensor 0, slot 3
        assert ctypes.string_at(flat.data_ptr() + at, row.numel()) == raw(row)
        assert int(flat.count_nonzero()) == int(row.count_nonzero())  # nothing else written
    per_group = [torch.zeros(n, dtype=torch.uint8) for n in needs]
    with TransferEngine(cfg, tensors, cpu_buffer=per_group) as engine:
        assert run(engine, store(2, 1, 4, 2)).success
        row = tensors[1][0][4]
        assert raw(per_group[1][2 * row.numel():3 * row.numel()]) == raw(row)
        assert [engine.pinned_bytes(g) for g in range(4)] == needs


def _small() -> tuple[OffloadConfig, list[list[torch.Tensor]], int]:
    cfg = replace(dsv4(num_cpu_blocks=2))
    tensors = dsv4_tensors(cfg)
    return cfg, tensors, sum(cpu_capacity(cfg, g) * chunk_bytes(cfg, tensors, g)
                             for g in range(4))


def _aliasing_buffer() -> tuple[OffloadConfig, list[list[torch.Tensor]], torch.Tensor]:
    """A buffer that starts inside the engine's own GPU tensor."""
    cfg, tensors, total = _small()
    arena = torch.zeros(tensors[0][0].numel() + total, dtype=torch.uint8)
    tensors[0][0] = arena[:tensors[0][0].numel()].view(BLOCKS, -1)
    return cfg, tensors, arena[64:64 + total]


def _shrunk(total: int) -> torch.Tensor:
    buf = torch.zeros(total, dtype=torch.uint8)
    buf.untyped_storage().resize_(64)
    return buf


BAD_BUFFERS: list[tuple[str, Callable[[int], Any]]] = [
    ("one byte short", lambda n: torch.zeros(n - 1, dtype=torch.uint8)),
    ("one byte more", lambda n: torch.zeros(n + 1, dtype=torch.uint8)),
    ("float32", lambda n: torch.zeros(n // 4, dtype=torch.float32)),
    ("2-D", lambda n: torch.zeros((1, n), dtype=torch.uint8)),
    ("strided", lambda n: torch.zeros(2 * n, dtype=torch.uint8)[::2]),
    ("misaligned", lambda n: torch.zeros(n + 64, dtype=torch.uint8)[1:n + 1]),
    ("storage shrunk", _shrunk),
    ("not a tensor", lambda n: bytearray(n)),
    ("meta device", lambda n: torch.empty(n, dtype=torch.uint8, device="meta")),
    ("three of four groups", lambda n: [torch.zeros(1, dtype=torch.uint8)] * 3),
    ("a group's buffer too big", lambda n: [torch.zeros(n, dtype=torch.uint8)] * 4),
]


@pytest.mark.parametrize(("why", "make"), BAD_BUFFERS, ids=[row[0] for row in BAD_BUFFERS])
def test_bad_cpu_buffers_are_refused(why: str, make: Callable[[int], Any]) -> None:
    """Where the error carries the number at fault and its bound, both are the real ones
    (an engine logs or compares them). Mutants: the strided buffer's bound 1 as 2 (held-
    out seed 63 m10 passed every test), a size error's value or bound off by one."""
    cfg, tensors, total = _small()
    with pytest.raises(TransferArgumentError) as info:
        TransferEngine(cfg, tensors, cpu_buffer=make(total))
    assert info.value.where.startswith("cpu_buffer"), info.value
    numbers = {"one byte short": (total - 1, total), "one byte more": (total + 1, total),
               "strided": (2, 1)}
    if why in numbers:
        assert (info.value.value, info.value.bound) == numbers[why], info.value


WRONG_SHAPES: list[tuple[str, Callable[[int], torch.Tensor]]] = [
    ("float32, n elements", lambda n: torch.zeros(n, dtype=torch.float32)),
    ("float32, n bytes", lambda n: torch.zeros(n // 4, dtype=torch.float32)),
    ("int8, n elements", lambda n: torch.zeros(n, dtype=torch.int8)),
    ("uint8 (n, 1)", lambda n: torch.zeros((n, 1), dtype=torch.uint8)),
    ("uint8 (1, n)", lambda n: torch.zeros((1, n), dtype=torch.uint8)),
]


@pytest.mark.parametrize(("why", "make"), WRONG_SHAPES, ids=[row[0] for row in WRONG_SHAPES])
def test_a_buffer_of_another_dtype_or_shape_is_refused_as_such(
        why: str, make: Callable[[int], torch.Tensor]) -> None:
    """The tier is addressed as flat bytes, so only a 1-D uint8 buffer is accepted, and the
    refusal says so: a float32 or int8 buffer with the right element count, or a uint8 one
    of shape (n, 1), would pass every later check (size, stride) and be used as if it were
    bytes; a float32 one of the right byte size would be refused as n/4 "bytes" long.

    Kills a dtype-and-dimension test joined by ``and`` instead of ``or`` (either check
    alone then lets the other through)."""
    cfg, tensors, total = _small()
    buf = make(total)
    with pytest.raises(TransferArgumentError) as info:
        TransferEngine(cfg, tensors, cpu_buffer=buf)
    assert info.value.where == "cpu_buffer", info.value
    text = str(info.value)
    assert "must be a 1-D uint8 tensor" in text and str(buf.dtype) in text, text
    assert str(tuple(buf.shape)) in text, text


def test_an_unpinned_buffer_is_refused_where_pinned_memory_is_needed() -> None:
    cfg, tensors, total = _small()
    with pytest.raises(TransferArgumentError) as info:
        TransferEngine(cfg, tensors, pin_memory=True,
                       cpu_buffer=torch.zeros(total, dtype=torch.uint8))
    assert info.value.where == "cpu_buffer" and "page-locked" in str(info.value)


def test_a_buffer_inside_a_gpu_tensor_is_refused() -> None:
    cfg, tensors, buf = _aliasing_buffer()
    with pytest.raises(TransferArgumentError) as info:
        TransferEngine(cfg, tensors, cpu_buffer=buf)
    text = str(info.value)
    assert "shares memory" in text, text
    # The two byte ranges it names are the real ones: they overlap, one starts where the
    # GPU tensor does, and each ends where its start plus its extent says.
    ranges = [(int(a, 16), int(b, 16)) for a, b in re.findall(r"(0x[0-9a-f]+)\.\.(0x[0-9a-f]+)",
                                                              text)]
    assert len(ranges) == 2 and all(a < b for a, b in ranges), text
    (a0, b0), (a1, b1) = sorted(ranges)
    assert a0 == tensors[0][0].data_ptr() and a1 < b0, text
    assert b0 - a0 == tensors[0][0].numel() or b1 - a1 == tensors[0][0].numel(), text


@pytest.mark.parametrize("field", ["storage_ptr", "storage_nbytes"])
def test_a_storage_change_in_either_pointer_or_size_alone_is_seen(field: str) -> None:
    """A pool resized in place may keep its address (realloc grew it where it was) or keep
    its size at a new address (freed and allocated again); either alone must fail the job.
    The registration is shifted instead of the storage so the case does not depend on
    what the allocator happens to return. Kills ``or`` read as ``and`` in the check."""
    from kvcore.transfer._memory import _pool_of

    pool = _pool_of(torch.zeros(4, 16, dtype=torch.uint8), "group 0's GPU tensor",
                    torch.device("cpu"))
    assert pool.changed() is None
    moved = replace(pool, **{field: getattr(pool, field) + 64})
    change = moved.changed()
    assert change is not None and "freed or resized" in change


@pytest.mark.parametrize("pin", [False, True])
def test_a_tier_the_host_cannot_allocate_is_a_config_error_naming_the_field(
        monkeypatch: pytest.MonkeyPatch, pin: bool) -> None:
    """torch's own out-of-memory error names neither the field nor the tier; the engine's
    names ``num_cpu_blocks``, the group, its size, whether it was pinned, and the fix.
    Mutants: "pinned" said of the wrong case, and the ``pin_memory`` error (no CUDA)
    given when CUDA is there (``torch.cuda.is_available`` is made to answer yes, so a
    refused pinned tier is the host's doing)."""
    from kvcore.spec.errors import ConfigError
    from kvcore.transfer import _setup

    cfg, tensors, _ = _small()
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("dtype") is torch.uint8 and "pin_memory" in kwargs:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory\nmore lines")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_setup.torch, "empty", empty)
    with pytest.raises(ConfigError) as info:
        _setup._allocate_tier(4096, 2, 64, pin)
    text = str(info.value)
    assert info.value.field == "num_cpu_blocks", text
    assert "group 2's CPU tier of 64 chunks" in text and "lower num_cpu_blocks" in text, text
    assert ("(4096 bytes, pinned)" if pin else "(4096 bytes)") in text, text
    assert "can't allocate memory)" in text and "more lines" not in text, text
    # Through the public entry: the same error, before any engine exists.
    with pytest.raises(ConfigError) as info:
        TransferEngine(cfg, tensors, pin_memory=False)
    assert info.value.field == "num_cpu_blocks", info.value


def test_a_pinned_tier_without_cuda_names_pin_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcore.spec.errors import ConfigError
    from kvcore.transfer import _setup

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("Cannot access accelerator device when none is available.")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_setup.torch, "empty", empty)
    with pytest.raises(ConfigError) as info:
        _setup._allocate_tier(4096, 0, 64, True)
    assert info.value.field == "pin_memory" and "pin_memory=False" in str(info.value)
