"""Types of the spec: group layouts, the validated configuration, keys, and chunk arithmetic.

Everything here is a frozen dataclass or a pure function over ints, so CrossHair can read it
and the scheduler, the tests and the proofs all share one definition. Validation happens
once, in ``OffloadConfig.__post_init__``; a config object that exists is a valid config.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

from kvcore.spec.errors import ArgumentRangeError, ArgumentTypeError, ConfigError
from kvcore.spec.errors import short_repr as _show

# A limit on everything (TigerBeetle): these bound what a config may ask for, so that a
# typo (a window of 10**12 tokens, bytes given where blocks are meant) is a ConfigError
# rather than a slow death or an allocation failure later. Each bound is what real engines
# use, times a wide margin; each says why.

# vLLM forms one KV group per distinct layer layout; real models have at most about 8
# (DeepSeek-V4: 4, Gemma-3 and gpt-oss: 2). Every hook's cost grows with the group count.
MAX_GROUPS = 64
# The longest contexts engines serve: 1M tokens (DeepSeek, Qwen-1M), 10M (Llama 4 Scout).
# 2**24 (16.7M) is above all of them; a window, a retained tail or an offload cap longer
# than any context is a unit mistake.
MAX_CONTEXT_TOKENS = 1 << 24
# Attention blocks are 1..256 tokens; hybrid Mamba layouts raise the attention block to
# about 1K..4K tokens so its page matches the state's. 65536 is 16x the largest.
MAX_TOKENS_PER_BLOCK = 1 << 16
# Offload chunks group 1..64 GPU blocks (vLLM's CPU block is a multiple of the GPU block;
# LMCache uses 256-token chunks). 1024 blocks per chunk is 16x that.
MAX_BLOCKS_PER_CHUNK = 1 << 10
# tokens_per_chunk (and so hash_block_tokens, which divides it): a 1M-token chunk already
# holds a whole DeepSeek context in one transfer; no lookup can hit a larger one.
MAX_CHUNK_TOKENS = 1 << 20
# GPU blocks per pool: ~14K for DeepSeek-V4 per stage, ~1M for a 0.5B model at 16-token
# blocks on a 192 GB GPU, a few million where the block is one token (SGLang page size 1).
# 2**24 (16.7M) covers these; 10**15 is a typo that would end in a torch allocation error.
MAX_GPU_BLOCKS = 1 << 24
# CPU chunks: at 4 KiB per chunk (already tiny) 2**28 chunks pin 1 TiB of host memory,
# more than the hosts engines run on; real chunks are 100 KiB and up.
MAX_CPU_BLOCKS = 1 << 28
# Workers are the engine's world size (TP x PP): 8..128 in the largest single-instance
# deployments (DeepSeek on 16 nodes x 8 GPUs); 1024 is 8x that.
MAX_WORKERS = 1 << 10
# Names are labels in reports and file stems; a path's component is at most 255 bytes.
MAX_NAME_CHARS = 256
KEY_GROUP_BYTES = 4
# A block hash longer than 64 bytes is no hash function an engine uses (SHA-256 is 32,
# vLLM's are 8-32).
MAX_HASH_BYTES = 64


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``.

    Rounding gets its own helper so a block count computed from a token count always says
    which way it rounds.
    """
    return -(-a // b)


class GroupKind(enum.Enum):
    """How a group's attention reaches back, which decides what a hit needs."""

    FULL = "full"
    SLIDING = "sliding"
    MAMBA = "mamba"


class StoreLevel(enum.Enum):
    """BLOCK skips chunks the request hit (someone stored them); REQUEST stores them again."""

    BLOCK = "block"
    REQUEST = "request"


class Status(enum.Enum):
    """A tier's answer for one key: READY (HIT), absent (MISS), or not known yet (PENDING)."""

    HIT = "hit"
    MISS = "miss"
    PENDING = "pending"


class _Pending:
    """The lookup answer "ask again next step"; a singleton so ``is PENDING`` reads well."""

    _instance: _Pending | None = None

    def __new__(cls) -> _Pending:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "PENDING"

    def __reduce__(self) -> str:
        return "PENDING"


PENDING = _Pending()
LookupResult = int | _Pending


@dataclass(frozen=True)
class GroupSpec:
    """One KV group: a set of layers sharing one layout.

    ``window_tokens`` is required for SLIDING and forbidden otherwise (MAMBA behaves as a
    window of one chunk). ``extra_retained_tokens`` says the engine keeps more than the
    window before a boundary (the reach grows by that much). ``is_draft`` marks the group
    holding a speculative drafter's layers: its trailing chunk is volatile.
    """

    kind: GroupKind
    tokens_per_block: int
    blocks_per_chunk: int = 1
    window_tokens: int | None = None
    is_draft: bool = False
    extra_retained_tokens: int = 0
    name: str = ""

    # The derived values below are the vocabulary's definitions (o, W, R, e), facts about
    # the type that both kvcore and the reference read, not rules: a wrong one is a spec
    # defect, pinned by tests/unit/test_spec_config.py, which the lock step cannot see.

    @cached_property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk

    @cached_property
    def window_chunks(self) -> int | None:
        """W: chunks a window needs at a chunk-aligned boundary; None for FULL."""
        if self.kind is GroupKind.SLIDING:
            assert_int(self.window_tokens)
            return cdiv(self.window_tokens, self.tokens_per_chunk)  # type: ignore[arg-type]
        if self.kind is GroupKind.MAMBA:
            return 1
        return None

    @property
    def reach_tokens(self) -> int:
        """R: tokens before a boundary T that the window reaches (SLIDING only)."""
        return (self.window_tokens or 0) - 1 + self.extra_retained_tokens

    @cached_property
    def extra_chunks(self) -> int:
        """e: 1 for a draft group (its last hit chunk is never served), else 0."""
        return 1 if self.is_draft else 0


def assert_int(value: object) -> None:
    """Narrow an Optional[int] for type checkers; config validation guarantees it."""
    if not isinstance(value, int):
        raise TypeError(f"expected int, got {value!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """The whole offloading set-up, validated once when built.

    ``num_cpu_blocks`` is the CPU tier's capacity in chunk slots PER GROUP: a slot holds
    one chunk of one group, every group has its own pool of ``num_cpu_blocks`` slots (ids
    0..num_cpu_blocks-1), and pinned memory is ``num_cpu_blocks`` x the sum over groups of
    the bytes of one chunk of the group. ``speculative`` says the engine runs EAGLE/MTP;
    then either some group is ``is_draft`` or ``draft_kv_elsewhere`` says the drafter's
    KV is not in any offloaded group. There is no "treat every group as draft"
    fallback (it zeroed hybrid Mamba hits upstream, vllm#52735).
    """

    groups: tuple[GroupSpec, ...]
    hash_block_tokens: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_workers: int = 1
    prompt_only: bool = False
    max_offload_tokens: int | None = None
    store_level: StoreLevel = StoreLevel.BLOCK
    speculative: bool = False
    draft_kv_elsewhere: bool = False
    store_alignment: bool = True
    name: str = field(default="", compare=False)
    max_pending_events: int = 65_536

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", _as_groups(self.groups))
        validate_config(self)
        check_pending_events(self.max_pending_events)

    # -- derived quantities (pure, recomputed; cheap) --------------------------------

    # Derived values are cached on first use: the config is frozen, and the store and
    # lookup rules ask for them on every step. Only type-level facts live here, values
    # the vocabulary defines (W, R, e, the shared MAMBA chunk size), never a rule: the
    # store keep rule, say, is kvcore's in ``kvcore.scheduler._rules`` and the spec's
    # in ``kvcore.spec.lookup.read_at_segment_end``, written apart so the lock step
    # compares two computations.

    @cached_property
    def has_window_groups(self) -> bool:
        return any(g.kind is not GroupKind.FULL for g in self.groups)

    @cached_property
    def mamba_align_tokens(self) -> int | None:
        """The MAMBA groups' shared tokens_per_chunk, or None without MAMBA groups."""
        sizes = {g.tokens_per_chunk for g in self.groups if g.kind is GroupKind.MAMBA}
        return next(iter(sizes)) if sizes else None

    def hashes_per_chunk(self, group: int) -> int:
        """Block hashes per chunk of ``group``; a group this config lacks is refused by
        name (a list index error would not say which config or which bound)."""
        if type(group) is not int:
            raise ArgumentTypeError("OffloadConfig.hashes_per_chunk", "group", group, "int",
                                    f"pass a group index in 0..{len(self.groups) - 1}")
        if not 0 <= group < len(self.groups):
            raise ArgumentRangeError("OffloadConfig.hashes_per_chunk", "group", group,
                                     f"0..{len(self.groups) - 1}",
                                     f"config {self.name!r} has {len(self.groups)} groups")
        return self.groups[group].tokens_per_chunk // self.hash_block_tokens


# The manager's event buffer holds at most ``max_pending_events`` keys' events (one
# ``KeyEvent`` each, about 100 bytes); when full the oldest are dropped and counted. The
# default, 65536, is several seconds of a busy tier (10k chunks/s) for an engine that
# drains every step, about 6 MiB; 2**24 (1.6 GiB) is the most any set-up needs. 0 means
# "no events": the engine never calls take_events. Keys dropped from the oldest event stay
# referenced until half of it is gone (the manager's ``_emit``): under twice the cap.
DEFAULT_MAX_PENDING_EVENTS = 65_536
MAX_PENDING_EVENTS = 1 << 24


def check_pending_events(value: object) -> None:
    """Raise ConfigError unless ``value`` is an int in ``0..MAX_PENDING_EVENTS``."""
    if type(value) is not int or not 0 <= value <= MAX_PENDING_EVENTS:
        raise ConfigError("max_pending_events", f"max_pending_events={value!r} must be an "
                          f"int in 0..{MAX_PENDING_EVENTS} (keys' events kept until "
                          "take_events; 0 keeps none); the default 65536 suits an engine "
                          "that calls take_events every step")


@dataclass(frozen=True)
class KeptOffsets:
    """A set of offsets in ``[0, period)`` held as sorted, disjoint ``[start, stop)`` spans.

    The keep rule's offsets are a few contiguous runs (one per needed range, wrapped at
    the segment end), as long as the window; spans keep membership and size O(spans)
    instead of materializing a window's worth of ints.
    """

    period: int
    spans: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, period: int, spans: list[tuple[int, int]]) -> KeptOffsets:
        """Merge overlapping or touching spans (each within ``[0, period]``).

        An empty span (``start >= stop``, a negative ``stop`` included) is dropped, so a
        caller may always pass a range's wrapped part and leave it empty when nothing wraps.
        """
        merged: list[tuple[int, int]] = []
        for start, stop in sorted(s for s in spans if s[0] < s[1]):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
            else:
                merged.append((start, stop))
        return cls(period, tuple(merged))

    def __contains__(self, offset: object) -> bool:
        if isinstance(offset, bool) or not isinstance(offset, int):
            return False
        for start, stop in self.spans:  # noqa: SIM110 (a loop: any() costs a generator)
            if start <= offset < stop:
                return True
        return False

    def __len__(self) -> int:
        return sum(stop - start for start, stop in self.spans)

    def __iter__(self) -> Iterator[int]:
        for start, stop in self.spans:
            yield from range(start, stop)


def _check_int(name: str, value: object, lo: int, hi: int, hint: str, why: str) -> None:
    """Raise ConfigError unless ``value`` is an int (not a bool, not a float) in [lo, hi].

    ``why`` is the limit's reason, quoted in the message so the user can judge the bound.
    """
    # Exactly int: a bool is no count, and an int subclass may compare as it likes (one
    # whose ``>`` always answers False passed num_gpu_blocks=10**15 through the bound).
    if type(value) is not int:
        raise ConfigError(name, f"{name}={_show(value)} ({type(value).__name__}) is not an "
                          f"int; {hint}")
    if value < lo:
        raise ConfigError(name, f"{name}={value} is below the minimum {lo}; {hint}")
    if value > hi:
        raise ConfigError(name, f"{name}={value} exceeds the limit {hi} ({why}); {hint}")


def _check_bool(name: str, value: object) -> None:
    """Raise ConfigError unless ``value`` is exactly True or False.

    A truthy stand-in is never read as a flag: ``"no"`` and ``"false"`` are truthy strings
    and ``1`` is an int, and each once turned a flag on.
    """
    if not isinstance(value, bool):
        leaf = name.rsplit(".", 1)[-1]
        raise ConfigError(name, f"{name}={_show(value)} ({type(value).__name__}) is not a "
                          f"bool; set True or False (in TOML: {leaf} = true or {leaf} = false, "
                          "without quotes)")


def _check_name(name: str, value: object) -> None:
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise ConfigError(name, f"{name}={_show(value)} must be a str of at most "
                          f"{MAX_NAME_CHARS} characters (a label for reports)")


def _check_window(prefix: str, g: GroupSpec) -> None:
    if g.kind is GroupKind.SLIDING:
        _check_int(f"{prefix}.window_tokens", g.window_tokens, 1, MAX_CONTEXT_TOKENS,
                   "a SLIDING group needs its attention window in tokens",
                   "longer than any served context")
    elif g.window_tokens is not None:
        raise ConfigError(f"{prefix}.window_tokens",
                          f"window_tokens={_show(g.window_tokens)} is set on a {g.kind.name} "
                          "group; only SLIDING groups have a window (MAMBA is one chunk), "
                          "remove it or make the group SLIDING")
    _check_int(f"{prefix}.extra_retained_tokens", g.extra_retained_tokens, 0,
               MAX_CONTEXT_TOKENS, "use 0 unless the engine keeps more than the window",
               "longer than any served context")
    if g.extra_retained_tokens and g.kind is not GroupKind.SLIDING:
        raise ConfigError(f"{prefix}.extra_retained_tokens",
                          f"extra_retained_tokens={g.extra_retained_tokens} applies to SLIDING "
                          "groups only; remove it")


def validate_group(index: int, g: GroupSpec) -> None:
    """Raise ConfigError naming ``groups[index].<field>`` for any inconsistent group."""
    prefix = f"groups[{index}]"
    if not isinstance(g, GroupSpec):
        raise ConfigError(prefix, f"{prefix}={_show(g)} ({type(g).__name__}) is not a "
                          "GroupSpec; describe each group with a GroupSpec")
    if not isinstance(g.kind, GroupKind):
        raise ConfigError(f"{prefix}.kind", f"kind={_show(g.kind)} must be a GroupKind "
                          "(FULL, SLIDING or MAMBA)")
    _check_int(f"{prefix}.tokens_per_block", g.tokens_per_block, 1, MAX_TOKENS_PER_BLOCK,
               "set the group's GPU block size in tokens", "16x the largest engine block")
    _check_int(f"{prefix}.blocks_per_chunk", g.blocks_per_chunk, 1, MAX_BLOCKS_PER_CHUNK,
               "use 1 to offload each GPU block as its own chunk",
               "16x the largest offload chunk in use")
    if g.tokens_per_chunk > MAX_CHUNK_TOKENS:
        raise ConfigError(f"{prefix}.blocks_per_chunk",
                          f"tokens_per_block x blocks_per_chunk = {g.tokens_per_chunk} tokens "
                          f"per chunk exceeds the limit {MAX_CHUNK_TOKENS} (a chunk that holds "
                          "a whole 1M-token context); use fewer blocks per chunk")
    _check_window(prefix, g)
    _check_bool(f"{prefix}.is_draft", g.is_draft)
    _check_name(f"{prefix}.name", g.name)


def _check_counts(cfg: OffloadConfig) -> None:
    """The sizes: hash block, pools, workers, the offload cap."""
    _check_int("hash_block_tokens", cfg.hash_block_tokens, 1, MAX_CHUNK_TOKENS,
               "set the engine's prefix-hash block size in tokens",
               "it divides tokens_per_chunk, which is bounded by the same limit")
    for i, g in enumerate(cfg.groups):
        o = g.tokens_per_chunk
        if o % cfg.hash_block_tokens != 0:
            divisor = math.gcd(*(x.tokens_per_chunk for x in cfg.groups))
            raise ConfigError(
                "hash_block_tokens",
                f"hash_block_tokens={cfg.hash_block_tokens} does not divide "
                f"tokens_per_chunk={o} of group {i} ({g.kind.name}); choose a divisor of "
                f"every group's tokens_per_chunk, e.g. {divisor}.")
    _check_int("num_gpu_blocks", cfg.num_gpu_blocks, 2, MAX_GPU_BLOCKS,
               "set the GPU block pool size in blocks (id 0 is the null block, so at least 2)",
               "16x a 1M-block pool")
    _check_int("num_cpu_blocks", cfg.num_cpu_blocks, 1, MAX_CPU_BLOCKS,
               "set the CPU tier's capacity in chunk slots per group, not bytes",
               "1 TiB of pinned memory even at 4 KiB per chunk")
    _check_int("num_workers", cfg.num_workers, 1, MAX_WORKERS,
               "use the engine's world size (TP x PP)", "8x the largest TP x PP")
    if cfg.max_offload_tokens is not None:
        _check_int("max_offload_tokens", cfg.max_offload_tokens, 0, MAX_CONTEXT_TOKENS,
                   "use None (omit it in TOML) for no cap, or a token count >= 0",
                   "longer than any served context")


def _check_flags(cfg: OffloadConfig) -> None:
    for flag in ("prompt_only", "speculative", "draft_kv_elsewhere", "store_alignment"):
        _check_bool(flag, getattr(cfg, flag))
    if not isinstance(cfg.store_level, StoreLevel):
        raise ConfigError("store_level", f"store_level={_show(cfg.store_level)} must be "
                          "StoreLevel.BLOCK or StoreLevel.REQUEST (in TOML: \"block\" or "
                          "\"request\")")
    _check_name("name", cfg.name)


def validate_config(cfg: OffloadConfig) -> None:
    """All config rules, in one place; each failure names its field and the fix.

    Types and ranges of every field come first, so the consistency rules below read only
    well-typed, bounded values.
    """
    if not cfg.groups:
        raise ConfigError("groups", "no groups given; describe at least one KV group")
    if len(cfg.groups) > MAX_GROUPS:
        raise ConfigError("groups", f"{len(cfg.groups)} groups exceed the limit {MAX_GROUPS} "
                          "(8x the most any model has); merge layers that share a layout")
    for i, g in enumerate(cfg.groups):
        validate_group(i, g)
    _check_counts(cfg)
    _check_flags(cfg)
    mamba = {g.tokens_per_chunk for g in cfg.groups if g.kind is GroupKind.MAMBA}
    if len(mamba) > 1:
        raise ConfigError("groups", f"MAMBA groups have tokens_per_chunk {sorted(mamba)}; all "
                          "MAMBA groups must share one chunk size (state exists only at "
                          "chunk ends)")
    drafts = [i for i, g in enumerate(cfg.groups) if g.is_draft]
    if cfg.speculative and not drafts and not cfg.draft_kv_elsewhere:
        raise ConfigError("speculative", "speculative decoding is declared but no group has "
                          "is_draft=True; flag the group holding the EAGLE/MTP drafter's "
                          "layers, or set draft_kv_elsewhere=True if the drafter's KV is not "
                          "in any offloaded group (kvcore never guesses 'all groups')")
    if drafts and not cfg.speculative:
        raise ConfigError("speculative", f"group {drafts[0]} has is_draft=True but "
                          "speculative=False; set speculative=True (a draft group only "
                          "exists with speculative decoding)")
    if drafts and cfg.draft_kv_elsewhere:
        raise ConfigError("draft_kv_elsewhere", "draft_kv_elsewhere=True contradicts "
                          f"is_draft=True on group {drafts[0]}; set only one of them")


def _as_groups(groups: object) -> tuple[GroupSpec, ...]:
    """The groups as a tuple; anything but a list or tuple is refused before it is read."""
    if not isinstance(groups, list | tuple):
        raise ConfigError("groups", f"groups={_show(groups)} ({type(groups).__name__}) is "
                          "not a tuple or list; pass a tuple of GroupSpec")
    return tuple(groups)


# -- keys -------------------------------------------------------------------------------

Key = bytes


def make_key(block_hash: bytes, group: int) -> Key:
    """The key of one chunk of one group: the chunk's last chained hash plus the group.

    The group is appended as fixed-width big-endian bytes, so two (hash, group) pairs give
    the same key only if both parts are equal, whatever the hash lengths (K1).
    """
    # ``bytes(8)`` is eight zero bytes and ``bytes("abc")`` a TypeError: only bytes is a hash.
    if type(block_hash) is not bytes:
        raise ArgumentTypeError("make_key", "block_hash", block_hash, "bytes",
                                "pass the block's hash as bytes")
    if len(block_hash) > MAX_HASH_BYTES:
        raise ArgumentRangeError("make_key", "len(block_hash)", len(block_hash),
                                 f"0..{MAX_HASH_BYTES}", "pass one block hash, not a chain")
    if type(group) is not int:
        raise ArgumentTypeError("make_key", "group", group, "int", "pass the group's index")
    if not 0 <= group < (1 << (8 * KEY_GROUP_BYTES)):
        raise ArgumentRangeError("make_key", "group", group,
                                 f"0..2**{8 * KEY_GROUP_BYTES}-1 (it must fit in "
                                 f"{KEY_GROUP_BYTES} bytes)", "pass the group's index")
    return block_hash + group.to_bytes(KEY_GROUP_BYTES, "big")


def key_group(key: Key) -> int:
    return int.from_bytes(key[-KEY_GROUP_BYTES:], "big")


def key_hash(key: Key) -> bytes:
    return key[:-KEY_GROUP_BYTES]


def group_keys(cfg: OffloadConfig, group: int,
               hashes: tuple[bytes, ...] | list[bytes]) -> list[Key]:
    """Keys of every complete chunk of ``group``: chunk i ends at hash ((i+1)*hpc - 1)."""
    hpc = cfg.hashes_per_chunk(group)
    return [make_key(hashes[(i + 1) * hpc - 1], group) for i in range(len(hashes) // hpc)]
