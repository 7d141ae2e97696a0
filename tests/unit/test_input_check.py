"""The set-up stage's valid hook inputs (``kvcore._inputcheck``): every documented form
is accepted as given, and a scan that breaks on one is named X2, not left to crash the
simulations unnamed."""

from __future__ import annotations

import pytest

from kvcore import _inputcheck
from kvcore.presets import PRESETS, preset
from kvcore.spec import hooks
from kvcore.spec.errors import InvariantViolation


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_form_is_accepted_on_every_preset(name: str) -> None:
    checked: dict[str, int] = {}
    _inputcheck.run_inputs(preset(name), checked)
    assert checked["X2"] >= 50  # one record per form made, one per read-back


def test_a_set_scan_that_fails_is_named() -> None:
    """Held-out seed 52's m37/m38: ``ids_max`` returning NULL for a set it could iterate
    (``it != NULL``). Every engine's first ``StepInput`` then raised SystemError, and
    ``kvcore check`` ended in an unnamed crash."""
    real = hooks._scan_ids

    def broken(ids: object) -> int:
        if isinstance(ids, frozenset | set):
            raise SystemError("<built-in function ids_max> returned NULL without setting "
                              "an exception")
        return real(ids)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hooks, "_scan_ids", broken)
        with pytest.raises(InvariantViolation, match=r"X2: StepInput\(allocated_ids=a "
                           r"frozenset\): a valid call refused .* SystemError") as caught:
            _inputcheck.run_inputs(preset("deepseek-v4-mtp"), {})
    assert caught.value.ids == ["X2"]


def test_a_form_read_back_changed_is_named() -> None:
    """A valid form accepted but changed (here: a list of hashes read back in reverse)
    is not honoured: X2."""
    real = hooks.check_hashes

    def reversed_lists(where: str, name: str, value: object) -> tuple[bytes, ...]:
        out = real(where, name, value)
        return tuple(reversed(out)) if isinstance(value, list) else out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hooks, "check_hashes", reversed_lists)
        with pytest.raises(InvariantViolation, match=r"X2: RequestInfo\(block_hashes=a list "
                           r"of 1-byte hashes\): .*reads back as"):
            _inputcheck.run_inputs(preset("deepseek-v4-mtp"), {})


def test_the_environment_switch_read_the_wrong_way_is_named() -> None:
    """Held-out seed 52's m00: ``KVCORE_CHECK`` compared with ``!=``, so an engine's test
    run with ``KVCORE_CHECK=1`` had no checks at all (and every run without it had them
    all). kvcore's own checks pass the flag, so only the switch itself can show it."""
    import os

    from kvcore.manager import _cpu
    from kvcore.scheduler import scheduler

    def inverted(flag: bool | None) -> bool:
        if flag is None:
            return os.environ.get("KVCORE_CHECK", "") != "1"
        return flag

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_cpu, "checks_enabled", inverted)
        mp.setattr(scheduler, "checks_enabled", inverted)
        with pytest.raises(InvariantViolation, match=r"X2: CPUOffloadManager\(check=None\) "
                           r"with KVCORE_CHECK unset: .*reads back as True"):
            _inputcheck.run_inputs(preset("deepseek-v4-mtp"), {})


def test_the_switch_leaves_the_environment_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    monkeypatch.setenv("KVCORE_CHECK", "x")
    _inputcheck.run_check_switch(preset("gemma3"), {})
    assert os.environ["KVCORE_CHECK"] == "x"
    monkeypatch.delenv("KVCORE_CHECK")
    _inputcheck.run_check_switch(preset("gemma3"), {})
    assert "KVCORE_CHECK" not in os.environ


@pytest.mark.parametrize("read", ["state_of", "slot_of", "lookup"])
def test_a_tier_read_that_refuses_a_valid_key_is_named(read: str) -> None:
    """A tier read whose type test is inverted refuses every valid key: the lock step and
    a router reading the tier then end in a crash that names nothing. ``run_reads`` asks
    each once (X2)."""
    from kvcore.manager import CPUOffloadManager
    from kvcore.spec.errors import ArgumentTypeError

    def refuses(self: object, key: object) -> object:
        raise ArgumentTypeError(f"CPUOffloadManager.{read}", "key", key, "bytes", "mutant")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CPUOffloadManager, read, refuses)
        with pytest.raises(InvariantViolation, match=rf"X2: CPUOffloadManager\.{read}\("):
            _inputcheck.run_reads(preset("deepseek-v4-mtp"), {})


def test_a_scheduler_read_that_answers_wrong_is_named() -> None:
    """``cursors`` of a fresh request must read back as zeros, one per group."""
    from kvcore.scheduler import OffloadScheduler

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OffloadScheduler, "cursors", lambda self, rid: (1,))
        with pytest.raises(InvariantViolation, match=r"X2: OffloadScheduler\.cursors"):
            _inputcheck.run_reads(preset("deepseek-v4-mtp"), {})
