"""L1 / L2 / E4 obligations: the spec's hit, over every small layout, request and hit map.

Each obligation runs ``spec.lookup.hit_for`` (the reference hit) on one of the layouts
below, a request of ``N <= 8`` tokens with ``C <= 2`` tokens already computed, and a
symbolic hit map (``N // o`` chunks per group, every HIT/MISS combination), and states one
property of docs/semantics.md "Lookup":

- ``hit_within_limit``: the hit is 0 or at least every group's chunk, and ``C + hit`` is at
  most the limit (N, or N - 1 with window groups, rounded down to the MAMBA chunk).
- ``hit_supported_by_every_group``: every group supports ``C + hit``.
- ``draft_never_serves_last_chunk`` (E4): a draft group's chunk just past the boundary
  exists and is a hit; it is verified, never served.
- ``window_reach_from_boundary``: a SLIDING group's chunks cover every token the window
  reaches back from the boundary itself (``[T - R, T)``), not from the chunk end.
- ``pending_only_when_it_matters`` (L2, on ``N <= 4``, ``C = 0``; hit maps are
  three-valued and every PENDING is also resolved, so each chunk is read four ways):
  PENDING exactly when the optimistic and pessimistic hits differ, every resolution lands
  between them, and an answer that is not PENDING is what every resolution gives.
- ``miss_to_hit_never_lowers``: turning any one MISS into a HIT never lowers the hit (on
  ``N <= 6``, ``C = 0``: two hit maps per path make it the most expensive; by induction
  one flip at a time covers turning any set of MISSes into HITs).

Each has a mutant, a deliberately wrong hit that CrossHair must refute. The layouts cover
FULL, SLIDING and MAMBA groups, draft groups of each kind, two draft groups, chunk sizes
1..3 and a window whose reach is longer than ``W`` chunks at unaligned boundaries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcore.spec.lookup import (
    candidate_boundaries,
    group_supports,
    hit_for,
    lookup_limit,
    spec_hit,
)
from kvcore.spec.types import PENDING, GroupKind, GroupSpec, OffloadConfig, Status, cdiv
from proofs._bounded import (
    CONFIRMED,
    REFUTED,
    Obligation,
    hit_maps,
    pick,
    small_config,
)

F, S, M = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA

LAYOUTS = (
    small_config(GroupSpec(F, 2)),
    small_config(GroupSpec(F, 2, is_draft=True)),
    small_config(GroupSpec(S, 2, window_tokens=3)),
    small_config(GroupSpec(F, 2), GroupSpec(S, 1, window_tokens=2)),
    small_config(GroupSpec(F, 2, is_draft=True), GroupSpec(S, 2, window_tokens=3, is_draft=True)),
    small_config(GroupSpec(S, 3, window_tokens=3), GroupSpec(M, 2)),
    small_config(GroupSpec(F, 1), GroupSpec(M, 2, is_draft=True)),
    small_config(GroupSpec(S, 2, window_tokens=1, is_draft=True),
                 GroupSpec(S, 2, window_tokens=3)),
)
N_MAX = 8        # tokens per request
C_MAX = 2        # tokens already computed
PER_GROUP = 8    # hit-map bits per group: N_MAX // smallest chunk
L2_N_MAX = 4     # three-valued maps and a resolution: four reads a chunk, kept smaller
BITS = 2 * PER_GROUP

HitFn = Callable[[OffloadConfig, int, int, Sequence[Sequence[Status]]], int]


def spec_hit_fn(cfg: OffloadConfig, computed: int, num_tokens: int,
                hits: Sequence[Sequence[Status]]) -> int:
    return hit_for(cfg, computed, num_tokens, hits, Status.HIT)


def _case(layout: int, num_tokens: int, computed: int, bits: list[bool],
          flip: tuple[int, int] | None = None, n_max: int = N_MAX, c_max: int = C_MAX
          ) -> tuple[OffloadConfig, int, int, tuple[Sequence[Status], ...]]:
    cfg = LAYOUTS[pick(layout, len(LAYOUTS))]
    n = pick(num_tokens, n_max + 1)
    c = pick(computed, c_max + 1)
    return cfg, n, c, hit_maps(cfg, n, bits, PER_GROUP, flip)


# -- properties (shared by each obligation and its mutant) --------------------------------------


def within_limit(cfg: OffloadConfig, computed: int, num_tokens: int, hit: int) -> bool:
    if hit == 0:
        return True
    align = cfg.mamba_align_tokens
    return (all(hit >= g.tokens_per_chunk for g in cfg.groups)
            and computed + hit <= lookup_limit(cfg, num_tokens)
            and (align is None or (computed + hit) % align == 0))


def supported(cfg: OffloadConfig, computed: int, hits: Sequence[Sequence[Status]],
              hit: int) -> bool:
    return hit == 0 or all(group_supports(g, hits[i], computed + hit, computed, Status.MISS)
                           for i, g in enumerate(cfg.groups))


def draft_extra_hit(cfg: OffloadConfig, computed: int, hits: Sequence[Sequence[Status]],
                    hit: int) -> bool:
    if hit == 0:
        return True
    for i, g in enumerate(cfg.groups):
        if g.is_draft:
            extra = cdiv(computed + hit, g.tokens_per_chunk)
            if extra >= len(hits[i]) or hits[i][extra] is not Status.HIT:
                return False
    return True


def reach_covered(cfg: OffloadConfig, computed: int, hits: Sequence[Sequence[Status]],
                  hit: int) -> bool:
    """Every token the window reaches back from T (and down to C) is in a hit chunk."""
    if hit == 0:
        return True
    boundary = computed + hit
    for i, g in enumerate(cfg.groups):
        if g.kind is not S:
            continue
        o = g.tokens_per_chunk
        for t in range(max(computed, boundary - g.reach_tokens), boundary):
            if t // o >= len(hits[i]) or hits[i][t // o] is not Status.HIT:
                return False
    return True


# -- obligations ----------------------------------------------------------------------------------


def hit_within_limit(layout: int, num_tokens: int, computed: int, bits: list[bool]) -> bool:
    """
    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 8
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits)
    return within_limit(cfg, c, n, spec_hit_fn(cfg, c, n, hits))


def hit_supported_by_every_group(layout: int, num_tokens: int, computed: int,
                                 bits: list[bool]) -> bool:
    """
    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 8
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits)
    return supported(cfg, c, hits, spec_hit_fn(cfg, c, n, hits))


def draft_never_serves_last_chunk(layout: int, num_tokens: int, computed: int,
                                  bits: list[bool]) -> bool:
    """
    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 8
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits)
    return draft_extra_hit(cfg, c, hits, spec_hit_fn(cfg, c, n, hits))


def window_reach_from_boundary(layout: int, num_tokens: int, computed: int,
                               bits: list[bool]) -> bool:
    """
    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 8
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits)
    return reach_covered(cfg, c, hits, spec_hit_fn(cfg, c, n, hits))


def miss_to_hit_never_lowers(layout: int, num_tokens: int, computed: int, bits: list[bool],
                             group: int, chunk: int) -> bool:
    """
    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 6
    pre: computed == 0
    pre: len(bits) == 16
    pre: 0 <= group < 2
    pre: 0 <= chunk < 6
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits, n_max=6, c_max=0)
    flip = (pick(group, 2), pick(chunk, 6))
    if flip[0] >= len(hits) or flip[1] >= len(hits[flip[0]]) or \
            hits[flip[0]][flip[1]] is Status.HIT:
        return True  # not a MISS: nothing turns into a HIT
    better = hit_maps(cfg, n, bits, PER_GROUP, flip)
    return spec_hit_fn(cfg, c, n, better) >= spec_hit_fn(cfg, c, n, hits)


def pending_only_when_it_matters(layout: int, num_tokens: int, computed: int,
                                 bits: list[bool], pending: list[bool],
                                 resolve: list[bool]) -> bool:
    """L2: the answer is PENDING exactly when the optimistic and pessimistic hits differ;
    every resolution of the PENDING keys lands between them; and an answer that is not
    PENDING is what every resolution gives (an unknown key that cannot change the hit
    does not defer the request).

    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 4
    pre: computed == 0
    pre: len(bits) == 16 and len(pending) == 16 and len(resolve) == 16
    post: __return__
    """
    return _l2(layout, num_tokens, computed, bits, pending, resolve, defer=True)


def _l2(layout: int, num_tokens: int, computed: int, bits: list[bool], pending: list[bool],
        resolve: list[bool], defer: bool) -> bool:
    cfg = LAYOUTS[pick(layout, len(LAYOUTS))]
    n = pick(num_tokens, L2_N_MAX + 1)
    c = pick(computed, 1)
    maps = hit_maps(cfg, n, bits, PER_GROUP, pending=pending)
    optimistic = hit_for(cfg, c, n, maps, Status.HIT)
    pessimistic = hit_for(cfg, c, n, maps, Status.MISS)
    answer = spec_hit(cfg, c, n, maps) if defer else optimistic
    resolved = hit_for(cfg, c, n, hit_maps(cfg, n, bits, PER_GROUP, pending=pending,
                                           resolve=resolve), Status.MISS)
    return (pessimistic <= resolved <= optimistic
            and (answer is PENDING) == (optimistic != pessimistic)
            and (answer is PENDING or resolved == answer))


# -- mutants: each must be refuted ----------------------------------------------------------------


def _brute_hit(cfg: OffloadConfig, computed: int, limit: int, hits: Sequence[Sequence[Status]],
               supports: Callable[[GroupSpec, Sequence[Status], int], bool],
               largest_first: bool = True) -> int:
    min_new = max(g.tokens_per_chunk for g in cfg.groups)
    order = range(limit, computed, -1) if largest_first else range(computed + 1, limit + 1)
    for boundary in order:
        if boundary - computed >= min_new and all(
                supports(g, hits[i], boundary) for i, g in enumerate(cfg.groups)):
            return boundary - computed
    return 0


def mutant_limit_ignores_windows(layout: int, num_tokens: int, computed: int,
                                 bits: list[bool]) -> bool:
    """The limit is always N: the last prompt token is not recomputed for window groups.

    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 8
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits)
    h = _brute_hit(cfg, c, n, hits,
                   lambda g, st, t: group_supports(g, st, t, c, Status.HIT))
    return within_limit(cfg, c, n, h)


def mutant_windows_not_reverified(layout: int, num_tokens: int, computed: int,
                                  bits: list[bool]) -> bool:
    """Each group answers once at the limit and the hit is the smallest answer: a window
    found at a larger boundary is not re-checked when another group shrinks it.

    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 8
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits)
    limit = lookup_limit(cfg, n)
    answers = []
    for i, g in enumerate(cfg.groups):
        best = 0
        for t in candidate_boundaries(cfg, c, limit):
            if group_supports(g, hits[i], t, c, Status.HIT):
                best = t - c
                break
        answers.append(best)
    h = min(answers)
    h = h if h >= max(g.tokens_per_chunk for g in cfg.groups) else 0
    return supported(cfg, c, hits, h)


def mutant_draft_not_widened(layout: int, num_tokens: int, computed: int,
                             bits: list[bool]) -> bool:
    """Draft groups looked up like any other (the pre-#44784 scheduler): no extra chunk.

    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 8
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits)
    plain = small_config(*(GroupSpec(g.kind, g.tokens_per_block, g.blocks_per_chunk,
                                     g.window_tokens) for g in cfg.groups))
    return draft_extra_hit(cfg, c, hits, spec_hit_fn(plain, c, n, hits))


def mutant_reach_from_chunk_end(layout: int, num_tokens: int, computed: int,
                                bits: list[bool]) -> bool:
    """A window needs only its last W chunks, measured from the chunk end, not from T.

    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 8
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits)

    def supports(g: GroupSpec, statuses: Sequence[Status], t: int) -> bool:
        if g.kind is not S:
            return group_supports(g, statuses, t, c, Status.HIT)
        o = g.tokens_per_chunk
        b = cdiv(t, o)
        lo = max(c // o, b - (g.window_chunks or 0))
        hi = b + g.extra_chunks
        return hi <= len(statuses) and all(s is Status.HIT for s in statuses[lo:hi])

    return reach_covered(cfg, c, hits, _brute_hit(cfg, c, lookup_limit(cfg, n), hits, supports))


def mutant_smallest_boundary(layout: int, num_tokens: int, computed: int, bits: list[bool],
                             group: int, chunk: int) -> bool:
    """The first supported boundary scanning up from C, not the largest: a new hit chunk
    can make a smaller boundary supported and lower the answer.

    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 6
    pre: computed == 0
    pre: len(bits) == 16
    pre: 0 <= group < 2
    pre: 0 <= chunk < 6
    post: __return__
    """
    cfg, n, c, hits = _case(layout, num_tokens, computed, bits, n_max=6, c_max=0)
    flip = (pick(group, 2), pick(chunk, 6))
    if flip[0] >= len(hits) or flip[1] >= len(hits[flip[0]]) or \
            hits[flip[0]][flip[1]] is Status.HIT:
        return True
    better = hit_maps(cfg, n, bits, PER_GROUP, flip)

    def smallest(h: Sequence[Sequence[Status]]) -> int:
        return _brute_hit(cfg, c, lookup_limit(cfg, n), h,
                          lambda g, st, t: group_supports(g, st, t, c, Status.HIT),
                          largest_first=False)

    return smallest(better) >= smallest(hits)


def mutant_pending_read_as_hit(layout: int, num_tokens: int, computed: int,
                               bits: list[bool], pending: list[bool],
                               resolve: list[bool]) -> bool:
    """PENDING keys are read as hits and the request is not deferred.

    pre: 0 <= layout < 8
    pre: 0 <= num_tokens <= 4
    pre: computed == 0
    pre: len(bits) == 16 and len(pending) == 16 and len(resolve) == 16
    post: __return__
    """
    return _l2(layout, num_tokens, computed, bits, pending, resolve, defer=False)


# Budgets in CPU seconds (CrossHair's --per_condition_timeout / --per_path_timeout).
OBLIGATIONS = (
    Obligation("hit_within_limit", CONFIRMED, 90, 10),
    Obligation("hit_supported_by_every_group", CONFIRMED, 90, 10),
    Obligation("draft_never_serves_last_chunk", CONFIRMED, 90, 10),
    Obligation("window_reach_from_boundary", CONFIRMED, 90, 10),
    Obligation("miss_to_hit_never_lowers", CONFIRMED, 120, 10),
    Obligation("pending_only_when_it_matters", CONFIRMED, 120, 10),
    Obligation("mutant_limit_ignores_windows", REFUTED, 30, 5, "hit_within_limit"),
    Obligation("mutant_windows_not_reverified", REFUTED, 30, 5, "hit_supported_by_every_group"),
    Obligation("mutant_draft_not_widened", REFUTED, 30, 5, "draft_never_serves_last_chunk"),
    Obligation("mutant_reach_from_chunk_end", REFUTED, 30, 5, "window_reach_from_boundary"),
    Obligation("mutant_smallest_boundary", REFUTED, 30, 5, "miss_to_hit_never_lowers"),
    Obligation("mutant_pending_read_as_hit", REFUTED, 30, 5, "pending_only_when_it_matters"),
)
# The most CPU seconds this file's obligations may take together (the sum of their
# per-condition budgets must fit); measured times are far lower (see proofs/README.md).
TOTAL_BUDGET_S = 780
