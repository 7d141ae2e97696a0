"""The store plan: which chunks a request offers to the CPU tier at each step.

Per step the write frontier is ``V = min(computed + scheduled, num_tokens)`` (tokens whose
KV exists after the step) and the storable prefix ``U = min(V, max_offload_tokens,
prompt_len if prompt_only)``. Chunks ``[cursor, end)`` are candidates, where ``end`` is
``U // o`` and, for a draft group, at most ``V // o - 1``: the chunk at the frontier is
rewritten by the drafter every step (E1). The cursor moves to ``end`` and never further, so
a held-back chunk is offered once the frontier moves on (E2: no holes).

A candidate is skipped, not offered, when its last GPU block is null (window/Mamba padding
or a stale block the engine re-allocated) or, for SLIDING groups with an alignment period
``a``, when no lookup can read it: only the W + e chunks around each segment end are kept
(``chunk_reachable``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcore.spec.types import OffloadConfig


class Skip(enum.Enum):
    """Why the cursor may pass a chunk without offering it."""

    NULL = "null"
    UNREACHABLE = "unreachable"
    HIT = "hit"


@dataclass(frozen=True)
class GroupOffer:
    """One group's candidates this step: offered chunk indices and the skipped ones."""

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


def chunk_reachable(cfg: OffloadConfig, group: int, chunk: int) -> bool:
    """False for a SLIDING chunk no lookup at a segment end can read.

    The kept chunks are derived from the lookup rule (``OffloadConfig.kept_offsets``):
    for a draft group they include the first chunk of the next segment (its extra chunk),
    and for an engine that keeps ``extra_retained_tokens`` they reach further back.
    Keeping "the segment's last W + 1" instead, as upstream's fix for #53951 does,
    stores a chunk no lookup reads and never the extra chunk a draft lookup needs.
    The trade-off is deliberate: a hit is rounded down to a segment end, so a request
    whose draft tail keeps the last segment end out of reach is served one segment less.
    """
    a = cfg.alignment_chunks(group)
    kept = cfg.kept_offsets(group)
    if a is None or kept is None:
        return True
    return chunk % a in kept


def group_offer(cfg: OffloadConfig, group: int, cursor: int, frontier: int, storable: int,
                table: Sequence[int]) -> GroupOffer:
    """Candidates of one group: each chunk is offered, or skipped with a reason."""
    end = store_end(cfg, group, frontier, storable)
    if end <= cursor:
        return GroupOffer(cursor, cursor)
    bpc = cfg.groups[group].blocks_per_chunk
    offered: list[int] = []
    skipped: dict[int, Skip] = {}
    for chunk in range(cursor, end):
        last = chunk * bpc + bpc - 1
        if last >= len(table):
            raise ValueError(f"group {group}: block table has {len(table)} blocks, chunk "
                             f"{chunk} needs position {last}; pass every allocated block")
        if 0 in table[chunk * bpc:last + 1]:
            # Only whole chunks are stored: a chunk with a null sub-block (outside the
            # window, or a stale block that was zeroed) would leave CPU bytes unwritten
            # that a later load starting mid-chunk reads.
            skipped[chunk] = Skip.NULL
        elif not chunk_reachable(cfg, group, chunk):
            skipped[chunk] = Skip.UNREACHABLE
        else:
            offered.append(chunk)
    return GroupOffer(cursor, end, tuple(offered), skipped)


def chunk_source_blocks(table: Sequence[int], chunk: int, blocks_per_chunk: int
                        ) -> tuple[int, tuple[int, ...]]:
    """(first position, ids) of a chunk's GPU blocks.

    Stores offer only whole chunks (``group_offer``), so for them nothing is dropped; the
    leading-null skip keeps the function total for any table (S2 then reports a short run).
    """
    start = chunk * blocks_per_chunk
    ids = table[start:start + blocks_per_chunk]
    skip = 0
    while skip < len(ids) and ids[skip] == 0:
        skip += 1
    return start + skip, tuple(ids[skip:])
