"""The quiet-step fast path (``_rules.quiet_cursors``) against the full store path.

With checks off, ``OffloadScheduler._store_step`` asks ``quiet_cursors`` first and skips
``draft_store`` when it answers. The two must agree: on tables without null blocks, the
fast path answers exactly when ``draft_store`` would offer nothing, and with the cursors
``draft_store`` would leave. (Null blocks make the full path skip more, which the fast
path leaves to it: it never answers for them wrongly, since it only answers when no group
has a chunk the keep rule keeps.) Mutants this kills, each tried: the draft cap dropped,
the cursor left where it was, a kept chunk missed. The "more than a segment" short cut
only bounds the loop (every segment holds a kept offset), so dropping it changes no
answer and nothing here can see it.
"""

from __future__ import annotations

from array import array

from hypothesis import example, given
from hypothesis import strategies as st
from spec_strategies import configs

from kvcore.presets import PRESETS, preset
from kvcore.scheduler._rules import quiet_cursors, store_shape
from kvcore.scheduler._state import HashChain, RequestState
from kvcore.scheduler._store import draft_store
from kvcore.spec.types import OffloadConfig, cdiv

HASH = bytes(28)


def request(cfg: OffloadConfig, frontier: int, cursors: list[int]) -> RequestState:
    """A request whose tables hold a real id at every position up to ``frontier``."""
    hashes = [i.to_bytes(4, "little") + HASH for i in range(frontier // cfg.hash_block_tokens)]
    req = RequestState.fresh(cfg, "r", frontier, None, False, HashChain(hashes))
    req.tables = [array("q", range(1, cdiv(frontier, g.tokens_per_block) + 1))
                  for g in cfg.groups]
    req.cursors = list(cursors)
    return req


def agree(cfg: OffloadConfig, frontier: int, storable: int, cursors: list[int]) -> None:
    quiet = quiet_cursors(store_shape(cfg), cursors, frontier, storable)
    draft = draft_store(cfg, request(cfg, frontier, cursors), frontier, None, storable)
    full = [max(c, o.new_cursor) for c, o in zip(cursors, draft.offers, strict=True)]
    assert (quiet is not None) == (not draft.keys), (quiet, draft)
    if quiet is not None:
        assert quiet == full


def partial_agrees(cfg: OffloadConfig, frontier: int, storable: int,
                   cursors: list[int]) -> None:
    """With a busy list, only the busy groups get the full offer: the same keys and the
    same cursors afterwards as the full path."""
    busy: list[int] = []
    moved = quiet_cursors(store_shape(cfg), cursors, frontier, storable, busy)
    assert moved is not None
    full = draft_store(cfg, request(cfg, frontier, cursors), frontier, None, storable)
    part = draft_store(cfg, request(cfg, frontier, cursors), frontier, None, storable,
                       (moved, busy))
    assert part.keys == full.keys
    assert [o.offered for o in part.offers] == [o.offered for o in full.offers]
    assert ([max(c, o.new_cursor) for c, o in zip(cursors, part.offers, strict=True)]
            == [max(c, o.new_cursor) for c, o in zip(cursors, full.offers, strict=True)])
    assert (not busy) == (not full.keys)


@st.composite
def steps(draw: st.DrawFn, cfg: OffloadConfig) -> tuple[int, int, list[int]]:
    frontier = draw(st.integers(0, 1200))
    storable = draw(st.integers(0, frontier))
    cursors = [draw(st.integers(0, frontier // g.tokens_per_chunk + 1)) for g in cfg.groups]
    return frontier, storable, cursors


@given(st.sampled_from(sorted(PRESETS)).flatmap(
    lambda name: st.tuples(st.just(preset(name)), steps(preset(name)))))
@example((preset("deepseek-v4-mtp"), (1016, 1016, [3, 14, 253, 127])))  # skipped chunk
@example((preset("deepseek-v4-mtp"), (1020, 1020, [3, 14, 253, 127])))  # then a kept one
@example((preset("deepseek-v4-mtp"), (1024, 1024, [3, 14, 189, 127])))  # a whole segment
def test_the_fast_path_agrees_with_the_offer_on_every_preset(
        case: tuple[OffloadConfig, tuple[int, int, list[int]]]) -> None:
    cfg, (frontier, storable, cursors) = case
    agree(cfg, frontier, storable, cursors)
    partial_agrees(cfg, frontier, storable, cursors)


@given(configs().flatmap(lambda cfg: st.tuples(st.just(cfg), steps(cfg))))
def test_the_fast_path_agrees_with_the_offer_on_any_layout(
        case: tuple[OffloadConfig, tuple[int, int, list[int]]]) -> None:
    cfg, (frontier, storable, cursors) = case
    agree(cfg, frontier, storable, cursors)
    partial_agrees(cfg, frontier, storable, cursors)


def test_a_decode_step_that_completes_a_skipped_chunk_is_quiet() -> None:
    """DeepSeek-V4: the 4-token compressor state keeps offsets 62 and 63 of each 64-chunk
    segment. At 1016 tokens its chunk 253 (offset 61) completed: quiet, and only that
    group's cursor moves (the draft window group stays one chunk behind V). At 1020 chunk
    254 (offset 62) completed too: the full path must run."""
    shape = store_shape(preset("deepseek-v4-mtp"))
    assert quiet_cursors(shape, [3, 14, 253, 127], 1016, 1016) == [3, 14, 254, 127]
    assert quiet_cursors(shape, [3, 14, 253, 127], 1020, 1020) is None
    # The draft group: V = 1024 completes its 64-token chunk 15, which it may not store
    # until chunk 16 is complete too, so nothing moves; from cursor 3 the full-attention
    # chunk 3 completes (no keep rule): the full path.
    assert quiet_cursors(shape, [4, 15, 256, 128], 1024, 1024) == [4, 15, 256, 128]
    assert quiet_cursors(shape, [3, 14, 255, 127], 1024, 1024) is None
