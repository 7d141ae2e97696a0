"""The battery's simulation stages see what the engine's real configuration runs.

Goal: each test patches one defect into kvcore and shows the stage names it. (1) A path
the scheduler takes only with its own checks off (the no-chunk-completed fast path) is
compared with the reference by the refinement stage's unchecked seeds (R1). (2) A
failure while a run is being built is a named failure of the stage, not an exception
that escapes the battery. (3) The shadow tier names a real tier that raises where the
reference answers (M2), and compares ``lookup_many``, the scheduler's read path. (4) A
valid lookup at an edge (everything computed, a cap of 0) refused by kvcore is named by
the directed edge-lookup scenario (R1). (5) The bad-calls stage's seeds meet every
variant of the options. (6) Each scheduler refusal the stage's twins reach, removed, is
named (A1).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcore import _check
from kvcore.manager import CPUOffloadManager
from kvcore.presets import preset
from kvcore.scheduler.scheduler import OffloadScheduler
from kvcore.spec.errors import InvariantViolation
from kvcore.spec.invariants import Violation
from kvcore.spec.types import Status

DEFAULT = "deepseek-v4-mtp"


def stage(lockstep: bool = False, seeds: int = 2) -> _check.BatteryResult:
    result = _check.BatteryResult()
    _check.run_sims(preset(DEFAULT), seeds, result, preset=DEFAULT, lockstep=lockstep)
    return result


def test_the_unchecked_fast_path_meets_the_lock_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``quiet_cursors`` misses a kept chunk, so with checks off the cursor passes
    window chunks a lookup reads without storing them; with checks on the full path runs
    and hides it. Seed 1 runs unchecked."""
    from refinement.test_refinement_mutants import mutated

    from kvcore.scheduler import _rules, scheduler
    monkeypatch.setattr(scheduler, "quiet_cursors", mutated(
        _rules.quiet_cursors, "if chunk % period in kept:",
        "if chunk % period in kept and chunk < 0:"))
    result = stage(lockstep=True)
    assert result.failure is not None and result.failure.ids == ["R1"], result.failure
    assert result.failure.seed == "1"


def test_a_failure_while_building_a_run_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the run breaks an invariant before its first step (as a lock step that
    disagrees at ``add_request`` does); the stage reports it instead of raising."""
    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        raise InvariantViolation([Violation("R1", "differs while the run is set up")])
    monkeypatch.setattr(_check.Simulator, "__init__", broken)
    result = stage()
    assert result.failure is not None and result.failure.kind == "invariant"
    assert result.failure.ids == ["R1"]


def test_a_tier_that_raises_is_an_m2_divergence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the tier's ``prepare_store`` fails with a builtin error (an ARC ghost list
    emptied by a wrong bound raised KeyError); the shadow names it M2."""
    def empty(self: Any, keys: Any) -> Any:
        raise KeyError("dictionary is empty")
    monkeypatch.setattr(CPUOffloadManager, "prepare_store", empty)
    result = stage()
    assert result.failure is not None and "M2" in result.failure.ids, result.failure
    assert "raised KeyError" in result.failure.message


def test_the_block_read_is_compared_with_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``lookup_hashes`` answers MISS for a stored key (the scheduler's read path
    with kvcore's tier; the shadow once passed its block reads through unchecked). The
    shadow names it before the scheduler acts on the answer."""
    real = CPUOffloadManager.lookup_hashes

    def forgetful(self: Any, hashes: Any, suffix: bytes) -> list[Status]:
        return [Status.MISS for _ in real(self, hashes, suffix)]
    monkeypatch.setattr(CPUOffloadManager, "lookup_hashes", forgetful)
    result = stage()
    assert result.failure is not None and result.failure.ids == ["M2"], result.failure
    assert "lookup_hashes" in result.failure.message


@pytest.mark.parametrize("edge", ["all computed", "cap 0"])
def test_edge_lookups_name_a_refused_valid_edge(monkeypatch: pytest.MonkeyPatch,
                                                edge: str) -> None:
    """Mutants: lookup refuses ``computed_tokens == num_tokens`` (``<`` for ``<=``) or a
    cap of 0 (``<= 0`` for ``< 0``). Both are valid calls the simulator almost never
    draws; the directed ``edge_lookups`` scenario makes them in lock step (R1)."""
    from kvcore import _scenarios
    from kvcore.scheduler import BadStepError
    lookup = OffloadScheduler.lookup

    def strict(self: Any, rid: str, computed: int, n: int, **kw: Any) -> Any:
        if (edge == "all computed" and computed == n) or (edge == "cap 0"
                                                           and kw.get("max_tokens") == 0):
            raise BadStepError(f"mutant refuses {edge}")
        return lookup(self, rid, computed, n, **kw)

    monkeypatch.setattr(OffloadScheduler, "lookup", strict)
    with pytest.raises(InvariantViolation, match="R1"):
        _scenarios.edge_lookups(OffloadScheduler, preset(DEFAULT))


def test_the_bad_calls_stage_meets_every_variant() -> None:
    """Mutant: the stage's seeds 0..5 again (``HOSTILE_STRIDE`` 1), all of the first
    variant, so a twin that needs another variant's option (a request that skips reading,
    a capped store) never runs. Seeds 5 apart meet every variant."""
    seeds = range(0, _check.HOSTILE_SEEDS * _check.HOSTILE_STRIDE, _check.HOSTILE_STRIDE)
    opts = [_check.stage_options(s, preset(DEFAULT), hostile=True) for s in seeds]
    variants = {(o.prompt_only, o.max_offload_tokens, o.request_cap_rate, o.lookup_cap_rate,
                 o.skip_reading_rate, o.gpu_cache_rate) for o in opts}
    assert len(variants) == len(_check.VARIANTS)


def test_tier_churn_names_an_arc_choice_that_never_switches_lists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ARC's choice of several victims keeps its list for the whole choice (its
    running |T1| not lowered per T1 victim), so it takes T1 keys the rule gives to T2.
    Only a store evicting several keys while |T1| crosses p shows it: the directed
    tier-churn scenario makes such stores, and the shadow names it (M2)."""
    from kvcore import _scenarios
    from kvcore.manager import _arc

    def sticky(self: Any, n: int, can_evict: Any) -> Any:
        first = _arc._candidates(self._t1 if self.t1_size >= int(self._target) else self._t2,
                                 can_evict)
        second = _arc._candidates(self._t2 if self.t1_size >= int(self._target) else self._t1,
                                  can_evict)
        chosen = [k for _, k in zip(range(n), [*first, *second], strict=False)]
        return chosen if len(chosen) == n else None

    monkeypatch.setattr(_arc.ARCPolicy, "choose", sticky)
    with pytest.raises(InvariantViolation, match="M2"):
        _scenarios.tier_churn(OffloadScheduler, preset(DEFAULT))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_tier_churn_names_a_policy_that_settles_for_fewer_victims(
        monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """Mutants: a policy's ``choose`` hands back the victims it found when it found too
    few, instead of None. The tier's count shortcut refuses first whenever too few keys
    are unpinned, so the walk comes back short only when the evictable keys are the
    store's own; tier churn ends on such a store, shadowed by the reference (M2)."""
    from refinement.test_refinement_mutants import mutated

    from kvcore import _scenarios
    from kvcore.manager import _arc, _lru
    cls = _lru.LRUPolicy if policy == "lru" else _arc.ARCPolicy
    # (The source as ``mutated`` reads it: dedented by the class's four spaces.)
    old = "return None" if policy == "lru" else "if key is None:\n            return None"
    new = "return chosen" if policy == "lru" else "if key is None:\n            return chosen"
    monkeypatch.setattr(cls, "choose", mutated(cls.choose, old, new))
    with pytest.raises(InvariantViolation, match="M2"):
        _scenarios.tier_churn(OffloadScheduler, preset(DEFAULT))


def test_a_window_not_reverified_after_a_shrink_is_named(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Mutant: the convergence loop re-verifies FULL and draft groups after a shrink but
    not windows (``is`` for ``is not`` in ``_needs_reverify``). Random lookups on
    DeepSeek-V4 never meet it; the directed scenario does (L1: 768 answered, 0 right)."""
    from kvcore import _scenarios
    from kvcore.scheduler import _lookup
    from kvcore.spec.types import GroupKind
    monkeypatch.setattr(_lookup, "_needs_reverify",
                        lambda g: g.kind is GroupKind.FULL or g.is_draft)
    with pytest.raises(InvariantViolation, match="L1"):
        _scenarios.window_reverified_after_shrink(OffloadScheduler, preset(DEFAULT))


def test_hashes_sent_with_the_step_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: a step's ``new_hashes`` subtracted from the hashes it brings, so a valid
    step that carries them is refused. The refinement seeds of the variant that sends
    hashes with the step meet it (R1)."""
    real = OffloadScheduler.build_step

    def lose_new(self: Any, step: Any) -> Any:
        if any(sr.new_hashes for sr in step.requests):
            from kvcore.scheduler import BadStepError
            raise BadStepError("mutant: new_hashes not counted")
        return real(self, step)

    monkeypatch.setattr(OffloadScheduler, "build_step", lose_new)
    result = _check.BatteryResult()
    _check.run_sims(preset(DEFAULT), 12, result, preset=DEFAULT, lockstep=True)
    assert result.failure is not None and result.failure.ids == ["R1"], result.failure


def test_tier_churn_names_a_ready_key_marked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``complete_store`` skips only absent keys, not those READY before the
    store, so a READY key is marked again (a second stored event, its pool's run grows).
    Churn completions also list READY, repeated and absent keys; the shadow names it
    (M2)."""
    from refinement.test_refinement_mutants import mutated

    from kvcore import _scenarios
    monkeypatch.setattr(CPUOffloadManager, "complete_store", mutated(
        CPUOffloadManager.complete_store,
        "if record is None or not record & WRITING:\n            continue  # READY before "
        "this store, or absent: not this store's key\n        entries[key] = record - WRITING",
        "if record is None:\n            continue\n        entries[key] = record & ~WRITING"))
    with pytest.raises(InvariantViolation, match="M2"):
        _scenarios.tier_churn(OffloadScheduler, preset(DEFAULT))


def test_the_pressure_tier_evicts_on_every_preset() -> None:
    """Mutant: the pressure tier fixed at 48 slots per group whatever the layout. On
    DeepSeek-V3 (64-token chunks, 400-token prompts) no run then evicted, and no eviction
    choice met M1; ``pressure_slots`` sizes it so that every preset's runs evict."""
    from kvcore.presets import PRESETS
    from kvcore.sim import Simulator
    for name in sorted(PRESETS):
        config = preset(name)
        evictions = 0
        for seed in range(2, 12, 3):  # the pressure profile's seeds
            opts = _check.stage_options(seed, config)
            sim = Simulator(config, opts, check=True)
            try:
                sim.run()
            finally:
                sim.transfer.close()
            evictions += sim.manager.checked.get("M1", 0)
        assert evictions > 0, name


def test_an_invariant_never_evaluated_fails_as_coverage() -> None:
    """Mutant: the store path stops handing E1 its records (``store_records`` without its
    offers), which no violation can show: E1's count falls to 0. A zero after every stage
    passed is a "coverage" failure naming it, and not a violation in the table."""
    result = _check.BatteryResult()
    result.checked = {i: 1 for i in _check.INVARIANT_IDS if i != "E1"}
    failure = _check.unchecked(result)
    assert failure is not None and failure.kind == "coverage" and failure.ids == ["E1"]
    result.failure = failure
    assert _check.invariant_table(result)["E1"] == {"checked": 0, "violations": 0}
    result.checked["E1"] = 1
    assert _check.unchecked(result) is None


def test_the_battery_asks_for_coverage_and_the_cli_calls_it_inconclusive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutants: ``run_battery`` never asks ``unchecked`` (a table of zeros reads "ok"), or
    the CLI has no exit code for coverage. With every stage a no-op, every id is 0: the
    battery names them all, and the CLI reports exit 5 (inconclusive), not 0 or 1."""
    from kvcore import cli
    monkeypatch.setattr(_check, "STAGES", ())
    result = _check.run_battery(preset(DEFAULT), preset=DEFAULT, seeds=1, examples=1,
                                steps=1)
    assert result.failure is not None and result.failure.kind == "coverage"
    assert result.failure.ids == list(_check.INVARIANT_IDS)
    assert "--seeds 1 --examples 1 --steps 1" in result.failure.reproducer
    assert cli._report_failure(result.failure) == cli.EXIT_INCONCLUSIVE


def test_the_store_records_feed_e1(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mechanism the coverage rule reads: with ``store_records`` dropping the offers,
    a checked simulation evaluates E1 no times (and with them, many)."""
    from kvcore.scheduler import _store
    from kvcore.sim import Simulator
    config = preset(DEFAULT)

    def e1_count() -> int:
        sim = Simulator(config, _check.stage_options(0, config), check=True)
        try:
            sim.run()
        finally:
            sim.transfer.close()
        return sim.scheduler.checked.get("E1", 0)

    assert e1_count() > 0
    real = _store.store_records
    monkeypatch.setattr(_store, "store_records", lambda cfg, draft, built, cursors: [
        r for r in real(cfg, draft, built, cursors)
        if type(r).__name__ not in ("StoreOfferRecord", "CursorMoveRecord")])
    assert e1_count() == 0


def test_a_null_inside_a_window_load_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the load plan's null check looks for -1, so a window group's table with a
    null block inside the load range plans a copy into block 0. The bad-calls stage's
    twin with such a hole must be refused saying so; under the mutant the plan's B1 check
    fires on it."""
    from refinement.test_refinement_mutants import mutated

    from kvcore.scheduler import _rules
    monkeypatch.setattr(_rules, "group_load", mutated(_rules.group_load, "if 0 in ids:",
                                                      "if -1 in ids:"))
    result = _check.BatteryResult()
    _check.run_sims(preset(DEFAULT), 2, result, preset=DEFAULT, hostile=True)
    assert result.failure is not None and result.failure.ids == ["B1"], result.failure


@pytest.mark.parametrize("which", ["distinct", "first_repeat"])
def test_the_bad_calls_stage_names_a_full_block_accepted_twice(
        monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """Mutants of the FULL-group repeat check in ``_validate.check_tables`` (a held-out
    mutation sample's survivor): the C test read the other way round (``ids_distinct``
    true), or the position search finding none. A FULL table that names one block at two
    positions is then accepted, and a store saves one chunk's bytes under two keys. The
    stage's twins repeat a FULL block in ``after_alloc`` and ``build_step``; either must
    bounce (A1)."""
    from kvcore.scheduler import _validate
    if which == "distinct":
        monkeypatch.setattr(_validate, "ids_distinct", lambda ids: True)
    else:
        monkeypatch.setattr(_validate, "_first_repeat", lambda ids: None)
    result = _check.BatteryResult()
    _check.run_sims(preset(DEFAULT), 2, result, preset=DEFAULT, hostile=True)
    assert result.failure is not None and result.failure.ids == ["A1"], result.failure
    assert "block twice: accepted" in result.failure.message


def test_the_bad_calls_stage_names_a_lone_str_hash_vouched_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant of the C hash scan (a held-out mutation sample's survivor): the type test
    of the first item read the other way round, so a list of one str of the hash's
    length is vouched for (every later item is still type-checked, so two or more strs
    never were). The stage's twins pass one hash as a str to ``add_request`` and
    ``add_hashes``; under the mutant one is accepted or crashes later (A1)."""
    from kvcore import _scan
    from kvcore.spec import hooks

    def vouches_for_one(seq: Any, max_len: int) -> int:
        if isinstance(seq, (tuple, list)) and len(seq) == 1 and isinstance(seq[0], str):
            return len(seq[0]) if 0 < len(seq[0]) <= max_len else -1
        return _scan.hashes_len(seq, max_len)
    monkeypatch.setattr(hooks, "_scan_bytes", vouches_for_one)
    result = _check.BatteryResult()
    _check.run_sims(preset(DEFAULT), 2, result, preset=DEFAULT, hostile=True)
    assert result.failure is not None and result.failure.ids == ["A1"], result.failure
    assert "one hash, a str" in result.failure.message


def test_a_coverage_failure_is_no_catch_of_a_zoo_mutant(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Mutant: ``run_mutant`` scores a coverage failure naming the mutant's id as a kill
    (at a tiny budget X1 is never met, so "failed-transfer-counted" would be "killed by
    X1" with nothing caught). A rule no stage reached is no catch: it survives."""
    from kvcore import zoo

    def unreached(config: Any, **kwargs: Any) -> _check.BatteryResult:
        result = _check.BatteryResult()
        result.failure = _check.Failure("coverage", list(_check.INVARIANT_IDS), "", "")
        return result

    monkeypatch.setattr(_check, "run_battery", unreached)
    mutant = zoo.MUTANTS[0]
    outcome = _check.run_mutant(mutant, seeds=1, examples=1, steps=1)
    assert outcome.status in ("survived", "n/a"), outcome


def test_the_follow_ups_scenario_brings_its_own_pool() -> None:
    """``kvcore check`` runs every stage on the user's layout with the stage's own pool
    sizes; this scenario took the layout's num_gpu_blocks, so a small engine pool (2
    blocks here) ended the check in a crash instead of checking the layout."""
    from dataclasses import replace

    from kvcore._scenarios import finished_then_follow_ups
    finished_then_follow_ups(OffloadScheduler, replace(preset("gemma3"), num_gpu_blocks=2))


def _crash(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("forced by the test")


@pytest.mark.parametrize("source", ["preset", "file"])
def test_every_stage_reproducer_is_a_command_that_runs(
        source: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing stage prints a command that re-runs it on the user's layout. They were
    not runnable: ``python -c '...layout('gpt-oss')'`` lost its inner quotes in the shell
    (``layout(gpt-oss)``), and a ``--config`` layout was named by its file stem, which
    no preset has. Each stage is made to crash here; its reproducer must then run clean
    against the unmutated code (exit 0) in a fresh shell."""
    import os
    import subprocess
    import sys

    from kvcore import _copycheck, _enginecheck, _scenarios
    if source == "file":
        (tmp_path / "my layout.toml").write_text('preset = "gpt-oss"\nnum_gpu_blocks = 2\n')
        ref, config = str(tmp_path / "my layout.toml"), preset("gpt-oss")
    else:
        ref, config = "gpt-oss", preset("gpt-oss")
    monkeypatch.setattr(_scenarios, "SCENARIOS", _scenarios.SCENARIOS[:1])
    monkeypatch.setattr(_check, "SCENARIOS", _scenarios.SCENARIOS[:1])
    monkeypatch.setattr(_check, "_counting", lambda *_: _crash)
    monkeypatch.setattr(_copycheck, "run_copy_library", _crash)
    monkeypatch.setattr(_enginecheck, "run_setup", _crash)
    monkeypatch.setattr(_check.Simulator, "run", _crash)
    stages: dict[str, Any] = {
        "directed": lambda r: _check.run_directed(config, r, preset=ref),
        "copy library": lambda r: _check.run_copy(config, 100, r, ref),
        "set-up": lambda r: _check.run_engine_stage(config, r, ref, setup=True),
        "simulations": lambda r: _check.run_sims(config, 1, r, preset=ref),
    }
    if source == "preset":
        del stages["simulations"]  # the same flag path as the check's; one sim is enough
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""))
    for stage, run in stages.items():
        result = _check.BatteryResult()
        run(result)
        assert result.failure is not None and "forced by the test" in result.failure.message
        command = result.failure.reproducer
        done = subprocess.run(["bash", "-c", command], env=env, capture_output=True,
                              text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, (stage, command, done.stderr[-2000:])


def test_the_step_fence_feeds_f1_only_when_checking() -> None:
    """Each ``build_step`` hands F1 its fence record with checks on, and builds none with
    them off (the check-mode flag read the wrong way round left F1 at zero evaluations
    in a checked run, and paid for it in an unchecked one)."""
    from kvcore.sim import Simulator
    config = preset(DEFAULT)
    counts = {}
    for check in (True, False):
        sim = Simulator(config, _check.stage_options(0, config), check=check)
        try:
            sim.run()
        finally:
            sim.transfer.close()
        counts[check] = sim.scheduler.checked.get("F1", 0)
    assert counts[True] > 0 and counts[False] == 0, counts


def _no_n_minus_1(cfg: Any, num_tokens: int) -> int:
    """The N - 1 limit dropped (held-out seeds 41's m19 and 43's m08): a window layout may
    answer a prompt's whole length, whose last token's logits nobody computes."""
    from kvcore.scheduler._rules import mamba_chunk
    mamba = mamba_chunk(cfg)
    return num_tokens // mamba * mamba if mamba else num_tokens


def test_crafted_lookups_ask_the_layout_without_its_drafter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On deepseek-v4-mtp the draft group's extra chunk keeps every hit a chunk below the
    prompt's end, so the N - 1 limit never decides a hit there and its removal survived
    the check. The directed lookups ask the same layout with speculative decoding off
    too, where the limit decides: L1 names it."""
    from kvcore import _scenarios
    from kvcore.scheduler import _lookup
    _scenarios.crafted_lookups(OffloadScheduler, preset(DEFAULT))  # correct code passes
    monkeypatch.setattr(_lookup, "lookup_limit", _no_n_minus_1)
    with pytest.raises(InvariantViolation, match="L1"):
        _scenarios.crafted_lookups(OffloadScheduler, preset(DEFAULT))


def test_speculative_off_drops_only_the_draft_groups() -> None:
    """Every fourth simulation seed serves the layout without its drafter: the draft
    groups go, the rest stay in order, and a layout without drafts is left alone."""
    from kvcore.sim import Simulator
    from kvcore.sim._workload import speculative_off
    cfg = preset(DEFAULT)
    off = speculative_off(cfg)
    assert off is not None and not off.speculative
    assert off.groups == tuple(g for g in cfg.groups if not g.is_draft)
    assert speculative_off(off) is None and speculative_off(preset("gemma3")) is None
    flagged = [s for s in range(24) if _check.sim_options(s).speculative_off]
    assert flagged == [3, 7, 11, 15, 19, 23]
    sim = Simulator(cfg, _check.stage_options(3, cfg))
    try:
        assert sim.config.groups == off.groups
    finally:
        sim.transfer.close()


def test_the_canaries_name_a_check_that_is_not_live(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the lookup's run-time check switched off (held-out seed 44's m33, ``if
    self.check`` inverted before ``_check_lookup``). The code still answers right, so no
    other stage can fail; the canaries plant the zoo's lookup bugs and find them caught
    by R1 instead of the ids they declare. The failure names the dead check's id, exits
    1, and is not counted as a violation of that id in the table."""
    from kvcore import cli
    cfg = preset(DEFAULT)
    live = _check.BatteryResult()
    _check.run_canaries(cfg, live, preset=DEFAULT, seeds=24, examples=5, steps=10)
    assert live.failure is None
    monkeypatch.setattr(OffloadScheduler, "_check_lookup", lambda self, *a, **k: None)
    dead = _check.BatteryResult()
    _check.run_canaries(cfg, dead, preset=DEFAULT, seeds=24, examples=5, steps=10)
    failure = dead.failure
    assert failure is not None and failure.kind == "canary" and failure.stage == "canaries"
    assert failure.ids[0] in ("E3", "E4", "L1", "L2", "J1") and "not live" in failure.message
    assert "--mutants" in failure.reproducer
    table = _check.invariant_table(dead)
    assert all(row["violations"] == 0 for row in table.values())
    assert cli._report_failure(failure) == cli.EXIT_FAIL


def test_the_canaries_run_only_in_a_users_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a zoo mutant the battery must not plant the zoo again (it would recurse), and
    a battery that crashed or hung cannot tell a dead check apart from that, so it skips
    them; a user's run (``canaries=True``) ends with them."""
    ran: list[str] = []
    monkeypatch.setattr(_check, "STAGES", ("canaries",))
    monkeypatch.setattr(_check, "run_canaries", lambda *a, **k: ran.append("canaries"))
    _check.run_battery(preset(DEFAULT), preset=DEFAULT, seeds=1, examples=1, steps=1)
    assert ran == []
    _check.run_battery(preset(DEFAULT), preset=DEFAULT, seeds=1, examples=1, steps=1,
                       canaries=True)
    assert ran == ["canaries"]


@pytest.mark.parametrize(("owner", "method", "flag", "expect"), [
    (OffloadScheduler, "_check_keys", "check", "K1"),
    (OffloadScheduler, "_check_completion", "check", "J2"),
    (CPUOffloadManager, "_check_eviction", "_check", "M1")])
def test_a_dead_check_is_not_live_even_where_a_harness_names_its_id(
        monkeypatch: pytest.MonkeyPatch, owner: type, method: str, flag: str,
        expect: str) -> None:
    """Mutants: ``if self.check`` inverted before ``_check_keys`` or ``_check_completion``,
    or ``if self._check`` before the tier's ``_check_eviction`` (the hook's check then
    runs only with checks off). K1 was dead by construction (the record decoded group
    and hash from the key itself, so equal keys always agreed); J2 was named anyway by
    the refinement stage, whose odd seeds run checks off; no zoo bug reached M1's check
    once the victims are chosen. The canaries plant ``keys-without-group``,
    ``first-report-settles`` and ``pinned-key-evicted`` and accept only a hook's own
    check in the stages that run checks on."""
    cfg = preset(DEFAULT)
    checks = getattr(owner, method)

    def inverted(self: Any, *args: Any) -> None:
        if not getattr(self, flag):
            checks(self, *args)
    monkeypatch.setattr(owner, method, inverted)
    dead = _check.BatteryResult()
    _check.run_canaries(cfg, dead, preset=DEFAULT, seeds=24, examples=5, steps=10)
    assert dead.failure is not None and dead.failure.kind == "canary"
    assert dead.failure.ids == [expect]


def test_a_harness_catch_is_not_a_run_time_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """A zoo mutant declared ``at_runtime`` and named by a harness (``at_runtime`` False on
    the failure) is a wrong check, not a kill."""
    from kvcore.zoo import MUTANTS
    mutant = next(m for m in MUTANTS if m.name == "first-report-settles")

    def harness(*_a: Any, **_k: Any) -> _check.BatteryResult:
        result = _check.BatteryResult()
        result.failure = _check.Failure("invariant", ["J2"], "m", "r", "refinement", "1")
        return result
    monkeypatch.setattr(_check, "run_battery", harness)
    outcome = _check.run_mutant(mutant, {DEFAULT: preset(DEFAULT)}, seeds=1, examples=1,
                                steps=1)
    assert outcome.status == "wrong check" and "harness" in outcome.by


def test_a_hash_chain_misread_past_its_prompt_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-out seed 53's m06: ``SEGMENT = 2 << SEGMENT_BITS``, so a chain's frozen
    segments of 2,048 hashes are indexed as if they held 1,024. Only hashes that arrive
    after the prompt land in segments, and no other stage grows a chain that far: the
    ``long_hash_chain`` scenario must name it (R1, the store's keys against the
    reference's)."""
    from kvcore import _scenarios
    from kvcore.scheduler import _state
    monkeypatch.setattr(_state, "SEGMENT", 2 << _state.SEGMENT_BITS)
    with pytest.raises(InvariantViolation, match="R1"):
        _scenarios.long_hash_chain(OffloadScheduler, preset("deepseek-v4-mtp"))


def test_a_failed_load_left_out_of_the_stats_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-out seed 54's m13: ``failed_loads += 0``, so an engine's metrics never count
    a failed load. The seeded runs make a few loads each and their injected failures
    seldom meet one; ``failed_load_in_lock_step`` fails one load and compares the stats
    with the reference's (R1)."""
    from kvcore import _scenarios
    from kvcore.scheduler import scheduler as module
    complete = module.OffloadScheduler._complete

    def uncounted(self: Any, job: Any, *args: Any) -> None:
        before = self._stats.failed_loads
        complete(self, job, *args)
        self._stats.failed_loads = before
    monkeypatch.setattr(module.OffloadScheduler, "_complete", uncounted)
    with pytest.raises(InvariantViolation, match=r"R1.*stats"):
        _scenarios.failed_load_in_lock_step(OffloadScheduler, preset(DEFAULT))


def test_a_preempted_request_stores_nothing_in_the_c_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-out seed 54's m29: ``step_apply`` (C) without its preempted test, so a request
    scheduled and preempted in one step is offered a store of blocks the engine just took
    back. Stood in for here by hiding the preempted ids from the C pass; the
    ``scheduled_and_preempted`` scenario must name it (R1, the step's stores)."""
    from kvcore import _scenarios
    from kvcore.scheduler import scheduler as module
    apply = module.step_apply

    def blind(requests: Any, states: Any, _preempted: Any, *rest: Any) -> Any:
        return apply(requests, states, (), *rest)
    monkeypatch.setattr(module, "step_apply", blind)
    with pytest.raises(InvariantViolation, match=r"R1.*build_step"):
        _scenarios.scheduled_and_preempted(OffloadScheduler, preset(DEFAULT))


def test_the_python_path_of_a_step_meets_the_lock_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``_apply_blocks`` places a window group's new blocks one position late, so
    their stale-block steps are read for the wrong slots. kvcore's own ScheduledRequest
    takes the C pass, which never runs this; refinement seed 2 sends an engine's own
    subclass (``own_step_type``), whose steps take the Python path, held to the
    reference (R1)."""
    from kvcore.scheduler._state import Placements
    place, apply = Placements.place, OffloadScheduler._apply_blocks

    def late(self: Any, position: int, step: int) -> None:
        place(self, position + 1, step)

    def apply_late(self: Any, req: Any, sr: Any) -> None:
        # Only here: the C pass calls ``place`` too, and must stay right.
        Placements.place = late  # type: ignore[method-assign]
        try:
            apply(self, req, sr)
        finally:
            Placements.place = place  # type: ignore[method-assign]

    monkeypatch.setattr(OffloadScheduler, "_apply_blocks", apply_late)
    assert _check.stage_options(2, preset(DEFAULT), lockstep=True).own_step_type
    result = stage(lockstep=True, seeds=3)
    assert result.failure is not None and result.failure.ids == ["R1"], result.failure
    assert result.failure.seed == "2"


def test_a_valid_call_refused_in_a_stage_is_x2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-out seed 55's m00 class: a public read whose type test is inverted refuses
    every valid argument. The lock step reads the tier's policy of each group after every
    hook; the kvcore error that ends the stage is a valid call refused (X2), where it was
    an unnamed crash. ``kvcore simulate``'s own errors stay usage errors."""
    from kvcore.manager import CPUOffloadManager
    from kvcore.spec.errors import ArgumentTypeError, BadStepError

    def refuses(self: object, group: object) -> object:
        raise ArgumentTypeError("CPUOffloadManager.policy_of", "group", group, "int", "mutant")
    monkeypatch.setattr(CPUOffloadManager, "policy_of", refuses)
    result = stage(lockstep=True, seeds=1)
    assert result.failure is not None and result.failure.kind == "invariant"
    assert result.failure.ids == ["X2"], result.failure
    assert _check.classify(BadStepError("x")) == ("crash", ["BadStepError"])
    assert _check.classify(BadStepError("x"), valid_calls=True) == ("invariant", ["X2"])


def test_a_lookup_beside_an_unrelated_load_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``_being_loaded`` answers True once any load is in flight (its last
    ``return False`` flipped), so every lookup waits while any request loads. No seeded
    run looked a request up beside an unrelated load; ``lookup_beside_another_load``
    does, and the lookup's own check names it (L2)."""
    from kvcore import _scenarios
    monkeypatch.setattr(OffloadScheduler, "_being_loaded",
                        lambda self, req, computed, hit: bool(self._jobs.loading))
    with pytest.raises(InvariantViolation, match="L2"):
        _scenarios.lookup_beside_another_load(OffloadScheduler, preset(DEFAULT))


@pytest.mark.parametrize("name", ["deepseek-v4-mtp", "gemma3"])
def test_a_prompt_being_written_is_pending(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Held-out seed 68's m04: the reader's saw-PENDING flag inverted for a block that
    holds one status (``got[0] is not PENDING``). A lookup whose every read block is
    wholly PENDING then serves keys not yet written; the crafted lookups mix statuses in
    most blocks and missed it. ``lookup_of_a_prefix_being_written`` reads only such
    blocks, and the lookup's own check names it (L2)."""
    from kvcore import _scenarios
    from kvcore.scheduler import _lookup

    real = _lookup.StatusReader._fetch

    def inverted(self: Any, group: int, idx: int) -> None:
        before = self.pending
        real(self, group, idx)
        if not before:
            lo = idx - idx % self.blocks[group]
            got = self.known[group][lo:lo + self.blocks[group]]
            self.pending = (Status.PENDING in got if _lookup.mixed(got)
                            else got[0] is not Status.PENDING)
    monkeypatch.setattr(_lookup.StatusReader, "_fetch", inverted)
    with pytest.raises(InvariantViolation, match="L2"):
        _scenarios.lookup_of_a_prefix_being_written(OffloadScheduler, preset(name))


def test_a_chain_that_grows_after_its_segments_meets_the_lock_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-out seed 71's m13: ``HashChain.extend`` cuts ``len + len % SEGMENT`` hashes
    into segments instead of ``len - ...``: the last segment is short, and a hash added
    after it is read from past its end. ``long_hash_chain`` grew its chain once only, so
    every read still landed; a later step of three more units now reads across the last
    segment and the tail, and the lock step names it (R1)."""
    import inspect
    import textwrap

    from kvcore import _scenarios
    from kvcore.scheduler import _state
    source = textwrap.dedent(inspect.getsource(_state.HashChain.extend))
    cut = "whole = len(tail) - len(tail) % SEGMENT"
    assert source.count(cut) == 1
    namespace = dict(vars(_state))
    exec(source.replace(cut, "whole = len(tail) + len(tail) % SEGMENT"), namespace)
    monkeypatch.setattr(_state.HashChain, "extend", namespace["extend"])
    with pytest.raises(InvariantViolation, match="R1"):
        _scenarios.long_hash_chain(OffloadScheduler, preset(DEFAULT))


def test_the_key_path_of_a_tier_of_your_own_meets_the_lock_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: with a tier that has only the base interface (no hash batches), a lookup's
    touch leaves out its first key. kvcore's own tier takes the hash path, so no stage
    met this; refinement seed 4 serves the scheduler from ``KeysOnlyTier`` and the lock
    step compares the LRU order (R1)."""
    real = OffloadScheduler._touch

    def short(self: Any, req: Any, boundary: int, reader: Any = None) -> None:
        if self._by_hash:
            real(self, req, boundary, reader)
            return
        manager, seen = self.manager, []
        touch = manager.touch
        monkeypatch.setattr(manager, "touch", lambda keys: seen.append(keys) or touch(keys[1:]))
        try:
            real(self, req, boundary, reader)
        finally:
            monkeypatch.setattr(manager, "touch", touch)
    monkeypatch.setattr(OffloadScheduler, "_touch", short)
    assert _check.stage_options(4, preset(DEFAULT), lockstep=True).keys_only_tier
    result = stage(lockstep=True, seeds=5)
    assert result.failure is not None and result.failure.ids == ["R1"], result.failure
    assert result.failure.seed == "4"


def test_the_simulators_own_limits_are_not_x2() -> None:
    """A layout the simulator's fixed pool cannot serve is the harness's limit
    (``HarnessLimit``), reported as a crash as before, not as kvcore refusing a call; a
    scenario's failure with an invariant id is that invariant."""
    from kvcore._scenarios import ScenarioFailure
    from kvcore.sim._engine import HarnessLimit
    assert _check.classify(HarnessLimit("num_gpu_blocks", "too small"), valid_calls=True) \
        == ("crash", ["HarnessLimit"])
    assert _check.classify(ScenarioFailure("m", "X1")) == ("invariant", ["X1"])
    assert _check.classify(ScenarioFailure("m")) == ("integrity", ["integrity"])


def test_an_unchecked_refinement_seed_is_replayed_unchecked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Odd refinement seeds run the scheduler with its checks off; their reproducer must
    say so (``--no-checks``), or it replays another run (with checks on the simulator
    also shadows the tier, and a keys-only seed gets its other tier)."""
    real = _check.Simulator

    class FailsAtSeed1(real):  # type: ignore[misc,valid-type]
        def run(self) -> Any:
            if self.options.seed == 1:
                raise _check.InvariantViolation([Violation("R1", "planted")])
            return super().run()
    monkeypatch.setattr(_check, "Simulator", FailsAtSeed1)
    result = stage(lockstep=True, seeds=2)
    assert result.failure is not None and result.failure.seed == "1"
    assert result.failure.reproducer.endswith("--check-options --lockstep --no-checks")


def test_a_wrong_first_verified_chunk_in_the_retained_window_error_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-out seed 55's m06: the ConfigError for a window block before the chunks the
    lookup verified names the wrong first chunk (``served[1]``), sending the engine's
    author to the wrong setting. The bad-calls stage puts a real block there and the
    error must name ``extra_retained_tokens`` and the spec's first verified chunk."""
    from kvcore.scheduler import _rules
    # The mutant changes only the message's chunk: raise it with another one.
    group_load = _rules.group_load

    def wrong_message(*args: Any, **kwargs: Any) -> Any:
        try:
            return group_load(*args, **kwargs)
        except _rules.ConfigError as exc:
            raise _rules.ConfigError(exc.field, str(exc).replace(" from ", " from 99")) from exc
    monkeypatch.setattr(_rules, "group_load", wrong_message)
    result = _check.BatteryResult()
    _check.run_sims(preset(DEFAULT), 6, result, preset=DEFAULT, hostile=True)
    assert result.failure is not None and result.failure.ids == ["A1"], result.failure
    assert "verified chunks from" in result.failure.message


# Refusals the bad-calls stage's twins reach (each line was executed by no stage of
# ``kvcore check`` before): the scheduler method, its check made never true, and the
# twin whose A1 names it.
REFUSALS = [
    ("_req", "if req.finished:", "a finished request"),
    ("lookup", "if num_tokens // self.config.hash_block_tokens > len(req.hashes):",
     "lookup: tokens past its hashes"),
    ("after_alloc", "if req.jobs:", "a load while the request's jobs run"),
    ("_validate_alloc", "if count > len(tables[group]):", "more valid blocks than the table"),
    ("_validate_step", "if type(step) is not StepInput:", "build_step: not a StepInput"),
    ("_validate_scheduled", "if sr.num_tokens // cfg.hash_block_tokens > hashes:",
     "build_step: tokens past its hashes"),
    ("_validate_reports", "if r.job_id in queued:", "a load after_alloc queued"),
    ("reset", "if self._queued_loads:", "reset: between after_alloc and build_step"),
    ("_validate_step", "if request_id in queued:",
     "build_step: preempting a request whose load it hands out"),
    ("_tracked", "if type(request_id) is not str:", "jobs_of: the id in a list"),
]


@pytest.mark.parametrize(("method", "check", "twin"), REFUSALS,
                         ids=[m for m, _, _ in REFUSALS])
def test_the_bad_calls_stage_names_each_refusal_removed(
        monkeypatch: pytest.MonkeyPatch, method: str, check: str, twin: str) -> None:
    """Mutants: one of the scheduler's refusals removed (a hook on a finished request
    acting on freed blocks; a lookup or step past the hashes given; a load beside the
    request's own jobs; more valid blocks than the table; a step that is not a
    StepInput; a report or a reset for a load queued but not yet handed to the workers,
    or a step that preempts the request whose queued load it hands out).
    The stage's twin for it must be accepted or refused for another reason, and named."""
    from refinement.test_refinement_mutants import mutated

    monkeypatch.setattr(OffloadScheduler, method,
                        mutated(getattr(OffloadScheduler, method), check, "if False:"))
    result = _check.BatteryResult()
    # The stage's first seeds, as kvcore check runs them (HOSTILE_SEEDS: 6). A report for
    # a queued load needs a load queued at report time: the stage's fourth seed meets it
    # since the twin of a null FULL id joined the draws (the third did before).
    seeds = 4 if method == "_validate_reports" else 3
    _check.run_sims(preset(DEFAULT), seeds, result, preset=DEFAULT, hostile=True)
    assert result.failure is not None and result.failure.ids == ["A1"], result.failure
    assert twin in result.failure.message, result.failure.message


def test_a_rare_twin_is_not_starved_by_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: a window group's load may start before the chunks its lookup verified
    (``group_load`` without ``first_chunk < served[0]``). On gpt-oss only the twin with a
    block before the verified chunks meets it, and that twin applies now and then: once
    the twins every call offers had spent the stage's limit, it never bounced and the
    stage passed. A kind's first bounce is outside the limit now."""
    from refinement.test_refinement_mutants import mutated

    from kvcore.scheduler import _rules
    monkeypatch.setattr(_rules, "group_load", mutated(
        _rules.group_load, "first_chunk < served[0] or ", ""))
    result = _check.BatteryResult()
    _check.run_sims(preset("gpt-oss"), 6, result, preset="gpt-oss", hostile=True)
    assert result.failure is not None and result.failure.ids in (["A1"], ["L1"]), \
        result.failure


def test_a_short_tier_answer_must_name_its_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant (held-out seed-58 m05): the error for a tier that answers one status short
    names the other batch call (``is not None`` read as ``is``). No stage's tier ever
    answered short; the directed scenario's tiers do, one per read path (A1)."""
    from refinement.test_refinement_mutants import mutated

    from kvcore import _scenarios
    from kvcore.scheduler._lookup import StatusReader
    monkeypatch.setattr(StatusReader, "_fetch", mutated(
        StatusReader._fetch, '"lookup_hashes" if self._by_hash is not None',
        '"lookup_hashes" if self._by_hash is None'))
    with pytest.raises(_scenarios.ScenarioFailure, match="not a BadReportError") as info:
        _scenarios.short_tier_answers(OffloadScheduler, preset(DEFAULT))
    assert info.value.id == "A1"


def test_hashes_of_another_length_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``hash_length`` takes any length once one is fixed (its test ``if False:``),
    so the hashes of a second hash function mix with the first's and no key of one ever
    matches the other's. Every earlier twin changed one hash of a call, which the hook's
    own length check refuses first; the bad-calls stage now makes every hash of a call
    one byte longer (add_request, add_hashes, build_step)."""
    from refinement.test_refinement_mutants import mutated

    from kvcore.scheduler import _validate
    monkeypatch.setattr(_validate, "hash_length", mutated(
        _validate.hash_length, "if current is not None and size != current:", "if False:"))
    result = _check.BatteryResult()
    _check.run_sims(preset(DEFAULT), 3, result, preset=DEFAULT, hostile=True)
    assert result.failure is not None and result.failure.ids == ["A1"], result.failure
    assert "one byte longer than the scheduler's" in result.failure.message


@pytest.mark.parametrize(("owner", "method", "old", "new"), [
    ("StatusReader", "items", "min(start + size, hi)", "min(start - size, hi)"),
    ("HitTest", "first_miss", "min(base + size, end)", "min(base - size, end)"),
])
def test_a_block_walk_that_goes_backwards_is_named_not_a_hang(
        monkeypatch: pytest.MonkeyPatch, owner: str, method: str, old: str, new: str) -> None:
    """Held-out seed-60 m05: the lookup reader's block walk with its step reversed. As a
    ``while at < hi`` loop that never advanced, ``kvcore check`` hung (a timeout names
    nothing); walked by a range, the same slip reads short or wrong blocks and the lock
    step names it (R1) in the directed stage."""
    from refinement.test_refinement_mutants import mutated

    from kvcore.scheduler import _lookup
    cls = getattr(_lookup, owner)
    monkeypatch.setattr(cls, method, mutated(getattr(cls, method), old, new))
    result = _check.BatteryResult()
    _check.run_directed(preset(DEFAULT), result, preset=DEFAULT)
    assert result.failure is not None and result.failure.ids == ["R1"], result.failure


def test_a_window_scan_that_stops_moving_is_named_not_a_hang(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the window groups' boundary scan steps to ``miss - extra + 1``, which can
    be where it already was. As ``while k * o > computed`` that scan never ended and
    ``kvcore check`` hung; bounded by a range of k + 1 passes it stops and names E3."""
    from refinement.test_refinement_mutants import mutated

    from kvcore.scheduler import _lookup
    monkeypatch.setattr(_lookup, "largest_supported", mutated(
        _lookup.largest_supported, "k = miss - extra\n    raise",
        "k = miss - extra + 1\n    raise"))
    result = _check.BatteryResult()
    _check.run_directed(preset(DEFAULT), result, preset=DEFAULT)
    assert result.failure is not None and result.failure.ids == ["E3"], result.failure


def test_the_bad_calls_stage_names_a_null_full_id_the_c_pass_vouched_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant (held-out seed 77's m15): the C pass's FULL flags inverted, so it vouches
    for a FULL group's null id 0 (and repeats) and applies the step without the Python
    checks. The bad-calls stage had no build_step twin with a null FULL id; it now
    names one accepted (A1)."""
    from refinement.test_refinement_mutants import mutated

    from kvcore.scheduler import scheduler as sched_module
    bad = mutated(sched_module.OffloadScheduler.__init__,
                  "tuple(not w for w in self._window_groups))",
                  "tuple(w for w in self._window_groups))")
    monkeypatch.setattr(sched_module.OffloadScheduler, "__init__", bad)
    result = _check.BatteryResult()
    _check.run_sims(preset(DEFAULT), 2, result, preset=DEFAULT, hostile=True)
    assert result.failure is not None and result.failure.ids == ["A1"], result.failure
    assert "null in a FULL group's new ids: accepted" in result.failure.message
