"""Types of the spec: group layouts, the validated configuration, keys, and chunk arithmetic.

Everything here is a frozen dataclass or a pure function over ints, so CrossHair can read it
and the scheduler, the tests and the proofs all share one definition. Validation happens
once, in ``OffloadConfig.__post_init__``; a config object that exists is a valid config.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from functools import cached_property

from kvcore.spec.errors import ConfigError

# A limit on everything (TigerBeetle): these bound what a config may ask for, so that a
# typo (a window of 10**12 tokens) is an error rather than a slow death.
MAX_GROUPS = 64
MAX_TOKENS_PER_BLOCK = 1 << 20
MAX_BLOCKS_PER_CHUNK = 1 << 10
MAX_WORKERS = 1 << 12
KEY_GROUP_BYTES = 4


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

    ``num_cpu_blocks`` is the CPU tier's capacity in chunks. ``speculative`` says the engine
    runs EAGLE/MTP; then either some group is ``is_draft`` or ``draft_kv_elsewhere`` says
    the drafter's KV is not in any offloaded group. There is no "treat every group as draft"
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        validate_config(self)

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
        return self.groups[group].tokens_per_chunk // self.hash_block_tokens


def _check_positive(name: str, value: object, hint: str, upper: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"{name}={value!r} must be an int; {hint}")
    if value <= 0:
        raise ConfigError(name, f"{name}={value} must be positive; {hint}")
    if upper is not None and value > upper:
        raise ConfigError(name, f"{name}={value} exceeds the limit {upper}; {hint}")


def validate_group(index: int, g: GroupSpec) -> None:
    """Raise ConfigError naming ``groups[index].<field>`` for any inconsistent group."""
    prefix = f"groups[{index}]"
    if not isinstance(g.kind, GroupKind):
        raise ConfigError(f"{prefix}.kind", f"kind={g.kind!r} must be a GroupKind "
                          "(FULL, SLIDING or MAMBA)")
    _check_positive(f"{prefix}.tokens_per_block", g.tokens_per_block,
                    "set the group's GPU block size in tokens", MAX_TOKENS_PER_BLOCK)
    _check_positive(f"{prefix}.blocks_per_chunk", g.blocks_per_chunk,
                    "use 1 to offload each GPU block as its own chunk", MAX_BLOCKS_PER_CHUNK)
    if g.kind is GroupKind.SLIDING:
        _check_positive(f"{prefix}.window_tokens", g.window_tokens,
                        "a SLIDING group needs its attention window in tokens")
    elif g.window_tokens is not None:
        raise ConfigError(f"{prefix}.window_tokens",
                          f"window_tokens={g.window_tokens} is set on a {g.kind.name} group; "
                          "only SLIDING groups have a window (MAMBA is one chunk), "
                          "remove it or make the group SLIDING")
    if isinstance(g.extra_retained_tokens, bool) or not isinstance(g.extra_retained_tokens, int) \
            or g.extra_retained_tokens < 0:
        raise ConfigError(f"{prefix}.extra_retained_tokens",
                          f"extra_retained_tokens={g.extra_retained_tokens!r} must be an int "
                          ">= 0 (0 unless the engine keeps more than the window)")
    if g.extra_retained_tokens and g.kind is not GroupKind.SLIDING:
        raise ConfigError(f"{prefix}.extra_retained_tokens",
                          "extra_retained_tokens applies to SLIDING groups only")


def validate_config(cfg: OffloadConfig) -> None:
    """All config rules, in one place; each failure names its field and the fix."""
    if not cfg.groups:
        raise ConfigError("groups", "no groups given; describe at least one KV group")
    if len(cfg.groups) > MAX_GROUPS:
        raise ConfigError("groups", f"{len(cfg.groups)} groups exceed the limit {MAX_GROUPS}")
    for i, g in enumerate(cfg.groups):
        validate_group(i, g)
    _check_positive("hash_block_tokens", cfg.hash_block_tokens,
                    "set the engine's prefix-hash block size in tokens")
    for i, g in enumerate(cfg.groups):
        o = g.tokens_per_chunk
        if o % cfg.hash_block_tokens != 0:
            divisor = math.gcd(*(x.tokens_per_chunk for x in cfg.groups))
            raise ConfigError(
                "hash_block_tokens",
                f"hash_block_tokens={cfg.hash_block_tokens} does not divide "
                f"tokens_per_chunk={o} of group {i} ({g.kind.name}); choose a divisor of "
                f"every group's tokens_per_chunk, e.g. {divisor}.")
    _check_positive("num_gpu_blocks", cfg.num_gpu_blocks,
                    "set the GPU block pool size (block 0 is the null block)")
    if cfg.num_gpu_blocks < 2:
        raise ConfigError("num_gpu_blocks", f"num_gpu_blocks={cfg.num_gpu_blocks} leaves no "
                          "usable block (id 0 is the null block); use at least 2")
    _check_positive("num_cpu_blocks", cfg.num_cpu_blocks,
                    "set the CPU tier's capacity in chunks")
    _check_positive("num_workers", cfg.num_workers,
                    "use the engine's world size (TP x PP)", MAX_WORKERS)
    if cfg.max_offload_tokens is not None and (
            isinstance(cfg.max_offload_tokens, bool)
            or not isinstance(cfg.max_offload_tokens, int) or cfg.max_offload_tokens < 0):
        raise ConfigError("max_offload_tokens", f"max_offload_tokens={cfg.max_offload_tokens!r}"
                          " must be None (no cap) or an int >= 0")
    if not isinstance(cfg.store_level, StoreLevel):
        raise ConfigError("store_level", f"store_level={cfg.store_level!r} must be "
                          "StoreLevel.BLOCK or StoreLevel.REQUEST")
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


# -- keys -------------------------------------------------------------------------------

Key = bytes


def make_key(block_hash: bytes, group: int) -> Key:
    """The key of one chunk of one group: the chunk's last chained hash plus the group.

    The group is appended as fixed-width big-endian bytes, so two (hash, group) pairs give
    the same key only if both parts are equal, whatever the hash lengths (K1).
    """
    if not 0 <= group < (1 << (8 * KEY_GROUP_BYTES)):
        raise ValueError(f"group={group} does not fit in {KEY_GROUP_BYTES} bytes")
    return bytes(block_hash) + group.to_bytes(KEY_GROUP_BYTES, "big")


def key_group(key: Key) -> int:
    return int.from_bytes(key[-KEY_GROUP_BYTES:], "big")


def key_hash(key: Key) -> bytes:
    return key[:-KEY_GROUP_BYTES]


def group_keys(cfg: OffloadConfig, group: int,
               hashes: tuple[bytes, ...] | list[bytes]) -> list[Key]:
    """Keys of every complete chunk of ``group``: chunk i ends at hash ((i+1)*hpc - 1)."""
    hpc = cfg.hashes_per_chunk(group)
    return [make_key(hashes[(i + 1) * hpc - 1], group) for i in range(len(hashes) // hpc)]
