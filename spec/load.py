"""The load plan: which GPU blocks a hit fills, and from which chunks.

Given the boundary ``T = C + hit`` and the engine's block table for each group (0 = null
block), the blocks to fill are those from the first unfilled one up to
``cdiv(T, tokens_per_block)``; the chunks are those covering them. ``block_index`` is the
first filled position, so a load may start mid-chunk. Every chunk loaded must lie inside
the range the lookup verified (L1): a table that asks for more is an engine/config
mismatch and an error, never a load of unverified data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.spec.errors import BlockTableError, ConfigError
from kvcore.spec.lookup import served_chunks
from kvcore.spec.types import OffloadConfig, cdiv


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
