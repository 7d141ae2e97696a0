"""Deterministic KV contents, so any wrong byte a load brings back is detectable.

Every GPU block of group g, layer l, at block position p of a request holds, once final,
a 64-bit value derived from (g, l, the chained hash of the tokens up to the block's end):
two blocks hold the same bytes only if they describe the same prefix of the same layers.
Blocks not final yet (partial, or a draft group's volatile tail) hold junk that changes
every step, as a drafter's rewrites do.
"""

from __future__ import annotations

import hashlib

MASK = (1 << 63) - 1


def chain_hashes(tokens: list[int], start: int, prev: bytes, block_tokens: int,
                 count: int) -> list[bytes]:
    """Chained hashes of ``count`` hash blocks starting at hash block ``start``."""
    out: list[bytes] = []
    for i in range(start, start + count):
        chunk = tokens[i * block_tokens:(i + 1) * block_tokens]
        h = hashlib.blake2b(prev + b"".join(t.to_bytes(4, "little") for t in chunk),
                            digest_size=16).digest()
        out.append(h)
        prev = h
    return out


def final_value(prefix_hash: bytes, group: int, layer: int) -> int:
    """The value every element of a final block holds (int64, never negative)."""
    d = hashlib.blake2b(prefix_hash + bytes((group, layer)), digest_size=8).digest()
    return int.from_bytes(d, "little") & MASK


def junk_value(step: int, request_index: int, group: int) -> int:
    """What a not-yet-final block holds this step (never a final value in practice)."""
    d = hashlib.blake2b(f"junk:{step}:{request_index}:{group}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") & MASK
