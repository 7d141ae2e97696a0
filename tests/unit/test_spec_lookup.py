"""The hit (L1, L2, E4): upstream's known answers, and properties over random group mixes.

Goal: pin the reference hit (``kvcore.spec.lookup``) from three sides. (1) The upstream
tables of docs/upstream.md §2.2 (the two primitive lookups, as single-group
layouts) and §2.3 (TestEagle) are reproduced where kvcore's semantics agree; where kvcore
differs on purpose the row pins kvcore's value and says why. (2) Properties that must hold
for any layout: the hit never exceeds the limit, every group supports it, a draft group
never serves its last available chunk, a window reaches back from the boundary itself,
MISS -> HIT never lowers the hit, adding a non-draft group never raises it, resolving
PENDING stays between the pessimistic and optimistic answers, keys being loaded defer.
(3) The candidate-boundary search equals a brute force over every boundary.

Method: Hypothesis draws 1..4 groups (chunk sizes 1..256 tokens that the hash size
divides, windows, draft flags, blocks_per_chunk 1..4, MAMBA groups sharing a chunk size)
and hit maps that are mostly HIT with a few MISS/PENDING edits, or random. Keys exist only
for complete chunks: group g gets ``N // o_g`` statuses. Oracles here are written from
docs/semantics.md independently of ``spec.lookup`` (token-level window reach, brute force).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from spec_strategies import (
    FULL,
    HIT,
    MAMBA,
    MISS,
    PENDING_S,
    SLIDING,
    Request,
    configs,
    group_specs,
    lookups,
    make_config,
    parse_statuses,
    requests,
    status_lists,
    with_hits,
)

from kvcore.spec.invariants import (
    LookupRecord,
    e4_draft_extra_chunk_hit,
    l1_hit_matches_spec,
    l2_pending_exactly_when_uncertain,
)
from kvcore.spec.lookup import (
    candidate_boundaries,
    group_supports,
    hit_for,
    lookup_limit,
    served_chunks,
    spec_hit,
)
from kvcore.spec.types import PENDING, GroupSpec, LookupResult, OffloadConfig, Status, cdiv

# -- helpers ------------------------------------------------------------------------------


def hit_of(cfg: OffloadConfig, req: Request, loading: Sequence[frozenset[int]] | None = None
           ) -> LookupResult:
    return spec_hit(cfg, req.computed, req.num_tokens, req.hits, loading)


def brute_force_hit(cfg: OffloadConfig, computed: int, num_tokens: int,
                    hits: Sequence[Sequence[Status]], pending_as: Status) -> int:
    """docs/semantics.md's hit by brute force: every boundary T, largest first."""
    min_new = max(g.tokens_per_chunk for g in cfg.groups)
    for boundary in range(lookup_limit(cfg, num_tokens), computed, -1):
        if boundary - computed >= min_new and all(
                group_supports(g, hits[i], boundary, computed, pending_as)
                for i, g in enumerate(cfg.groups)):
            return boundary - computed
    return 0


def is_hit(status: Status, pending_as: Status) -> bool:
    return (pending_as if status is Status.PENDING else status) is Status.HIT


def tokens_all_hit(statuses: Sequence[Status], o: int, first_token: int, end_token: int,
                   pending_as: Status) -> bool:
    """Every token in [first_token, end_token) lies in a chunk that exists and is a hit."""
    for t in range(max(first_token, 0), end_token):
        c = t // o
        if c >= len(statuses) or not is_hit(statuses[c], pending_as):
            return False
    return True


def resolve(hits: tuple[tuple[Status, ...], ...], choices: Sequence[bool]
            ) -> tuple[tuple[Status, ...], ...]:
    """Replace each PENDING, in order, by HIT (True) or MISS (False)."""
    it = iter(choices)
    return tuple(tuple((HIT if next(it, True) else MISS) if s is PENDING_S else s for s in row)
                 for row in hits)


# -- upstream tables (docs/upstream.md §2.2, §2.3) --------------------------------

# §2.2 `_maximal_prefix_lookup`, as one FULL group with 4-token chunks and N = 4 * len(keys):
# the count of consecutive hits becomes a hit of 4 * count tokens, None becomes PENDING.
MAXIMAL_PREFIX = [
    ("1T 2T", "HH", 8),
    ("all miss", "MMM", 0),
    ("1T 2T 3F", "HHM", 8),
    ("1F 2T", "MH", 0),
    ("single T", "H", 4),
    ("empty", "", 0),
    ("1None 2T", "PH", PENDING),
    ("1T 2None", "HP", PENDING),
    ("1None 2F 3T", "PMH", PENDING),
]


@pytest.mark.parametrize(("statuses", "expected"),
                         [pytest.param(s, e, id=name) for name, s, e in MAXIMAL_PREFIX])
def test_upstream_maximal_prefix_table(statuses: str, expected: LookupResult) -> None:
    cfg = make_config(GroupSpec(FULL, 4))
    hits = (parse_statuses(statuses),)
    assert spec_hit(cfg, 0, 4 * len(statuses), hits) == expected


# §2.2 `_sliding_window_lookup`, as one SLIDING group with 4-token chunks and a window of
# 4 * W tokens. N = 4 * len(keys) + 1, so the limit N - 1 is the end of the last key and
# the request has exactly len(keys) complete chunks. A run ending at chunk index r is a
# hit of 4 * r tokens. kvcore's "prefix fallback" is the window clipped at C = 0.
SLIDING_WINDOW = [
    ("[1,2] all hit, W=2", "HH", 2, 8),
    ("all miss, W=1", "MM", 1, 0),
    ("hits {2,3} of [1,2,3], W=2", "MHH", 2, 12),
    ("hits {2,3} of [1,2,3,4], W=2", "MHHM", 2, 12),
    ("hits {1,2} of [1,2,3], W=3: prefix fallback", "HHM", 3, 8),
    ("hits {2,3}, W=1", "MHH", 1, 12),
    ("[1,2,3,0,4] hits {2,3,4}, W=2", "MHHMH", 2, 12),
    ("two valid windows: the rightmost wins", "HHMHH", 2, 20),
    ("[2,1,3,4,5] hits {2,3,4,5}, W=4: prefix fallback", "HMHHH", 4, 4),
    ("empty", "", 2, 0),
    ("a None scanned before the window", "HHP", 2, PENDING),
    # Upstream scans from the right and returns at the first full window, before it
    # reaches the None; kvcore agrees because PENDING there cannot change the answer.
    ("a None left of the rightmost window", "PHH", 2, 12),
]


@pytest.mark.parametrize(("statuses", "window_chunks", "expected"),
                         [pytest.param(s, w, e, id=name) for name, s, w, e in SLIDING_WINDOW])
def test_upstream_sliding_window_table(statuses: str, window_chunks: int,
                                       expected: LookupResult) -> None:
    cfg = make_config(GroupSpec(SLIDING, 4, window_tokens=4 * window_chunks))
    hits = (parse_statuses(statuses),)
    assert spec_hit(cfg, 0, 4 * len(statuses) + 1, hits) == expected


def eagle(kind: str, window: int | None = None, draft: bool = True) -> GroupSpec:
    k = {"F": FULL, "S": SLIDING}[kind]
    return GroupSpec(k, 4, window_tokens=window, is_draft=draft)


# §2.3 TestEagle: GPU block 4 tokens, one block per chunk.
EAGLE = [
    ("single FULL eagle, 3 keys hit, N=12: 3 -> pop -> 2",
     (eagle("F"),), 12, ("HHH",), 8),
    ("single FULL eagle, one key, N=4: pop -> 0", (eagle("F"),), 4, ("H",), 0),
    ("single FULL eagle, no hits", (eagle("F"),), 12, ("MMM",), 0),
    # Upstream's test hands a 13-token request 4 keys; with them kvcore agrees (12).
    ("SWA eagle W=2, N=13, 4 keys hit (upstream's key count)",
     (eagle("S", 8),), 13, ("HHHH",), 12),
    # kvcore differs: keys exist only for complete chunks, so a 13-token request has 3
    # keys, the draft group must keep its 3rd chunk as the extra one, and the hit is 8.
    ("SWA eagle W=2, N=13, the 3 keys kvcore derives", (eagle("S", 8),), 13, ("HHH",), 8),
    ("SWA eagle W=2, N=9, 2 keys: widening capped by the key count",
     (eagle("S", 8),), 9, ("HH",), 4),
    ("SWA eagle W=2, N=13, keys [1,2,3] hit", (eagle("S", 8),), 13, ("HHH",), 8),
    ("FULL + FULL eagle, all hit, N=12: the eagle shrink ends the loop",
     (eagle("F", draft=False), eagle("F")), 12, ("HHH", "HHH"), 8),
    # kvcore differs (#52771, docs/semantics.md: b + e for FULL): a FULL draft group is widened like
    # a window draft group, so its extra chunk 1 (a hit) is verified and chunk 0 served.
    # Upstream W24 did not widen FULL eagle groups, popped the only queried key and
    # returned 0, discarding a block that was actually hit.
    ("FULL (only key 0 hit) + FULL eagle (all hit): kvcore widens the FULL draft",
     (eagle("F", draft=False), eagle("F")), 12, ("HMM", "HHH"), 4),
]


@pytest.mark.parametrize(("groups", "num_tokens", "statuses", "expected"),
                         [pytest.param(g, n, s, e, id=name) for name, g, n, s, e in EAGLE])
def test_upstream_eagle_table(groups: tuple[GroupSpec, ...], num_tokens: int,
                              statuses: tuple[str, ...], expected: int) -> None:
    cfg = make_config(*groups)
    hits = tuple(parse_statuses(s) for s in statuses)
    assert spec_hit(cfg, 0, num_tokens, hits) == expected


def test_no_all_groups_fallback_for_hybrid_mamba() -> None:
    """kvcore differs (#52735): no group is made a draft group behind the engine's back.

    Upstream's all-groups fallback made the Mamba group of a Qwen3.5-style hybrid an eagle
    group whose "window + 1" was never met, so every lookup returned 0 ("stores but never
    serves"). kvcore refuses the ambiguous config (test_spec_config) and, told the drafter's
    KV lives elsewhere, serves the whole hit.
    """
    cfg = make_config(GroupSpec(FULL, 4), GroupSpec(MAMBA, 4), speculative=True,
                      draft_kv_elsewhere=True)
    hits = (parse_statuses("HHH"), parse_statuses("HHH"))
    # limit: N - 1 = 12 (a MAMBA group exists), a multiple of the MAMBA chunk already.
    assert spec_hit(cfg, 0, 13, hits) == 12


def test_window_reach_adds_a_chunk_at_an_unaligned_boundary() -> None:
    """Lookup rule: the window reaches back R tokens from T itself, not from the chunk end.

    SLIDING 4-token chunks, window 7 (W = 2, R = 6). At T = 9 the next token (9) attends
    to tokens 3..8: chunks 0, 1 and 2, one more than W. Measured from the chunk end (12),
    chunks 1 and 2 would seem to suffice. A MAMBA group with 3-token chunks makes T = 9 a
    candidate (its chunk 3 is a miss, so T = 12 is out).
    """
    window = GroupSpec(SLIDING, 4, window_tokens=7)
    assert served_chunks(window, 9, 0) == (0, 3)
    assert served_chunks(window, 12, 0) == (1, 3)
    cfg = make_config(window, GroupSpec(MAMBA, 3))
    mamba = parse_statuses("HHHM")
    assert spec_hit(cfg, 0, 13, (parse_statuses("HHH"), mamba)) == 9
    # Chunk 0 is inside the reach of T = 9: without it there is no hit at all.
    assert spec_hit(cfg, 0, 13, (parse_statuses("MHH"), mamba)) == 0


def test_being_loaded_key_in_the_hit_range_defers() -> None:
    cfg = make_config(GroupSpec(FULL, 4))
    hits = (parse_statuses("HHH"),)
    assert spec_hit(cfg, 0, 12, hits, [frozenset()]) == 12
    assert spec_hit(cfg, 0, 12, hits, [frozenset({1})]) is PENDING
    # A key already on the GPU (below C) is not read by this hit.
    assert spec_hit(cfg, 4, 12, hits, [frozenset({0})]) == 8


def test_draft_extra_chunk_being_loaded_does_not_defer() -> None:
    """The draft group's extra chunk is verified but never read, so its load is irrelevant."""
    cfg = make_config(GroupSpec(FULL, 4, is_draft=True))
    hits = (parse_statuses("HHH"),)
    assert spec_hit(cfg, 0, 12, hits, [frozenset({2})]) == 8
    assert spec_hit(cfg, 0, 12, hits, [frozenset({1})]) is PENDING


def test_mamba_boundary_must_be_a_chunk_end() -> None:
    cfg = make_config(GroupSpec(FULL, 2), GroupSpec(MAMBA, 4))
    hits = (parse_statuses("HHHHHH"), parse_statuses("HHH"))
    # N = 13: limit 12, already a multiple of the MAMBA chunk.
    assert spec_hit(cfg, 0, 13, hits) == 12
    # N = 12: limit 11, rounded down to 8.
    assert spec_hit(cfg, 0, 12, hits) == 8
    assert lookup_limit(cfg, 12) == 8


# -- properties -------------------------------------------------------------------------------


@given(lookups())
def test_hit_never_exceeds_the_limit(case: tuple[OffloadConfig, Request]) -> None:
    cfg, req = case
    result = hit_of(cfg, req)
    if not isinstance(result, int) or result == 0:
        return
    assert req.computed + result <= lookup_limit(cfg, req.num_tokens)
    assert result >= max(g.tokens_per_chunk for g in cfg.groups)
    align = cfg.mamba_align_tokens
    if align is not None:
        assert (req.computed + result) % align == 0


@given(lookups())
def test_hit_is_supported_by_every_group(case: tuple[OffloadConfig, Request]) -> None:
    cfg, req = case
    result = hit_of(cfg, req)
    if not isinstance(result, int) or result == 0:
        return
    for i, g in enumerate(cfg.groups):
        for pending_as in (HIT, MISS):
            assert group_supports(g, req.hits[i], req.computed + result, req.computed,
                                  pending_as), (i, g)


@given(lookups())
def test_candidate_boundaries_equal_brute_force(case: tuple[OffloadConfig, Request]) -> None:
    cfg, req = case
    for pending_as in (HIT, MISS):
        assert hit_for(cfg, req.computed, req.num_tokens, req.hits, pending_as) == \
            brute_force_hit(cfg, req.computed, req.num_tokens, req.hits, pending_as)


@given(lookups())
def test_candidate_boundaries_are_sorted_and_in_range(case: tuple[OffloadConfig, Request]
                                                      ) -> None:
    cfg, req = case
    limit = lookup_limit(cfg, req.num_tokens)
    points = candidate_boundaries(cfg, req.computed, limit)
    assert points == sorted(set(points), reverse=True)
    assert all(req.computed < t <= limit for t in points)


@given(lookups())
def test_draft_group_never_serves_its_last_available_chunk(
        case: tuple[OffloadConfig, Request]) -> None:
    cfg, req = case
    result = hit_of(cfg, req)
    if not isinstance(result, int) or result == 0:
        return
    boundary = req.computed + result
    for i, g in enumerate(cfg.groups):
        if not g.is_draft:
            continue
        served = served_chunks(g, boundary, req.computed)
        assert served is not None
        # The served chunks end before the last key: one more chunk exists and is a hit.
        assert served[1] <= len(req.hits[i]) - 1
        assert req.hits[i][served[1]] is HIT
    record = LookupRecord(cfg, req.computed, req.num_tokens, req.hits, None, result)
    assert e4_draft_extra_chunk_hit(record) == []


@given(lookups())
def test_window_reaches_back_from_the_boundary_itself(case: tuple[OffloadConfig, Request]
                                                      ) -> None:
    """Token-level oracle: the next token attends to R tokens before T, all must be hits."""
    cfg, req = case
    result = hit_of(cfg, req)
    if not isinstance(result, int) or result == 0:
        return
    boundary, computed = req.computed + result, req.computed
    for i, g in enumerate(cfg.groups):
        o, e = g.tokens_per_chunk, g.extra_chunks
        end = (cdiv(boundary, o) + e) * o  # through the draft extra chunk
        if g.kind is SLIDING:
            window = g.window_chunks
            assert window is not None
            first = max(computed, boundary - g.reach_tokens)
            assert tokens_all_hit(req.hits[i], o, first, end, MISS), (i, g)
            # And at least W chunks before the boundary's chunk end, unless C covers them.
            first_w = max(computed // o, cdiv(boundary, o) - window) * o
            assert tokens_all_hit(req.hits[i], o, first_w, end, MISS), (i, g)
        elif g.kind is FULL:
            assert tokens_all_hit(req.hits[i], o, computed, end, MISS), (i, g)
        else:
            assert boundary % o == 0
            assert tokens_all_hit(req.hits[i], o, max(computed, boundary - o), end, MISS)


@given(lookups(pending=False), st.data())
def test_miss_to_hit_never_lowers_the_hit(case: tuple[OffloadConfig, Request],
                                          data: st.DataObject) -> None:
    cfg, req = case
    misses = [(i, c) for i, row in enumerate(req.hits) for c, s in enumerate(row) if s is MISS]
    if not misses:
        # Every group has a chunk (N >= the largest chunk): make one a miss, so nothing
        # drawn is thrown away.
        group = data.draw(st.integers(0, len(cfg.groups) - 1))
        chunk = data.draw(st.integers(0, len(req.hits[group]) - 1))
        row = list(req.hits[group])
        row[chunk] = MISS
        req = with_hits(req, tuple(tuple(row) if i == group else r
                                   for i, r in enumerate(req.hits)))
        misses = [(group, chunk)]
    flips = data.draw(st.sets(st.sampled_from(misses), min_size=1, max_size=3))
    better = tuple(tuple(HIT if (i, c) in flips else s for c, s in enumerate(row))
                   for i, row in enumerate(req.hits))
    before = hit_of(cfg, req)
    after = spec_hit(cfg, req.computed, req.num_tokens, better)
    assert isinstance(before, int) and isinstance(after, int)
    assert after >= before


@st.composite
def extra_groups(draw: st.DrawFn, cfg: OffloadConfig) -> GroupSpec:
    """A non-draft group that keeps ``cfg`` valid when appended."""
    unit = cfg.hash_block_tokens * draw(st.sampled_from([1, 2, 4]))
    mamba = cfg.mamba_align_tokens or unit * draw(st.integers(1, 4))
    kind = draw(st.sampled_from([FULL, SLIDING, MAMBA]))
    return draw(group_specs(unit, kind, mamba, allow_draft=False))


@given(lookups(), st.data())
def test_adding_a_non_draft_group_never_raises_the_hit(case: tuple[OffloadConfig, Request],
                                                       data: st.DataObject) -> None:
    cfg, req = case
    extra = data.draw(extra_groups(cfg))
    bigger = make_config(*cfg.groups, extra, hash_block_tokens=cfg.hash_block_tokens,
                         speculative=cfg.speculative, draft_kv_elsewhere=cfg.draft_kv_elsewhere)
    row = data.draw(status_lists(req.num_tokens // extra.tokens_per_chunk, pending=True))
    hits = (*req.hits, row)
    for pending_as in (HIT, MISS):
        assert hit_for(bigger, req.computed, req.num_tokens, hits, pending_as) <= \
            hit_for(cfg, req.computed, req.num_tokens, req.hits, pending_as)


@given(lookups(), st.lists(st.booleans(), max_size=64))
def test_resolving_pending_stays_between_the_two_answers(
        case: tuple[OffloadConfig, Request], choices: list[bool]) -> None:
    cfg, req = case
    optimistic = hit_for(cfg, req.computed, req.num_tokens, req.hits, HIT)
    pessimistic = hit_for(cfg, req.computed, req.num_tokens, req.hits, MISS)
    resolved = hit_for(cfg, req.computed, req.num_tokens, resolve(req.hits, choices), MISS)
    assert pessimistic <= resolved <= optimistic
    answer = hit_of(cfg, req)
    if answer is not PENDING:
        # Not deferred means no resolution of the unknown keys can change the answer.
        assert resolved == answer


@given(lookups())
def test_pending_exactly_when_the_two_answers_differ(case: tuple[OffloadConfig, Request]
                                                     ) -> None:
    cfg, req = case
    optimistic = hit_for(cfg, req.computed, req.num_tokens, req.hits, HIT)
    pessimistic = hit_for(cfg, req.computed, req.num_tokens, req.hits, MISS)
    answer = hit_of(cfg, req)
    assert (answer is PENDING) == (optimistic != pessimistic)
    record = LookupRecord(cfg, req.computed, req.num_tokens, req.hits, None, answer)
    assert l1_hit_matches_spec(record) == []
    assert l2_pending_exactly_when_uncertain(record) == []


@given(lookups(pending=False), st.data())
def test_being_loaded_keys_give_pending(case: tuple[OffloadConfig, Request],
                                        data: st.DataObject) -> None:
    cfg, req = case
    result = hit_of(cfg, req)
    if not isinstance(result, int) or result == 0:
        return
    boundary = req.computed + result
    served = [served_chunks(g, boundary, req.computed) for g in cfg.groups]
    readable = [(i, c) for i, rng in enumerate(served) if rng for c in range(*rng)]
    if not readable:
        return
    i, c = data.draw(st.sampled_from(readable))
    loading = [frozenset({c}) if j == i else frozenset() for j in range(len(cfg.groups))]
    assert hit_of(cfg, req, loading) is PENDING
    # Keys outside every served range (below it, or the draft extra chunk) never defer.
    outside = [frozenset(set(range(len(req.hits[j]))) - set(range(*rng)) if rng else
                         set(range(len(req.hits[j]))))
               for j, rng in enumerate(served)]
    assert hit_of(cfg, req, outside) == result


@given(configs(), st.data())
def test_all_hit_single_draft_group_loses_exactly_its_last_chunk(
        cfg: OffloadConfig, data: st.DataObject) -> None:
    """With every key a hit, a lone FULL draft group serves all complete chunks but one."""
    g = GroupSpec(FULL, cfg.groups[0].tokens_per_block, cfg.groups[0].blocks_per_chunk,
                  is_draft=True)
    one = make_config(g, hash_block_tokens=cfg.hash_block_tokens)
    req = data.draw(requests(one, pending=False))
    o = g.tokens_per_chunk
    hits = ((HIT,) * (req.num_tokens // o),)
    keys = req.num_tokens // o
    expected = max(keys - 1, 0) * o - req.computed
    if expected < o:
        expected = 0
    assert spec_hit(one, req.computed, req.num_tokens, hits) == expected
