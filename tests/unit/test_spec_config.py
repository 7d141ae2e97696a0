"""Configuration validation and keys (K1): what the spec refuses, and what it accepts.

Goal: every way an engine can describe its layout wrongly or ambiguously raises
``ConfigError`` naming the offending field, whatever else is right; real layouts (the
presets kvcore/presets.py lists) are accepted; keys of different groups or prefixes never collide.

Method: one parametrized table of invalid configs (Hypothesis keeps its invalid-argument
cases the same way), each row a small edit of a valid base config and the ``.field`` it
must name; a table of valid real layouts; and Hypothesis properties for ``make_key``
(injective across groups and hash lengths) checked through the K1 predicate.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcore.scheduler._rules import keep_rule
from kvcore.spec.errors import ArgumentRangeError, ArgumentTypeError, ConfigError
from kvcore.spec.invariants import KeyRecord, k1_keys_distinct
from kvcore.spec.types import (
    KEY_GROUP_BYTES,
    MAX_BLOCKS_PER_CHUNK,
    MAX_CHUNK_TOKENS,
    MAX_CONTEXT_TOKENS,
    MAX_CPU_BLOCKS,
    MAX_GPU_BLOCKS,
    MAX_GROUPS,
    MAX_HASH_BYTES,
    MAX_NAME_CHARS,
    MAX_TOKENS_PER_BLOCK,
    MAX_WORKERS,
    GroupKind,
    GroupSpec,
    OffloadConfig,
    StoreLevel,
    group_keys,
    key_group,
    key_hash,
    make_key,
)

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA

BASE_GROUPS = (GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=8))
BASE: dict[str, Any] = {
    "groups": BASE_GROUPS,
    "hash_block_tokens": 4,
    "num_gpu_blocks": 1024,
    "num_cpu_blocks": 4096,
}


def build(groups: tuple[GroupSpec, ...] | None = None, **overrides: Any) -> OffloadConfig:
    kw = dict(BASE, **overrides)
    if groups is not None:
        kw["groups"] = groups
    return OffloadConfig(**kw)


def g0(**edit: Any) -> tuple[GroupSpec, ...]:
    """The base groups with group 0 edited."""
    return (replace(BASE_GROUPS[0], **edit), BASE_GROUPS[1])


def g1(**edit: Any) -> tuple[GroupSpec, ...]:
    """The base groups with group 1 edited."""
    return (BASE_GROUPS[0], replace(BASE_GROUPS[1], **edit))


# (case id, groups or None for the base groups, config overrides, expected ConfigError.field)
INVALID: list[tuple[str, tuple[GroupSpec, ...] | None, dict[str, Any], str]] = [
    ("no groups", (), {}, "groups"),
    ("too many groups", (GroupSpec(FULL, 16),) * (MAX_GROUPS + 1), {}, "groups"),
    ("kind not a GroupKind", g0(kind="full"), {}, "groups[0].kind"),
    ("zero tokens_per_block", g0(tokens_per_block=0), {}, "groups[0].tokens_per_block"),
    ("negative tokens_per_block", g0(tokens_per_block=-16), {}, "groups[0].tokens_per_block"),
    ("bool tokens_per_block", g0(tokens_per_block=True), {}, "groups[0].tokens_per_block"),
    ("float tokens_per_block", g0(tokens_per_block=16.0), {}, "groups[0].tokens_per_block"),
    ("huge tokens_per_block", g0(tokens_per_block=MAX_TOKENS_PER_BLOCK * 2), {},
     "groups[0].tokens_per_block"),
    ("zero blocks_per_chunk", g1(blocks_per_chunk=0), {}, "groups[1].blocks_per_chunk"),
    ("negative blocks_per_chunk", g1(blocks_per_chunk=-1), {}, "groups[1].blocks_per_chunk"),
    ("bool blocks_per_chunk", g1(blocks_per_chunk=True), {}, "groups[1].blocks_per_chunk"),
    ("huge blocks_per_chunk", g1(blocks_per_chunk=MAX_BLOCKS_PER_CHUNK + 1), {},
     "groups[1].blocks_per_chunk"),
    ("missing window on SLIDING", g1(window_tokens=None), {}, "groups[1].window_tokens"),
    ("zero window", g1(window_tokens=0), {}, "groups[1].window_tokens"),
    ("negative window", g1(window_tokens=-8), {}, "groups[1].window_tokens"),
    ("bool window", g1(window_tokens=True), {}, "groups[1].window_tokens"),
    ("window on FULL", g0(window_tokens=128), {}, "groups[0].window_tokens"),
    ("window on MAMBA", (GroupSpec(FULL, 16), GroupSpec(MAMBA, 16, window_tokens=16)), {},
     "groups[1].window_tokens"),
    ("negative extra_retained_tokens", g1(extra_retained_tokens=-1), {},
     "groups[1].extra_retained_tokens"),
    ("bool extra_retained_tokens", g1(extra_retained_tokens=True), {},
     "groups[1].extra_retained_tokens"),
    ("extra_retained_tokens on FULL", g0(extra_retained_tokens=4), {},
     "groups[0].extra_retained_tokens"),
    ("hash does not divide a chunk", None, {"hash_block_tokens": 3}, "hash_block_tokens"),
    ("hash larger than a chunk", None, {"hash_block_tokens": 8}, "hash_block_tokens"),
    ("hash does not divide a multi-block chunk", (GroupSpec(FULL, 2, 3),),
     {"hash_block_tokens": 4}, "hash_block_tokens"),
    ("zero hash_block_tokens", None, {"hash_block_tokens": 0}, "hash_block_tokens"),
    ("bool hash_block_tokens", None, {"hash_block_tokens": True}, "hash_block_tokens"),
    ("zero num_gpu_blocks", None, {"num_gpu_blocks": 0}, "num_gpu_blocks"),
    ("only the null GPU block", None, {"num_gpu_blocks": 1}, "num_gpu_blocks"),
    ("bool num_gpu_blocks", None, {"num_gpu_blocks": True}, "num_gpu_blocks"),
    ("zero num_cpu_blocks", None, {"num_cpu_blocks": 0}, "num_cpu_blocks"),
    ("negative num_cpu_blocks", None, {"num_cpu_blocks": -5}, "num_cpu_blocks"),
    ("zero num_workers", None, {"num_workers": 0}, "num_workers"),
    ("bool num_workers", None, {"num_workers": True}, "num_workers"),
    ("huge num_workers", None, {"num_workers": MAX_WORKERS + 1}, "num_workers"),
    ("negative max_offload_tokens", None, {"max_offload_tokens": -1}, "max_offload_tokens"),
    ("bool max_offload_tokens", None, {"max_offload_tokens": False}, "max_offload_tokens"),
    ("float max_offload_tokens", None, {"max_offload_tokens": 64.0}, "max_offload_tokens"),
    ("store_level as a string", None, {"store_level": "block"}, "store_level"),
    ("mixed MAMBA chunk sizes",
     (GroupSpec(FULL, 16), GroupSpec(MAMBA, 16), GroupSpec(MAMBA, 8, 1)), {}, "groups"),
    ("mixed MAMBA chunk sizes via blocks_per_chunk",
     (GroupSpec(MAMBA, 8, 1), GroupSpec(MAMBA, 8, 2)), {}, "groups"),
    ("speculative with no draft group and no draft_kv_elsewhere", None, {"speculative": True},
     "speculative"),
    ("draft flag without speculative", g0(is_draft=True), {}, "speculative"),
    ("draft flag and draft_kv_elsewhere", g0(is_draft=True),
     {"speculative": True, "draft_kv_elsewhere": True}, "draft_kv_elsewhere"),
    # Booleans are exactly True or False: truthy strings and ints once turned flags on.
    ('is_draft "no"', g0(is_draft="no"), {"speculative": True}, "groups[0].is_draft"),
    ("is_draft 1", g1(is_draft=1), {"speculative": True}, "groups[1].is_draft"),
    ("is_draft None", g0(is_draft=None), {}, "groups[0].is_draft"),
    ('speculative "false"', g0(is_draft=True), {"speculative": "false"}, "speculative"),
    ("speculative 1", None, {"speculative": 1, "draft_kv_elsewhere": True}, "speculative"),
    ('prompt_only "no"', None, {"prompt_only": "no"}, "prompt_only"),
    ("prompt_only 0", None, {"prompt_only": 0}, "prompt_only"),
    ('draft_kv_elsewhere "true"', None, {"speculative": True, "draft_kv_elsewhere": "true"},
     "draft_kv_elsewhere"),
    ("store_alignment 1", None, {"store_alignment": 1}, "store_alignment"),
    # Every numeric field has an upper bound (spec/types.py says why, beside each).
    ("window of 10**12 tokens", g1(window_tokens=10**12), {}, "groups[1].window_tokens"),
    ("window one past the limit", g1(window_tokens=MAX_CONTEXT_TOKENS + 1), {},
     "groups[1].window_tokens"),
    ("float window", g1(window_tokens=8.0), {}, "groups[1].window_tokens"),
    ("huge extra_retained_tokens", g1(extra_retained_tokens=MAX_CONTEXT_TOKENS + 1), {},
     "groups[1].extra_retained_tokens"),
    ("float extra_retained_tokens", g1(extra_retained_tokens=1.0), {},
     "groups[1].extra_retained_tokens"),
    ("tokens_per_block one past the limit", g0(tokens_per_block=MAX_TOKENS_PER_BLOCK + 1), {},
     "groups[0].tokens_per_block"),
    ("chunk over the token limit",
     g0(tokens_per_block=MAX_TOKENS_PER_BLOCK,
        blocks_per_chunk=2 * MAX_CHUNK_TOKENS // MAX_TOKENS_PER_BLOCK), {},
     "groups[0].blocks_per_chunk"),
    ("hash_block_tokens one past the limit", None, {"hash_block_tokens": MAX_CHUNK_TOKENS + 1},
     "hash_block_tokens"),
    ("float hash_block_tokens", None, {"hash_block_tokens": 4.0}, "hash_block_tokens"),
    ("num_gpu_blocks 10**15", None, {"num_gpu_blocks": 10**15}, "num_gpu_blocks"),
    ("num_gpu_blocks one past the limit", None, {"num_gpu_blocks": MAX_GPU_BLOCKS + 1},
     "num_gpu_blocks"),
    ("float num_gpu_blocks", None, {"num_gpu_blocks": 1024.0}, "num_gpu_blocks"),
    ("num_cpu_blocks one past the limit", None, {"num_cpu_blocks": MAX_CPU_BLOCKS + 1},
     "num_cpu_blocks"),
    ("bool num_cpu_blocks", None, {"num_cpu_blocks": True}, "num_cpu_blocks"),
    ("str num_cpu_blocks", None, {"num_cpu_blocks": "4096"}, "num_cpu_blocks"),
    ("float num_workers", None, {"num_workers": 2.0}, "num_workers"),
    ("max_offload_tokens one past the limit", None,
     {"max_offload_tokens": MAX_CONTEXT_TOKENS + 1}, "max_offload_tokens"),
    ("store_level None", None, {"store_level": None}, "store_level"),
    ("name not a str", None, {"name": 5}, "name"),
    ("name too long", None, {"name": "n" * (MAX_NAME_CHARS + 1)}, "name"),
    ("group name not a str", g1(name=b"local"), {}, "groups[1].name"),
    ("groups a string", "full", {}, "groups"),  # type: ignore[list-item]
    ("a group that is not a GroupSpec", (GroupSpec(FULL, 16), {"kind": "sliding"}), {},
     "groups[1]"),  # type: ignore[list-item]
]


@pytest.mark.parametrize(("groups", "overrides", "field"),
                         [pytest.param(g, o, f, id=name) for name, g, o, f in INVALID])
def test_invalid_config_names_its_field(groups: tuple[GroupSpec, ...] | None,
                                        overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(groups, **overrides)
    assert info.value.field == field
    # Errors teach: the message starts with the field and says something beyond it.
    assert str(info.value).startswith(f"{field}: ")
    assert len(str(info.value)) > len(field) + 20


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="hash_block_tokens"):
        build(hash_block_tokens=3)


def test_hash_error_suggests_a_divisor() -> None:
    with pytest.raises(ConfigError, match=r"e\.g\. 4"):
        build(hash_block_tokens=8)


# Real layouts (kvcore/presets.py), written out here so the spec is tested on its own.
VALID: list[tuple[str, tuple[GroupSpec, ...], dict[str, Any]]] = [
    ("Llama-3 + EAGLE-3", (GroupSpec(FULL, 16), GroupSpec(FULL, 16, is_draft=True)),
     {"hash_block_tokens": 16, "speculative": True}),
    ("DeepSeek-V3 + MTP, drafter KV elsewhere", (GroupSpec(FULL, 64),),
     {"hash_block_tokens": 64, "speculative": True, "draft_kv_elsewhere": True}),
    ("DeepSeek-V4 + MTP", (GroupSpec(FULL, 256), GroupSpec(SLIDING, 64, window_tokens=128),
                           GroupSpec(SLIDING, 4, window_tokens=8),
                           GroupSpec(SLIDING, 8, window_tokens=128, is_draft=True)),
     {"hash_block_tokens": 4, "speculative": True}),
    ("Gemma-3", (GroupSpec(FULL, 16), GroupSpec(SLIDING, 16, window_tokens=1024)),
     {"hash_block_tokens": 16}),
    ("gpt-oss", (GroupSpec(FULL, 16), GroupSpec(SLIDING, 16, window_tokens=128)),
     {"hash_block_tokens": 16}),
    ("Qwen3-Next + MTP", (GroupSpec(FULL, 64), GroupSpec(MAMBA, 64, is_draft=True)),
     {"hash_block_tokens": 64, "speculative": True}),
    ("blocks_per_chunk 4, capped offload", (GroupSpec(FULL, 16, 4),),
     {"hash_block_tokens": 16, "max_offload_tokens": 0, "store_level": StoreLevel.REQUEST,
      "prompt_only": True, "num_workers": 8}),
    ("SLIDING keeping extra tokens",
     (GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=8, extra_retained_tokens=4)),
     {"hash_block_tokens": 4}),
    ("hash dividing the chunk but not the block", (GroupSpec(FULL, 2, 2),),
     {"hash_block_tokens": 4}),
    ("MAMBA groups sharing a chunk size", (GroupSpec(MAMBA, 16, 2), GroupSpec(MAMBA, 32)),
     {"hash_block_tokens": 32}),
    # Each limit is inclusive: a layout exactly at every bound is accepted.
    ("every field at its upper bound",
     (GroupSpec(FULL, MAX_TOKENS_PER_BLOCK, MAX_CHUNK_TOKENS // MAX_TOKENS_PER_BLOCK),
      GroupSpec(SLIDING, MAX_CHUNK_TOKENS // MAX_BLOCKS_PER_CHUNK, MAX_BLOCKS_PER_CHUNK,
                window_tokens=MAX_CONTEXT_TOKENS, extra_retained_tokens=MAX_CONTEXT_TOKENS,
                name="n" * MAX_NAME_CHARS)),
     {"hash_block_tokens": MAX_CHUNK_TOKENS, "num_gpu_blocks": MAX_GPU_BLOCKS,
      "num_cpu_blocks": MAX_CPU_BLOCKS, "num_workers": MAX_WORKERS,
      "max_offload_tokens": MAX_CONTEXT_TOKENS, "name": "n" * MAX_NAME_CHARS}),
    ("the most groups", (GroupSpec(FULL, 16),) * MAX_GROUPS, {"hash_block_tokens": 16}),
    ("every field at its lower bound", (GroupSpec(SLIDING, 1, window_tokens=1),),
     {"hash_block_tokens": 1, "num_gpu_blocks": 2, "num_cpu_blocks": 1, "num_workers": 1,
      "max_offload_tokens": 0}),
]


@pytest.mark.parametrize(("groups", "overrides"),
                         [pytest.param(g, o, id=name) for name, g, o in VALID])
def test_valid_layouts_are_accepted(groups: tuple[GroupSpec, ...],
                                    overrides: dict[str, Any]) -> None:
    cfg = build(groups, **overrides)
    assert cfg.groups == tuple(groups)
    for i, g in enumerate(cfg.groups):
        assert g.tokens_per_chunk % cfg.hash_block_tokens == 0
        assert cfg.hashes_per_chunk(i) * cfg.hash_block_tokens == g.tokens_per_chunk


def test_groups_given_as_a_list_are_frozen_to_a_tuple() -> None:
    cfg = build(list(BASE_GROUPS))  # type: ignore[arg-type]
    assert isinstance(cfg.groups, tuple)


def alignment(cfg: OffloadConfig, group: int) -> int | None:
    """The keep rule's period (kvcore's rule: derived values that are rules live there)."""
    rule = keep_rule(cfg, group)
    return None if rule is None else rule[0]


def test_derived_quantities_of_the_base_layout() -> None:
    cfg = build()
    assert cfg.has_window_groups
    assert cfg.mamba_align_tokens is None
    # Upstream's alignment_block_count for FULL 16 + SLIDING 4 window 8 (§2.7): 4, W = 2.
    assert alignment(cfg, 1) == 4
    assert alignment(cfg, 0) is None
    assert cfg.groups[1].window_chunks == 2
    assert cfg.groups[1].reach_tokens == 7
    assert cfg.groups[0].window_chunks is None


def test_alignment_needs_exactly_one_full_chunk_size() -> None:
    two_sizes = (GroupSpec(FULL, 16), GroupSpec(FULL, 32), GroupSpec(SLIDING, 4, window_tokens=8))
    assert alignment(build(two_sizes), 2) is None
    assert alignment(build(store_alignment=False), 1) is None
    # A window (plus the draft extra chunk) filling the whole segment keeps every chunk.
    assert alignment(build(g1(window_tokens=16)), 1) is None
    drafted = build(g1(window_tokens=12, is_draft=True), speculative=True)
    assert alignment(drafted, 1) is None


# -- K1: keys ---------------------------------------------------------------------------------

hashes = st.binary(min_size=0, max_size=12)
groups_ = st.integers(0, (1 << (8 * KEY_GROUP_BYTES)) - 1)


@given(st.lists(st.tuples(groups_, hashes), min_size=1, max_size=30))
def test_make_key_is_injective_across_groups_and_hash_lengths(
        pairs: list[tuple[int, bytes]]) -> None:
    triples = tuple((g, h, make_key(h, g)) for g, h in pairs)
    assert k1_keys_distinct(KeyRecord(triples)) == []
    by_key: dict[bytes, tuple[int, bytes]] = {}
    for g, h, key in triples:
        assert by_key.setdefault(key, (g, h)) == (g, h)


@given(hashes, groups_)
def test_key_parts_round_trip(block_hash: bytes, group: int) -> None:
    key = make_key(block_hash, group)
    assert key_group(key) == group
    assert key_hash(key) == block_hash


def test_hash_suffix_that_looks_like_a_group_does_not_collide() -> None:
    """A hash ending in group bytes must not alias a shorter hash of another group (K1)."""
    a = make_key(b"\x01" + (7).to_bytes(KEY_GROUP_BYTES, "big"), 0)
    b = make_key(b"\x01", 7)
    assert a != b


@pytest.mark.parametrize("group", [-1, 1 << (8 * KEY_GROUP_BYTES)])
def test_group_out_of_key_range_is_refused(group: int) -> None:
    with pytest.raises(ArgumentRangeError, match=r"^make_key: group="):
        make_key(b"h", group)


@pytest.mark.parametrize(("block_hash", "group", "error", "argument"), [
    (8, 0, ArgumentTypeError, "block_hash"),  # bytes(8) would be eight zero bytes
    ("abc", 0, ArgumentTypeError, "block_hash"),
    (None, 0, ArgumentTypeError, "block_hash"),
    (bytearray(b"h"), 0, ArgumentTypeError, "block_hash"),
    (bytes(MAX_HASH_BYTES + 1), 0, ArgumentRangeError, "len(block_hash)"),
    (b"h", 1.5, ArgumentTypeError, "group"),
    (b"h", None, ArgumentTypeError, "group"),
    (b"h", True, ArgumentTypeError, "group"),
])
def test_make_key_names_a_wrong_argument(block_hash: object, group: object,
                                         error: type[Exception], argument: str) -> None:
    with pytest.raises(error, match=rf"^make_key: {re.escape(argument)}="):
        make_key(block_hash, group)  # type: ignore[arg-type]


@pytest.mark.parametrize(("group", "error"), [
    (2, ArgumentRangeError), (-1, ArgumentRangeError), ("0", ArgumentTypeError),
    (None, ArgumentTypeError), (True, ArgumentTypeError)])
def test_hashes_per_chunk_names_a_group_the_config_lacks(group: object,
                                                         error: type[Exception]) -> None:
    cfg = build(BASE_GROUPS)  # two groups: -1 would have read the last one
    with pytest.raises(error, match=r"^OffloadConfig.hashes_per_chunk: group="):
        cfg.hashes_per_chunk(group)  # type: ignore[arg-type]
    assert [cfg.hashes_per_chunk(g) for g in (0, 1)] == [16 // cfg.hash_block_tokens,
                                                        4 // cfg.hash_block_tokens]


@given(st.lists(st.binary(min_size=8, max_size=8), max_size=24, unique=True))
def test_group_keys_cover_complete_chunks_only_and_differ_by_group(
        chain: list[bytes]) -> None:
    cfg = build((GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=8),
                 GroupSpec(FULL, 8, 2)))
    triples = []
    for i, g in enumerate(cfg.groups):
        keys = group_keys(cfg, i, chain)
        hpc = g.tokens_per_chunk // cfg.hash_block_tokens
        assert len(keys) == len(chain) // hpc
        for c, key in enumerate(keys):
            # A chunk's key is the chained hash of its last hash block, plus the group.
            assert key == make_key(chain[(c + 1) * hpc - 1], i)
            triples.append((i, chain[(c + 1) * hpc - 1], key))
    assert k1_keys_distinct(KeyRecord(tuple(triples))) == []


class _Sneaky(int):
    """An int whose ``>`` always says no: a bound check by comparison cannot see it."""

    def __gt__(self, other: object) -> bool:
        return False


@pytest.mark.parametrize("field", ["num_gpu_blocks", "num_cpu_blocks", "hash_block_tokens"])
def test_an_int_subclass_is_not_a_count(field: str) -> None:
    """``isinstance(value, int)`` let _Sneaky(10**15) through the 2**24 bound."""
    with pytest.raises(ConfigError, match=rf"^{field}: .*\(_Sneaky\) is not an int"):
        build(**{field: _Sneaky(10**15)})
