"""``kvcore check``'s "set-up" and "transfer engine" stages (``kvcore._enginecheck``).

Goal: the stages pass on every preset, and each catches, under its named invariant, a
defect patched into the engine code it exists to check: a refusal skipped, a refusal that
names the wrong field, a copy to the wrong place. Each test names the mutant it kills.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

from kvcore import _enginecheck
from kvcore.presets import PRESETS, preset
from kvcore.spec.errors import InvariantViolation
from kvcore.spec.plans import JobKind
from kvcore.transfer import _engine, _memory, _plans, _setup

DEFAULT = "deepseek-v4-mtp"


def both_stages(name: str = DEFAULT) -> dict[str, int]:
    checked: dict[str, int] = {}
    _enginecheck.run_setup(preset(name), checked)
    _enginecheck.run_transfer_engine(preset(name), _enginecheck.ENGINE_CASES, checked)
    return checked


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_both_stages_pass_and_count_their_checks(name: str) -> None:
    checked = both_stages(name)
    # Every constructor twin and two records per plan twin (validate, submit) for A1;
    # one outcome per valid plan for X2.
    assert checked["A1"] > 300
    assert checked["X2"] >= _enginecheck.ENGINE_CASES


def caught(ids: str, stage: Callable[[], Any] = both_stages) -> str:
    with pytest.raises(InvariantViolation) as info:
        stage()
    assert ids in info.value.ids, info.value
    return str(info.value)


def test_a_skipped_storage_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``_storage_error`` never looks at a pool (a freed pool is copied)."""
    monkeypatch.setattr(_engine.TransferEngine, "_storage_error", lambda self, plan: None)
    assert "a pool freed in place: accepted" in caught("A1")


def test_unchecked_options_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the constructor's option checks removed (max_queued_jobs=0 accepted)."""
    monkeypatch.setattr(_engine, "_check_options", lambda *args: None)
    caught("A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_an_unchecked_cpu_buffer_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the CPU buffer taken as given (a float32 or 2-D buffer accepted)."""
    monkeypatch.setattr(_memory, "_check_buffer", lambda buf, *args: buf)
    monkeypatch.setattr(_setup, "_check_buffer", lambda buf, *args: buf)
    caught("A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_tensor_with_a_lazy_conj_bit_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the conj/neg test of a registered tensor removed; a raw byte copy of a
    ``.conj()`` view serves values that are not what the tensor reads as."""
    from refinement.test_refinement_mutants import mutated

    monkeypatch.setattr(_memory, "_row_layout", mutated(
        _memory._row_layout, "if t.is_conj() or t.is_neg():", "if False:"))
    assert "lazy conj bit: accepted" in caught(
        "A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_manager_short_of_a_pool_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the scheduler takes a manager with no pool for one of its groups (its
    first store of that group fails after the step had changed the scheduler)."""
    from kvcore.scheduler import scheduler
    monkeypatch.setattr(scheduler, "_check_pools", lambda config, manager: None)
    assert "without the last group's pool: accepted" in caught(
        "A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_c_validator_run_through_the_python_checks_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant (held-out seed-57 m09): ``_validate_in_c`` builds its table with the Python
    id checks after all, so the comparison of the C validator with Python compares
    Python with itself. Both refusals carry the same fields by design; ``native`` tells
    them apart."""
    from refinement.test_refinement_mutants import mutated

    monkeypatch.setattr(_engine.TransferEngine, "_validate_in_c", mutated(
        _engine.TransferEngine._validate_in_c, "check_ranges=False", "check_ranges=True"))
    assert "not the C validator" in caught("A1", lambda: _enginecheck.run_transfer_engine(
        preset(DEFAULT), _enginecheck.ENGINE_CASES, {}))


@pytest.mark.parametrize("read", ["policy_of", "capacity_of"])
def test_a_tier_read_that_refuses_a_group_is_named(monkeypatch: pytest.MonkeyPatch,
                                                   read: str) -> None:
    """Held-out seed 55's m00: ``policy_of``'s type test inverted (``if not type(group)
    is not int``), so every valid group raised ArgumentTypeError and ``kvcore check``
    ended in an unnamed crash. The set-up stage asks each group's policy and capacity
    inside ``_valid`` (X2)."""
    from kvcore.manager import CPUOffloadManager
    from kvcore.spec.errors import ArgumentTypeError

    def refuses(self: object, group: object) -> object:
        raise ArgumentTypeError(f"CPUOffloadManager.{read}", "group", group, "int", "mutant")
    monkeypatch.setattr(CPUOffloadManager, read, refuses)
    message = caught("X2", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))
    assert "a valid call refused" in message and f"CPUOffloadManager.{read}:" in message


def test_python_plan_checks_removed_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the Python range and double-write checks skipped; the C library still
    refuses, but its error no longer names the plan's group and position as the fault
    implies (or a slot past the tier goes unrefused)."""
    monkeypatch.setattr(_plans, "_check_group_ranges", lambda *args: None)
    caught("A1")


def test_a_wrong_error_index_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: refusals report the next descriptor (an off-by-one in the index)."""
    real = _plans._kv_error

    def shifted(message: str, code: int, *, index: int | None, **kw: Any) -> Any:
        return real(message, code, index=None if index is None else index + 1, **kw)
    monkeypatch.setattr(_plans, "_kv_error", shifted)
    assert "descriptor_index=" in caught("A1")


def test_a_copy_to_the_wrong_sub_block_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: a store writes sub-blocks of a chunk in reverse order (destinations still
    distinct, so the C library accepts it); only the pass with two-block chunks sees it."""
    real = _plans._group_table

    def reversed_subs(kind: JobKind, grp: Any, bpc: int, regs: Any) -> torch.Tensor:
        table = real(kind, grp, bpc, regs).clone()
        if kind is JobKind.STORE:
            table[:, 5] = (bpc - 1) * table[:, 6] - table[:, 5]
        return table
    monkeypatch.setattr(_plans, "_group_table", reversed_subs)
    assert "differs from the plan's copy" in caught("X2")


def test_a_truthy_check_flag_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``checks_enabled`` takes any value (check='no' turns checks on)."""
    from kvcore.scheduler import scheduler

    monkeypatch.setattr(scheduler, "checks_enabled", lambda flag: bool(flag))
    assert "check='no'" in caught("A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_manager_error_with_the_wrong_pin_count_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``NotPinnedError`` reports one pin more than the key holds."""
    from kvcore.manager import _cpu

    real = _cpu.NotPinnedError

    def more(key: bytes, state: str, pins: int, releases: int) -> Exception:
        return real(key, state, pins + 1, releases)
    monkeypatch.setattr(_cpu, "NotPinnedError", more)
    assert "carries pins=1, the fault implies 0" in caught(
        "A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_release_before_validation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``complete_load`` releases the keys it knows before refusing the rest (a
    failed call changes the manager)."""
    from kvcore.manager import CPUOffloadManager

    real = CPUOffloadManager.complete_load

    def eager(self: CPUOffloadManager, keys: Any) -> None:
        for key in keys:
            try:
                real(self, [key])
            except Exception:
                real(self, keys)
    monkeypatch.setattr(CPUOffloadManager, "complete_load", eager)
    assert "but changed the state" in caught(
        "A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_checks_that_count_nothing_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``tally`` counts nothing (every stage's figures read 0); the canary that
    opens the set-up stage stops the run under A1."""
    from kvcore import _checks

    monkeypatch.setattr(_checks, "tally", lambda records, counts: None)
    assert "the checks are off" in caught(
        "A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_read_back_that_loses_its_range_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``read_cpu_chunk`` checks its slot against the tensor's row width, not the
    tier's slot count (a slot past the tier reads another row or raises IndexError)."""
    real = _engine.TransferEngine.read_cpu_chunk

    def loose(self: Any, group: int, tensor: int, slot: int) -> bytes:
        cpu = self._registered(group, tensor).cpu
        if isinstance(slot, int) and 0 <= slot < cpu.shape[0] + 1:
            return bytes(cpu[min(slot, cpu.shape[0] - 1)].tolist())
        return real(self, group, tensor, slot)  # type: ignore[no-any-return]
    monkeypatch.setattr(_engine.TransferEngine, "read_cpu_chunk", loose)
    assert "read_cpu_chunk" in caught("A1")


def test_views_of_different_strides_said_apart_are_caught(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Mutant: ``_rows_may_meet`` answers "apart" for views of different strides, which it
    cannot show apart (two tensors sharing a storage's first bytes are accepted)."""
    real = _memory._rows_may_meet
    monkeypatch.setattr(_memory, "_rows_may_meet", lambda a, b: a.stride_bytes == b.stride_bytes
                        and real(a, b))
    assert "two strides over one storage: accepted" in caught(
        "A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_bool_tensor_index_let_through_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``_registered`` takes a bool for a tensor index (True reads tensor 1)."""
    real = _engine.TransferEngine._registered

    def lax(self: Any, group: object, tensor: object) -> Any:
        return real(self, group, int(tensor) if isinstance(tensor, bool) else tensor)
    monkeypatch.setattr(_engine.TransferEngine, "_registered", lax)
    assert "read_cpu_chunk(0, True, 0): accepted" in caught("A1")


def test_a_repr_cut_one_character_late_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``short_repr`` shows a 61-character repr whole (the cut is at 60)."""
    monkeypatch.setattr(_plans, "short_repr", lambda v: repr(v) if len(repr(v)) <= 61
                        else repr(v)[:56] + "...>")
    monkeypatch.setattr(_engine, "short_repr", _plans.short_repr)
    assert "...> is a str" in caught("A1")


def test_a_misaligned_buffer_error_carries_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the misaligned CPU buffer's error carries bound -1 (the offset it needs is
    0 modulo 64); the set-up twin pins value and bound."""
    from refinement.test_refinement_mutants import mutated
    bad = mutated(_memory._check_buffer, "CPU_BUFFER_ALIGNMENT, bound=0)",
                  "CPU_BUFFER_ALIGNMENT, bound=-1)")
    monkeypatch.setattr(_memory, "_check_buffer", bad)
    monkeypatch.setattr(_setup, "_check_buffer", bad)
    assert "misaligned" in caught("A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_close_that_drops_jobs_on_the_stream_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the worker stops without retiring the jobs still on the stream when its
    queue ends, so ``close()`` reports them failed ("transfer worker stopped") instead of
    finishing them as documented. The stage closes with a burst in flight (X2)."""
    from refinement.test_refinement_mutants import mutated
    monkeypatch.setattr(_engine.TransferEngine, "_worker", mutated(
        _engine.TransferEngine._worker, "        while flight:\n            cast(",
        "        while False:\n            cast("))
    assert "transfer worker stopped" in caught(
        "X2", lambda: _enginecheck.run_transfer_engine(preset(DEFAULT),
                                                       _enginecheck.ENGINE_CASES, {}))


@pytest.mark.parametrize("shift", [1, 2], ids=["next group", "two on"])
def test_c_refusals_naming_the_wrong_group_are_caught(monkeypatch: pytest.MonkeyPatch,
                                                      shift: int) -> None:
    """Mutant: ``_Job.group_of`` off by one (``bisect_right(...) - 0`` or ``+ 1``), so a
    refusal from the C library names a neighbouring group. Python's checks refuse every
    bad id first, so only the C-alone pass of each range fault (the table built with
    them left out) reaches ``group_of``."""
    import bisect

    def off(self: Any, index: int) -> int:
        return bisect.bisect_right(self.offsets, index) - 1 + shift
    monkeypatch.setattr(_plans._Job, "group_of", off)
    assert "C validator alone" in caught("A1")


def test_python_and_c_agree_on_the_null_blocks_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: Python's null-block refusal gives ``num_gpu_blocks`` as its bound (the C
    library, and ``spec.descriptors``, give 1: ids must be >= 1). The engine's errors
    read the same whichever validator refused."""
    from refinement.test_refinement_mutants import mutated
    monkeypatch.setattr(_plans, "_check_group_ranges", mutated(
        _plans._check_group_ranges, "raise fail(Status.E_NULL_ROW, i, b, 1, gpu_side)",
        "raise fail(Status.E_NULL_ROW, i, b, num_gpu_blocks, gpu_side)"))
    assert "the null block: raised KVCopyError, but it carries bound=" in caught("A1")


def test_a_stream_seed_past_64_bits_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``simulate_stream``'s range check made inclusive (a seed of 2**64, which
    no 64-bit seed can hold, accepted); the set-up stage's twin one past the largest seed
    is refused."""
    from refinement.test_refinement_mutants import mutated
    monkeypatch.setattr(_engine, "_check_options", mutated(
        _setup._check_options, "0 <= simulate_stream < 1 << 64",
        "0 <= simulate_stream <= 1 << 64"))
    assert "one past the largest seed: accepted" in caught(
        "A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_key_type_check_inverted_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``CPUOffloadManager.lookup``'s fast check reads ``type(key) is bytes``, so
    a ``str`` key of a key's length skips ``check_key`` and reaches the tier's key index,
    whose own type check raises a bare TypeError (before the index it answered MISS). The
    set-up stage asks every key-taking call with keys of the wrong type and names it."""
    from refinement.test_refinement_mutants import mutated

    from kvcore.manager import _cpu
    monkeypatch.setattr(_cpu.CPUOffloadManager, "lookup", mutated(
        _cpu.CPUOffloadManager.lookup, "type(key) is not bytes", "type(key) is bytes"))
    assert "CPUOffloadManager.lookup: a str key: raised TypeError, not a kvcore error" in \
        caught("A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_job_zero_refused_by_job_in_flight_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``job_in_flight`` checks ``job_id`` against 1.. instead of its documented
    0.., so asking about job 0 raises. The set-up stage asks about both ends of the
    range (X2)."""
    from refinement.test_refinement_mutants import mutated

    from kvcore import scheduler
    monkeypatch.setattr(scheduler.OffloadScheduler, "job_in_flight", mutated(
        scheduler.OffloadScheduler.job_in_flight, "job_id, 0, MAX_REPORT_INT",
        "job_id, 1, MAX_REPORT_INT"))
    assert "job_in_flight(0)" in caught("X2", lambda: _enginecheck.run_setup(
        preset(DEFAULT), {}))


def test_job_zero_refused_by_submit_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``check_plan`` takes job ids from 1 (0 is documented as valid), so the
    engine refuses a plan numbered 0. The stage's first plan is job 0 (X2)."""
    from refinement.test_refinement_mutants import mutated
    bad = mutated(_plans.check_plan, "not 0 <= job <= MAX_JOB_ID", "not 1 <= job <= MAX_JOB_ID")
    monkeypatch.setattr(_plans, "check_plan", bad)
    monkeypatch.setattr(_engine, "check_plan", bad)
    assert "valid plan 0" in caught("X2", lambda: _enginecheck.run_transfer_engine(
        preset(DEFAULT), _enginecheck.ENGINE_CASES, {}))


@pytest.mark.parametrize("where", ["construct", "rebind"])
def test_gpu_tensors_type_check_weakened_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                   where: str) -> None:
    """Mutant: the ``gpu_tensors`` type check's ``or`` made ``and``, so only a tensor is
    refused and ``None`` reaches ``len()`` (a bare TypeError). The set-up stage builds
    an engine with ``gpu_tensors=None``; the engine stage rebinds to it."""
    from refinement.test_refinement_mutants import mutated
    old = "isinstance(gpu_tensors, torch.Tensor) or not"
    new = "isinstance(gpu_tensors, torch.Tensor) and not"
    if where == "construct":
        monkeypatch.setattr(_engine, "_check_options", mutated(_setup._check_options, old, new))
        stage = partial(_enginecheck.run_setup, preset(DEFAULT), {})
    else:
        monkeypatch.setattr(_engine.TransferEngine, "rebind_gpu_tensors", mutated(
            _engine.TransferEngine.rebind_gpu_tensors, old, new))
        stage = partial(_enginecheck.run_transfer_engine, preset(DEFAULT),
                        _enginecheck.ENGINE_CASES, {})
    assert "None: raised TypeError, not a kvcore error" in caught("A1", stage)


def test_a_touch_before_validation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``touch`` refreshes the good keys of a call before refusing its bad one (a
    refused call reorders the LRU). The bad-key cases compare the policies' orders."""
    from kvcore.manager import CPUOffloadManager

    real = CPUOffloadManager.touch

    def eager(self: CPUOffloadManager, keys: Any) -> None:
        good = [k for k in keys if type(k) is bytes and k]
        if good and len(good) < len(keys):
            real(self, good)
        real(self, keys)
    monkeypatch.setattr(CPUOffloadManager, "touch", eager)
    assert "touch: a str key beside a good one: raised BadKeyError but changed the state" \
        in caught("A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_wait_limit_refused_at_its_edge_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant (held-out seed 43's m18): the limit's bound ``<= TIMEOUT_MAX`` read as ``<``,
    so the longest wait the lock takes is refused. Found by the transfer engine stage's
    wait-limit edges (X2: a valid call refused)."""
    real = _engine._timeout

    def strict(where: str, timeout: object) -> float | None:
        if timeout == threading.TIMEOUT_MAX:
            raise _engine._bad(f"{where}(timeout)", "mutant: the edge refused")
        return real(where, timeout)
    monkeypatch.setattr(_engine, "_timeout", strict)
    assert "drain(timeout=" in caught("X2")


def test_a_negative_wait_limit_let_through_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the limit's lower bound dropped (a negative limit reads as "already timed
    out" instead of a sign mistake named at the call). Found as an A1 bad call."""
    real = _engine._timeout

    def lax(where: str, timeout: object) -> float | None:
        if isinstance(timeout, int | float) and not isinstance(timeout, bool) \
                and timeout < 0:
            return 0.0
        return real(where, timeout)
    monkeypatch.setattr(_engine, "_timeout", lax)
    assert "drain(timeout=-" in caught("A1")


def test_a_pool_size_lost_per_group_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant (held-out seed 44's m03): ``capacity_of``'s range test inverted for a
    manager sized per group, so every group it serves answers 0 (and one it does not
    serve raises IndexError). The set-up stage asks each group of ``for_config`` through
    ``_valid``: X2, where the stage crashed before."""
    from kvcore.manager import _cpu

    def inverted(self: Any, group: int) -> int:
        if self._per_group is not None:
            return self._per_group[group] if not 0 <= group < len(self._per_group) else 0
        return self._capacity if 0 <= group < _cpu.MAX_GROUPS else 0
    monkeypatch.setattr(_cpu.CPUOffloadManager, "capacity_of", inverted)
    assert "every group's pool holds the config's slots" in caught(
        "X2", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_the_tier_accessors_are_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant (held-out seed 44's m43): ``num_tensors`` asks for tensor 1, refusing a
    group of one tensor (the stage's third group is one); and a ``pinned_bytes`` a row
    short (the set-up stage sees that one too, in the CPU buffer it sizes). Both are X2: a
    valid question not answered, or answered wrong."""
    monkeypatch.setattr(_engine.TransferEngine, "num_tensors",
                        lambda self, group: (self._registered(group, 1), 2)[1])
    assert "num_tensors(2)" in caught("X2")
    monkeypatch.undo()
    real = _engine.TransferEngine.pinned_bytes
    monkeypatch.setattr(_engine.TransferEngine, "pinned_bytes",
                        lambda self, group=None: real(self, group) - (group == 1))
    assert "pinned_bytes(1)" in caught("X2", lambda: _enginecheck.run_transfer_engine(
        preset(DEFAULT), _enginecheck.ENGINE_CASES, {}))


def test_a_valid_wait_refused_is_named_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant (held-out seed 44's m45): the wait limit's range test inverted, so every
    finite limit is refused. The stage's own bounded calls (its waits, and its closes,
    the first it makes) go through ``_valid``: X2 names it, where the battery only
    crashed before."""
    real = _engine._timeout

    def inverted(where: str, timeout: object) -> float | None:
        if isinstance(timeout, float | int) and 0 <= timeout < float("inf"):
            raise _engine._bad(f"{where}(timeout)", f"{timeout} is outside the range")
        return real(where, timeout)
    monkeypatch.setattr(_engine, "_timeout", inverted)
    assert re.search(r"(close|wait)\(.*\(timeout\): 60\.0 is outside the range", caught("X2"))


def test_a_wait_that_times_out_is_judged_as_lost_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait that times out is no refusal of the call: the stage's own waits let
    TimeoutError through ``_valid`` (``passes``), and the jobs never reported are failed
    results, named by their plans' X2 record, not as a valid wait refused."""
    def lost(self: Any, job_ids: Any, timeout: float | None = None) -> list[Any]:
        raise TimeoutError("jobs lost")
    monkeypatch.setattr(_engine.TransferEngine, "wait", lost)
    message = caught("X2", lambda: _enginecheck.run_transfer_engine(
        preset(DEFAULT), _enginecheck.ENGINE_CASES, {}))
    assert "0 results reported" in message and "wait(" not in message


def engine_stage() -> None:
    _enginecheck.run_transfer_engine(preset(DEFAULT), 40, {})


def test_a_with_block_that_hands_back_something_else_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``__enter__`` returns None, so ``with TransferEngine(...) as e`` gives an
    engine nobody can call (X2)."""
    monkeypatch.setattr(_engine.TransferEngine, "__enter__", lambda self: None)
    assert "e is the engine" in caught("X2", engine_stage)


def test_a_with_block_that_leaves_the_engine_open_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``__exit__`` does not close: the worker and the pinned tier outlive the
    block, and a submit after it is taken (A1)."""
    monkeypatch.setattr(_engine.TransferEngine, "__exit__", lambda self, *exc: None)
    assert "submit after the with block: accepted" in caught("A1", engine_stage)


def test_a_submit_after_close_that_is_taken_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``submit`` skips its closed test (the job is queued for a worker that has
    stopped: it never finishes)."""
    real = _engine.TransferEngine.submit

    def submit(self: Any, plan: Any) -> None:
        closed, self._closed = self._closed, False
        try:
            real(self, plan)
        finally:
            self._closed = closed
    monkeypatch.setattr(_engine.TransferEngine, "submit", submit)
    assert "submit after close(): accepted" in caught("A1", engine_stage)


def test_a_wait_for_non_int_ids_that_returns_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``wait`` takes ids of any type, so ``wait(["7"])`` returns at once as if
    job 7 had finished: the fence it stands for does not hold."""
    monkeypatch.setattr(_engine, "_job_ids", lambda job_ids: set(job_ids or ()))
    assert "accepted" in caught("A1", engine_stage)


@pytest.mark.parametrize(("name", "value", "twin"), [
    ("hasattr", lambda obj, field: True, "a plan without its fields"),
    ("GroupTransfer", object, "a group that is not a GroupTransfer")])
def test_plan_type_checks_removed_are_caught(monkeypatch: pytest.MonkeyPatch, name: str,
                                            value: object, twin: str) -> None:
    """Mutants: ``check_plan`` never finds a field missing (``hasattr`` always true), or
    ``_normalize_group`` takes any object as a GroupTransfer. A plan made without its
    constructor, or a group of another type, reaches the code that reads its fields: an
    AttributeError, not a kvcore error naming the plan (A1)."""
    monkeypatch.setattr(_plans, name, value, raising=False)
    assert f"{twin}: raised AttributeError" in caught("A1", engine_stage)


def test_a_suffix_check_removed_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``_check_hashes`` takes a suffix of any length, so a key of one group is
    assembled with another's bytes cut short (A1: a suffix a byte short, accepted)."""
    from kvcore.manager import _cpu
    real = _cpu._check_hashes

    def lenient(where: str, hashes: Any, suffix: Any) -> Any:
        if type(suffix) is bytes:
            return _cpu.check_hashes(where, "hashes", hashes)
        return real(where, hashes, suffix)
    monkeypatch.setattr(_cpu, "_check_hashes", lenient)
    message = caught("A1", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))
    assert "a suffix a byte short: accepted" in message


def test_an_empty_touch_that_is_refused_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``touch`` without its empty-batch return reads ``keys[0]`` of an empty list
    (X2: a valid call refused)."""
    from kvcore.manager import CPUOffloadManager
    real = CPUOffloadManager.touch

    def touch(self: Any, keys: Any) -> None:
        if not keys:
            raise IndexError("list index out of range")
        real(self, keys)
    monkeypatch.setattr(CPUOffloadManager, "touch", touch)
    assert "touch([]): a valid call refused" in caught(
        "X2", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def _transfer_stage() -> None:
    _enginecheck.run_transfer_engine(preset(DEFAULT), _enginecheck.ENGINE_CASES, {})


# Mutants of the transfer engine's timing-dependent refusals. Before the stand-in stream
# held a job in flight, no stage of ``kvcore check`` executed any of these lines, so
# removing each passed the check. Each row: the class and method patched, the text
# replaced and its replacement, the invariant the check must name, a phrase of its
# message, and whether the stage's close limit is shortened (for mutants that would
# otherwise leave a worker waiting out the full ``JOB_SECONDS``).
HELD_JOB_MUTANTS = [
    # submit's in-flight id test removed: a second job under a live id is queued and
    # the first result settles both.
    pytest.param(_engine.TransferEngine, "submit",
                 "if plan.job_id in self._pending or plan.job_id in self._done:",
                 "if False:", "A1", "again while it is in flight", False, id="dup-id"),
    # wait answers when its limit runs out instead of raising TimeoutError: the fence
    # a wait stands for would pass with the store's bytes still moving.
    pytest.param(_engine.TransferEngine, "wait",
                 "lambda: not ids & self._pending, timeout):",
                 "lambda: not ids & self._pending, timeout) and False:",
                 "X2", "instead of raising TimeoutError", False, id="wait-timeout"),
    # rebind swaps the pools without waiting for the jobs in flight: a copy still
    # running reads or writes pools the engine has just handed back.
    pytest.param(_engine.TransferEngine, "rebind_gpu_tensors",
                 "if not self._cond.wait_for(lambda: not self._pending, timeout):",
                 "if False:", "X2", "rebound with a job in flight", False, id="rebind"),
    # _Pool.changed looks at the storage alone (its address test removed), so a pool
    # re-pointed with set_ is copied at its old address: wrong bytes, no error. The
    # rebinds alternate between freeing a pool and re-pointing it.
    pytest.param(_memory._Pool, "changed", "if self.tensor.data_ptr() != self.base:",
                 "if False:", "A1", "a pool pointed elsewhere: accepted", False,
                 id="re-pointed-pool"),
    # close returns with its worker still running (its TimeoutError removed), so the
    # caller frees pools a copy is still reading.
    pytest.param(_engine.TransferEngine, "close", "if self._thread.is_alive():",
                 "if False:", "X2", "instead of raising TimeoutError", False,
                 id="close-early"),
    # close releases the stream without destroying its events (on CUDA they outlive
    # the engine).
    pytest.param(_engine.TransferEngine, "close", "self._cuda.event_destroy(event)",
                 "pass", "X2", "events still alive", False, id="close-keeps-events"),
    # close finds the queue full behind a stuck worker and builds the thread that
    # would post the stop mark but never starts it: the worker waits forever and
    # every later close times out.
    pytest.param(_engine.TransferEngine, "close", 'name="kvcore-transfer-stop").start()',
                 'name="kvcore-transfer-stop")', "X2", "events still alive", True,
                 id="close-drops-stop-mark"),
    # the worker's last words are gone (its finally reports no job): when it dies with
    # a job in flight the job leaves the jobs in flight with no result, so a wait
    # answers as if it had finished and the scheduler never hears of it.
    pytest.param(_engine.TransferEngine, "_fail_pending",
                 "for job_id in sorted(self._pending):", "for job_id in []:", "X2",
                 "when its worker died", True, id="worker-dies"),
]


@pytest.mark.parametrize(("cls", "method", "old", "new", "invariant", "says", "short"),
                         HELD_JOB_MUTANTS)
def test_a_timing_dependent_refusal_removed_is_caught(
        monkeypatch: pytest.MonkeyPatch, cls: type, method: str, old: str, new: str,
        invariant: str, says: str, short: bool) -> None:
    """Each mutant passed ``kvcore check`` until the transfer stage held a job in flight;
    now the stage names it."""
    from refinement.test_refinement_mutants import mutated

    if short:
        monkeypatch.setattr(_enginecheck, "JOB_SECONDS", 5.0)
    monkeypatch.setattr(cls, method, mutated(getattr(cls, method), old, new))
    assert says in caught(invariant, _transfer_stage)


def test_a_worker_that_does_not_look_at_the_pools_again_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the worker's second pool check before the copy removed (``if False:``), so
    a job queued before its pool was freed copies from freed memory. The stand-in pass
    holds one job in flight, queues a store behind it and frees that store's pool. Here
    the copy of that one job is skipped (the mutant would read freed memory), so the
    test sees what the check sees: a job that succeeded and moved bytes."""
    from refinement.test_refinement_mutants import mutated

    from kvcore import _native

    behind = 2 * (_enginecheck.ENGINE_CASES * 2 // 8) + 2  # the stand-in pass's held job + 1
    real, skipped = _native.copy, []

    def copy(regions: Any, descs: Any, **funnel: Any) -> Any:
        if funnel.get("job_id") == behind:
            skipped.append(behind)
            return None
        return real(regions, descs, **funnel)

    monkeypatch.setattr(_native, "copy", copy)
    monkeypatch.setattr(_engine.TransferEngine, "_execute", mutated(
        _engine.TransferEngine._execute, "if failure is not None:", "if False:"))
    assert "a pool freed after its job was queued" in caught("A1", _transfer_stage)
    assert skipped == [behind]


@pytest.mark.parametrize(("method", "old", "new"), [
    ("event_create", "if len(self._live) >= MAX_EVENTS:", "if len(self._live) > MAX_EVENTS:"),
    ("event_record", "if event in self._pending:", "if False:"),
    ("_known", "if event not in self._live:", "if False:"),
])
def test_a_stand_in_detector_that_does_not_bite_is_caught(
        monkeypatch: pytest.MonkeyPatch, method: str, old: str, new: str) -> None:
    """Mutants of the stand-in stream's misuse detectors: each passed every engine that
    uses events correctly, so only the set-up stage's stream canary can see them."""
    from refinement.test_refinement_mutants import mutated

    from kvcore.transfer import _stream

    cls = _stream.SimulatedStream
    monkeypatch.setattr(cls, method, mutated(getattr(cls, method), old, new))
    assert "misuse detectors are off" in caught(
        "X2", lambda: _enginecheck.run_setup(preset(DEFAULT), {}))


def test_a_python_id_check_removed_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the Python range check of a plan's GPU ids is gone (its loop runs over
    nothing), so only the C validator refuses a bad id: same fields, but the first line
    of defence is down. The transfer stage now asks that a bad id be refused by the
    Python checks (``native`` False) as well as by C alone (held-out seed 77's m21)."""
    from refinement.test_refinement_mutants import mutated
    bad = mutated(_plans._check_group_ranges, "for i, b in enumerate(grp.ids):",
                  "for i, b in []:")
    monkeypatch.setattr(_plans, "_check_group_ranges", bad)
    assert "came from the C validator alone" in caught("A1", _transfer_stage)


@pytest.mark.parametrize(("old", "new", "says"), [
    ("for event in events:", "for event in []:", "events still alive"),
    ("jobs.put_nowait(None)", "pass", "its worker still runs"),
], ids=["events-kept", "no-stop-mark"])
def test_an_engine_dropped_without_close_that_is_not_freed_is_caught(
        monkeypatch: pytest.MonkeyPatch, old: str, new: str, says: str) -> None:
    """Mutants of the finalizer of an engine dropped without close() (held-out seed 78's
    m23 is the first): its events are not destroyed, or its worker is never told to
    stop. The transfer stage now drops a fourth engine and looks (X2)."""
    from refinement.test_refinement_mutants import mutated
    monkeypatch.setattr(_enginecheck, "JOB_SECONDS", 5.0)  # the join's guard, for no-stop
    monkeypatch.setattr(_engine, "_dropped", mutated(_engine._dropped, old, new))
    assert says in caught("X2", _transfer_stage)
