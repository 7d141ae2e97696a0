"""The layout and hashes the bad-input tables share (``test_scheduler_bad_input.py`` and
``test_bad_calls.py``): one FULL and one SLIDING group of 4-token blocks, two workers, so
both window nulls and multi-worker reports can be exercised."""

from __future__ import annotations

import hashlib

from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig

CFG = OffloadConfig((GroupSpec(GroupKind.FULL, 4), GroupSpec(GroupKind.SLIDING, 4,
                                                              window_tokens=8)),
                    hash_block_tokens=4, num_gpu_blocks=64, num_cpu_blocks=64, num_workers=2)


def hashes(n: int, seed: int = 0) -> tuple[bytes, ...]:
    """``n`` chained 8-byte hashes; ``seed`` gives an unrelated prefix."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.blake2b(prev + bytes((seed, i)), digest_size=8).digest()
        out.append(prev)
    return tuple(out)
