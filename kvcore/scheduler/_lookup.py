"""The lookup's convergence loop: the fast way to compute the spec's hit.

``spec.lookup.hit_for`` tests every candidate boundary; this loop instead asks each group
for the largest boundary it supports at or below the current one, shrinking the boundary
until every group agrees. Full-attention groups go first (one prefix scan each), then
window groups, largest window first. A group is re-verified when another group shrinks
the boundary below the one it was verified at, if its support can change with the
boundary (window groups) or it is a draft group (its extra chunk must sit just beyond the
boundary it serves, E3/E4). Each verification of a draft group requires exactly one
extra chunk: one pop per convergence cycle.

Why this equals the spec: the boundary ``M`` never drops below a boundary every group
supports (each group answers the largest one it supports at or below ``M``), and the loop
stops only when every group that could object has verified ``M`` itself; full-attention
support is downward closed, so earlier answers stay valid. Cost: each verification scans
only keys it has not ruled out, so a lookup touches O(keys in the verified ranges).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcore.scheduler._rules import lookup_limit, needed_chunks, window_reach, window_span
from kvcore.spec.errors import InvariantViolation
from kvcore.spec.invariants import TraceEntry, Violation
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, cdiv

# is_hit(group, chunk_index) -> bool; PENDING has already been read as HIT or MISS.
HitFn = Callable[[int, int], bool]


@dataclass(frozen=True)
class Convergence:
    """The loop's answer: the hit (0 for none) and the trace E3 checks."""

    hit: int
    trace: tuple[TraceEntry, ...]


def lookup_order(cfg: OffloadConfig) -> tuple[int, ...]:
    """FULL groups by index, then window groups, largest reach first.

    Full-attention prefix scans shrink the boundary cheaply and never need re-checking;
    wide windows are the most likely to shrink it, so they go before narrow ones.
    """
    full = [i for i, g in enumerate(cfg.groups) if g.kind is GroupKind.FULL]
    windows = [i for i, g in enumerate(cfg.groups) if g.kind is not GroupKind.FULL]
    windows.sort(key=lambda i: -reach_chunks(cfg.groups[i]) * cfg.groups[i].tokens_per_chunk)
    return tuple(full + windows)


def reach_chunks(g: GroupSpec) -> int:
    """Chunks a window group needs ending at an aligned boundary (before the draft extra)."""
    if g.kind is GroupKind.MAMBA:
        return 1
    span = window_span(g) if g.kind is GroupKind.SLIDING else 1
    return max(span, cdiv(window_reach(g), g.tokens_per_chunk))


def _needs_reverify(g: GroupSpec) -> bool:
    return g.kind is not GroupKind.FULL or g.is_draft


def _rightmost_miss(is_hit: HitFn, group: int, start: int, end: int) -> int | None:
    for idx in range(end - 1, start - 1, -1):
        if not is_hit(group, idx):
            return idx
    return None


def largest_supported(g: GroupSpec, group: int, bound: int, computed: int, num_keys: int,
                      is_hit: HitFn, extra: int) -> tuple[int, tuple[int, int]]:
    """(largest T <= bound with T > computed that group supports, or 0; the range read)."""
    o = g.tokens_per_chunk
    first = computed // o
    if g.kind is not GroupKind.MAMBA or bound % o == 0:
        rng = needed_chunks(g, bound, computed)
        if rng is not None:
            lo, hi = rng[0], rng[1] - g.extra_chunks + extra
            if hi <= num_keys:
                miss = _rightmost_miss(is_hit, group, lo, hi) if g.kind is not GroupKind.FULL \
                    else _first_miss(is_hit, group, lo, hi)
                if miss is None:
                    return bound, (lo, hi)
                if g.kind is GroupKind.FULL:
                    k = miss - extra
                    return (k * o if k * o > computed else 0), (lo, hi)
    if g.kind is GroupKind.FULL:
        return 0, (first, first)
    # Window groups: scan aligned boundaries k * o below ``bound`` from the right, jumping
    # past each miss; every key is read at most once.
    need = reach_chunks(g)
    k = min((bound - 1) // o, num_keys - extra)
    while k * o > computed:
        start, end = max(first, k - need), k + extra
        miss = _rightmost_miss(is_hit, group, start, end)
        if miss is None:
            return k * o, (start, end)
        k = miss - extra
    return 0, (first, first)


def _first_miss(is_hit: HitFn, group: int, start: int, end: int) -> int | None:
    for idx in range(start, end):
        if not is_hit(group, idx):
            return idx
    return None


def converge(cfg: OffloadConfig, computed: int, num_tokens: int, num_keys: Sequence[int],
             is_hit: HitFn, extra_chunks: Callable[[int, int], int] | None = None, *,
             max_tokens: int | None = None) -> Convergence:
    """Run the convergence loop; ``extra_chunks(group, verification_no)`` is the pop rule.

    The default pop rule is E3's: every verification of a draft group requires exactly one
    extra chunk. (The bug zoo swaps in broken rules to show the checks catch them.)
    ``max_tokens`` caps the hit: the loop starts at ``computed + max_tokens`` at most and,
    as always, only ever moves down to boundaries a group supports.
    """
    pops = extra_chunks or (lambda group, _n: cfg.groups[group].extra_chunks)
    min_new = max(g.tokens_per_chunk for g in cfg.groups)
    boundary = lookup_limit(cfg, num_tokens)
    if max_tokens is not None:
        boundary = min(boundary, computed + max_tokens)
    for i, g in enumerate(cfg.groups):
        boundary = min(boundary, max(num_keys[i] - g.extra_chunks, 0) * g.tokens_per_chunk)
    trace: list[TraceEntry] = []
    if boundary - computed < min_new:
        return Convergence(0, tuple(trace))
    order = lookup_order(cfg)
    verified_at: dict[int, int] = {}
    counts = dict.fromkeys(order, 0)
    pending = list(order)
    # Bound: every pass but the last strictly lowers the boundary by >= 1 token.
    for _ in range(boundary - computed + 2):
        for group in pending:
            extra = pops(group, counts[group])
            counts[group] += 1
            result, query = largest_supported(cfg.groups[group], group, boundary, computed,
                                              num_keys[group], is_hit, extra)
            trace.append(TraceEntry(group, boundary, query, result, extra))
            if result - computed < min_new:
                return Convergence(0, tuple(trace))
            boundary = result
            verified_at[group] = boundary
        pending = [g for g in order if verified_at[g] > boundary
                   and _needs_reverify(cfg.groups[g])]
        if not pending:
            return Convergence(boundary - computed, tuple(trace))
    raise InvariantViolation([Violation("E3", "lookup convergence loop exceeded its bound",
                                        {"computed": computed, "num_tokens": num_tokens})])
