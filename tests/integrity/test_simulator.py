"""Integrity: real bytes through the real scheduler, manager and copy library.

Goal: every loaded block holds exactly the bytes its prefix was stored from, on every
preset, under faults (failed, late and out-of-order reports, aborts, resets, memory
pressure), with every runtime invariant on. Method: seeded runs of ``kvcore.sim`` (each
block's bytes are a function of its prefix, so any wrong load fails the run), plus the
Hypothesis state machine over the simulator with the active profile.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvcore._check import sim_options
from kvcore.presets import PRESETS, preset
from kvcore.sim import SimOptions, Simulator, simulate
from kvcore.sim._machine import make_machine


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("seed", range(6))
def test_seeded_runs_are_clean(name: str, seed: int) -> None:
    sim = Simulator(preset(name), sim_options(seed), check=True)
    counters = sim.run()
    assert counters.finished + counters.aborted > 0
    assert not sim.scheduler.has_pending_work()


@pytest.mark.parametrize("name", ["gpt-oss", "llama3-eagle3", "deepseek-v4-mtp"])
def test_runs_load_and_verify_something(name: str) -> None:
    """The integrity check must not pass vacuously: loads happen and are verified."""
    report = simulate(preset(name), SimOptions(seed=3, requests=16, context_tokens=600,
                                               fail_rate=0.0, reset_rate=0.0,
                                               abort_rate=0.0, shared_prefix_rate=1.0))
    assert report.loads_verified > 0
    assert report.blocks_verified > 0
    assert report.invariants_checked["L1"] > 0


def test_same_seed_same_run() -> None:
    a = simulate(preset("deepseek-v4-mtp"), sim_options(5))
    b = simulate(preset("deepseek-v4-mtp"), sim_options(5))
    keys = ("steps", "chunks_stored", "chunks_loaded", "chunks_evicted", "bytes_loaded",
            "failed_loads", "failed_stores", "invariants_checked")
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}


def test_corrupted_cpu_tier_is_detected() -> None:
    """Negative space: flip the bytes of the CPU tier and a later load must fail."""
    from kvcore.sim import IntegrityError

    sim = Simulator(preset("gpt-oss"), SimOptions(seed=1, requests=12, context_tokens=400,
                                                  shared_prefix_rate=1.0, fail_rate=0.0,
                                                  reset_rate=0.0, abort_rate=0.0))
    original = sim.transfer.submit

    def submit(plan):  # type: ignore[no-untyped-def]
        if plan.kind.value == "load":
            for group in range(len(sim.config.groups)):
                for t in range(sim.transfer.num_tensors(group)):
                    cpu = sim.transfer.cpu_tensor(group, t)
                    cpu.view(-1)[::7] ^= 0x5A
        return original(plan)

    sim.transfer.submit = submit  # type: ignore[method-assign]
    with pytest.raises(IntegrityError):
        sim.run()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_state_machine(name: str) -> None:
    machine = make_machine(preset(name))
    run_state_machine_as_test(machine, settings=settings(
        settings.default, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_crash_shape_420k_runs_clean() -> None:
    """The shape of the vllm#44780 report: DeepSeek-V4 + MTP, a 420K-token context
    reloaded by a follow-up (a 4-token group's block table holds ~105K entries)."""
    report = simulate(preset("deepseek-v4-mtp"),
                      SimOptions(seed=0, requests=2, context_tokens=420_000,
                                 prefill_budget=16_384, max_new_tokens=4,
                                 shared_prefix_rate=1.0, follow_up_rate=1.0, fail_rate=0.0,
                                 delay_rate=0.0, abort_rate=0.0, reset_rate=0.0,
                                 num_workers=2, max_running=1))
    assert report.loads_verified >= 1
    assert report.offload_hit_tokens > 300_000


def _sim(name: str, check: bool = True, **options: object) -> Simulator:
    base: dict[str, object] = {"seed": 2, "requests": 16, "context_tokens": 400,
                               "shared_prefix_rate": 1.0, "fail_rate": 0.0,
                               "reset_rate": 0.0, "abort_rate": 0.0}
    base.update(options)
    return Simulator(preset(name), SimOptions(**base), check=check)  # type: ignore[arg-type]


def test_a_load_that_skips_a_promised_block_is_caught() -> None:
    """The coverage half of the byte check: a load plan that leaves the first block it
    should fill untouched (first_unfilled one too far) passes the plan's own byte check
    (every block it copies is right) but not coverage. Runtime checks are off, so the
    simulator's own byte check must catch it (with them on, L3 fires first)."""
    from unittest import mock

    from kvcore.scheduler import _rules
    from kvcore.sim import IntegrityError

    original = _rules.first_unfilled

    def skips_one(table, valid_blocks, end):  # type: ignore[no-untyped-def]
        return min(original(table, valid_blocks, end) + 1, end)
    sim = _sim("gpt-oss", check=False)
    with mock.patch.object(_rules, "first_unfilled", skips_one), \
            pytest.raises(IntegrityError, match="told loaded"):
        sim.run()
    sim.transfer.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_runs_exercise_eviction_order_for_both_policies(policy: str) -> None:
    sim = _sim("deepseek-v4-mtp", policy=policy, num_cpu_blocks=48)
    sim.run()
    assert sim.manager.checked.get("M2", 0) > 10
    assert sim.manager.real.policy.name == policy


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_an_eviction_of_the_wrong_victim_is_caught(policy: str) -> None:
    """M2 in the simulator: a policy that evicts its most recent candidates first breaks
    no safety rule (M1 holds) but is not the policy's order."""
    from unittest import mock

    from kvcore.manager import POLICIES
    from kvcore.spec.errors import InvariantViolation

    cls = POLICIES[policy]
    original = cls.choose

    def newest_first(self, n, can_evict):  # type: ignore[no-untyped-def]
        chosen = original(self, n, can_evict)
        if chosen is None:
            return None
        pool = [k for k in reversed(list(getattr(self, "_order", None) or
                                          [*self._t2, *self._t1])) if can_evict(k)]
        return pool[:n]
    sim = _sim("deepseek-v4-mtp", policy=policy, num_cpu_blocks=48)
    with mock.patch.object(cls, "choose", newest_first), \
            pytest.raises(InvariantViolation) as caught:
        sim.run()
    sim.transfer.close()
    assert caught.value.ids == ["M2"]


def test_variants_make_the_storable_prefix_fall_below_the_frontier() -> None:
    """prompt_only, a config cap and per-request caps: fewer chunks are stored than the
    same seed stores without them, and the run stays clean."""
    plain = simulate(preset("gpt-oss"), SimOptions(seed=4, requests=12, context_tokens=300,
                                                   fail_rate=0.0, reset_rate=0.0,
                                                   abort_rate=0.0))
    capped = simulate(preset("gpt-oss"), SimOptions(seed=4, requests=12, context_tokens=300,
                                                    fail_rate=0.0, reset_rate=0.0,
                                                    abort_rate=0.0, prompt_only=True,
                                                    max_offload_tokens=150,
                                                    request_cap_rate=0.5))
    assert 0 < capped.chunks_stored < plain.chunks_stored


@pytest.mark.parametrize(("name", "gpu_blocks"), [("llama3-eagle3", 40),
                                                  ("deepseek-v4-mtp", 700)])
def test_preempted_requests_leave_the_step_and_resume_whole(name: str,
                                                            gpu_blocks: int) -> None:
    """Preemption by pool pressure (llama3 on 40 blocks) and by ``preempt_rate``: a step
    never schedules a request it preempts, nor one request twice, and a preempted request
    comes back with ``resumed`` and its whole table. Kills the simulator mutants that keep
    a preempted victim in the step's requests (its blocks already freed) or re-admit it in
    the step that preempted it, and the one that never sets ``resumed``."""
    opts = SimOptions(seed=3, requests=12, context_tokens=400, max_running=3,
                      num_gpu_blocks=gpu_blocks, preempt_rate=0.2)
    sim = Simulator(preset(name), opts, check=True)
    real = sim.scheduler.build_step
    resumed = 0

    def spy(step: Any) -> Any:
        nonlocal resumed
        ids = [r.request_id for r in step.requests]
        assert len(ids) == len(set(ids)), ids
        assert not set(ids) & set(step.preempted), (ids, step.preempted)
        resumed += sum(r.resumed for r in step.requests)
        return real(step)
    sim.scheduler.build_step = spy  # type: ignore[method-assign]
    counters = sim.run()
    assert counters.preemptions > 0 and resumed > 0
    assert counters.finished + counters.aborted == opts.requests


def test_events_the_engine_drains_are_the_reference_tiers() -> None:
    """With ``events_rate`` the simulator drains ``take_events`` as an engine publishing KV
    events does, and the shadow tier compares each drain with the reference manager's.
    Kills the manager mutants that report an eviction as a store, or count the event
    buffer wrong after a reset (so it drops a different number of events)."""
    opts = sim_options(2)  # the pressure profile: 24-event buffer, resets
    assert opts.events_rate and opts.max_pending_events
    sim = Simulator(preset("llama3-eagle3"), opts, check=True)
    drained: list[int] = []
    real = sim.scheduler.take_events

    def spy() -> Any:
        events = real()
        drained.append(len(events))
        return events
    sim.scheduler.take_events = spy  # type: ignore[method-assign]
    sim.run()
    assert sum(drained) > 0 and sim.scheduler.stats().events_dropped > 0
    assert sim.manager.checked.get("M2", 0) > 0


def test_aligned_prompts_end_on_the_largest_chunk_and_run_clean() -> None:
    """aligned_prompt_rate=1: every prompt, follow-ups included, is a whole number of the
    layout's largest chunk (256 tokens on DeepSeek-V4) or one token more (where the N - 1
    limit is the boundary itself), both occur, and the checked run stays clean."""
    cfg = preset("deepseek-v4-mtp")
    sim = Simulator(cfg, SimOptions(seed=3, requests=10, context_tokens=600,
                                    aligned_prompt_rate=1.0, follow_up_rate=0.8,
                                    fail_rate=0.0, reset_rate=0.0, abort_rate=0.0))
    sim.run()
    lengths = {r.prompt_len for r in sim.reqs.values()}
    assert lengths and all(n % 256 in (0, 1) for n in lengths), lengths
    assert {n % 256 for n in lengths} == {0, 1}, lengths


@pytest.mark.parametrize("gpu", [2, 6])
def test_a_pool_too_small_for_one_request_is_a_config_error(gpu: int) -> None:
    """A request that alone needs more GPU blocks than the pool has is admitted,
    preempted and re-admitted forever: the run used to spin to max_steps and end in a
    RuntimeError (a "crash"). It is refused at the first allocation that cannot succeed,
    naming num_gpu_blocks and the count. (gemma3: two groups, so 2 blocks at least.)"""
    from kvcore.spec.errors import ConfigError
    opts = SimOptions(seed=0, requests=2, context_tokens=64, max_new_tokens=2,
                      num_gpu_blocks=gpu, max_steps=400)
    with pytest.raises(ConfigError, match=rf"^num_gpu_blocks: request r\d+ needs \d+ GPU "
                                          rf"blocks.* pool's {gpu - 1}\b") as info:
        Simulator(preset("gemma3"), opts, check=True).run()
    assert int(str(info.value).split(" needs ")[1].split()[0]) > gpu - 1


def test_a_run_that_does_not_settle_is_liveness_not_a_crash() -> None:
    """``kvcore simulate`` exits 3 (liveness) for a run past max_steps, not 4 (crash)."""
    from kvcore._check import classify
    from kvcore.sim._engine import NotSettled
    opts = SimOptions(seed=0, requests=4, context_tokens=200, max_steps=3)
    with pytest.raises(NotSettled) as info:
        Simulator(preset("gemma3"), opts, check=True).run()
    assert classify(info.value) == ("liveness", ["liveness"])
