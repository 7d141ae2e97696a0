"""kvcore's own store, load and lookup-range rules (docs/semantics.md, "Store", "Load", "Lookup").

These are the implementation's rules. ``kvcore.spec`` keeps an independent reference
written from the same semantics (``kvcore.spec.model``) and the invariant predicates;
the two share types and errors only, so a bug here cannot hide by also being in the
reference the lock step compares against.

Store: per step the write frontier is ``V = min(computed + scheduled, num_tokens)`` and
the storable prefix ``U = min(V, max_offload_tokens, prompt_len if prompt_only)``. Chunks
``[cursor, end)`` are candidates, ``end = U // o`` and, for a draft group, at most
``V // o - 1`` (E1). The cursor moves to ``end`` and never further (E2: no holes). A
candidate whose GPU blocks include a null is skipped, and for SLIDING groups so is a chunk
no lookup at a segment end can read.

Load: for boundary ``T = C + hit`` the blocks to fill run from the first unfilled one to
``cdiv(T, tokens_per_block)``; every chunk loaded must lie inside the range the lookup
verified (L1), else the table and the config disagree and that is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcore.spec.errors import BlockTableError, ConfigError
from kvcore.spec.invariants import Skip
from kvcore.spec.types import (
    GroupKind,
    GroupSpec,
    KeptOffsets,
    OffloadConfig,
    assert_int,
    cdiv,
)

# -- lookup ranges ----------------------------------------------------------------------
# The window sizes are derived here from the config's fields, not read from the spec's
# derived properties, so a slip in one of those is a difference the lock step can see.

def window_reach(g: GroupSpec) -> int:
    """Tokens before a boundary that a window group's state there still depends on: its
    window less the boundary token itself, plus what the engine retains beyond it."""
    return (g.window_tokens or 0) - 1 + g.extra_retained_tokens


def window_span(g: GroupSpec) -> int:
    """Whole chunks a SLIDING window covers at a chunk-aligned boundary."""
    assert_int(g.window_tokens)
    return -(-g.window_tokens // g.tokens_per_chunk)  # type: ignore[operator]


def mamba_chunk(cfg: OffloadConfig) -> int | None:
    """The Mamba groups' chunk (config validation makes them share one), or None."""
    for g in cfg.groups:
        if g.kind is GroupKind.MAMBA:
            return g.tokens_per_chunk
    return None


def lookup_limit(cfg: OffloadConfig, num_tokens: int) -> int:
    """The largest boundary a lookup may return.

    A window or Mamba group cannot resume past the last prompt token (its logits must be
    computed, and its state cannot be rebuilt from blocks), so that token is recomputed;
    Mamba state is saved only where a Mamba chunk ends, so the boundary drops to one.
    Written in tokens here; the reference (``spec.lookup``) states the same rule its own way.
    """
    top = num_tokens
    for g in cfg.groups:
        if g.kind is not GroupKind.FULL:
            top = num_tokens - 1
    mamba = mamba_chunk(cfg)
    if mamba:
        top = top // mamba * mamba
    return top if top > 0 else 0


def needed_chunks(g: GroupSpec, boundary: int, computed: int) -> tuple[int, int] | None:
    """``[lo, hi)``: the chunks group ``g`` must hit to support ``boundary``; None if it cannot.

    Derived from the first token the group's state at ``boundary`` depends on: FULL needs
    everything not already computed; SLIDING the last ``window_reach`` tokens, and at least
    the ``window_span`` chunks up to the boundary's; MAMBA the one chunk ending exactly at
    the boundary (None off a chunk end). A draft group also needs one chunk past the end.
    """
    o = g.tokens_per_chunk
    end = -(-boundary // o)
    if g.kind is GroupKind.FULL:
        first_token = computed
    elif g.kind is GroupKind.MAMBA:
        if boundary % o:
            return None
        first_token = boundary - o
    else:
        first_token = min((end - window_span(g)) * o, boundary - window_reach(g))
    lo = max(first_token, computed) // o
    return lo, end + (1 if g.is_draft else 0)


def served_chunks(g: GroupSpec, boundary: int, computed: int) -> tuple[int, int] | None:
    """The chunks a load at ``boundary`` may read: the needed ones, but never the draft
    group's chunk past the end (a draft's last chunk is volatile)."""
    rng = needed_chunks(g, boundary, computed)
    if rng is None:
        return None
    lo, hi = rng
    return lo, hi - 1 if g.is_draft else hi


# -- store ------------------------------------------------------------------------------

@dataclass(slots=True)
class GroupOffer:
    """One group's candidates this step: offered chunk indices and the skipped ones.

    Not frozen: one is built per group per storing request per step, and a frozen
    dataclass pays ``object.__setattr__`` per field; nothing mutates one once returned.
    """

    old_cursor: int
    new_cursor: int
    offered: tuple[int, ...] = ()
    skipped: dict[int, Skip] = field(default_factory=dict)


def storable_prefix(cfg: OffloadConfig, frontier: int, prompt_tokens: int,
                    request_max_tokens: int | None) -> int:
    """U: the tokens whose chunks may be stored this step."""
    limit = frontier
    if cfg.max_offload_tokens is not None:
        limit = min(limit, cfg.max_offload_tokens)
    if request_max_tokens is not None:
        limit = min(limit, request_max_tokens)
    if cfg.prompt_only:
        limit = min(limit, prompt_tokens)
    return max(limit, 0)


def store_end(cfg: OffloadConfig, group: int, frontier: int, storable: int) -> int:
    """The first chunk index not yet storable for ``group``."""
    g = cfg.groups[group]
    o = g.tokens_per_chunk
    end = storable // o
    if g.is_draft:
        end = min(end, max(frontier // o - 1, 0))
    return end


_KEEP_CACHE: dict[tuple[int, int], tuple[OffloadConfig, tuple[int, KeptOffsets] | None]] = {}
_KEEP_CACHE_LIMIT = 256


def keep_rule(cfg: OffloadConfig, group: int) -> tuple[int, KeptOffsets] | None:
    """(a, kept offsets) for a SLIDING group, or None: every chunk is kept (``_keep_rule``).

    Cached by the config's identity (the config is frozen), never by hashing it: a
    CrossHair obligation hands in configs of symbolic ints, and hashing would make it
    realize them. The entry holds the config, so its id cannot be reused while cached.
    """
    g = cfg.groups[group]
    if not cfg.store_alignment or g.kind is not GroupKind.SLIDING:
        return None
    hit = _KEEP_CACHE.get((id(cfg), group))
    if hit is not None and hit[0] is cfg:
        return hit[1]
    if len(_KEEP_CACHE) >= _KEEP_CACHE_LIMIT:
        _KEEP_CACHE.clear()
    rule = _keep_rule(cfg, group)
    _KEEP_CACHE[(id(cfg), group)] = (cfg, rule)
    return rule


def _keep_rule(cfg: OffloadConfig, group: int) -> tuple[int, KeptOffsets] | None:
    """(a, kept offsets): the store-skip period of a SLIDING group and what it keeps.

    With exactly one full-attention chunk size A, a fully stored prefix is found again at
    a segment end (a multiple of A, or one token before it under the N - 1 limit), so
    inside each segment of ``a = A / o`` chunks only those a lookup at such a boundary
    reads are worth storing: the chunks ``needed_chunks`` names at ``kA - 1``, ``kA`` and
    (with Mamba groups) ``kA - 1`` rounded down to a Mamba chunk end, for a segment far
    enough from 0 that nothing is clipped; they repeat every segment. None (keep every
    chunk) when MAMBA state exists only at ends that are not segment ends, or when the
    kept offsets fill the segment. Only ``keep_rule`` calls it, for a SLIDING group with
    alignment on (that test is made once, there: a second copy here made the first one
    untestable).

    For a draft group the kept chunks include the first chunk of the next segment (its
    extra chunk), and for an engine that keeps ``extra_retained_tokens`` they reach
    further back. Keeping "the segment's last W + 1" instead, as upstream's fix for
    #53951 does, stores a chunk no lookup reads and never the extra chunk a draft lookup
    needs. The trade-off is deliberate: a hit is rounded down to a segment end, so a
    request whose draft tail keeps the last segment end out of reach is served one
    segment less.
    """
    g = cfg.groups[group]
    full_sizes = {x.tokens_per_chunk for x in cfg.groups if x.kind is GroupKind.FULL}
    if len(full_sizes) != 1:
        return None
    (a_tokens,) = full_sizes
    o = g.tokens_per_chunk
    mamba = mamba_chunk(cfg)
    if a_tokens <= o or a_tokens % o != 0 or (mamba is not None and a_tokens % mamba):
        return None
    a = a_tokens // o
    k = cdiv(window_reach(g), a_tokens) + 2
    ends = [k * a_tokens - 1, k * a_tokens]
    if mamba is not None:
        # Under the N - 1 limit, Mamba rounds the boundary down to its own chunk end.
        ends.append(ends[0] - ends[0] % mamba)
    # Each needed range becomes one or two spans modulo ``a``, so the cost is the same for
    # a 128-token window and a 16M-token one (no loop over the window's chunks). Always two
    # spans, the wrapped part empty (``stop - a <= 0``) when the range fits the segment:
    # ``KeptOffsets.of`` drops empty spans, and a branch here would have a boundary (the
    # range ending exactly at ``a``) where both arms agree, which no test can tell apart.
    spans: list[tuple[int, int]] = []
    for boundary in ends:
        rng = needed_chunks(g, boundary, 0)
        if rng is None:
            continue
        lo, hi = rng
        if hi - lo >= a:
            return None  # this range alone covers every offset
        start = lo % a
        stop = start + (hi - lo)
        spans.extend([(start, min(stop, a)), (0, stop - a)])
    kept = KeptOffsets.of(a, spans)
    if len(kept) >= a:
        return None
    return a, kept


def group_offer(cfg: OffloadConfig, group: int, cursor: int, frontier: int, storable: int,
                table: Sequence[int]) -> GroupOffer:
    """Candidates of one group: each chunk is offered, or skipped with a reason."""
    end = store_end(cfg, group, frontier, storable)
    if end <= cursor:
        return GroupOffer(cursor, cursor)
    bpc = cfg.groups[group].blocks_per_chunk
    rule = keep_rule(cfg, group)
    offered: list[int] = []
    skipped: dict[int, Skip] = {}
    if end * bpc > len(table):  # checked once for the range, not per chunk
        bad = max(cursor, len(table) // bpc)
        raise ValueError(f"group {group}: block table has {len(table)} blocks, chunk "
                         f"{bad} needs position {bad * bpc + bpc - 1}; pass every allocated "
                         "block")
    for chunk in range(cursor, end):
        if 0 in table[chunk * bpc:chunk * bpc + bpc]:
            # Only whole chunks are stored: a chunk with a null sub-block (outside the
            # window, or a stale block that was zeroed) would leave CPU bytes unwritten
            # that a later load starting mid-chunk reads.
            skipped[chunk] = Skip.NULL
        elif rule is not None and chunk % rule[0] not in rule[1]:
            skipped[chunk] = Skip.UNREACHABLE
        else:
            offered.append(chunk)
    return GroupOffer(cursor, end, tuple(offered), skipped)


StoreShape = tuple[tuple[int, bool, "tuple[int, KeptOffsets] | None"], ...]


def store_shape(cfg: OffloadConfig) -> StoreShape:
    """Per group (tokens per chunk, draft, keep rule): what ``quiet_cursors`` reads, built
    once per scheduler (the config is frozen)."""
    return tuple((g.tokens_per_chunk, g.is_draft, keep_rule(cfg, i))
                 for i, g in enumerate(cfg.groups))


def quiet_cursors(shape: StoreShape, cursors: Sequence[int], frontier: int,
                  storable: int, busy: list[int] | None = None) -> list[int] | None:
    """The cursors after a step in which no group has a chunk to offer, else None.

    Most decode steps of a layout with small window chunks (DeepSeek-V4's 4-token
    compressor state) complete a chunk the keep rule skips: ``group_offer`` would offer
    nothing and move the cursor to the store end. This answers that without building
    offers, in O(groups + chunks passed), under a segment per group; None (some group has
    a chunk it could offer, or passes a whole segment) sends the caller down the full
    path, which also judges null blocks. The draft cap repeats ``store_end``'s (read from
    the precomputed shape, not the config); ``tests/unit/test_quiet_cursors.py`` holds
    the two to the same answers.

    With a ``busy`` list, such a group is appended to it and keeps its cursor in the
    answer instead of ending the scan, so that the caller runs the full offer for the
    busy groups alone (``draft_store``'s ``quiet``): a DeepSeek-V4 decode store has one
    group to offer and two more whose chunks the keep rule skips.
    """
    moved = list(cursors)
    for group, (tokens, draft, rule) in enumerate(shape):
        end = storable // tokens
        if draft:
            end = min(end, max(frontier // tokens - 1, 0))
        cursor = moved[group]
        if end <= cursor:
            continue
        if rule is not None and end - cursor < rule[0]:
            period, kept = rule
            for chunk in range(cursor, end):
                if chunk % period in kept:
                    break
            else:
                moved[group] = end
                continue
        if busy is None:
            return None
        busy.append(group)
    return moved


def chunk_source_blocks(table: Sequence[int], chunk: int, blocks_per_chunk: int
                        ) -> tuple[int, tuple[int, ...]]:
    """(first position, ids) of a chunk's GPU blocks.

    Stores offer only whole chunks (``group_offer`` skips a chunk with any null block),
    so the ids are taken as they are: a null id here would be a bug of the offer, and B1
    names it on the plan. (An earlier version skipped leading nulls to stay total for any
    table; no caller could reach that branch, so no check could tell it was wrong.)
    """
    start = chunk * blocks_per_chunk
    return start, tuple(table[start:start + blocks_per_chunk])


# -- load -------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupLoad:
    """One group's share of a load: chunks ``[first_chunk, end_chunk)`` into these blocks."""

    first_chunk: int
    end_chunk: int
    block_index: int
    gpu_block_ids: tuple[int, ...]


def first_unfilled(table: Sequence[int], valid_blocks: int, end: int) -> int:
    """Index of the first real (non-null) block at or after ``valid_blocks``, else ``end``."""
    for i in range(valid_blocks, end):
        if table[i] != 0:
            return i
    return end


def group_load(cfg: OffloadConfig, group: int, computed: int, hit: int,
               table: Sequence[int], valid_blocks: int) -> GroupLoad:
    """The load of one group for boundary ``computed + hit``; raises on a bad table."""
    g = cfg.groups[group]
    boundary = computed + hit
    end = cdiv(boundary, g.tokens_per_block)
    if len(table) < end:
        raise BlockTableError(f"group {group}: block table has {len(table)} blocks but "
                              f"{end} are needed to load up to token {boundary}")
    start = first_unfilled(table, valid_blocks, end)
    if start == end:
        return GroupLoad(0, 0, 0, ())
    ids = tuple(table[start:end])
    if 0 in ids:
        raise BlockTableError(f"group {group}: null block inside the load range "
                              f"[{start}, {end}) of the block table")
    first_chunk = start // g.blocks_per_chunk
    end_chunk = cdiv(boundary, g.tokens_per_chunk)
    served = served_chunks(g, boundary, computed)
    if served is None or first_chunk < served[0] or end_chunk > served[1]:
        lo = served[0] if served else end_chunk
        raise ConfigError(
            f"groups[{group}].extra_retained_tokens",
            f"the block table of group {group} ({g.kind.name}) asks to load chunk "
            f"{first_chunk}, but the lookup verified chunks from {lo} only; if the engine "
            "keeps more than window_tokens before the boundary, set extra_retained_tokens")
    return GroupLoad(first_chunk, end_chunk, start, ids)


def load_plan(cfg: OffloadConfig, computed: int, hit: int,
              tables: Sequence[Sequence[int]], valid_blocks: Sequence[int]) -> list[GroupLoad]:
    """Every group's load for the hit (the reference for the scheduler's after-alloc hook)."""
    if len(tables) != len(cfg.groups) or len(valid_blocks) != len(cfg.groups):
        raise BlockTableError(f"expected {len(cfg.groups)} block tables and valid counts, "
                              f"got {len(tables)} and {len(valid_blocks)}")
    return [group_load(cfg, i, computed, hit, tables[i], valid_blocks[i])
            for i in range(len(cfg.groups))]
