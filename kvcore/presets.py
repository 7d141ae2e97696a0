"""KV-group layouts of real models, so engine CI can check the layout it actually runs.

Each preset states where its numbers come from. Block sizes are the engines' common
choices for those models; pass ``--config`` with your own TOML when yours differ.
``num_cpu_blocks`` is the number of CPU chunk slots of EACH group (one slot holds one chunk
of one group): pinned memory is ``num_cpu_blocks`` x the sum over groups of the bytes one
chunk of the group occupies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace

from kvcore.spec.errors import ConfigError, short_repr
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA


def llama3_eagle3() -> OffloadConfig:
    """Llama-3.x with an EAGLE-3 drafter: one full-attention group, 16-token blocks.

    The drafter's single layer shares the target's KV layout, so it merges into the one
    group, which therefore holds the volatile draft tail.
    """
    return OffloadConfig((GroupSpec(FULL, 16, is_draft=True, name="attn+eagle3"),),
                         hash_block_tokens=16, num_gpu_blocks=8192, num_cpu_blocks=16384,
                         speculative=True, name="llama3-eagle3")


def deepseek_v3_mtp() -> OffloadConfig:
    """DeepSeek-V3/R1 with MTP: one MLA group (64-token blocks); the MTP layer merges in."""
    return OffloadConfig((GroupSpec(FULL, 64, is_draft=True, name="mla+mtp"),),
                         hash_block_tokens=64, num_gpu_blocks=4096, num_cpu_blocks=8192,
                         speculative=True, name="deepseek-v3-mtp")


def deepseek_v4_mtp() -> OffloadConfig:
    """DeepSeek-V4 with MTP: the layout of the vllm#44780 crash report.

    Four groups (model code facts): compressed MLA with 256-token blocks (full
    attention), the sliding-window MLA cache with 64-token blocks and a 128-token window,
    the C4 compressor state (4-token blocks, window 8) and the C128 compressor state
    (8-token blocks, window 128). Hashes are at gcd = 4 tokens. The draft flag sits on the
    group holding the MTP layer's sliding-window cache. GPU blocks: 14,067 per pipeline
    stage (vllm#50821). ``num_cpu_blocks`` is CPU chunk slots per group: 65,536 per group
    is the same 262,144 slots in all that one shared pool had, and holds a 420K-token
    request (about 46K chunks over all groups under the window keep rule) in every group.
    Pinned memory is 65,536 x the sum of the four groups' bytes per chunk.
    """
    groups = (
        GroupSpec(FULL, 256, name="mla"),
        GroupSpec(SLIDING, 64, window_tokens=128, is_draft=True, name="swa+mtp"),
        GroupSpec(SLIDING, 4, window_tokens=8, name="c4-state"),
        GroupSpec(SLIDING, 8, window_tokens=128, name="c128-state"),
    )
    return OffloadConfig(groups, hash_block_tokens=4, num_gpu_blocks=14067,
                         num_cpu_blocks=65536, speculative=True, name="deepseek-v4-mtp")


def gemma3() -> OffloadConfig:
    """Gemma-3: full attention plus 1024-token sliding-window layers (16-token blocks)."""
    groups = (GroupSpec(FULL, 16, name="global"),
              GroupSpec(SLIDING, 16, window_tokens=1024, name="local"))
    return OffloadConfig(groups, hash_block_tokens=16, num_gpu_blocks=8192,
                         num_cpu_blocks=16384, name="gemma3")


def gpt_oss() -> OffloadConfig:
    """gpt-oss: alternating full and 128-token sliding-window attention (16-token blocks)."""
    groups = (GroupSpec(FULL, 16, name="full"),
              GroupSpec(SLIDING, 16, window_tokens=128, name="sliding"))
    return OffloadConfig(groups, hash_block_tokens=16, num_gpu_blocks=8192,
                         num_cpu_blocks=16384, name="gpt-oss")


def qwen3_next_mtp() -> OffloadConfig:
    """Qwen3-Next with MTP: gated-attention (full) layers plus Gated DeltaNet (Mamba-style
    state), 64-token blocks with state cached per chunk; the MTP layer is full attention
    and shares that group (the set-up of vllm#52735, whose all-groups fallback zeroed
    every hit)."""
    groups = (GroupSpec(FULL, 64, is_draft=True, name="attn+mtp"),
              GroupSpec(MAMBA, 64, name="gdn"))
    return OffloadConfig(groups, hash_block_tokens=64, num_gpu_blocks=4096,
                         num_cpu_blocks=8192, speculative=True, name="qwen3-next-mtp")


PRESETS: dict[str, Callable[[], OffloadConfig]] = {
    "deepseek-v4-mtp": deepseek_v4_mtp,
    "deepseek-v3-mtp": deepseek_v3_mtp,
    "llama3-eagle3": llama3_eagle3,
    "gemma3": gemma3,
    "gpt-oss": gpt_oss,
    "qwen3-next-mtp": qwen3_next_mtp,
}
DEFAULT_PRESET = "deepseek-v4-mtp"


def preset(name: str, /, **overrides: object) -> OffloadConfig:
    """The named preset, with fields overridden (validated again, like any config).

    ``name`` is positional-only, so the config's own ``name`` field can be overridden."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError("preset", f"preset={short_repr(name)} is unknown; choose one of "
                          f"{', '.join(sorted(PRESETS))}")
    unknown = sorted(set(overrides) - {f.name for f in fields(OffloadConfig)})
    if unknown:
        raise ConfigError(unknown[0], f"{unknown[0]} is not an OffloadConfig field; known "
                          f"fields: {', '.join(f.name for f in fields(OffloadConfig))}")
    base = PRESETS[name]()
    return replace(base, **overrides) if overrides else base  # type: ignore[arg-type]
