"""Config limits: every numeric field is bounded, and no operation's cost grows with one.

Goal: a config at its limits (a 16M-token window, 64 groups, 16M GPU blocks, a 1M-token
chunk) is accepted and every config-dependent operation on it (construction, the keep
rule, presets with extreme overrides, scheduler and manager construction, a lookup on an
empty tier, a store step and its completion) stays fast; one field past its bound or of
the wrong type is a ConfigError naming that field. Before the limits, ``window_tokens =
10**12`` passed and ``alignment_chunks()`` never returned.

Method: configs are built directly at and across the bounds (each field drawn from its
boundary values or uniformly in range; valid by construction, no filtering). Each
operation runs under a CPU-time alarm (``ITIMER_PROF``, 1 s of process CPU time, which a
busy machine does not inflate): a hang raises inside the loop instead of stalling the
suite. The operations take milliseconds; the alarm is a hang detector, not a timing
assertion. The keep rule's closed form is compared with the original brute force (every
needed chunk, reduced modulo the segment) on small layouts.
"""

from __future__ import annotations

import contextlib
import math
import signal
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_strategies import configs

from kvcore import presets
from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
    _rules,
)
from kvcore.spec.errors import ConfigError
from kvcore.spec.lookup import needed_chunks
from kvcore.spec.types import (
    MAX_BLOCKS_PER_CHUNK,
    MAX_CHUNK_TOKENS,
    MAX_CONTEXT_TOKENS,
    MAX_CPU_BLOCKS,
    MAX_GPU_BLOCKS,
    MAX_GROUPS,
    MAX_NAME_CHARS,
    MAX_TOKENS_PER_BLOCK,
    MAX_WORKERS,
    GroupKind,
    GroupSpec,
    KeptOffsets,
    OffloadConfig,
    StoreLevel,
    cdiv,
)


def kvcore_keep_rule_uncached(cfg: OffloadConfig, group: int) -> Any:
    """kvcore's keep rule (``_rules.keep_rule``) computed afresh, not from its cache."""
    _rules._KEEP_CACHE.clear()
    return _rules.keep_rule(cfg, group)


def _alignment(cfg: OffloadConfig, group: int) -> int | None:
    """The keep rule's period (kvcore's rule, ``kvcore.scheduler._rules.keep_rule``)."""
    rule = kvcore_keep_rule_uncached(cfg, group)
    return None if rule is None else rule[0]


def _kept(cfg: OffloadConfig, group: int) -> KeptOffsets | None:
    """The keep rule's kept offsets, computed afresh (not from the rule's cache)."""
    rule = kvcore_keep_rule_uncached(cfg, group)
    return None if rule is None else rule[1]


FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
T = TypeVar("T")

# Process CPU seconds one operation may use before it counts as a hang. Measured cost of
# the heaviest operation here (a store step of 2**13 blocks with checks on) is well under
# 0.1 s, so this is a 10x margin and more.
OP_CPU_BUDGET_S = 1.0
# Bounded request sizes: the work a request asks for is real structure (its hashes and
# blocks), and is kept small here so that only config-driven cost could exceed the budget.
MAX_TEST_BLOCKS = 1 << 13
MAX_TEST_HASHES = 1 << 13


class OpHang(Exception):
    """An operation used more CPU time than any config may cost it."""


@contextlib.contextmanager
def cpu_alarm(what: str) -> Iterator[None]:
    def fire(_signum: int, _frame: Any) -> None:
        raise OpHang(f"{what} used over {OP_CPU_BUDGET_S}s of CPU time")

    previous = signal.signal(signal.SIGPROF, fire)
    signal.setitimer(signal.ITIMER_PROF, OP_CPU_BUDGET_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def bounded(what: str, op: Callable[[], T]) -> T:
    with cpu_alarm(what):
        return op()


def edge(lo: int, hi: int) -> st.SearchStrategy[int]:
    """An int in [lo, hi], often exactly at a bound or one inside it."""
    return st.one_of(st.sampled_from(sorted({lo, min(lo + 1, hi), max(hi - 1, lo), hi})),
                     st.integers(lo, hi))


def split(draw: st.DrawFn, chunk: int) -> tuple[int, int]:
    """(tokens_per_block, blocks_per_chunk) of a chunk size, both within their limits."""
    lo = cdiv(chunk, MAX_TOKENS_PER_BLOCK)
    options = [b for b in (1, 2, 16, MAX_BLOCKS_PER_CHUNK) if b >= lo and chunk % b == 0]
    bpc = draw(st.sampled_from(options))
    return chunk // bpc, bpc


@st.composite
def extreme_group(draw: st.DrawFn, kind: GroupKind, shape: tuple[int, int] | None
                  ) -> GroupSpec:
    """A group at the limits; ``shape`` fixes (tokens_per_block, blocks_per_chunk)."""
    if shape is not None:
        tpb, bpc = shape
    else:
        tpb = draw(edge(1, MAX_TOKENS_PER_BLOCK))
        bpc = draw(edge(1, min(MAX_BLOCKS_PER_CHUNK, MAX_CHUNK_TOKENS // tpb)))
    window = draw(edge(1, MAX_CONTEXT_TOKENS)) if kind is SLIDING else None
    extra = draw(edge(0, MAX_CONTEXT_TOKENS)) if kind is SLIDING else 0
    return GroupSpec(kind, tpb, bpc, window_tokens=window, is_draft=draw(st.booleans()),
                     extra_retained_tokens=extra, name=draw(st.sampled_from(
                         ["", "g" * MAX_NAME_CHARS])))


@st.composite
def extreme_configs(draw: st.DrawFn) -> OffloadConfig:
    """A valid config with every numeric field drawn at or near its bounds.

    Half the layouts are *aligned* (one full-attention chunk size A, windows and Mamba in
    chunks dividing A) so that the keep rule is on, with windows up to the context limit;
    the others draw every group's sizes freely.
    """
    n = draw(st.one_of(st.sampled_from([1, 2, MAX_GROUPS]), st.integers(1, MAX_GROUPS)))
    kinds = [draw(st.sampled_from([FULL, SLIDING, MAMBA])) for _ in range(n)]
    aligned = draw(st.booleans())
    full_chunk = 1 << draw(edge(1, MAX_CHUNK_TOKENS.bit_length() - 1))
    mamba: tuple[int, int] | None = None
    if aligned and MAMBA in kinds:
        mamba = split(draw, max(full_chunk >> draw(st.integers(0, 2)), 1))
    full_shape = split(draw, full_chunk)
    groups = []
    for kind in kinds:
        shape = None
        if kind is MAMBA:
            shape = mamba
        elif aligned:
            # Mostly small window chunks under a large A: the keep rule's hardest case.
            top = full_chunk.bit_length() - 1
            shift = draw(st.one_of(st.sampled_from([top, top, max(top - 1, 1)]),
                                   st.integers(1, top)))
            shape = full_shape if kind is FULL else split(draw, full_chunk >> shift)
        g = draw(extreme_group(kind, shape))
        if kind is MAMBA:
            mamba = (g.tokens_per_block, g.blocks_per_chunk)
        groups.append(g)
    divisor = math.gcd(*(g.tokens_per_chunk for g in groups))
    drafts = any(g.is_draft for g in groups)
    spec = drafts or draw(st.booleans())
    return OffloadConfig(
        tuple(groups), hash_block_tokens=draw(st.sampled_from([1, divisor])),
        num_gpu_blocks=draw(edge(2, MAX_GPU_BLOCKS)),
        num_cpu_blocks=draw(edge(1, MAX_CPU_BLOCKS)),
        num_workers=draw(st.sampled_from([1, 2, MAX_WORKERS])),
        prompt_only=draw(st.booleans()),
        max_offload_tokens=draw(st.one_of(st.none(), edge(0, MAX_CONTEXT_TOKENS))),
        store_level=draw(st.sampled_from(StoreLevel)), speculative=spec,
        draft_kv_elsewhere=spec and not drafts,
        store_alignment=aligned or draw(st.booleans()))


def request_tokens(cfg: OffloadConfig) -> int:
    """Tokens of a test request: up to 4 of the largest chunks, within the block and hash
    budgets (halving keeps it a multiple of every chunk size that fits)."""
    budget = min(MAX_TEST_BLOCKS, cfg.num_gpu_blocks - 1)
    tokens = 4 * max(g.tokens_per_chunk for g in cfg.groups)
    while tokens and (sum(cdiv(tokens, g.tokens_per_block) for g in cfg.groups) > budget
                      or tokens // cfg.hash_block_tokens > MAX_TEST_HASHES):
        tokens //= 2
    return tokens


def store_step(cfg: OffloadConfig) -> None:
    """Add a request, look it up on the empty tier, store what it computed, finish it."""
    manager = bounded("manager construction",
                      lambda: CPUOffloadManager.for_config(cfg, check=True))
    sched = bounded("scheduler construction",
                    lambda: OffloadScheduler(cfg, manager, check=True))
    tokens = request_tokens(cfg)
    hashes = tuple(i.to_bytes(8, "big") for i in range(tokens // cfg.hash_block_tokens))
    bounded("add_request", lambda: sched.add_request(RequestInfo("r", tokens, hashes)))
    assert bounded("lookup", lambda: sched.lookup("r", 0, tokens)) == 0
    next_id = iter(range(1, cfg.num_gpu_blocks))
    tables = tuple(tuple(next(next_id) for _ in range(cdiv(tokens, g.tokens_per_block)))
                   for g in cfg.groups)
    ids = frozenset(i for t in tables for i in t)
    step = StepInput((ScheduledRequest("r", tokens, 0, tokens, tables),), (), ids)
    plan = bounded("build_step", lambda: sched.build_step(step))
    reports = [WorkerReport(w, p.job_id) for p in plan.stores for w in range(cfg.num_workers)]
    bounded("worker_output", lambda: sched.worker_output(reports))
    bounded("request_finished", lambda: sched.request_finished("r"))


def keep_rule(cfg: OffloadConfig) -> None:
    for i in range(len(cfg.groups)):
        a = bounded("alignment_chunks", lambda i=i: _alignment(cfg, i))
        kept = bounded("kept_offsets", lambda i=i: _kept(cfg, i))
        assert (a is None) == (kept is None)
        if a is not None and kept is not None:
            assert bounded("kept size", lambda k=kept: len(k)) < a
            bounded("kept membership", lambda k=kept, a=a: [x in k for x in (0, a // 2, a - 1)])


@settings(max_examples=30)
@given(extreme_configs())
def test_every_operation_is_bounded_at_the_limits(cfg: OffloadConfig) -> None:
    # Construction again, from the drawn fields: validation itself must be bounded.
    bounded("construction", lambda: replace(cfg, name="again"))
    keep_rule(cfg)
    store_step(cfg)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_presets_with_extreme_overrides_are_bounded(name: str) -> None:
    for overrides in ({"num_gpu_blocks": MAX_GPU_BLOCKS, "num_cpu_blocks": MAX_CPU_BLOCKS,
                       "num_workers": MAX_WORKERS}, {"num_gpu_blocks": 2, "num_cpu_blocks": 1}):
        cfg = bounded("preset", lambda o=overrides: presets.preset(name, **o))
        keep_rule(cfg)
        store_step(cfg)


def test_the_largest_window_keep_rule_is_closed_form() -> None:
    """Windows of 2**19 and 2**24 1-token chunks under a 2**20-token full chunk: the brute
    force enumerates every chunk of the window per boundary; the spans answer at once."""
    groups = (GroupSpec(FULL, MAX_TOKENS_PER_BLOCK, MAX_CHUNK_TOKENS // MAX_TOKENS_PER_BLOCK),
              GroupSpec(SLIDING, 1, window_tokens=MAX_CHUNK_TOKENS // 2))
    cfg = OffloadConfig(groups, hash_block_tokens=1, num_gpu_blocks=MAX_GPU_BLOCKS,
                        num_cpu_blocks=MAX_CPU_BLOCKS)
    kept = bounded("kept_offsets", lambda: _kept(cfg, 1))
    a = _alignment(cfg, 1)
    assert a == MAX_CHUNK_TOKENS and kept is not None
    # The window's chunks before each segment end, plus the one the N - 1 lookup adds.
    assert len(kept) == MAX_CHUNK_TOKENS // 2 + 1
    assert a - 1 in kept and 0 not in kept and a // 2 - 2 not in kept
    widest = replace(cfg, groups=(groups[0], replace(groups[1], window_tokens=MAX_CONTEXT_TOKENS)))
    assert bounded("kept_offsets", lambda: _kept(widest, 1)) is None


# -- one field across its bound ---------------------------------------------------------

INT_BAD: list[object] = [True, 1.5, "16", None]
GROUP_INT_LIMITS = {"tokens_per_block": (1, MAX_TOKENS_PER_BLOCK),
                    "blocks_per_chunk": (1, MAX_BLOCKS_PER_CHUNK),
                    "extra_retained_tokens": (0, MAX_CONTEXT_TOKENS)}
CONFIG_INT_LIMITS = {"hash_block_tokens": (1, MAX_CHUNK_TOKENS),
                     "num_gpu_blocks": (2, MAX_GPU_BLOCKS),
                     "num_cpu_blocks": (1, MAX_CPU_BLOCKS),
                     "num_workers": (1, MAX_WORKERS)}
BOOL_BAD: list[object] = ["no", "false", "true", 1, 0, None, 1.0]
CONFIG_BOOLS = ("prompt_only", "speculative", "draft_kv_elsewhere", "store_alignment")


def out_of_range(lo: int, hi: int) -> st.SearchStrategy[object]:
    return st.one_of(st.sampled_from([lo - 1, hi + 1, 10**12, 10**15, -(10**12)]),
                     st.integers(hi + 1, 10**30), st.integers(-(10**30), lo - 1),
                     st.sampled_from(INT_BAD))


@st.composite
def broken(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """The fields of a valid extreme config with exactly one made invalid, and its name."""
    cfg = draw(extreme_configs())
    fields: dict[str, Any] = {f: getattr(cfg, f) for f in (
        "groups", "hash_block_tokens", "num_gpu_blocks", "num_cpu_blocks", "num_workers",
        "prompt_only", "max_offload_tokens", "store_level", "speculative",
        "draft_kv_elsewhere", "store_alignment", "name")}
    target = draw(st.sampled_from(["group", "config_int", "bool", "other"]))
    if target == "group":
        i = draw(st.integers(0, len(cfg.groups) - 1))
        g = cfg.groups[i]
        name = draw(st.sampled_from([*GROUP_INT_LIMITS, "window_tokens", "is_draft",
                                     "kind", "name"]))
        if name in GROUP_INT_LIMITS:
            value = draw(out_of_range(*GROUP_INT_LIMITS[name]))
        elif name == "window_tokens":
            value = (draw(out_of_range(1, MAX_CONTEXT_TOKENS)) if g.kind is SLIDING
                     else draw(st.sampled_from([1, 128, 10**12])))
        elif name == "is_draft":
            value = draw(st.sampled_from(BOOL_BAD))
        elif name == "kind":
            value = draw(st.sampled_from(["full", "sliding", 0, None]))
        else:
            value = draw(st.sampled_from([5, None, "n" * (MAX_NAME_CHARS + 1)]))
        groups = list(cfg.groups)
        groups[i] = replace(g, **{name: value})
        fields["groups"] = tuple(groups)
        return fields, f"groups[{i}].{name}"
    if target == "config_int":
        name = draw(st.sampled_from([*CONFIG_INT_LIMITS, "max_offload_tokens"]))
        limits = CONFIG_INT_LIMITS.get(name, (0, MAX_CONTEXT_TOKENS))
        value = draw(out_of_range(*limits).filter(lambda v: v is not None
                                                  or name != "max_offload_tokens"))
        fields[name] = value
        return fields, name
    if target == "bool":
        name = draw(st.sampled_from(CONFIG_BOOLS))
        fields[name] = draw(st.sampled_from(BOOL_BAD))
        return fields, name
    name = draw(st.sampled_from(["store_level", "name", "groups"]))
    bad: dict[str, list[object]] = {
        "store_level": ["block", 0, None], "name": [5, "n" * (MAX_NAME_CHARS + 1)],
        "groups": [(), (GroupSpec(FULL, 16),) * (MAX_GROUPS + 1), "full", 3]}
    fields[name] = draw(st.sampled_from(bad[name]))
    return fields, name


@settings(max_examples=80)
@given(broken())
def test_one_field_across_its_bound_is_a_config_error_naming_it(
        case: tuple[dict[str, Any], str]) -> None:
    fields, name = case
    with pytest.raises(ConfigError) as info:
        bounded("invalid construction", lambda: OffloadConfig(**fields))
    assert info.value.field == name
    assert str(info.value).startswith(f"{name}: ")


# -- the keep rule's closed form against the brute force --------------------------------


def brute_kept(cfg: OffloadConfig, group: int) -> tuple[int, frozenset[int]] | None:
    """The keep rule as first written: every needed chunk of each boundary, modulo a."""
    g = cfg.groups[group]
    if not cfg.store_alignment or g.kind is not SLIDING:
        return None
    full = {x.tokens_per_chunk for x in cfg.groups if x.kind is FULL}
    if len(full) != 1:
        return None
    (big,) = full
    o, mamba = g.tokens_per_chunk, cfg.mamba_align_tokens
    if big <= o or big % o or (mamba is not None and big % mamba):
        return None
    a = big // o
    k = cdiv(g.reach_tokens, big) + 2
    ends = [k * big - 1, k * big] + ([k * big - 1 - (k * big - 1) % mamba] if mamba else [])
    kept: set[int] = set()
    for boundary in ends:
        rng = needed_chunks(g, boundary, 0)
        if rng is not None:
            kept.update(c % a for c in range(*rng))
    return None if len(kept) >= a else (a, frozenset(kept))


@settings(max_examples=200)
@given(configs(store_alignment=True))
def test_kept_offsets_equal_the_brute_force(cfg: OffloadConfig) -> None:
    for i in range(len(cfg.groups)):
        expected = brute_kept(cfg, i)
        kept = _kept(cfg, i)
        if expected is None:
            assert kept is None and _alignment(cfg, i) is None
        else:
            assert kept is not None and _alignment(cfg, i) == expected[0]
            assert frozenset(kept) == expected[1]
            assert len(kept) == len(expected[1])
            assert all((x in kept) == (x in expected[1]) for x in range(expected[0]))
