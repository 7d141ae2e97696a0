"""`kvcore check` on a layout of 16,384-token chunks (a valid config at its limits).

Goal: the check's own harness sizes what it builds from the user's layout, so a valid
layout is never failed for the harness's bad call. Found by a review: the directed
scenarios handed out GPU ids past a fixed 4,096-block pool (X2, "raise num_gpu_blocks",
which the user could not fix), the transfer stage doubled 1,024-block chunks past the
config limit (X2, a ConfigError), and the bad-calls stage sized its pool for the context
while aligned prompts are padded to a whole chunk (a HarnessLimit reported as a crash).
Each test below failed that way before.
"""

from __future__ import annotations

from kvcore import _check, _enginecheck
from kvcore._scenarios import run_scenarios
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig

BIG = OffloadConfig((GroupSpec(GroupKind.FULL, 16, 1024),), hash_block_tokens=16,
                    num_gpu_blocks=4096, num_cpu_blocks=8192)


def test_the_directed_scenarios_fit_their_pool() -> None:
    run_scenarios(BIG)


def test_chunks_too_large_to_widen_keep_their_size() -> None:
    wide = _enginecheck._layout(BIG, 2)
    assert wide.groups == BIG.groups
    small = OffloadConfig((GroupSpec(GroupKind.FULL, 16, 2),), hash_block_tokens=16,
                          num_gpu_blocks=64, num_cpu_blocks=64)
    assert _enginecheck._layout(small, 2).groups[0].blocks_per_chunk == 4


def test_the_bad_calls_stage_holds_a_padded_prompt() -> None:
    result = _check.BatteryResult()
    _check.run_sims(BIG, 1, result, preset="big.toml", hostile=True)
    assert result.failure is None, result.failure
