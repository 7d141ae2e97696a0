"""Keys derived on read (``GroupKeys``) equal the eager ``make_key`` derivation."""

from __future__ import annotations

import random

import pytest

from kvcore.scheduler._state import GroupKeys
from kvcore.spec.types import make_key


@pytest.mark.parametrize("hpc", [1, 2, 16, 64])
def test_every_read_equals_make_key_of_the_chunk_end(hpc: int) -> None:
    rng = random.Random(hpc)
    for n in range(0, 200, 13):
        hashes = [rng.randbytes(8) for _ in range(n)]
        keys = GroupKeys(hashes, hpc, 3)
        want = [make_key(hashes[(i + 1) * hpc - 1], 3) for i in range(n // hpc)]
        assert len(keys) == len(want)
        assert list(keys) == want
        for a in range(-3, len(want) + 3):
            for b in range(-3, len(want) + 3, 4):
                assert keys[a:b] == want[a:b]
                assert keys[a:b:2] == want[a:b:2]
            if -len(want) <= a < len(want):
                assert keys[a] == want[a]


def test_length_follows_the_hash_list_and_out_of_range_raises() -> None:
    hashes = [bytes([i]) * 4 for i in range(5)]
    keys = GroupKeys(hashes, 2, 0)
    assert len(keys) == 2
    hashes.append(b"\xff" * 4)
    assert len(keys) == 3 and keys[2] == make_key(b"\xff" * 4, 0)
    # The message names the valid range (0..n-1), as a list's would not.
    with pytest.raises(IndexError, match=r"^chunk 3 outside 0\.\.2$"):
        keys[3]
    with pytest.raises(IndexError, match=r"^chunk -4 outside 0\.\.2$"):
        keys[-4]
