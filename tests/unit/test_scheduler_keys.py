"""Keys derived on read (``GroupKeys``) equal the eager ``make_key`` derivation, and the
hash chain they read (``HashChain``) answers as the plain list it replaces."""

from __future__ import annotations

import gc
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
)
from kvcore.scheduler._state import SEGMENT, GroupKeys, HashChain
from kvcore.spec.errors import InvariantViolation
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, make_key


@pytest.mark.parametrize("hpc", [1, 2, 16, 64])
def test_every_read_equals_make_key_of_the_chunk_end(hpc: int) -> None:
    rng = random.Random(hpc)
    for n in range(0, 200, 13):
        hashes = [rng.randbytes(8) for _ in range(n)]
        keys = GroupKeys(HashChain(hashes), hpc, 3)
        want = [make_key(hashes[(i + 1) * hpc - 1], 3) for i in range(n // hpc)]
        assert len(keys) == len(want)
        assert list(keys) == want
        for a in range(-3, len(want) + 3):
            for b in range(-3, len(want) + 3, 4):
                assert keys[a:b] == want[a:b]
                assert keys[a:b:2] == want[a:b:2]
                assert keys[b:a:-1] == want[b:a:-1]
            if -len(want) <= a < len(want):
                assert keys[a] == want[a]


def test_keys_across_segments_equal_make_key() -> None:
    """Chunk ends that fall in frozen segments, at their edges and in the tail."""
    n = 3 * SEGMENT + 37
    hashes = [i.to_bytes(4, "little") for i in range(n)]
    for hpc in (1, 3, 64, SEGMENT, SEGMENT + 1):
        keys = GroupKeys(HashChain(hashes), hpc, 1)
        want = [make_key(hashes[(i + 1) * hpc - 1], 1) for i in range(n // hpc)]
        assert keys[:] == want
        for a, b in ((0, 1), (SEGMENT // hpc - 1, SEGMENT // hpc + 2), (5, len(want))):
            assert keys[a:b] == want[a:b]
            assert keys[a:b:3] == want[a:b:3]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2 * SEGMENT + 5), st.booleans()), max_size=6),
       st.data())
def test_chain_answers_as_a_list(extends: list[tuple[int, bool]], data: st.DataObject) -> None:
    """A chain built by any series of extends, of lists or of tuples (the first, when a
    tuple, is kept whole as the base; the rest go through the tail into segments), reads
    as the list of the same hashes, strided reads across the base's end included."""
    chain, model = HashChain(), []
    for size, as_tuple in extends:
        new = [(len(model) + i).to_bytes(4, "little") for i in range(size)]
        chain.extend(tuple(new) if as_tuple else new)
        model.extend(new)
        assert len(chain) == len(model)
    assert chain.strided(0, len(model), 1) == model
    if model:
        for index in data.draw(st.lists(st.integers(0, len(model) - 1), max_size=10)):
            assert chain[index] == model[index]
    for index in (len(model), -1, -len(model) - 1):
        with pytest.raises(IndexError):
            chain[index]
    for _ in range(5):
        start = data.draw(st.integers(0, len(model) + 2))
        stop = data.draw(st.integers(0, len(model) + SEGMENT))
        step = data.draw(st.sampled_from([1, 2, 3, 64, SEGMENT - 1, SEGMENT + 7]))
        assert chain.strided(start, stop, step) == model[start:stop:step]


def test_frozen_parts_are_not_walked_by_the_collector() -> None:
    """The point of the chain: the prompt's tuple is kept as it came (no second reference
    to each hash), and after a collection it and the frozen segments are untracked, so
    only the chain, its list of segments and the tail are left for the collector.
    Mutants: slicing the prompt's tuple into copies; freezing a segment as a list."""
    prompt = tuple(i.to_bytes(32, "little") for i in range(2 * SEGMENT + 5))
    chain = HashChain(prompt)
    chain.extend([bytes(32)] * (2 * SEGMENT + 1))  # two segments and a tail of one
    gc.collect()
    referents = gc.get_referents(chain)
    assert any(r is prompt for r in referents)
    assert not gc.is_tracked(prompt)
    segments = [r for r in referents if isinstance(r, list) and r and isinstance(r[0], tuple)]
    frozen = [s for part in segments for s in part]
    assert len(frozen) == 2 and all(type(s) is tuple and len(s) == SEGMENT for s in frozen)
    assert not any(gc.is_tracked(s) for s in frozen)
    assert len(chain) == 4 * SEGMENT + 6


def test_length_follows_the_hash_chain_and_out_of_range_raises() -> None:
    hashes = HashChain([bytes([i]) * 4 for i in range(5)])
    keys = GroupKeys(hashes, 2, 0)
    assert len(keys) == 2
    hashes.extend([b"\xff" * 4])
    assert len(keys) == 3 and keys[2] == make_key(b"\xff" * 4, 0)
    # The message names the valid range (0..n-1), as a list's would not.
    with pytest.raises(IndexError, match=r"^chunk 3 outside 0\.\.2$"):
        keys[3]
    with pytest.raises(IndexError, match=r"^chunk -4 outside 0\.\.2$"):
        keys[-4]


def _scheduler_on_a_shuffling_chain(monkeypatch: pytest.MonkeyPatch) -> OffloadScheduler:
    """A checked scheduler whose chain stores every batch of added hashes reversed (the
    prompt's tuple stays whole): keys read back through it name the wrong hash."""
    original = HashChain.extend

    def reversed_batches(self: HashChain, hashes: Sequence[bytes]) -> None:
        if self.size:
            hashes = list(hashes)[::-1]
        original(self, hashes)

    monkeypatch.setattr(HashChain, "extend", reversed_batches)
    config = OffloadConfig((GroupSpec(GroupKind.FULL, 4),), hash_block_tokens=4,
                           num_gpu_blocks=64, num_cpu_blocks=16)
    sched = OffloadScheduler(config, CPUOffloadManager.for_config(config), check=True)
    sched.add_request(RequestInfo("r", 8, (b"\x01" * 8, b"\x02" * 8)))
    return sched


def test_keys_of_hashes_added_later_are_checked_by_add_hashes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """K1 runs on every growth of the chain, not only on the prompt's hashes: before,
    a chain that misplaced a later hash (any part but the prompt's tuple) was checked
    by nothing. Mutant: the check at add_hashes removed."""
    sched = _scheduler_on_a_shuffling_chain(monkeypatch)
    with pytest.raises(InvariantViolation, match="K1"):
        sched.add_hashes("r", [b"\x03" * 8, b"\x04" * 8, b"\x05" * 8])


def test_keys_of_a_steps_new_hashes_are_checked_by_build_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through a step's ``new_hashes``. Mutant: the check in build_step removed."""
    sched = _scheduler_on_a_shuffling_chain(monkeypatch)
    step = StepInput((ScheduledRequest("r", 20, 0, 20, ((1, 2, 3, 4, 5),),
                                       new_hashes=(b"\x03" * 8, b"\x04" * 8, b"\x05" * 8)),))
    with pytest.raises(InvariantViolation, match="K1"):
        sched.build_step(step)
