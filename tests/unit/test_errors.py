"""Every error kvcore raises is a ``KVCoreError`` and the builtin that fits.

An engine catches ``KVCoreError`` to tell kvcore's refusals from its own bugs; a class
added to ``kvcore.spec.errors`` without the base (or without a builtin base, so that an
existing ``except ValueError`` no longer catches it) fails here.
"""

from __future__ import annotations

import inspect

import pytest

import kvcore
from kvcore.manager import _capacity
from kvcore.presets import preset
from kvcore.spec import errors
from kvcore.transfer import short_repr

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass)
           if issubclass(c, BaseException) and c.__module__ == errors.__name__]
BUILTINS = (ValueError, TypeError, KeyError, RuntimeError, AssertionError)


def test_the_module_defines_the_errors_users_see() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"ConfigError", "KVCopyError", "InvariantViolation", "ArgumentTypeError",
            "ArgumentRangeError", "BlockIdError", "TransferArgumentError"} <= names


@pytest.mark.parametrize("cls", [c for c in CLASSES if c is not errors.KVCoreError],
                         ids=lambda c: c.__name__)
def test_each_error_is_a_kvcore_error_and_a_builtin(cls: type) -> None:
    assert issubclass(cls, errors.KVCoreError)
    if not cls.__name__.startswith("_"):
        assert issubclass(cls, BUILTINS), f"{cls.__name__} derives from no fitting builtin"


def test_argument_errors_carry_their_fields_and_teach() -> None:
    exc = errors.ArgumentRangeError("lookup", "num_tokens", -1, "0..2**40", "pass a count")
    assert isinstance(exc, ValueError) and isinstance(exc, kvcore.KVCoreError)
    assert (exc.where, exc.argument, exc.value, exc.bound) == ("lookup", "num_tokens", -1,
                                                               "0..2**40")
    assert str(exc) == "lookup: num_tokens=-1 is outside 0..2**40; pass a count"
    typed = errors.ArgumentTypeError("lookup", "num_tokens", "7", "int", "pass an int")
    assert isinstance(typed, TypeError)
    assert str(typed) == "lookup: num_tokens='7' is a str, expected int; pass an int"


@pytest.mark.parametrize(("call", "error"), [
    (lambda: kvcore.CPUOffloadManager.for_config({"num_cpu_blocks": 8}), errors.ArgumentTypeError),
    (lambda: _capacity.cpu_capacities("gemma3"), errors.ArgumentTypeError),
    (lambda: _capacity.group_capacity(preset("gemma3"), 2), errors.ArgumentRangeError),
    (lambda: _capacity.group_capacity(preset("gemma3"), -1), errors.ArgumentRangeError),
    (lambda: _capacity.group_capacity(preset("gemma3"), True), errors.ArgumentTypeError),
], ids=["for_config-dict", "capacities-name", "group-past-end", "group-negative", "group-bool"])
def test_pool_sizing_refuses_what_is_not_a_config_or_a_group(call: object, error: type) -> None:
    """Sizing the CPU pools from something that is not a config, or for a group the config
    lacks, is an argument error naming it, never an AttributeError or IndexError."""
    with pytest.raises(error):
        call()  # type: ignore[operator]



class _Repr:
    """An object whose repr is exactly the given text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


@pytest.mark.parametrize("length", [1, 59, 60, 61, 62, 10_000])
def test_values_in_transfer_messages_are_cut_to_60_characters(length: int) -> None:
    """A transfer error names the offending value by its repr, at most 60 characters, so a
    huge id list or object cannot flood a log: a repr that fits is shown whole, a longer
    one keeps as much as fits (56 characters) and ends in "...>" so it reads as cut.

    Kills a bound moved by one either way (``<= 61`` lets a 61-character repr through whole,
    ``< 60`` cuts one that fits) and a cut that keeps more or fewer than 56 characters."""
    text = "<" + "x" * (length - 1)
    shown = short_repr(_Repr(text))
    if length <= 60:
        assert shown == text
    else:
        assert shown == text[:56] + "...>" and len(shown) == 60


# Found by a hostile-input review: each raised a bare builtin before (TypeError from
# frozenset, OverflowError from math.isfinite, TypeError from preset's signature) or was
# accepted and failed later (a nested capacity, in stats()).
@pytest.mark.parametrize("call, error, argument", [
    (lambda: kvcore.StepInput((), (), [[1]]), errors.ArgumentTypeError, "allocated_ids[0]"),
    (lambda: kvcore.StepInput((), (), ([1, 2],)), errors.ArgumentTypeError,
     "allocated_ids[0]"),
    (lambda: kvcore.WorkerReport(0, 1, seconds=2**1024), errors.ArgumentRangeError,
     "seconds"),
    (lambda: kvcore.WorkerReport(0, 1, seconds=10**400), errors.ArgumentRangeError,
     "seconds"),
    # A float past the bound (the int check alone would let 1e300 through).
    (lambda: kvcore.WorkerReport(0, 1, seconds=float(2**63)), errors.ArgumentRangeError,
     "seconds"),
    (lambda: kvcore.WorkerReport(0, 1, seconds=1e300), errors.ArgumentRangeError, "seconds"),
])
def test_hook_fields_refuse_unhashable_ids_and_huge_durations(call: object, error: type,
                                                              argument: str) -> None:
    with pytest.raises(error) as caught:
        call()  # type: ignore[operator]
    assert type(caught.value) is error and caught.value.argument == argument  # type: ignore[attr-defined]


@pytest.mark.parametrize("capacity", [[[4]], [4, [4, 4]], ((2,),)])
def test_a_nested_capacity_is_a_config_error(capacity: object) -> None:
    with pytest.raises(errors.ConfigError, match="nests a list") as caught:
        kvcore.CPUOffloadManager(capacity)  # type: ignore[arg-type]
    assert caught.value.field == "capacity"


def test_a_preset_can_override_the_config_name() -> None:
    assert preset("gemma3", name="my-layout").name == "my-layout"


# One instance of every error class, built as kvcore builds it (a class added to the module
# without an entry here fails test_every_error_survives_pickling).
SAMPLES: dict[str, errors.KVCoreError] = {
    "KVCoreError": errors.KVCoreError("plain"),
    "ConfigError": errors.ConfigError("groups[1].window_tokens", "must be > 0"),
    "KVCopyError": errors.KVCopyError("bad id", code=3, descriptor_index=2, job_id=7,
                                      group=1, value=99, bound=64, side=1, native=True),
    "InvariantViolation": errors.InvariantViolation([], at_runtime=True),
    "UnknownRequestError": errors.UnknownRequestError("r1"),
    "UnknownJobError": errors.UnknownJobError("job 3"),
    "BadReportError": errors.BadReportError("twice"),
    "BadStepError": errors.BadStepError("groups"),
    "CallOrderError": errors.CallOrderError("submit", "engine closed"),
    "BlockTableError": errors.BlockTableError("short"),
    "KeyNotReadyError": errors.KeyNotReadyError(b"k" * 8, "writing"),
    "NotPinnedError": errors.NotPinnedError(b"k" * 8, "ready", 0, 1),
    "InvalidKeyError": errors.InvalidKeyError("not bytes"),
    "ArgumentTypeError": errors.ArgumentTypeError("lookup", "request_id", 3, "str", "fix"),
    "ArgumentRangeError": errors.ArgumentRangeError("lookup", "n", -1, ">= 0", "fix"),
    "BlockIdError": errors.BlockIdError("step", "ids[0]", 0, "1..9", "fix", group=2),
    "HashError": errors.HashError("add_request", "hashes[0]", b"x", "32 bytes", "fix"),
    "DuplicateRequestError": errors.DuplicateRequestError("build_step", "requests", "r"),
    "BadKeyError": errors.BadKeyError("lookup_many", b"", 68),
    "KeyGroupError": errors.KeyGroupError("prepare_store", b"k" * 8, 9, 2),
    "TransferArgumentError": errors.TransferArgumentError("cpu_buffer", "too small",
                                                          value=3, bound=4, job_id=1),
}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_survives_pickling(cls: type[BaseException]) -> None:
    """An engine's workers run in other processes and send their exceptions back pickled
    (multiprocessing, Ray): each kvcore error must arrive as itself, message and fields.
    Before, every class with its own constructor failed to unpickle with a bare TypeError
    (``cls(*args)`` with the message as the only argument), and ``KVCopyError`` lost its
    fields."""
    import pickle

    if cls.__name__.startswith("_"):
        pytest.skip("abstract base")
    error = SAMPLES[cls.__name__]
    assert type(error) is cls
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error) and back.args == error.args
    assert back.__dict__ == error.__dict__


def test_a_key_error_repr_names_its_own_call() -> None:
    """``BadKeyError``'s args held its base's ``prepare_store`` message ("is a bytes, not
    bytes"), so ``repr``, logs and pickles named the wrong call."""
    error = errors.BadKeyError("lookup_many", b"", 68)
    assert error.args == (str(error),) and "lookup_many" in repr(error)
    group = errors.KeyGroupError("touch", b"k" * 8, 9, 2)
    assert group.args == (str(group),) and "group=9" in repr(group)


def test_a_huge_or_hostile_value_is_named_cheaply() -> None:
    """A wrong-typed container of millions of items is named by its first few (its whole
    repr took seconds and hundreds of MB), and a value whose ``__repr__`` raises is named
    by its type (its exception replaced kvcore's)."""

    class Hostile:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    assert errors.short_repr(Hostile()).startswith("<")
    assert "Hostile" in errors.short_repr(Hostile())
    big = list(range(2_000_000))
    assert errors.short_repr(big).startswith("[0, 1, 2")
    with pytest.raises(errors.ArgumentTypeError) as info:
        kvcore.CPUOffloadManager(4).prepare_store(Hostile())  # type: ignore[arg-type]
    assert "Hostile" in str(info.value)


def test_an_error_holding_an_unpicklable_value_still_pickles() -> None:
    """The argument errors carry the caller's bad value, which may be a generator or a
    lock (it failed to pickle, so the worker's error became a pickling TypeError) or a
    container of millions of items (copied whole into the pickle). Such a field travels
    as its short repr; plain fields as they are."""
    import pickle
    import threading

    gen = (i for i in range(3))
    for error in (errors.ArgumentTypeError("lookup", "keys", gen, "a list", "fix"),
                  errors.InvalidKeyError(threading.Lock()),
                  errors.ArgumentTypeError("lookup", "keys", set(range(500_000)), "a list",
                                           "fix")):
        data = pickle.dumps(error)
        assert len(data) < 4096
        back = pickle.loads(data)
        assert type(back) is type(error) and str(back) == str(error)
        field = back.value if hasattr(back, "value") else back.key
        assert isinstance(field, str) and len(field) <= 60
    plain = errors.KVCopyError("bad", code=2, value=7, bound=4)
    assert pickle.loads(pickle.dumps(plain)).__dict__ == plain.__dict__
