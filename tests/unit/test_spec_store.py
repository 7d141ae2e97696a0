"""The store plan (E1, E2): which chunks a request offers, step by step.

Goal: pin kvcore's store rule (``kvcore.scheduler._rules``) against the semantics, and
against the reference's own walk (``kvcore.spec.model.store_walk``) and keep rule
(``kvcore.spec.lookup.read_at_segment_end``): a draft group never offers its
volatile chunk (E1) for any cursor and frontier; the cursor never passes a chunk that was
not offered or skipped for a stated reason, never moves back, and a held-back chunk is
offered once the frontier moves on (E2: no holes, across multi-step chunked prefill);
SLIDING groups keep only the ``W + e`` chunks around each alignment segment end; prompt-only
and max-token caps; null blocks are skipped; nothing is offered for unwritten tokens. The
upstream store examples of docs/upstream.md §2.7 are reproduced, and where
kvcore differs (no hole after a chunked-prefill store, #44784 / W24) the value is pinned.

Method: a small driver replays a request's steps through ``group_offer``, carrying the
cursor as the scheduler does, and checks every step with the E1 and E2 predicates of
``kvcore.spec.invariants``. Hypothesis draws layouts, prompt lengths, chunked-prefill and
decode schedules, caps and growing null prefixes. A round-trip property stores a whole
prompt and looks it up again: the chunks skipped as unreachable must not be needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from spec_strategies import FULL, HIT, MAMBA, MISS, SLIDING, configs, make_config

from kvcore.scheduler import _rules
from kvcore.scheduler._rules import (
    GroupOffer,
    chunk_source_blocks,
    group_offer,
    keep_rule,
    storable_prefix,
    store_end,
)
from kvcore.spec.invariants import (
    CursorMoveRecord,
    Skip,
    StoreOfferRecord,
    e1_volatile_chunk_never_offered,
    e2_cursor_leaves_no_hole,
)
from kvcore.spec.lookup import hit_for, needed_chunks, read_at_segment_end
from kvcore.spec.model import store_walk
from kvcore.spec.types import GroupSpec, KeptOffsets, OffloadConfig, cdiv


def chunk_reachable(cfg: OffloadConfig, group: int, chunk: int) -> bool:
    """kvcore's keep rule as a per-chunk predicate: whether its store keeps ``chunk``."""
    rule = keep_rule(cfg, group)
    return rule is None or chunk % rule[0] in rule[1]


# -- driver -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step's inputs for one group: the frontier V, the storable prefix U, the table."""

    frontier: int
    storable: int
    table: tuple[int, ...]


def table_with_nulls(num_blocks: int, nulls: int) -> tuple[int, ...]:
    """GPU block ids 1..num_blocks with the first ``nulls`` positions freed (0)."""
    return tuple(0 if i < nulls else i + 1 for i in range(num_blocks))


def replay(cfg: OffloadConfig, group: int, steps: Sequence[Step]) -> list[GroupOffer]:
    """Offer step by step, carrying the cursor; check E1 and E2 at every step."""
    g = cfg.groups[group]
    cursor = 0
    offers = []
    for step in steps:
        offer = group_offer(cfg, group, cursor, step.frontier, step.storable, step.table)
        assert offer.old_cursor == cursor
        assert e1_volatile_chunk_never_offered(StoreOfferRecord(
            group, g.is_draft, g.tokens_per_chunk, step.frontier, offer.offered)) == []
        assert e2_cursor_leaves_no_hole(CursorMoveRecord(
            group, offer.old_cursor, offer.new_cursor, frozenset(offer.offered),
            offer.skipped)) == []
        cursor = offer.new_cursor
        offers.append(offer)
    return offers


def offered_chunks(cfg: OffloadConfig, group: int, num_tokens: int,
                   frontiers: Sequence[int] | None = None) -> list[int]:
    """Chunks of ``group`` offered over steps reaching ``frontiers`` (default: N at once)."""
    g = cfg.groups[group]
    table = table_with_nulls(cdiv(num_tokens, g.tokens_per_block), 0)
    steps = [Step(v, storable_prefix(cfg, v, num_tokens, None), table)
             for v in (frontiers or [num_tokens])]
    return [c for offer in replay(cfg, group, steps) for c in offer.offered]


# -- upstream examples (§2.7) ------------------------------------------------------------------


def test_upstream_swa_alignment_skip_example() -> None:
    """FULL 16 + SLIDING 4 window 8 (a = 4, W = 2): 32 tokens store FULL 0, 1 and SWA 2, 3, 6, 7."""
    cfg = make_config(GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=8),
                      hash_block_tokens=4)
    assert offered_chunks(cfg, 0, 32) == [0, 1]
    assert offered_chunks(cfg, 1, 32) == [2, 3, 6, 7]
    table = table_with_nulls(8, 0)
    offer = group_offer(cfg, 1, 0, 32, 32, table)
    assert offer.skipped == {c: Skip.UNREACHABLE for c in (0, 1, 4, 5)}
    assert offer.new_cursor == 8


def test_upstream_eagle_full_three_block_prompt() -> None:
    """FULL + FULL eagle, 3-block prompt: group 0 stores 0, 1, 2; the eagle group 0, 1."""
    cfg = make_config(GroupSpec(FULL, 4), GroupSpec(FULL, 4, is_draft=True))
    assert offered_chunks(cfg, 0, 12) == [0, 1, 2]
    assert offered_chunks(cfg, 1, 12) == [0, 1]


def test_upstream_eagle_swa_three_block_prompt() -> None:
    cfg = make_config(GroupSpec(SLIDING, 4, window_tokens=8, is_draft=True))
    assert offered_chunks(cfg, 0, 12) == [0, 1]


def test_upstream_single_eagle_group_one_block_prompt_offers_nothing() -> None:
    cfg = make_config(GroupSpec(FULL, 4, is_draft=True))
    offer = group_offer(cfg, 0, 0, 4, 4, table_with_nulls(1, 0))
    assert offer.offered == () and offer.new_cursor == 0


def test_upstream_block_size_factor_three_middle_key() -> None:
    """bsf 3: storing only the middle chunk of three copies GPU positions 3, 4, 5."""
    table = table_with_nulls(9, 0)
    assert chunk_source_blocks(table, 1, 3) == (3, (4, 5, 6))


def test_a_chunk_is_read_whole_and_a_leading_null_reaches_b1() -> None:
    """The chunk's ids as they are, nulls included: the offer never offers a chunk with
    a null block, and if it did (the refinement machine's W24 mutant), the null id would
    reach the plan whole, where B1 names it. Mutant: a slice one position off."""
    table = (0, 0, 7, 8, 9, 10)
    assert chunk_source_blocks(table, 0, 3) == (0, (0, 0, 7))
    assert chunk_source_blocks(table, 1, 3) == (3, (8, 9, 10))
    assert chunk_source_blocks((5, 6, 0, 7), 1, 2) == (2, (0, 7))


def test_no_hole_after_a_chunked_prefill_store() -> None:
    """kvcore differs from W24 (#44784 follow-up): the held-back chunk is offered later.

    W24 reduced the eagle end only when collecting keys and then moved the cursor to the
    unreduced ``U // o``, so the last chunk of every prefill chunk became a permanent hole.
    kvcore's cursor stops at the reduced end: 8-token prefill steps of a draft group with
    4-token chunks offer 0, then 1 and 2, then 3 and 4: contiguous.
    """
    cfg = make_config(GroupSpec(FULL, 4, is_draft=True))
    table = table_with_nulls(6, 0)
    offers = replay(cfg, 0, [Step(v, v, table) for v in (8, 16, 24)])
    assert [o.offered for o in offers] == [(0,), (1, 2), (3, 4)]
    assert [o.new_cursor for o in offers] == [1, 3, 5]


def test_draft_tail_is_never_stored_even_at_finish() -> None:
    """Semantics: the chunk at the frontier is volatile at every step, finished requests included
    (upstream W33 lifts the exclusion at finish; kvcore keeps E1 unconditional)."""
    cfg = make_config(GroupSpec(FULL, 4, is_draft=True))
    assert offered_chunks(cfg, 0, 16, [16, 16]) == [0, 1, 2]


def test_draft_window_keeps_the_extra_chunk_of_each_segment_end() -> None:
    """A draft SLIDING group keeps W + 1 chunks per segment *around* its end: the last W of
    the segment and the first of the next, which is the extra chunk a lookup at the
    segment end verifies. Round trip: a 41-token prompt stored and looked up again hits 32
    (FULL chunk 1 ends there); keeping the segment's last W + 1 (upstream #53951) would
    stop at 28.
    """
    cfg = make_config(GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=8, is_draft=True),
                      hash_block_tokens=4)
    stored = offered_chunks(cfg, 1, 41)
    assert {2, 3, 4, 6, 7, 8} <= set(stored)
    hits = (stored_map(cfg, 0, 41, offered_chunks(cfg, 0, 41)),
            stored_map(cfg, 1, 41, stored))
    assert hit_for(cfg, 0, 41, hits, HIT) == 32


def test_chunk_with_any_null_block_is_skipped_and_the_cursor_passes_it() -> None:
    cfg = make_config(GroupSpec(SLIDING, 2, 2, window_tokens=4))
    # Chunk 0 = positions 0, 1 (both null: freed by the window); chunk 1 = 2, 3 (2 null).
    # Only whole chunks are stored: chunk 1's CPU sub-block 0 would stay unwritten.
    table = (0, 0, 0, 5, 6, 7)
    offer = group_offer(cfg, 0, 0, 12, 12, table)
    assert offer.skipped == {0: Skip.NULL, 1: Skip.NULL}
    assert offer.offered == (2,)
    assert offer.new_cursor == 3
    assert chunk_source_blocks(table, 2, 2) == (4, (6, 7))


def test_short_table_is_refused() -> None:
    cfg = make_config(GroupSpec(FULL, 4))
    with pytest.raises(ValueError, match="block table"):
        group_offer(cfg, 0, 0, 16, 16, table_with_nulls(3, 0))


@pytest.mark.parametrize(("overrides", "prompt", "request_max", "frontier", "expected"), [
    ({}, 100, None, 64, 64),
    ({"prompt_only": True}, 40, None, 64, 40),
    ({"prompt_only": True}, 100, None, 64, 64),
    ({"max_offload_tokens": 32}, 100, None, 64, 32),
    ({"max_offload_tokens": 0}, 100, None, 64, 0),
    ({}, 100, 16, 64, 16),
    ({"max_offload_tokens": 48, "prompt_only": True}, 40, 44, 64, 40),
    ({}, 100, None, 0, 0),
])
def test_storable_prefix_caps(overrides: dict[str, object], prompt: int,
                              request_max: int | None, frontier: int, expected: int) -> None:
    cfg = make_config(GroupSpec(FULL, 4), **overrides)
    assert storable_prefix(cfg, frontier, prompt, request_max) == expected


# -- properties -------------------------------------------------------------------------------


@given(configs(), st.data())
def test_e1_for_any_cursor_and_frontier(cfg: OffloadConfig, data: st.DataObject) -> None:
    group = data.draw(st.integers(0, len(cfg.groups) - 1))
    g = cfg.groups[group]
    o = g.tokens_per_chunk
    frontier = data.draw(st.integers(0, 40 * o))
    storable = data.draw(st.integers(0, frontier))
    cursor = data.draw(st.integers(0, 45))
    table = table_with_nulls(cdiv(frontier, g.tokens_per_block) + g.blocks_per_chunk, 0)
    offer = group_offer(cfg, group, cursor, frontier, storable, table)
    assert e1_volatile_chunk_never_offered(StoreOfferRecord(
        group, g.is_draft, o, frontier, offer.offered)) == []
    assert e2_cursor_leaves_no_hole(CursorMoveRecord(
        group, cursor, offer.new_cursor, frozenset(offer.offered), offer.skipped)) == []
    for c in offer.offered:
        assert (c + 1) * o <= storable  # nothing for unwritten or capped tokens
        if g.is_draft:
            assert c < frontier // o - 1


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[OffloadConfig, int, int, int, list[Step]]:
    """A request's steps for one group: chunked prefill, then decode, with caps and nulls."""
    cfg = draw(configs())
    group = draw(st.integers(0, len(cfg.groups) - 1))
    g = cfg.groups[group]
    o = g.tokens_per_chunk
    prompt = draw(st.integers(0, 12 * o))
    decode = draw(st.integers(0, 4 * o))
    num_tokens = prompt + decode
    request_max = draw(st.one_of(st.none(), st.integers(0, num_tokens + o)))
    num_blocks = cdiv(num_tokens, g.tokens_per_block)
    steps = []
    frontier, nulls = 0, 0
    while frontier < num_tokens:
        size = draw(st.integers(1, max(1, 3 * o))) if frontier < prompt else \
            draw(st.integers(1, 4))
        frontier = min(frontier + size, num_tokens)
        if g.kind is not FULL:
            nulls = draw(st.integers(nulls, max(nulls, frontier // g.tokens_per_block - 1)))
        steps.append(Step(frontier, storable_prefix(cfg, frontier, prompt, request_max),
                          table_with_nulls(num_blocks, nulls)))
    return cfg, group, num_tokens, prompt, steps


@given(scenarios())
def test_no_holes_across_chunked_prefill_and_decode(
        scenario: tuple[OffloadConfig, int, int, int, list[Step]]) -> None:
    cfg, group, num_tokens, _, steps = scenario
    g = cfg.groups[group]
    o = g.tokens_per_chunk
    offers = replay(cfg, group, steps)
    seen: list[int] = []
    for step, offer in zip(steps, offers, strict=True):
        seen.extend(offer.offered)
        seen.extend(offer.skipped)
        for c in offer.offered:
            assert (c + 1) * o <= step.storable
            assert chunk_reachable(cfg, group, c)
            bpc = g.blocks_per_chunk
            assert 0 not in step.table[c * bpc:(c + 1) * bpc]
        for c, why in offer.skipped.items():
            bpc = g.blocks_per_chunk
            null = 0 in step.table[c * bpc:(c + 1) * bpc]
            assert why is (Skip.NULL if null else Skip.UNREACHABLE)
    final = offers[-1].new_cursor if offers else 0
    # Every chunk before the final cursor was offered or skipped, exactly once.
    assert sorted(seen) == list(range(final))
    if steps:
        last = steps[-1]
        # Nothing storable is left behind once the frontier reaches N.
        assert final == store_end(cfg, group, last.frontier, last.storable)
        if g.is_draft:
            assert final <= max(num_tokens // o - 1, 0)


@given(configs(kinds=(SLIDING,), min_groups=1, max_groups=1), st.data())
def test_window_keep_rule_keeps_what_segment_end_lookups_read(cfg: OffloadConfig,
                                                              data: st.DataObject) -> None:
    """With one FULL chunk size A = a * o, each segment keeps exactly the chunks a lookup
    at its end (kA, or kA - 1 under the N - 1 limit) reads: at least W + e of them, the
    draft group's extra chunk (the first of the next segment) included."""
    sliding = cfg.groups[0]
    o = sliding.tokens_per_chunk
    a = data.draw(st.integers(2, 8))
    full = GroupSpec(FULL, a * o)
    both = make_config(full, sliding, hash_block_tokens=cfg.hash_block_tokens,
                       speculative=cfg.speculative, draft_kv_elsewhere=cfg.draft_kv_elsewhere)
    rule = keep_rule(both, 1)
    period = None if rule is None else rule[0]
    window = sliding.window_chunks
    assert window is not None
    first = cdiv(sliding.reach_tokens, a * o) + 2
    for k in range(first, first + 3):
        read: set[int] = set()
        for boundary in (k * a * o - 1, k * a * o):
            rng = needed_chunks(sliding, boundary, 0)
            assert rng is not None
            read.update(range(*rng))
        if period is None:
            # Off only when a segment-end lookup reads every chunk of the segment anyway.
            assert len({c % a for c in read}) >= a
            continue
        assert period == a
        assert all(chunk_reachable(both, 1, c) for c in read)
        kept = [c for c in range(k * a, (k + 1) * a) if chunk_reachable(both, 1, c)]
        assert len(kept) == len({c % a for c in read}) >= window + sliding.extra_chunks


def stored_map(cfg: OffloadConfig, group: int, num_tokens: int, stored: Sequence[int]
               ) -> tuple:  # type: ignore[type-arg]
    keep = set(stored)
    return tuple(HIT if c in keep else MISS
                 for c in range(num_tokens // cfg.groups[group].tokens_per_chunk))


def round_trip(cfg: OffloadConfig, num_tokens: int) -> tuple[int, int]:
    """(hit of the stored prompt, hit had the chunks skipped as unreachable been stored)."""
    stored, with_skipped = [], []
    for i, g in enumerate(cfg.groups):
        table = table_with_nulls(cdiv(num_tokens, g.tokens_per_block), 0)
        offer = group_offer(cfg, i, 0, num_tokens, num_tokens, table)
        unreachable = [c for c, why in offer.skipped.items() if why is Skip.UNREACHABLE]
        stored.append(stored_map(cfg, i, num_tokens, offer.offered))
        with_skipped.append(stored_map(cfg, i, num_tokens, [*offer.offered, *unreachable]))
    return (hit_for(cfg, 0, num_tokens, stored, HIT),
            hit_for(cfg, 0, num_tokens, with_skipped, HIT))


def boundaries_stay_on_segment_ends(cfg: OffloadConfig) -> bool:
    """The layouts where every lookup of a fully stored prompt ends on a FULL chunk end.

    No draft group (its hold-back can end the hit mid-segment), every other chunk size
    divides the FULL chunk (a key count cannot bind mid-segment), MAMBA chunks are whole
    multiples of it, aligned window groups have chunks longer than one token (at
    ``N - 1`` the reach then stays in the segment) and no ``extra_retained_tokens``.
    """
    full = {g.tokens_per_chunk for g in cfg.groups if g.kind is FULL}
    if len(full) != 1 or any(g.is_draft for g in cfg.groups):
        return False
    (a_tokens,) = full
    for g in cfg.groups:
        if g.kind is MAMBA and g.tokens_per_chunk % a_tokens:
            return False
        if g.kind is not MAMBA and a_tokens % g.tokens_per_chunk:
            return False
        if g.kind is SLIDING and (g.tokens_per_chunk == 1 or g.extra_retained_tokens):
            return False
    return True


def _divisors(n: int, limit: int = 4) -> list[int]:
    return [d for d in range(1, limit + 1) if n % d == 0]


@st.composite
def segment_end_layouts(draw: st.DrawFn) -> OffloadConfig:
    """Layouts with ``boundaries_stay_on_segment_ends``, built directly (no filtering).

    One FULL chunk size ``A``; SLIDING chunks that divide ``A`` and are longer than one
    token, without ``extra_retained_tokens``; MAMBA chunks that are multiples of ``A``; no
    draft group; every chunk a multiple of the hash block size; groups in any order.
    """
    hbt = draw(st.sampled_from([1, 2, 4]))
    a_tokens = hbt * draw(st.sampled_from([2, 4, 8]))
    mamba = a_tokens * draw(st.integers(1, 2))
    sliding_sizes = [hbt * d for d in range(1, a_tokens // hbt + 1)
                     if a_tokens % (hbt * d) == 0 and hbt * d > 1]
    groups = []
    for kind in [FULL, *draw(st.lists(st.sampled_from([FULL, SLIDING, MAMBA]), max_size=3))]:
        chunk = {FULL: a_tokens, MAMBA: mamba}.get(kind) or draw(st.sampled_from(sliding_sizes))
        bpc = draw(st.sampled_from(_divisors(chunk)))
        window = draw(st.integers(1, 4 * chunk)) if kind is SLIDING else None
        groups.append(GroupSpec(kind, chunk // bpc, bpc, window_tokens=window))
    order = draw(st.permutations(groups))
    return make_config(*order, hash_block_tokens=hbt, store_alignment=True)


@given(segment_end_layouts(), st.integers(1, 12), st.integers(0, 3))
def test_chunks_skipped_as_unreachable_are_not_needed(cfg: OffloadConfig, full_chunks: int,
                                                      tail: int) -> None:
    """Round trip: store a whole prompt, look it up again; the skipped chunks are not needed."""
    assert boundaries_stay_on_segment_ends(cfg)
    num_tokens = full_chunks * max(g.tokens_per_chunk for g in cfg.groups) + tail
    stored, with_skipped = round_trip(cfg, num_tokens)
    assert stored == with_skipped


# Spec defects found here and fixed: the old keep rule's premise, "loads end on full-attention chunk
# boundaries", fails in these layouts, so chunk_reachable drops chunks a lookup of the very
# prompt that stored them needs. Each example gives (stored hit, hit had they been kept).
KEEP_RULE_FIXED = [
    pytest.param(
        (GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=8, extra_retained_tokens=4)),
        4, 33, (0, 32),
        id="extra_retained_tokens widens the reach beyond W: the group never hits"),
    pytest.param(
        (GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=4), GroupSpec(MAMBA, 12)),
        4, 33, (0, 24),
        id="MAMBA chunk not a multiple of the FULL chunk: boundaries are mid-segment"),
    pytest.param(
        (GroupSpec(FULL, 16), GroupSpec(SLIDING, 1, window_tokens=4)),
        1, 32, (16, 31),
        id="1-token window chunks: the N-1 limit ends the hit one chunk before the segment end"),
    pytest.param(
        (GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=4), GroupSpec(MAMBA, 8)),
        4, 32, (16, 24),
        id="Mamba rounds the N-1 limit down to kA - m, mid-segment"),
]


# The deliberate trade-off: hits are rounded down to segment ends. Here the draft group's
# hold-back keeps the last segment end out of reach; without the keep rule the hit would
# be 8 (mid-segment), with it 6. Pinned so a change of the trade-off is a conscious one.
KEEP_RULE_TRADE_OFF = (
    (GroupSpec(FULL, 6), GroupSpec(SLIDING, 2, window_tokens=1),
     GroupSpec(SLIDING, 2, window_tokens=1, is_draft=True)),
    1, 12, (6, 8))


@pytest.mark.parametrize(("groups", "hash_tokens", "num_tokens", "observed"), KEEP_RULE_FIXED)
def test_keep_rule_loses_no_segment_end_hit(groups: tuple[GroupSpec, ...], hash_tokens: int,
                                            num_tokens: int, observed: tuple[int, int]) -> None:
    """Found by this suite with the old "last W + e" rule (``observed`` was its result);
    the rule is now derived from the lookup rule and these hit as if nothing were skipped."""
    cfg = make_config(*groups, hash_block_tokens=hash_tokens)
    stored, unskipped = round_trip(cfg, num_tokens)
    assert stored == unskipped


def test_keep_rule_trade_off_is_pinned() -> None:
    groups, hash_tokens, num_tokens, observed = KEEP_RULE_TRADE_OFF
    cfg = make_config(*groups, hash_block_tokens=hash_tokens, speculative=True)
    assert round_trip(cfg, num_tokens) == observed


# -- kvcore's rule against the reference's, computed apart ------------------------------------


@st.composite
def aligned_layouts(draw: st.DrawFn) -> OffloadConfig:
    """FULL chunk ``A = a * o`` beside one SLIDING group of chunk ``o`` (any window,
    retention, draft flag, blocks per chunk), sometimes a MAMBA group whose chunk divides
    ``A`` or not, sometimes alignment off: the set-ups where the keep rule is decided."""
    hbt = draw(st.sampled_from([1, 2]))
    o = hbt * draw(st.integers(1, 3))
    a = draw(st.integers(2, 8))
    bpc = draw(st.sampled_from(_divisors(o)))
    window = draw(st.integers(1, 3 * a * o))
    sliding = GroupSpec(SLIDING, o // bpc, bpc, window_tokens=window,
                        is_draft=draw(st.booleans()),
                        extra_retained_tokens=draw(st.sampled_from([0, 0, 1, o, 3 * o + 1])))
    groups = [GroupSpec(FULL, a * o), sliding]
    if draw(st.booleans()):
        groups.append(GroupSpec(MAMBA, hbt * draw(st.integers(1, 2 * a))))
    return make_config(*draw(st.permutations(groups)), hash_block_tokens=hbt,
                       store_alignment=draw(st.sampled_from([True, True, True, False])))


@given(aligned_layouts())
# Pinned so the comparison never depends on what a run happens to draw: a Mamba chunk
# (4) that rounds the N - 1 limit to kA - 4, and a draft window with retention.
@example(make_config(GroupSpec(FULL, 8), GroupSpec(SLIDING, 1, window_tokens=2),
                     GroupSpec(MAMBA, 4)))
@example(make_config(GroupSpec(FULL, 12), GroupSpec(SLIDING, 2, 2, window_tokens=5,
                                                    is_draft=True, extra_retained_tokens=5),
                     hash_block_tokens=2))
def test_keep_rule_agrees_with_the_reference(cfg: OffloadConfig) -> None:
    """kvcore's periodic keep rule == the spec's segment-end reads, chunk by chunk, over
    the first four segments and beyond.

    Kills a kvcore ``keep_rule`` that drops the Mamba-rounded end, the ``kA - 1`` end or
    the draft extra chunk, or keeps one chunk more (the #53951 "last W + 1" rule)."""
    group = next(i for i, g in enumerate(cfg.groups) if g.kind is SLIDING)
    o = cfg.groups[group].tokens_per_chunk
    a = max(g.tokens_per_chunk for g in cfg.groups if g.kind is FULL) // o
    for chunk in range(4 * a + 3):
        assert chunk_reachable(cfg, group, chunk) == read_at_segment_end(cfg, group, chunk), \
            (cfg.groups, chunk)


def test_keep_rule_is_derived_once_per_config_and_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cost property of the store path: ``group_offer`` asks for the keep rule of every
    SLIDING group at every step, and deriving it walks the lookup rule, so it must be
    derived once per (config, group) and served from the cache after that. The cache is
    keyed by the config's identity: an equal config built anew is derived afresh (and
    agrees), never served another object's entry.

    Kills a cache whose hit test never matches (``hit[-1] is cfg``: the same answers,
    re-derived at every step) and one keyed by the config's value (hashing it).
    """
    calls: list[tuple[int, int]] = []
    derive = _rules._keep_rule

    def counting(cfg: OffloadConfig, group: int) -> tuple[int, KeptOffsets] | None:
        calls.append((id(cfg), group))
        return derive(cfg, group)

    monkeypatch.setattr(_rules, "_keep_rule", counting)
    monkeypatch.setattr(_rules, "_KEEP_CACHE", {})
    cfg = make_config(GroupSpec(FULL, 8), GroupSpec(SLIDING, 2, window_tokens=4))
    table = tuple(range(1, 65))
    for frontier in range(8, 129, 8):  # 16 steps of one request's prefill
        group_offer(cfg, 1, 0, frontier, frontier, table)
    rule = keep_rule(cfg, 1)
    assert rule is not None and rule[0] == 4
    assert calls == [(id(cfg), 1)]
    twin = replace(cfg)
    assert twin == cfg and twin is not cfg
    assert keep_rule(twin, 1) == rule
    assert keep_rule(twin, 1) == rule
    assert keep_rule(cfg, 1) == rule
    assert calls == [(id(cfg), 1), (id(twin), 1)]


def test_kept_offsets_drop_empty_spans_and_merge_the_rest() -> None:
    """The keep rule always passes a range's wrapped part, ``(0, stop - a)``, empty or
    negative when the range fits its segment: such a span must add no offset (a kept
    ``-1`` would count towards "the kept offsets fill the segment" and turn the rule off),
    and spans that touch or overlap become one."""
    kept = KeptOffsets.of(8, [(6, 8), (0, -2), (3, 3), (0, 0), (0, 1), (5, 7)])
    assert kept.spans == ((0, 1), (5, 8))
    assert len(kept) == 4 and list(kept) == [0, 5, 6, 7]
    assert -1 not in kept and -2 not in kept and 3 not in kept


OfferCase = tuple[OffloadConfig, int, int, int, int, tuple[int, ...]]


@st.composite
def offer_cases(draw: st.DrawFn) -> OfferCase:
    """(config, group, cursor, frontier V, storable U, table): the cursor at or near the
    end, U often V, nulls as window padding and sometimes one stale block anywhere."""
    cfg = draw(configs())
    group = draw(st.integers(0, len(cfg.groups) - 1))
    g = cfg.groups[group]
    o = g.tokens_per_chunk
    frontier = draw(st.integers(0, 12 * o))
    storable = draw(st.integers(0, frontier)) if draw(st.booleans()) else frontier
    cursor = draw(st.integers(0, storable // o + 1))
    size = cdiv(frontier, g.tokens_per_block)
    padding = draw(st.integers(0, size))
    table = [0 if i < padding else i + 1 for i in range(size)]
    if size and draw(st.booleans()):
        table[draw(st.integers(0, size - 1))] = 0  # a stale block, zeroed
    return cfg, group, cursor, frontier, storable, tuple(table)


@given(offer_cases())
# Pinned: padding ends mid-chunk (W24 offered chunk 0, its last block real), and a draft
# group whose U reaches the volatile chunk.
@example((make_config(GroupSpec(SLIDING, 2, 2, window_tokens=4)), 0, 0, 12, 12,
          (0, 5, 6, 7, 8, 9)))
@example((make_config(GroupSpec(FULL, 4, is_draft=True)), 0, 0, 16, 16, (1, 2, 3, 4)))
def test_offer_agrees_with_the_reference_walk(case: OfferCase) -> None:
    """``group_offer`` and the reference's ``store_walk`` agree for any cursor, frontier,
    cap and table with nulls (window padding, or anywhere): same chunks offered, same
    cursor after, and every chunk passed and not offered skipped with the reason the
    reference would give. Kills an offer that checks only a chunk's last block for null
    (upstream W24), a store end that lets a draft group's volatile chunk through (E1), and
    a cursor that stops one chunk short or runs one past."""
    cfg, group, cursor, frontier, storable, table = case
    g = cfg.groups[group]
    offer = group_offer(cfg, group, cursor, frontier, storable, table)
    offered, after = store_walk(cfg, group, cursor, frontier, storable, table)
    assert list(offer.offered) == offered
    assert offer.new_cursor == after
    bpc = g.blocks_per_chunk
    for c, why in offer.skipped.items():
        assert why is (Skip.NULL if 0 in table[c * bpc:(c + 1) * bpc] else Skip.UNREACHABLE)
