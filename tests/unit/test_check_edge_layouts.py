"""``kvcore check`` on legal edge layouts: the harness never blames kvcore for its own limits.

Goal: a layout whose every field is within its documented limits gets a true verdict.
Each test is one layout (or budget) that made the check report a kvcore failure (exit 1),
crash or run out of memory because a harness of the check assumed more than the layout
gives: one CPU slot per group, a config that stores nothing, a window wider than a
scenario's fixed pool, a window no fixed memory can exercise (refused up front as a
harness limit, exit 2), a canary whose bug the user's small budget never met
(inconclusive, exit 5, not a dead check), a simulator pool too large to allocate, a
layout file named like a preset, and a layout without events where the event buffer's
canary was named by the lock step instead of M3.

Each test calls the one stage or scenario that met the limit, at the smallest budget that
reaches it; none asserts on time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvcore import _check, _enginecheck, _scenarios, zoo
from kvcore.presets import preset
from kvcore.scheduler import OffloadScheduler
from kvcore.sim import SimOptions, Simulator
from kvcore.sim._engine import HarnessLimit
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig


def _window(window_tokens: int, tokens_per_block: int = 16) -> OffloadConfig:
    """Gemma-3's two groups with the sliding group's window (and block size) replaced."""
    return replace(preset("gemma3"), name=f"w{window_tokens}", groups=(
        GroupSpec(GroupKind.FULL, tokens_per_block),
        GroupSpec(GroupKind.SLIDING, tokens_per_block, window_tokens=window_tokens)))


def _huge_window() -> OffloadConfig:
    """One sliding group of 1-token blocks with the widest window allowed (2**24 tokens)."""
    return OffloadConfig(groups=(GroupSpec(GroupKind.SLIDING, 1, window_tokens=1 << 24),),
                         hash_block_tokens=1, num_gpu_blocks=100, num_cpu_blocks=10,
                         name="huge_window")


def _mutant(name: str) -> zoo.Mutant:
    return next(m for m in zoo.MUTANTS if m.name == name)


# -- a. one CPU slot per group ------------------------------------------------------------

def test_one_cpu_slot_per_group_passes_the_set_up_stage() -> None:
    """``num_cpu_blocks = 1`` (its minimum): the set-up's mixed-group touch stored two keys
    per group into a tier of the layout's one slot, the tier rightly refused, and the
    check reported X2 ("LRU orders [[], []]"); the manager-calls check then needed three
    slots of group 0. Both now build their tier with the slots they hold at once."""
    _enginecheck.run_setup(replace(preset("gemma3"), num_cpu_blocks=1), {})


# -- b. a layout that stores nothing (or too little for a follow-up to load) ---------------

@pytest.mark.parametrize(("name", "cap"), [("gemma3", 0), ("llama3-eagle3", 31),
                                           ("qwen3-next-mtp", 127)])
def test_the_follow_ups_scenario_is_na_where_the_cap_leaves_nothing_to_load(
        name: str, cap: int) -> None:
    """``max_offload_tokens = 0`` stores nothing, and a cap below the follow-ups' three
    units may leave them nothing to load (each cap here did, on its preset): the scenario
    demanded loads and failed "follow-ups loaded nothing" (integrity). It is n/a there."""
    _scenarios.finished_then_follow_ups(
        OffloadScheduler, replace(preset(name), max_offload_tokens=cap))


def test_the_follow_ups_scenario_still_demands_loads_where_the_cap_binds_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guard: a cap of three units binds nothing the follow-ups load, so the scenario
    still runs and asserts that they loaded (it is not skipped for every cap)."""
    asked: list[bool] = []

    def record(condition: bool, message: str, id: str = "integrity") -> None:
        asked.append(condition)
    monkeypatch.setattr(_scenarios, "assert_true", record)
    config = preset("gemma3")
    _scenarios.finished_then_follow_ups(OffloadScheduler, replace(
        config, max_offload_tokens=3 * _scenarios.unit_tokens(config)))
    assert asked == [True]


# -- c. a window wider than the scenario's fixed pool ---------------------------------------

@pytest.mark.parametrize("window", [16384, 32768])
def test_the_stale_block_scenario_sizes_its_pool_from_its_window(window: int) -> None:
    """A 16K- or 32K-token window of 16-token blocks: the scenario's unit grows with the
    window, but its GPU pool was fixed at 4096 blocks, so the scheduler rightly refused
    ``allocated_ids=4096`` (or 8192) and the check reported X2."""
    _scenarios.stale_window_block_after_refused_store(OffloadScheduler, _window(window))


def test_the_stale_block_scenario_still_sees_stale_blocks_on_a_32k_window() -> None:
    """With the pool sized, a 32K-token window's stores still met a 4096-slot tier: each
    was refused for room, no stale block was ever offered, and the 'stale-window-block-
    stored' canary survived. The tier is sized from what the scenario stores too."""
    with _mutant("stale-window-block-stored").apply() as factory, \
            pytest.raises(_scenarios.ScenarioFailure, match="freed and re-allocated"):
        _scenarios.stale_window_block_after_refused_store(factory or OffloadScheduler,
                                                          _window(32768))


# -- d. a window no fixed memory can exercise -------------------------------------------------

def test_a_window_past_the_harness_budget_is_refused_before_any_stage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2**24-token window of 1-token blocks: the stale-block scenario built requests of
    3 x (window + 1) tokens and was killed at 23 GB. ``kvcore check`` now refuses the
    layout up front with a ``HarnessLimit`` (exit 2) naming the window field; no stage
    may start (a stage that starts here is the old behaviour)."""
    def no_stage(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a stage ran on a layout the harness cannot exercise")
    monkeypatch.setattr(_check, "run_directed", no_stage)
    monkeypatch.setattr(_check, "run_engine_stage", no_stage)
    with pytest.raises(HarnessLimit) as raised:
        _check.run_battery(_huge_window(), preset="huge_window", seeds=1, examples=1,
                           steps=1)
    assert raised.value.field == "groups[0].window_tokens"
    assert "window_tokens" in str(raised.value).split(": ", 1)[1]


def test_the_crafted_lookups_stay_within_their_budget_on_a_huge_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The crafted lookups' requests were three window reaches long (50M tokens for a
    2**24-token window of 1-token blocks); they now stop at ``LOOKUP_MAX_CHUNKS`` (8192
    here). The hash maker refuses any request past 2**16 hashes, so the old sizing fails
    at once instead of exhausting memory; two cases keep the test short."""
    made = _scenarios._hashes
    budget = 1 << 16

    def bounded(n: int, salt: int = 0) -> tuple[bytes, ...]:
        assert n <= budget, f"a request of {n} hashes, past {budget}"
        return made(n, salt)
    monkeypatch.setattr(_scenarios, "_hashes", bounded)
    monkeypatch.setattr(_scenarios, "LOOKUP_CASES", 2)
    _scenarios.crafted_lookups(OffloadScheduler, _huge_window())


# -- e. a canary the user's small budget never put to the test --------------------------------

@contextlib.contextmanager
def _unchecked_schedulers() -> Iterator[Any]:
    """A planted bug that takes effect and that no check can name: every scheduler runs
    with its checks off (so fewer checks are counted, and none fires)."""
    def factory(cfg: OffloadConfig, manager: Any, check: bool = True) -> OffloadScheduler:
        return OffloadScheduler(cfg, manager, check=False)
    yield factory


def _canaries(monkeypatch: pytest.MonkeyPatch, *mutants: zoo.Mutant) -> _check.Failure | None:
    monkeypatch.setattr(_check, "MUTANTS", mutants)
    result = _check.BatteryResult()
    _check.run_canaries(preset("gemma3"), result, preset="gemma3", seeds=1, examples=1,
                        steps=1)
    return result.failure


def test_a_canary_whose_bug_never_took_effect_is_inconclusive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--seeds 1`` on gemma3: no store's source block is reused while the store is in
    flight, so the 'no-fence' mutant changes nothing and survives. That is no evidence
    that F1's check is dead: the verdict is inconclusive (coverage, exit 5), names the
    budget to raise, and its reproducer carries the budget."""
    failure = _canaries(monkeypatch, _mutant("no-fence"))
    assert failure is not None and failure.kind == "coverage", failure
    assert failure.ids == ["F1"] and failure.stage == "canaries"
    assert "--seeds" in failure.message
    assert failure.reproducer == ("kvcore check --no-proofs --preset gemma3 --seeds 1 "
                                  "--examples 1 --steps 1")
    assert _check.invariant_table(_check.BatteryResult(failure=failure))["F1"][
        "violations"] == 0


def test_a_canary_whose_bug_took_effect_uncaught_stays_a_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guard for the strict half: a planted bug that changed what the stages did while no
    check fired is a dead check, whatever the budget (exit 1); its reproducer carries the
    budget too (it did not). A bug that changed nothing beside it stays inconclusive."""
    took_effect = zoo.Mutant("checks-off", "every scheduler's checks off", ("gemma3",),
                             "E1", _unchecked_schedulers)
    failure = _canaries(monkeypatch, _mutant("no-fence"), took_effect)
    assert failure is not None and failure.kind == "canary", failure
    assert failure.ids == ["E1"] and failure.seed == "checks-off"
    assert failure.reproducer == ("kvcore check --no-proofs --preset gemma3 --seeds 1 "
                                  "--examples 1 --steps 1 --mutants")


def test_at_the_default_budget_every_surviving_canary_is_a_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal check counts do not prove a bug was not met (it can change bytes, not how
    many records are checked), so the untested verdict is only for a reduced budget: at
    ``CHECK_SEEDS``, the budget CI runs, a survivor fails the run as before. The counts
    are stubbed equal; the mutant survives. Mutant: the budget condition dropped."""
    monkeypatch.setattr(_check, "MUTANTS", (_mutant("no-fence"),))
    survived = _check.MutantOutcome("no-fence", "vllm", "F1", "survived", "", "gemma3", 0.0,
                                    checked={"F1": 1})
    monkeypatch.setattr(_check, "run_mutant", lambda *_a, **_k: survived)
    monkeypatch.setattr(_check, "run_battery",
                        lambda *_a, **_k: _check.BatteryResult(checked={"F1": 1}))
    for seeds, kind in ((_check.CHECK_SEEDS - 1, "coverage"), (_check.CHECK_SEEDS, "canary")):
        result = _check.BatteryResult()
        _check.run_canaries(preset("gemma3"), result, preset="gemma3", seeds=seeds,
                            examples=1, steps=1)
        assert result.failure is not None and result.failure.kind == kind, seeds


def test_the_cli_default_budget_is_the_canaries_default() -> None:
    from kvcore.cli import build_parser
    args = build_parser().parse_args(["check"])
    assert args.seeds == _check.CHECK_SEEDS


# -- f. a simulator pool too large to allocate ------------------------------------------------

def test_the_simulator_refuses_a_gpu_pool_past_its_limit_before_allocating(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """64 groups of 2**24 GPU blocks (both within their limits): the simulator asked
    torch for 64 GiB and crashed. It now refuses with a ``HarnessLimit`` (exit 2) naming
    num_gpu_blocks and the most that fit; torch's allocator must not even be asked (here
    it refuses loudly, so the old code fails at once instead of allocating)."""
    def no_alloc(*_args: Any, **_kwargs: Any) -> torch.Tensor:
        raise AssertionError("the GPU pool was allocated")
    monkeypatch.setattr(torch, "zeros", no_alloc)
    config = OffloadConfig(groups=tuple(GroupSpec(GroupKind.FULL, 16) for _ in range(64)),
                           hash_block_tokens=16, num_gpu_blocks=1 << 24, num_cpu_blocks=64)
    with pytest.raises(HarnessLimit) as raised:
        Simulator(config, SimOptions(seed=0, requests=1, context_tokens=16, max_new_tokens=1))
    assert raised.value.field == "num_gpu_blocks"
    assert f"at most {(2 << 30) // (64 * 2 * 4 * 8)}" in str(raised.value)


# -- g. a layout file named like a preset -----------------------------------------------------

def test_a_layout_file_named_like_a_preset_is_reproduced_as_the_file(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``kvcore check --config gemma3`` (a file in the working directory): the CLI says it
    read a file, so the reproducer loads the file; it named the built-in preset, guessed
    from the spelling. One forced scenario failure shows the reproducer."""
    from kvcore import cli

    def forced(factory: Any, config: OffloadConfig) -> None:
        raise _scenarios.ScenarioFailure("forced by the test")
    forced.__name__ = "forced"
    (tmp_path / "gemma3").write_text('hash_block_tokens = 16\nnum_gpu_blocks = 4096\n'
                                     'num_cpu_blocks = 64\n[[groups]]\nkind = "full"\n'
                                     'tokens_per_block = 32\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_check, "SCENARIOS", (forced,))
    code = cli.main(["check", "--no-proofs", "--config", "gemma3", "--seeds", "1",
                     "--examples", "1", "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "from kvcore._configfile import load_config as layout" in out, out
    assert "from kvcore.zoo import layout" not in out


# -- h. a layout without events and the event buffer's canary ----------------------------------

def test_the_event_buffer_canary_is_named_by_m3_on_a_layout_without_events() -> None:
    """``max_pending_events = 0`` (no events): a buffer that never drops keeps every
    event, the worst case of the bug, so the canary applies. Its check is live, but the
    lock-step scenarios ran kvcore's tier with its checks off, and the lock step's stats
    comparison named the bug R1 first ("killed by R1, expected M3"). With the tier's
    checks on, M3 names it at the call, as an engine's ``KVCORE_CHECK=1`` would."""
    config = replace(preset("gemma3"), max_pending_events=0, name="no_events")
    outcome = _check.run_mutant(_mutant("event-buffer-unbounded"), {"no_events": config},
                                seeds=1, examples=1, steps=1, only=_check.CANARY_STAGES)
    assert outcome.killed and outcome.by == "M3", outcome.describe()


# -- the zoo on a layout that stores nothing -----------------------------------------------

def test_on_a_layout_that_stores_nothing_only_the_key_mutant_can_matter() -> None:
    """``max_offload_tokens = 0``: nothing is stored, so no store, job, load, hit,
    eviction or event bug can change behaviour; only the keys (derived whatever is
    stored) can. Such mutants were run there and reported as survivors or crashes.
    Mutant: ``needs_stores`` ignored by ``can_matter``."""
    cfg = replace(preset("gpt-oss"), max_offload_tokens=0)
    assert [m.name for m in zoo.MUTANTS if m.can_matter(cfg)] == ["keys-without-group"]
    assert len([m for m in zoo.MUTANTS if m.can_matter(preset("gpt-oss"))]) > 10


def test_the_lookup_while_jobs_mutant_takes_a_lookup_cap() -> None:
    """The mutant's lookup had no ``max_tokens``: a capped lookup made the planted bug
    itself raise TypeError, a crash instead of the J1 catch it is there for."""
    from kvcore.manager import CPUOffloadManager
    from kvcore.spec.hooks import RequestInfo
    cfg = preset("gpt-oss")
    with _mutant("lookup-while-jobs").apply():
        sched = OffloadScheduler(cfg, CPUOffloadManager.for_config(cfg), check=True)
        tokens = 4 * cfg.hash_block_tokens
        sched.add_request(RequestInfo("r", tokens, tuple(bytes([i + 1]) * 8
                                                         for i in range(4))))
        assert sched.lookup("r", 0, tokens, max_tokens=2) == 0


# -- 1-token blocks ----------------------------------------------------------------------------

def _one_token_blocks() -> OffloadConfig:
    cfg = preset("gemma3")
    return replace(cfg, hash_block_tokens=1,
                   groups=tuple(replace(g, tokens_per_block=1) for g in cfg.groups))


@pytest.mark.parametrize("stage", [{}, {"hostile": True}, {"lockstep": True}],
                         ids=["simulations", "bad calls", "refinement"])
def test_one_token_blocks_get_pools_that_hold_their_requests(stage: dict[str, bool]) -> None:
    """gemma3 with 1-token blocks: the simulations' fixed pools (1,500 and 700 blocks)
    could not hold one request (2,090 blocks at once), so every stage ended in a
    HarnessLimit and `kvcore check` in exit 4 on a legal layout. The pools now hold two
    requests at least (the presets' pools are unchanged). Mutant: the floor dropped."""
    cfg = _one_token_blocks()
    opts = replace(_check.stage_options(1, cfg, **stage), requests=2)
    assert opts.num_gpu_blocks > 1500
    Simulator(cfg, opts, check=False).run()


def test_the_presets_keep_their_simulation_pools() -> None:
    for name in ("gemma3", "deepseek-v4-mtp", "llama3-eagle3"):
        for seed in range(12):
            assert _check.stage_options(seed, preset(name)).num_gpu_blocks in (700, 1500)
