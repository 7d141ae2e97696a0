"""The battery's simulation stages see what the engine's real configuration runs.

Goal: each test patches one defect into kvcore and shows the stage names it. (1) A path
the scheduler takes only with its own checks off (the no-chunk-completed fast path) is
compared with the reference by the refinement stage's unchecked seeds (R1). (2) A
failure while a run is being built is a named failure of the stage, not an exception
that escapes the battery. (3) The shadow tier names a real tier that raises where the
reference answers (M2), and compares ``lookup_many``, the scheduler's read path. (4) A
valid lookup at an edge (everything computed, a cap of 0) refused by kvcore is named by
the directed edge-lookup scenario (R1). (5) The bad-calls stage's seeds meet every
variant of the options.
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
    """Mutant: ``_chunk_completed`` always answers no, so with checks off nothing is ever
    stored; with checks on the full path runs and hides it. Seed 1 runs unchecked."""
    monkeypatch.setattr(OffloadScheduler, "_chunk_completed", lambda self, req, s: False)
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


def test_lookup_many_is_compared_with_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``lookup_many`` answers MISS for a stored key (the scheduler's only read
    path; the shadow used to pass it through unchecked). The shadow names it before the
    scheduler acts on the answer."""
    real = CPUOffloadManager.lookup_many

    def forgetful(self: Any, keys: Any) -> list[Status]:
        return [Status.MISS for _ in real(self, keys)]
    monkeypatch.setattr(CPUOffloadManager, "lookup_many", forgetful)
    result = stage()
    assert result.failure is not None and result.failure.ids == ["M2"], result.failure
    assert "lookup_many" in result.failure.message


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
