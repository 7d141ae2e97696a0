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
from typing import Any

from kvcore.scheduler._rules import lookup_limit, needed_chunks, window_reach, window_span
from kvcore.scheduler._state import GroupKeys
from kvcore.spec.errors import BadReportError, InvariantViolation
from kvcore.spec.invariants import TraceEntry, Violation
from kvcore.spec.types import GroupKind, GroupSpec, Key, OffloadConfig, Status, cdiv

# is_hit(group, chunk_index) -> bool; PENDING has already been read as HIT or MISS.
HitFn = Callable[[int, int], bool]


# Keys asked of the tier per call: the loop reads keys one at a time, but each read pulls
# the aligned block around it, so a 8,192-key prefix costs 128 calls, not 8,192. A FULL
# group is scanned from its start to the first miss, so its blocks are larger (16 calls
# for 8,192 keys; a miss wastes at most 511 reads, about 50 us); a window group reads a
# few chunks around each boundary it verifies, so its blocks stay small.
READ_BLOCK = 64
FULL_READ_BLOCK = 512


def read_blocks(cfg: OffloadConfig) -> tuple[int, ...]:
    """Per group, the keys one tier call reads (``StatusReader``'s block sizes)."""
    return tuple(FULL_READ_BLOCK if g.kind is GroupKind.FULL else READ_BLOCK
                 for g in cfg.groups)


def mixed(statuses: Sequence[Status | None]) -> bool:
    """Whether a non-empty block holds more than one status.

    A block of a long prompt is one status throughout (all HIT, or all MISS past the
    stored prefix). ``count`` of the first element matches the others by identity, about
    1 ns each, while ``in`` or ``index`` for a status that is absent compares every
    element through the enum's equality, about 18 ns each: three such scans a 512-key
    block were a third of a 128K Llama lookup (0.45 of 1.3 ms).
    """
    return statuses.count(statuses[0]) != len(statuses)


class StatusReader:
    """One lookup's view of the tier: each key's status, read in blocks and kept.

    Statuses cannot change during a lookup (nothing else runs), so a key read twice (by
    both runs, or by two verifications) is asked once. A block may read a few keys the
    loop never needs; reads are pure (recency changes only with ``touch``). A tier
    without ``lookup_many`` is asked key by key. ``known[g][i]`` is None until read: one
    list slot per key of the request (8 bytes, for the lookup's duration only). The keys
    each block derived are kept too, for the touch that follows (``keys``): the same
    objects, their hashes already computed, instead of deriving them again.
    """

    __slots__ = ("_by_hash", "_derived", "_keys", "_many", "blocks", "known", "pending")

    def __init__(self, keys: Sequence[GroupKeys], manager: Any, blocks: Sequence[int],
                 by_hash: bool) -> None:
        self._keys = keys
        self.blocks = blocks  # per group, the keys read per call (READ_BLOCK, FULL_READ_BLOCK)
        many = getattr(manager, "lookup_many", None)
        self._many: Callable[[list[Key]], Sequence[Status]] = (
            many if many is not None else lambda ks: [manager.lookup(k) for k in ks])
        # ``by_hash``: the tier takes a group's keys as hashes and the group's suffix
        # (``lookup_hashes``; the scheduler decides, kvcore's tier does): no key object is
        # made for a probe, and ``_derived`` holds the hashes read, for ``touch_hashes``.
        self._by_hash: Callable[[list[bytes], bytes], Sequence[Status]] | None = (
            manager.lookup_hashes if by_hash else None)
        self.known: list[list[Status | None]] = [[None] * len(k) for k in keys]
        # block start -> what was read there: keys, or hashes when ``by_hash``
        self._derived: list[dict[int, list[bytes]]] = [{} for _ in keys]
        self.pending = False  # whether any key read is PENDING

    @property
    def by_hash(self) -> bool:
        """Whether the blocks read were hashes (``items`` then answers hashes)."""
        return self._by_hash is not None

    def _fetch(self, group: int, idx: int) -> None:
        size = self.blocks[group]
        lo = idx - idx % size
        hi = min(lo + size, len(self.known[group]))
        keys = self._keys[group]
        if self._by_hash is not None:
            items = keys.chunk_hashes(lo, hi)
            got = list(self._by_hash(list(items), keys.suffix))
        else:
            items = keys[lo:hi]
            got = list(self._many(list(items)))  # the tier gets its own list: ours is reused
        if len(got) != hi - lo:
            call = "lookup_hashes" if self._by_hash is not None else "lookup_many"
            raise BadReportError(f"the tier's {call} answered {len(got)} statuses "
                                 f"for {hi - lo} keys; it must answer one per key, in order")
        self.known[group][lo:hi] = got
        self._derived[group][lo] = items
        if not self.pending:
            self.pending = Status.PENDING in got if mixed(got) else got[0] is Status.PENDING

    def status(self, group: int, idx: int) -> Status:
        s = self.known[group][idx]
        if s is None:
            self._fetch(group, idx)
            s = self.known[group][idx]
        return s  # type: ignore[return-value]

    def block(self, group: int, lo: int, hi: int) -> list[Status | None]:
        """Statuses of chunks ``[lo, hi)``, inside one aligned block (read if not yet)."""
        known = self.known[group]
        if known[lo] is None:
            self._fetch(group, lo)
        return known[lo:hi]

    def saw_pending(self) -> bool:
        return self.pending

    def items(self, group: int, lo: int, hi: int) -> list[bytes]:
        """Chunks ``[lo, hi)`` of ``group`` as this lookup read them (keys, or hashes when
        ``by_hash``): the blocks read, reused, and the rest derived now."""
        size, derived, keys = self.blocks[group], self._derived[group], self._keys[group]
        hi = min(hi, len(self.known[group]))
        out: list[bytes] = []
        # One pass per aligned block, by a range: no slip in the body can turn a lookup
        # into a hang.
        for start in range(lo - lo % size, hi, size) if lo < hi else ():
            at, stop = max(lo, start), min(start + size, hi)
            block = derived.get(start)
            if block is not None:
                out.extend(block[at - start:stop - start])
            else:
                out.extend(keys.chunk_hashes(at, stop) if self._by_hash is not None
                           else keys[at:stop])
        return out


class Smaller(Exception):
    """Raised inside the pessimistic run once its hit must be smaller than the optimistic."""


class HitTest:
    """``is_hit`` for one run of the loop: PENDING read as HIT (the optimistic run) or as
    MISS (the pessimistic one). ``floor[g]``: a read of group ``g`` below it raises
    ``Smaller`` (see ``OffloadScheduler._lookup_hit``). ``first_miss`` answers a FULL
    prefix scan a block at a time, in C, instead of one call per key."""

    __slots__ = ("_floor", "_ok", "_reader")

    def __init__(self, reader: StatusReader, pending_is_hit: bool,
                 floor: Sequence[int] | None = None) -> None:
        self._reader = reader
        self._ok = (Status.HIT, Status.PENDING) if pending_is_hit else (Status.HIT,)
        self._floor = floor

    def __call__(self, group: int, idx: int) -> bool:
        if self._floor is not None and idx < self._floor[group]:
            raise Smaller
        return self._reader.status(group, idx) in self._ok

    def first_miss(self, group: int, start: int, end: int) -> int | None:
        """The first ``idx`` in ``[start, end)`` that is not a hit, or None (the same keys
        read, in the same order, as calling the test on each)."""
        if start < end and self._floor is not None and start < self._floor[group]:
            raise Smaller
        bad = [s for s in (Status.MISS, Status.PENDING) if s not in self._ok]
        size = self._reader.blocks[group]
        # One pass per aligned block, by a range (as ``items``).
        for base in range(start - start % size, end, size) if start < end else ():
            at, stop = max(start, base), min(base + size, end)
            statuses = self._reader.block(group, at, stop)
            if not mixed(statuses):  # one status throughout: the first says it all
                if statuses[0] in bad:
                    return at
                continue
            found = [statuses.index(b) for b in bad if b in statuses]
            if found:
                return at + min(found)
        return None


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
    # Each pass moves k down by one at least (a miss lies below k + extra), so k + 1
    # passes end the scan; a slip that stops moving it is E3, not a hang.
    for _ in range(max(k, 0) + 1):
        if k * o <= computed:
            return 0, (first, first)
        start, end = max(first, k - need), k + extra
        miss = _rightmost_miss(is_hit, group, start, end)
        if miss is None:
            return k * o, (start, end)
        k = miss - extra
    raise InvariantViolation([Violation("E3", "a window group's boundary scan exceeded "
                                        "its bound", {"group": group, "bound": bound})])


def _first_miss(is_hit: HitFn, group: int, start: int, end: int) -> int | None:
    fast = getattr(is_hit, "first_miss", None)
    if fast is not None:
        return fast(group, start, end)  # type: ignore[no-any-return]
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
