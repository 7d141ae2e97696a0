"""The simulator's Python API refuses a bad option by name, before anything runs.

A review found that ``SimOptions`` checked none of its fields: a string count failed deep
in a run with a bare TypeError, a NaN or negative rate ran as if it were a share, a
10**30-token context hung making prompts, ``max_running=0`` burned 20,000 steps to report
a liveness failure, and ``lockstep=True`` without a policy failed on most seeds (the
drawn policy was ARC). Each row below did one of those; each is now a ``ConfigError``
naming the field. Mutant: any one field's check removed from ``__post_init__``.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.presets import preset
from kvcore.sim import SimOptions, simulate
from kvcore.spec.errors import ConfigError

SMALL: dict[str, Any] = {"requests": 2, "context_tokens": 64, "max_new_tokens": 4,
                         "fail_rate": 0.0, "delay_rate": 0.0, "abort_rate": 0.0,
                         "reset_rate": 0.0, "num_workers": 1, "policy": "lru"}

BAD = [("requests", "2"), ("requests", 2.5), ("requests", True), ("requests", -3),
       ("context_tokens", 0), ("context_tokens", 10**30), ("context_tokens", float("nan")),
       ("max_new_tokens", 0), ("prefill_budget", 0), ("prefill_budget", 10**30),
       ("max_running", 0), ("max_running", 1.5), ("spec_tokens", -1), ("spec_tokens", 10**30),
       ("layers", 2.5), ("row_elems", "4"), ("max_steps", 0), ("seed", "x"), ("seed", None),
       ("fail_rate", float("nan")), ("fail_rate", 5), ("fail_rate", "x"),
       ("accept_rate", -1.0), ("reset_rate", float("inf")), ("preempt_rate", 1.0),
       ("shared_prefix_rate", True), ("lockstep", "x"), ("speculative_off", "no"),
       ("own_step_type", 1), ("policy", ""), ("policy", "LRU"),
       ("stream_fault_rate", 0.5)]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_option_is_a_config_error_naming_it(name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        SimOptions(**{**SMALL, name: value})
    assert info.value.field == name


def test_contradictory_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="lockstep=True with hostile=True"):
        SimOptions(**SMALL, lockstep=True, hostile=True)
    with pytest.raises(ConfigError, match="needs policy='lru'"):
        SimOptions(**{**SMALL, "policy": "arc"}, lockstep=True)


@pytest.mark.parametrize(("config", "options", "device", "field"), [
    (None, SimOptions(**SMALL), "cpu", "config"),
    ("gemma3", SimOptions(**SMALL), "cpu", "config"),
    (preset("gemma3"), None, "cpu", "options"),
    (preset("gemma3"), dict(SMALL), "cpu", "options"),
    (preset("gemma3"), SimOptions(**SMALL), "tpu", "device"),
    (preset("gemma3"), SimOptions(**SMALL), 3, "device"),
    (preset("gemma3"), SimOptions(**SMALL), "cuda:x", "device"),
], ids=["config None", "config str", "options None", "options dict", "device tpu",
        "device 3", "device cuda:x"])
def test_simulate_names_a_bad_config_options_or_device(config: Any, options: Any,
                                                       device: Any, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        simulate(config, options, device=device)
    assert info.value.field == field


def test_lockstep_without_a_policy_runs_on_every_seed() -> None:
    """The drawn policy was ARC on seeds 0, 1, 3, 4 and 5, which lockstep refused."""
    for seed in range(6):
        opts = SimOptions(**{**SMALL, "policy": None, "seed": seed}, lockstep=True)
        assert opts.drawn().policy == "lru"
    simulate(preset("gemma3"), SimOptions(**{**SMALL, "policy": None}, lockstep=True))


@pytest.mark.parametrize(("layout_cap", "option_cap", "applied"), [
    (None, 256, 256), (4096, 256, 256), (256, 4096, 256), (4096, None, 4096)])
def test_the_tighter_store_cap_applies(layout_cap: int | None, option_cap: int | None,
                                       applied: int) -> None:
    """``max_offload_tokens`` was dropped whenever the layout had a cap of its own, so a
    run asked to cap stores at 256 tokens stored up to the layout's 4096."""
    from kvcore.sim._engine import Simulator

    sim = Simulator(preset("gemma3", max_offload_tokens=layout_cap),
                    SimOptions(**SMALL, max_offload_tokens=option_cap))
    assert sim.config.max_offload_tokens == applied
