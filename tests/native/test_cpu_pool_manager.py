"""The manager can use every CPU row the transfer engine pinned, on DeepSeek-V4's groups.

Goal: with MLA-like row sizes on the four groups of ``deepseek-v4-mtp``, pinned bytes
are the sum over groups of capacity x bytes per chunk (no factor of the group count),
and ``CPUOffloadManager.for_config`` hands out every one of those rows: storing until
every group's pool is full uses slots 0..capacity_g-1 of each group with no eviction,
and the engine accepts each slot as a row of its group's tier.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvcore.manager import CPUOffloadManager
from kvcore.presets import preset
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import make_key
from kvcore.transfer import TransferEngine, cpu_capacity

BLOCKS = 6
LATENT = 576 * 2  # bytes per token of an MLA entry: 512 latent + 64 rope dims, bf16
LAYOUT = ((2, LATENT), (3, LATENT), (1, 4 * LATENT), (1, 2 * LATENT))


def test_every_pinned_row_is_a_slot_the_manager_hands_out() -> None:
    """Kills: one pool shared by all groups (the 4x4 keys would evict, slots collide);
    all keys routed to pool 0; a pool smaller or larger than cpu_capacity."""
    cfg = replace(preset("deepseek-v4-mtp"), num_gpu_blocks=BLOCKS, num_cpu_blocks=3)
    gen = torch.Generator().manual_seed(9)
    tensors = [[torch.randint(0, 256, (BLOCKS, g.tokens_per_block * per), dtype=torch.uint8,
                              generator=gen) for _ in range(n)]
               for g, (n, per) in zip(cfg.groups, LAYOUT, strict=True)]
    chunk = [g.blocks_per_chunk * sum(t[0].numel() for t in ts)
             for g, ts in zip(cfg.groups, tensors, strict=True)]
    manager = CPUOffloadManager.for_config(cfg, check=True)
    with TransferEngine(cfg, tensors) as engine:
        caps = [cpu_capacity(cfg, g) for g in range(4)]
        assert engine.pinned_bytes() == sum(c * b for c, b in zip(caps, chunk, strict=True))
        assert engine.pinned_bytes() < len(cfg.groups) * cfg.num_cpu_blocks * sum(chunk)
        job = 1
        for g, cap in enumerate(caps):
            keys = [make_key(b"h%d" % i, g) for i in range(cap)]
            got = manager.prepare_store(keys)
            assert got is not None and got.evicted == () and sorted(got.slots) == list(range(cap))
            manager.complete_store(keys)
            for slot in got.slots:
                parts = [GroupTransfer()] * 4
                parts[g] = GroupTransfer((1 + slot % (BLOCKS - 1),), 0, (slot,))
                engine.submit(TransferPlan(job, JobKind.STORE, "r", tuple(parts)))
                (result,) = engine.wait([job], timeout=60)
                assert result.success, result
                job += 1
        stats = manager.stats()
        assert stats.used == stats.capacity == sum(caps) and stats.evictions == 0
        # every pool is full: one more key of any group evicts exactly one key of it
        for g in range(4):
            more = manager.prepare_store([make_key(b"more", g)])
            assert more is not None and [k[-1] for k in more.evicted] == [g]
