"""Hypothesis strategies for the spec's inputs: group mixes, requests and hit maps.

Goal: one place that draws *valid* configurations the way real layouts look (1 to 4 groups,
chunk sizes 1..256 tokens that the hash block size divides, windows, draft flags,
blocks_per_chunk 1..4, MAMBA groups sharing one chunk size), and hit maps that are neither
all-miss nor uniformly random, so that properties about the hit are exercised on hits
that are actually large.

Method: chunk sizes are drawn as ``unit * m`` with ``m`` in 1..4, so the smallest and the
largest chunk of a mix differ by at most 4x and a request of a few dozen chunks of the
largest group stays small for the smallest one. ``tokens_per_block`` is the chunk size
divided by a ``blocks_per_chunk`` that divides it. Hit maps start from all-HIT and apply
a few edits (MISS or PENDING at drawn positions), or are drawn at random per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, Status

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
HIT, MISS, PENDING_S = Status.HIT, Status.MISS, Status.PENDING

# Large enough that no config drawn here is refused for capacity.
GPU_BLOCKS = 1 << 16
CPU_BLOCKS = 1 << 16
MAX_CHUNKS_OF_LARGEST_GROUP = 10


def make_config(*groups: GroupSpec, hash_block_tokens: int = 1, **kw: object) -> OffloadConfig:
    """A valid config for these groups; ``speculative`` follows the draft flags."""
    kw.setdefault("speculative", any(g.is_draft for g in groups))
    return OffloadConfig(tuple(groups), hash_block_tokens=hash_block_tokens,
                         num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=CPU_BLOCKS,
                         **kw)  # type: ignore[arg-type]


@st.composite
def group_specs(draw: st.DrawFn, unit: int, kind: GroupKind, mamba_chunk: int,
                allow_draft: bool) -> GroupSpec:
    """One group whose chunk size is a multiple (1..4) of ``unit`` (MAMBA: ``mamba_chunk``)."""
    chunk = mamba_chunk if kind is MAMBA else unit * draw(st.integers(1, 4))
    bpc = draw(st.sampled_from([d for d in (1, 2, 3, 4) if chunk % d == 0]))
    window = None
    extra = 0
    if kind is SLIDING:
        window = draw(st.integers(1, 4 * chunk))
        extra = draw(st.sampled_from([0, 0, 0, 1, chunk]))
    return GroupSpec(kind, chunk // bpc, bpc, window_tokens=window,
                     is_draft=allow_draft and draw(st.booleans()), extra_retained_tokens=extra)


@st.composite
def configs(draw: st.DrawFn, min_groups: int = 1, max_groups: int = 4,
            kinds: tuple[GroupKind, ...] = (FULL, SLIDING, MAMBA),
            allow_draft: bool = True, store_alignment: bool | None = None) -> OffloadConfig:
    """A valid OffloadConfig: 1..4 groups, chunk sizes 1..256 that the hash size divides."""
    hash_tokens = draw(st.sampled_from([1, 2, 4, 8]))
    unit = hash_tokens * draw(st.sampled_from([1, 2, 4, 8]))
    mamba_chunk = unit * draw(st.integers(1, 4))
    n = draw(st.integers(min_groups, max_groups))
    groups = [draw(group_specs(unit, draw(st.sampled_from(kinds)), mamba_chunk, allow_draft))
              for _ in range(n)]
    drafts = any(g.is_draft for g in groups)
    elsewhere = not drafts and draw(st.booleans())
    align = draw(st.booleans()) if store_alignment is None else store_alignment
    return make_config(*groups, hash_block_tokens=hash_tokens, speculative=drafts or elsewhere,
                       draft_kv_elsewhere=elsewhere, store_alignment=align)


@dataclass(frozen=True)
class Request:
    """A lookup's inputs: C (tokens already on the GPU), N (tokens), and the hit map."""

    computed: int
    num_tokens: int
    hits: tuple[tuple[Status, ...], ...]


def max_chunk(cfg: OffloadConfig) -> int:
    return max(g.tokens_per_chunk for g in cfg.groups)


@st.composite
def status_lists(draw: st.DrawFn, n: int, pending: bool) -> tuple[Status, ...]:
    """``n`` statuses: mostly HIT with a few edits, or drawn at random per chunk."""
    bad = [MISS, PENDING_S] if pending else [MISS]
    if draw(st.integers(0, 5)) == 0:
        return tuple(draw(st.lists(st.sampled_from([HIT, *bad]), min_size=n, max_size=n)))
    out = [HIT] * n
    if n:
        for _ in range(draw(st.integers(0, 2))):
            out[draw(st.integers(0, n - 1))] = draw(st.sampled_from(bad))
    return tuple(out)


@st.composite
def requests(draw: st.DrawFn, cfg: OffloadConfig, pending: bool = True) -> Request:
    """A request of up to ``MAX_CHUNKS_OF_LARGEST_GROUP`` of the largest chunks (+ a tail).

    Keys exist only for complete chunks, so group g gets ``N // o_g`` statuses.
    """
    big = max_chunk(cfg)
    num_tokens = (draw(st.integers(1, MAX_CHUNKS_OF_LARGEST_GROUP)) * big
                  + draw(st.integers(0, big - 1)))
    small = min(g.tokens_per_block for g in cfg.groups)
    # C: mostly 0 or a whole number of small blocks leaving room for a hit; sometimes any.
    mode = draw(st.sampled_from(["zero", "zero", "blocks", "any"]))
    if mode == "zero":
        computed = 0
    elif mode == "blocks":
        room = max(num_tokens - 2 * big, 0)
        computed = draw(st.integers(0, room // small)) * small
    else:
        computed = draw(st.integers(0, num_tokens))
    hits = tuple(draw(status_lists(num_tokens // g.tokens_per_chunk, pending))
                 for g in cfg.groups)
    return Request(computed, num_tokens, hits)


def with_hits(req: Request, hits: tuple[tuple[Status, ...], ...]) -> Request:
    return replace(req, hits=hits)


@st.composite
def lookups(draw: st.DrawFn, pending: bool = True, **config_kw: object
            ) -> tuple[OffloadConfig, Request]:
    """A config and a request for it."""
    cfg = draw(configs(**config_kw))  # type: ignore[arg-type]
    return cfg, draw(requests(cfg, pending=pending))


def parse_statuses(text: str) -> tuple[Status, ...]:
    """``"HMP"`` -> (HIT, MISS, PENDING): compact hit maps for tables of known answers."""
    table = {"H": HIT, "M": MISS, "P": PENDING_S}
    return tuple(table[c] for c in text)
