"""The load plan (L1 load half, S1, B1): which GPU blocks a hit fills, from which chunks.

Goal: pin ``kvcore.spec.load`` against docs/semantics.md "Load": the blocks to fill run from the
first unfilled (non-null) one up to ``cdiv(C + hit, tokens_per_block)``; ``block_index`` is
that first position, so a load may start mid-chunk; a too-short table or a null inside the
range is refused; every chunk loaded lies inside the range the lookup verified, and a table
that asks for more (the engine retains more of a window than the config says) raises
``ConfigError`` naming ``groups[i].extra_retained_tokens``, never a load of unverified data.

Method: known cases first; then Hypothesis draws a layout and an all-hit request, takes the
spec's hit, and builds each group's block table the way an engine would (window groups free
the blocks before their reach, MAMBA groups keep only the state block) with either the
config's reach (the load must succeed, stay verified, and yield an S1/B1-clean plan) or a
larger one (it must succeed within the verified range or raise the named ConfigError).
"""

from __future__ import annotations

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from spec_strategies import FULL, HIT, MAMBA, SLIDING, configs, make_config, requests

from kvcore.spec.errors import ConfigError
from kvcore.spec.invariants import (
    LoadRecord,
    PlanRecord,
    b1_block_ids_in_range,
    l1_load_within_verified,
    s1_plan_shape,
)
from kvcore.spec.load import BlockTableError, GroupLoad, group_load, load_plan
from kvcore.spec.lookup import served_chunks, spec_hit
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan, chunks_spanned
from kvcore.spec.types import GroupSpec, OffloadConfig, cdiv, make_key


def ids(n: int, nulls: int = 0) -> list[int]:
    """A block table of ``n`` positions, ids 1..n, the first ``nulls`` freed (0)."""
    return [0 if i < nulls else i + 1 for i in range(n)]


def as_plan(cfg: OffloadConfig, loads: list[GroupLoad]) -> TransferPlan:
    """The load job as the reference scheduler assembles it: one CPU slot and key per chunk."""
    groups = []
    slot = 0
    for i, gl in enumerate(loads):
        n = gl.end_chunk - gl.first_chunk
        groups.append(GroupTransfer(gl.gpu_block_ids, gl.block_index,
                                    tuple(range(slot, slot + n)),
                                    tuple(make_key(c.to_bytes(4, "big"), i)
                                          for c in range(gl.first_chunk, gl.end_chunk))))
        slot += n
    return TransferPlan(1, JobKind.LOAD, "r", tuple(groups))


# -- known cases ------------------------------------------------------------------------------


def test_load_starts_mid_chunk() -> None:
    """8-token chunks of two 4-token blocks; C = 12 leaves 3 valid blocks: start at block 3."""
    cfg = make_config(GroupSpec(FULL, 4, 2))
    gl = group_load(cfg, 0, 12, 12, ids(6), valid_blocks=3)
    assert gl == GroupLoad(first_chunk=1, end_chunk=3, block_index=3, gpu_block_ids=(4, 5, 6))
    assert chunks_spanned(len(gl.gpu_block_ids), gl.block_index, 2) == 2


def test_load_may_stop_mid_chunk_at_an_unaligned_boundary() -> None:
    cfg = make_config(GroupSpec(FULL, 4, 2), GroupSpec(SLIDING, 4, 2, window_tokens=16))
    # T = 15 (N - 1 with a window group): blocks 0..3, chunks 0..1.
    gl = group_load(cfg, 0, 0, 15, ids(4), valid_blocks=0)
    assert (gl.first_chunk, gl.end_chunk, gl.gpu_block_ids) == (0, 2, (1, 2, 3, 4))


def test_leading_nulls_are_skipped() -> None:
    """A window group's freed blocks before its reach are not loaded."""
    cfg = make_config(GroupSpec(SLIDING, 4, window_tokens=8))
    # T = 32: the window needs chunks 6, 7 (tokens 25..31); the engine freed blocks 0..5.
    gl = group_load(cfg, 0, 0, 32, ids(8, nulls=6), valid_blocks=0)
    assert gl == GroupLoad(6, 8, 6, (7, 8))


def test_nothing_to_fill() -> None:
    cfg = make_config(GroupSpec(FULL, 4))
    assert group_load(cfg, 0, 0, 8, ids(2), valid_blocks=2) == GroupLoad(0, 0, 0, ())


def test_draft_group_never_loads_its_extra_chunk() -> None:
    cfg = make_config(GroupSpec(FULL, 4, is_draft=True))
    hits = ((HIT, HIT, HIT),)
    hit = spec_hit(cfg, 0, 12, hits)
    assert hit == 8
    gl = group_load(cfg, 0, 0, hit, ids(3), valid_blocks=0)
    assert (gl.first_chunk, gl.end_chunk) == (0, 2)


def test_too_short_table_is_refused() -> None:
    cfg = make_config(GroupSpec(FULL, 4))
    with pytest.raises(BlockTableError, match="block table has 5 blocks but 6"):
        group_load(cfg, 0, 0, 24, ids(5), valid_blocks=0)


def test_null_inside_the_load_range_is_refused() -> None:
    cfg = make_config(GroupSpec(FULL, 4))
    with pytest.raises(BlockTableError, match="null block inside"):
        group_load(cfg, 0, 0, 24, [1, 2, 3, 0, 5, 6], valid_blocks=0)


def test_wrong_number_of_tables_is_refused() -> None:
    cfg = make_config(GroupSpec(FULL, 4), GroupSpec(FULL, 8))
    with pytest.raises(BlockTableError, match="expected 2 block tables"):
        load_plan(cfg, 0, 8, [ids(2)], [0])


def test_table_beyond_the_verified_window_names_extra_retained_tokens() -> None:
    """The engine kept every block; the lookup verified only the window (chunks 6, 7)."""
    groups = (GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=8))
    cfg = make_config(*groups, hash_block_tokens=4)
    with pytest.raises(ConfigError) as info:
        load_plan(cfg, 0, 32, [ids(2), ids(8)], [0, 0])
    assert info.value.field == "groups[1].extra_retained_tokens"
    assert "chunk 0" in str(info.value) and "from 6" in str(info.value)
    # Declaring what the engine keeps widens the verified reach, and the load is accepted.
    wide = make_config(groups[0], GroupSpec(SLIDING, 4, window_tokens=8,
                                            extra_retained_tokens=24), hash_block_tokens=4)
    loads = load_plan(wide, 0, 32, [ids(2), ids(8)], [0, 0])
    assert (loads[1].first_chunk, loads[1].end_chunk) == (0, 8)


def test_mamba_table_asking_for_old_states_is_refused() -> None:
    cfg = make_config(GroupSpec(FULL, 4), GroupSpec(MAMBA, 8))
    # T = 16: the MAMBA group verified only its state chunk 1.
    with pytest.raises(ConfigError, match=r"groups\[1\]\.extra_retained_tokens"):
        load_plan(cfg, 0, 16, [ids(4), ids(2)], [0, 0])
    loads = load_plan(cfg, 0, 16, [ids(4), ids(2, nulls=1)], [0, 0])
    assert (loads[1].first_chunk, loads[1].end_chunk) == (1, 2)


# -- properties -------------------------------------------------------------------------------


def engine_table(g: GroupSpec, boundary: int, computed: int, keep_tokens: int) -> list[int]:
    """The block table an engine holds at ``boundary``: window groups free what lies before
    ``boundary - keep_tokens``; MAMBA groups keep only the block ending at the boundary."""
    end = cdiv(boundary, g.tokens_per_block)
    if g.kind is FULL:
        return ids(end)
    if g.kind is MAMBA:
        return ids(end, nulls=max(end - 1, 0))
    nulls = max(boundary - keep_tokens, 0) // g.tokens_per_block
    return ids(end, nulls=min(nulls, end))


@given(configs(), st.data())
def test_load_stays_inside_the_verified_range(cfg: OffloadConfig, data: st.DataObject) -> None:
    req = data.draw(requests(cfg, pending=False))
    hits = tuple(tuple(HIT for _ in row) for row in req.hits)
    hit = spec_hit(cfg, req.computed, req.num_tokens, hits)
    assert isinstance(hit, int)
    if hit == 0:
        event("no hit")
        return
    boundary = req.computed + hit
    more = data.draw(st.booleans())
    tables, valid = [], []
    for g in cfg.groups:
        keep = g.reach_tokens + (data.draw(st.integers(1, 3 * g.tokens_per_chunk)) if more else 0)
        tables.append(engine_table(g, boundary, req.computed, keep))
        valid.append(req.computed // g.tokens_per_block)
    try:
        loads = load_plan(cfg, req.computed, hit, tables, valid)
    except ConfigError as err:
        # Only an engine keeping more than the config says may be refused, and the error
        # names the group whose table asked for unverified chunks.
        assert more
        event("refused: the engine keeps more than verified")
        group = int(err.field.split("[")[1].split("]")[0])
        assert err.field == f"groups[{group}].extra_retained_tokens"
        g = cfg.groups[group]
        served = served_chunks(g, boundary, req.computed)
        assert served is not None
        first = next(i for i in range(valid[group], len(tables[group])) if tables[group][i])
        assert first // g.blocks_per_chunk < served[0]
        return
    event("loaded" + (" (engine keeps more)" if more else ""))
    ranges = tuple((gl.first_chunk, gl.end_chunk) for gl in loads)
    assert l1_load_within_verified(LoadRecord(cfg, req.computed, hit, ranges)) == []
    for g, gl in zip(cfg.groups, loads, strict=True):
        if gl.gpu_block_ids:
            assert gl.end_chunk == cdiv(boundary, g.tokens_per_chunk)
            assert gl.block_index + len(gl.gpu_block_ids) == cdiv(boundary, g.tokens_per_block)
            assert gl.first_chunk == gl.block_index // g.blocks_per_chunk
    record = PlanRecord(cfg, as_plan(cfg, loads))
    assert s1_plan_shape(record) == []
    assert b1_block_ids_in_range(record) == []
