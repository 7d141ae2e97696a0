"""The hit: how many tokens a request may load, defined by brute force over boundaries.

This is the reference definition (docs/semantics.md, "Lookup"). It is written to be obviously
correct, not fast: the implementation's convergence loop must return the same value.

A boundary T (tokens) is *supported* by group g when every key the group needs to resume
computation at T is a hit. With ``o`` the group's tokens_per_chunk, ``b = cdiv(T, o)`` the
chunks covering T, and ``e`` 1 for a draft group:

- FULL needs chunks ``[C // o, b + e)``;
- SLIDING needs chunks from ``max(C // o, min(b - W, (T - R) // o))``: the window reaches
  back R tokens from T itself, so an unaligned T can need one chunk more than W;
- MAMBA needs T on a chunk end and chunks ``[max(C // o, b - 1), b + e)``.

A draft group needs one hit chunk beyond the boundary (E4) because its last chunk was
rewritten by the drafter after it was stored; that chunk is verified but never served.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.spec.types import (
    PENDING,
    GroupKind,
    GroupSpec,
    LookupResult,
    OffloadConfig,
    Status,
    assert_int,
    cdiv,
)

# Per group, the status of each of the request's complete chunks, in order.
HitMap = Sequence[Sequence[Status]]


def lookup_limit(cfg: OffloadConfig, num_tokens: int) -> int:
    """The largest boundary a lookup may return.

    With a SLIDING or MAMBA group the last prompt token is always recomputed (its logits are
    needed and a window cannot be resumed past it); MAMBA state exists only at chunk ends.
    """
    limit = num_tokens - 1 if cfg.has_window_groups else num_tokens
    align = cfg.mamba_align_tokens
    if align is not None:
        limit -= limit % align
    return max(limit, 0)


def needed_chunks(g: GroupSpec, boundary: int, computed: int) -> tuple[int, int] | None:
    """``[lo, hi)``: the chunks group ``g`` must hit to support ``boundary``; None if it cannot.

    ``hi`` includes a draft group's extra chunk. None means the boundary is impossible for
    the group whatever the hit map (a MAMBA boundary off a chunk end).
    """
    o = g.tokens_per_chunk
    b = cdiv(boundary, o)
    first_needed = computed // o
    if g.kind is GroupKind.FULL:
        lo = first_needed
    elif g.kind is GroupKind.SLIDING:
        window = g.window_chunks
        assert_int(window)
        reach = min(b - window, (boundary - g.reach_tokens) // o)  # type: ignore[operator]
        lo = max(first_needed, reach)
    else:
        if boundary % o != 0:
            return None
        lo = max(first_needed, b - 1)
    return lo, b + g.extra_chunks


def served_chunks(g: GroupSpec, boundary: int, computed: int) -> tuple[int, int] | None:
    """The chunks a load at ``boundary`` may read: the needed ones minus the draft extra."""
    rng = needed_chunks(g, boundary, computed)
    if rng is None:
        return None
    return rng[0], rng[1] - g.extra_chunks


def group_supports(
    g: GroupSpec, statuses: Sequence[Status], boundary: int, computed: int, pending_as: Status
) -> bool:
    """True iff every needed chunk exists and is a hit (PENDING read as ``pending_as``)."""
    rng = needed_chunks(g, boundary, computed)
    if rng is None:
        return False
    lo, hi = rng
    if hi > len(statuses):
        return False
    for idx in range(lo, hi):
        status = statuses[idx]
        effective = pending_as if status is Status.PENDING else status
        if effective is not Status.HIT:
            return False
    return True


def candidate_boundaries(cfg: OffloadConfig, computed: int, limit: int) -> list[int]:
    """Boundaries worth testing, largest first: the limit and every chunk end below it.

    Between two consecutive chunk ends (of any group) every group's ``b`` is fixed, FULL
    support does not change, SLIDING support can only grow with T (its reach moves right)
    and MAMBA needs a chunk end; so the largest supported T of each such interval is its
    right end or the limit. Testing only these is exhaustive.
    """
    points = {limit}
    for g in cfg.groups:
        o = g.tokens_per_chunk
        points.update(range(o * (computed // o + 1), limit + 1, o))
    return sorted((t for t in points if computed < t <= limit), reverse=True)


def capped_limit(cfg: OffloadConfig, computed: int, num_tokens: int,
                 max_tokens: int | None) -> int:
    """The lookup limit, lowered to ``computed + max_tokens`` when the engine caps the hit.

    The cap only lowers the largest boundary tested: the hit is then the largest
    *supported* boundary at or below it, never a supported one above it cut down to an
    unsupported one (a window or Mamba group may support none in between).
    """
    limit = lookup_limit(cfg, num_tokens)
    return limit if max_tokens is None else min(limit, computed + max_tokens)


def hit_for(cfg: OffloadConfig, computed: int, num_tokens: int, hits: HitMap,
            pending_as: Status, *, max_tokens: int | None = None) -> int:
    """The largest ``T - C`` with every group supporting T and ``T - C >= o`` for all groups.

    ``max_tokens`` caps ``T - C`` (the engine's "load at most this many tokens").
    """
    min_new = max(g.tokens_per_chunk for g in cfg.groups)
    limit = capped_limit(cfg, computed, num_tokens, max_tokens)
    for boundary in candidate_boundaries(cfg, computed, limit):
        if boundary - computed < min_new:
            break
        if all(group_supports(g, hits[i], boundary, computed, pending_as)
               for i, g in enumerate(cfg.groups)):
            return boundary - computed
    return 0


def served_keys_loading(cfg: OffloadConfig, computed: int, hit: int,
                        loading: Sequence[frozenset[int]]) -> bool:
    """True iff another request is loading a chunk this hit would read (so: wait)."""
    for i, g in enumerate(cfg.groups):
        rng = served_chunks(g, computed + hit, computed)
        if rng is not None and any(idx in loading[i] for idx in range(*rng)):
            return True
    return False


def spec_hit(cfg: OffloadConfig, computed: int, num_tokens: int, hits: HitMap,
             loading: Sequence[frozenset[int]] | None = None, *,
             max_tokens: int | None = None) -> LookupResult:
    """The lookup answer: the hit, 0, or PENDING (L1, L2).

    PENDING is decided on the whole lookup: the hit is computed with PENDING read as HIT and
    as MISS; if the answers differ the request must ask again, if they agree an unknown key
    could not change the answer and the request is not deferred. ``max_tokens`` caps the
    hit (see ``capped_limit``).
    """
    optimistic = hit_for(cfg, computed, num_tokens, hits, Status.HIT, max_tokens=max_tokens)
    pessimistic = hit_for(cfg, computed, num_tokens, hits, Status.MISS, max_tokens=max_tokens)
    if optimistic != pessimistic:
        return PENDING
    if optimistic > 0 and loading is not None and served_keys_loading(
            cfg, computed, optimistic, loading):
        return PENDING
    return optimistic


def read_at_segment_end(cfg: OffloadConfig, group: int, chunk: int) -> bool:
    """The spec's keep rule: False only for a SLIDING chunk no segment-end lookup reads.

    With exactly one FULL chunk size ``A`` (a multiple of the group's chunk ``o``, and of
    the MAMBA chunk if any), a fully stored prefix is found again at a *segment end*:
    ``kA``, ``kA - 1`` (the N - 1 limit) or ``kA - 1`` rounded down to a MAMBA chunk end.
    A SLIDING chunk is worth storing iff some lookup at such a boundary reads it
    (``needed_chunks``, the draft extra chunk included). The rule is the same in every
    segment, so it is decided on the chunk at the same offset of a segment far from token
    0, where no range is clipped by the start of the request. Outside that set-up (store
    alignment off, no single FULL chunk size, ...) every chunk is kept.
    """
    g = cfg.groups[group]
    fulls = {x.tokens_per_chunk for x in cfg.groups if x.kind is GroupKind.FULL}
    if not cfg.store_alignment or g.kind is not GroupKind.SLIDING or len(fulls) != 1:
        return True
    (seg,) = fulls
    o, mamba = g.tokens_per_chunk, cfg.mamba_align_tokens
    if seg <= o or seg % o or (mamba is not None and seg % mamba):
        return True
    # A chunk at the same offset, far enough from 0 that no lookup range touching it is
    # clipped: a lookup reads at most W + cdiv(R, o) + 2 chunks behind its boundary.
    span = (g.window_chunks or 1) + cdiv(max(g.reach_tokens, 0), o) + 2
    far = chunk % (seg // o) + (seg // o) * (cdiv(span * o, seg) + 2)
    for k in range(max(1, (far - 2) * o // seg), (far + span + 1) * o // seg + 3):
        ends = {k * seg, k * seg - 1}
        if mamba is not None:
            ends.add((k * seg - 1) // mamba * mamba)
        for boundary in ends:
            rng = needed_chunks(g, boundary, 0)
            if rng is not None and rng[0] <= far < rng[1]:
                return True
    return False
