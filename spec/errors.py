"""Every error kvcore raises, defined once; each is a ``KVCoreError``.

They live in ``spec`` (standard library only) because the spec's own validation raises
``ConfigError`` and its predicates feed ``InvariantViolation``; ``kvcore`` re-exports them.
There are two kinds of failure (TigerBeetle's split): bad input from the engine is an
*operating error* (``ConfigError``, ``KVCopyError``) raised whatever the flags say; a broken
invariant is a *programmer error* in kvcore itself (``InvariantViolation``). Each exception
carries its facts as fields so that ``--json`` output never parses message text.
"""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Sequence
from typing import Any

Key = bytes


def _rebuild(cls: type[KVCoreError], args: tuple[Any, ...],
             state: dict[str, Any]) -> KVCoreError:
    """Unpickle an error without its ``__init__`` (whose arguments are not ``args``)."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class KVCoreError(Exception):
    """The base of every error kvcore raises, so ``except KVCoreError`` catches exactly
    kvcore's own. Each subclass also derives from the builtin that fits (``ValueError``,
    ``TypeError``, ``KeyError``...), so existing ``except ValueError`` handlers keep working.

    Errors cross process boundaries (an engine's workers run in other processes and send
    their exceptions back pickled): the default pickling calls ``cls(*args)``, which the
    subclasses' keyword constructors refuse, so every error pickles as its args and fields.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        # A field holding the caller's bad value (a generator, a lock, a container of
        # millions of keys) travels as its short repr: it may not pickle, and its size is
        # the caller's. kvcore's own records (``violations``) travel as they are.
        state = {k: v if k == "violations" else _portable(v) for k, v in self.__dict__.items()}
        return (_rebuild, (type(self), self.args, state))


class ConfigError(KVCoreError, ValueError):
    """Raised when a configuration is invalid or ambiguous.

    ``field`` names the offending field (dotted, e.g. ``groups[1].window_tokens``) so tools
    can point at it; the message says what is wrong and what to set instead. kvcore never
    warns and falls back: an ambiguous set-up is an error.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class KVCopyError(KVCoreError, RuntimeError):
    """Raised when a copy descriptor is invalid; no byte has moved when it is raised.

    The copy library validates every descriptor before the first byte moves (invariant B1),
    so this error always means "nothing was copied". ``descriptor_index`` is the first bad
    descriptor, ``code`` the native status code, ``value`` and ``bound`` the offending number
    and the limit it broke (when known). ``side`` says which side of the descriptor (1
    source, 2 destination) or 3 for a region, whose index is then ``region_index``.
    ``native`` is True when the C library's own validator refused (its last line of
    defence, which holds even where a Python check was skipped), False when kvcore's
    Python checks refused first: the fields are the same either way.
    """

    def __init__(
        self,
        message: str,
        *,
        code: int = 0,
        descriptor_index: int | None = None,
        job_id: int | None = None,
        group: int | None = None,
        value: int | None = None,
        bound: int | None = None,
        side: int | None = None,
        region_index: int | None = None,
        native: bool = False,
    ) -> None:
        self.code = code
        self.native = native
        self.descriptor_index = descriptor_index
        self.job_id = job_id
        self.group = group
        self.value = value
        self.bound = bound
        self.side = side
        self.region_index = region_index
        super().__init__(message)


class InvariantViolation(KVCoreError, AssertionError):
    """Raised when runtime checking finds a broken invariant: a bug in kvcore, not the engine.

    ``ids`` lists the broken invariant ids (``"E1"``, ``"B1"``...) and ``violations`` the
    ``spec.invariants.Violation`` records with the offending values. It subclasses
    ``AssertionError`` because it reports a programmer error, but it is raised explicitly,
    so ``python -O`` does not strip it.
    """

    def __init__(self, violations: Sequence[Any], *, at_runtime: bool = False) -> None:
        self.violations = list(violations)
        self.ids = sorted({v.id for v in self.violations})
        # Raised by a hook's own check (what an engine gets with KVCORE_CHECK=1), not by
        # a harness beside it: the check's canaries ask which of the two caught a bug.
        self.at_runtime = at_runtime
        lines = [f"{v.id}: {v.message}" for v in self.violations]
        super().__init__("invariants broken: " + "; ".join(lines))

class UnknownRequestError(KVCoreError, KeyError):
    """A scheduler hook named a request it does not track (add_request first)."""


class UnknownJobError(KVCoreError, KeyError):
    """A worker reported a job the scheduler never issued (or already completed)."""


class BadReportError(KVCoreError, ValueError):
    """A worker report is a duplicate, or comes from a worker outside num_workers."""


class BadStepError(KVCoreError, ValueError):
    """A hook's arguments contradict the config or the request (group count, hashes)."""


class CallOrderError(KVCoreError, RuntimeError):
    """A call the protocol does not allow now: a hook on the wrong side of a connector, a
    step hook called twice for one step, a use of a closed engine, a registration repeated.

    Raised before anything changes; ``where`` names the call. A repeated step hook would
    submit the step's jobs twice, and the duplicate reports would make the scheduler
    refuse the good one with them, leaving the job in flight for good.
    """

    def __init__(self, where: str, message: str) -> None:
        self.where = where
        super().__init__(f"{where}: {message}")


class BlockTableError(KVCoreError, ValueError):
    """The engine's block table cannot hold what it claims (too short, or a null inside)."""


# Containers are shown by their first items: a wrong-typed container of millions of keys
# is refused in the time of a few, not of its whole repr (nor of sorting it, as reprlib
# does a set's).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 200
_FIRST = 6


def _container_repr(value: list[Any] | tuple[Any, ...] | set[Any] | frozenset[Any]
                    | dict[Any, Any]) -> str:
    if type(value) in (list, tuple):
        return _REPR.repr(value)  # reprlib reads the first items of these
    if isinstance(value, dict):
        pairs = list(itertools.islice(value.items(), _FIRST + 1))
        shown = [f"{_REPR.repr(k)}: {_REPR.repr(v)}" for k, v in pairs[:_FIRST]]
        more = ", ..." if len(pairs) > _FIRST else ""
    else:
        first = list(itertools.islice(value, _FIRST + 1))
        shown = [_REPR.repr(x) for x in first[:_FIRST]]
        more = ", ..." if len(first) > _FIRST else ""
    return f"{type(value).__name__}({', '.join(shown)}{more})"


def short_repr(value: object, limit: int = 60) -> str:
    """A value for a message: its repr, whole up to ``limit`` characters, else its first
    ``limit - 4`` and ``...>`` so it reads as cut; an object whose ``__repr__`` raises
    is named by its type instead of replacing the kvcore error with its own."""
    try:
        text = _container_repr(value) if isinstance(value, (list, tuple, set, frozenset, dict)) \
            else repr(value)
    except Exception:  # any failure of a caller's __repr__
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 4] + "...>"


def _portable(value: object) -> object:
    """A field as it crosses a process: a plain value (ints, short strings and bytes, and
    small tuples and lists of them) as it is, anything else as its short repr."""
    if value is None or type(value) in (int, float, bool):
        return value
    if type(value) in (str, bytes):
        return value if len(value) <= 4096 else short_repr(value)  # type: ignore[arg-type]
    if type(value) in (tuple, list) and len(value) <= 64:  # type: ignore[arg-type]
        items = [_portable(v) for v in value]  # type: ignore[attr-defined]
        if all(a is b for a, b in zip(items, value, strict=True)):  # type: ignore[call-overload]
            return value
    return short_repr(value)


def type_name(value: object) -> str:
    """A type's name for a message, with its module when not a builtin: numpy's bool is
    ``numpy.bool``, so "is a bool, expected bool" cannot happen."""
    kind = type(value)
    module = kind.__module__
    return kind.__name__ if module == "builtins" else f"{module}.{kind.__name__}"


def short_key(key: object) -> str:
    """A key for messages: its repr, cut to a readable length, with its size when cut."""
    text = short_repr(key, 40)
    if not text.endswith("...>"):
        return text
    size = f" ({len(key)} bytes)" if isinstance(key, bytes) else ""
    return text + size


class KeyNotReadyError(KVCoreError, KeyError):
    """Raised by ``prepare_load`` for a key that is absent or still being written.

    A load may only read a READY chunk; ``state`` is ``"absent"`` or ``"writing"``. The
    manager's state is unchanged when it is raised (no key of the call was pinned).
    """

    def __init__(self, key: Key, state: str) -> None:
        self.key = key
        self.state = state
        hint = ("lookup() must answer HIT before a load" if state == "absent"
                else "wait for complete_store; lookup() answers PENDING until then")
        self.message = f"prepare_load: key {short_key(key)} is {state}, not READY; {hint}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class NotPinnedError(KVCoreError, ValueError):
    """Raised by ``complete_load`` for a key with no load in flight to complete.

    ``state`` is ``"absent"``, ``"writing"``, ``"ready"`` (pin count 0) or ``"pinned"``;
    ``pins`` is the key's pin count and ``releases`` how many times the call names it,
    which is more than ``pins``. The manager's state is unchanged when it is raised.
    """

    def __init__(self, key: Key, state: str, pins: int, releases: int) -> None:
        self.key = key
        self.state = state
        self.pins = pins
        self.releases = releases
        self.message = (f"complete_load: key {short_key(key)} is {state} with pins={pins} "
                        f"but the call releases {releases}; call complete_load once per "
                        "prepare_load, with the same keys")
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class InvalidKeyError(KVCoreError, TypeError):
    """Raised by ``prepare_store`` for a key that is not ``bytes`` (make_key builds keys).

    Checked where keys enter the tier, so a wrong type cannot hide in the contents.
    """

    def __init__(self, key: object) -> None:
        self.key = key
        self.message = (f"prepare_store: key {short_key(key)} is a {type_name(key)}, "
                        "not bytes; build keys with kvcore.spec.types.make_key")
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


# -- argument errors (the boundary's validation layer) ------------------------------------
# Raised by the hooks, the hook dataclasses and the manager before anything changes. Each
# carries ``where`` (the call), ``argument`` (the name, with an index when it is one item
# of a sequence), ``value``, ``bound`` (what was allowed) and ``fix`` as fields.


class _ArgumentError(KVCoreError):
    """The fields every argument error carries; the message is the subclass's."""

    def __init__(self, where: str, argument: str, value: object, bound: str,
                 fix: str) -> None:
        self.where = where
        self.argument = argument
        self.value = value
        self.bound = bound
        self.fix = fix
        self.message = self._message()
        super().__init__(self.message)

    def _message(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.message


class ArgumentTypeError(_ArgumentError, TypeError):
    """An argument of the wrong type: a ``str`` hash, a ``bool`` count, a list for an id.

    ``bound`` names the type expected. Checked before any state changes, so a caller that
    catches it can fix the call and go on with an unchanged scheduler or manager.
    """

    def _message(self) -> str:
        return (f"{self.where}: {self.argument}={short_repr(self.value)} is a "
                f"{type_name(self.value)}, expected {self.bound}; {self.fix}")


class ArgumentRangeError(_ArgumentError, ValueError):
    """An argument of the right type outside its range (a negative count, a job id 0).

    ``bound`` says the allowed range; the message names the argument, the value and what
    to pass instead. Nothing has changed when it is raised.
    """

    def _message(self) -> str:
        return (f"{self.where}: {self.argument}={short_repr(self.value)} is outside "
                f"{self.bound}; {self.fix}")


class BlockIdError(ArgumentRangeError):
    """A GPU block id outside ``1..num_gpu_blocks-1``, or a null (0) where none may be.

    ``group`` is the group whose table held it (None for ``allocated_ids``). A store plan
    holding such an id would hand a worker an address outside the GPU pool.
    """

    def __init__(self, where: str, argument: str, value: object, bound: str, fix: str,
                 group: int | None = None) -> None:
        self.group = group
        super().__init__(where, argument, value, bound, fix)


class HashError(ArgumentRangeError):
    """A block hash of a length other than the one this scheduler's hashes have.

    The first hash a scheduler accepts fixes the length (``bound``) for its lifetime: one
    engine uses one hash function, and a mixed length means two callers disagree.
    """


class DuplicateRequestError(BadStepError):
    """One request twice in one ``StepInput`` (scheduled twice, or preempted twice).

    Its block lists would both be appended to its table and a later store would copy
    one block under another's key. ``argument`` is the field, ``value`` the request id.
    """

    def __init__(self, where: str, argument: str, value: str) -> None:
        self.where = where
        self.argument = argument
        self.value = value
        self.bound = "each request at most once per step"
        self.fix = "merge its entries into one ScheduledRequest"
        super().__init__(f"{where}: request {value!r} appears twice in {argument}; "
                         f"{self.bound}: {self.fix}")


class BadKeyError(InvalidKeyError):
    """A manager call got a key that is not ``bytes`` of a key's length (1..``bound``).

    ``where`` names the call; like ``InvalidKeyError`` (its base) it is raised before the
    tier changes.
    """

    def __init__(self, where: str, key: object, bound: int) -> None:
        super().__init__(key)
        self.where = where
        self.argument = "key"
        self.value = key
        self.bound = bound
        what = (f"is a {type_name(key)}, not bytes" if type(key) is not bytes
                else f"has {len(key)} bytes, outside 1..{bound}")
        self.message = (f"{where}: key {short_key(key)} {what}; build keys with "
                        "kvcore.spec.types.make_key")
        self.args = (self.message,)  # the base's prepare_store message would stay there


class KeyGroupError(BadKeyError):
    """A store got a key whose group (its last bytes, ``key_group``) has no CPU pool.

    The tier keeps one pool per group; ``group`` is the key's group and ``bound`` the
    number of pools (``0..bound-1``). Raised before the tier changes.
    """

    def __init__(self, where: str, key: bytes, group: int, bound: int) -> None:
        super().__init__(where, key, bound)
        self.group = group
        self.message = (f"{where}: key {short_key(key)} is of group={group}, outside the "
                        f"tier's pools 0..{bound - 1}; build keys with "
                        "kvcore.spec.types.make_key(hash, group) for a configured group, "
                        "or give the manager one capacity per group")
        self.args = (self.message,)


class TransferArgumentError(KVCoreError, ValueError):
    """``TransferEngine`` refused an argument: a tensor or buffer to register, or a call's plan.

    Raised before anything is registered or queued, so the engine is unchanged. ``where``
    names the argument (``gpu_tensors[1][3]``, ``cpu_buffer``, ``plan.groups[0]``...);
    ``value`` and ``bound`` are the offending number and its limit when there is one, and
    ``job_id`` the plan's job when the call had one. Copy-time failures of a valid-looking
    job are ``KVCopyError`` (in ``validate``) or a failed ``TransferResult`` (in ``submit``).
    """

    def __init__(self, where: str, message: str, *, value: int | None = None,
                 bound: int | None = None, job_id: int | None = None) -> None:
        self.where = where
        self.value = value
        self.bound = bound
        self.job_id = job_id
        super().__init__(f"{where}: {message}")
