"""Plain data crossing the engine/scheduler seam: what each hook takes and returns.

No engine types: an engine adapts its own request and scheduler-output objects to these.
They live in the spec so the implementation and the reference model take and return the
very same values, and refinement compares them directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import cast

from kvcore.spec.errors import ArgumentRangeError, ArgumentTypeError, BadKeyError, ConfigError
from kvcore.spec.plans import TransferPlan
from kvcore.spec.types import KEY_GROUP_BYTES, MAX_GROUPS, MAX_HASH_BYTES, Key

# Limits on what a hook accepts. A hash is at most MAX_HASH_BYTES (spec.types); a request
# id of more than 1024 characters is a caller passing the wrong string; 2**40 tokens is far
# beyond any context length, so a larger count is a units or sign mistake. Report counters
# stay below 2**62.
MAX_REQUEST_ID_CHARS = 1024
MAX_TOKENS = 1 << 40
MAX_REPORT_INT = 1 << 62
_INT = frozenset({int})
_BYTES = frozenset({bytes})
_SEQUENCES = (list, tuple)


# -- optional C scans ----------------------------------------------------------------------
# Checking every item is the one cost of building a hook value that grows with its input:
# a preempted 128K-token request resends 51,712 block ids, a 128K prompt brings 32,768
# hashes, and the Python passes below cost 17-25 ns an item each. kvcore installs one-pass
# C scans on import (``kvcore._scan``, through ``install_scans``); the checks ask a scan
# first and run their Python test only when it does not vouch for the input. The Python
# tests stay the definition (they raise the errors, and run alone wherever no scan is
# installed: this module imports nothing from kvcore), so a scan can make a check faster
# but must never vouch for what the Python test refuses; tests/unit/test_scan.py holds the
# C scans to that on hostile inputs.


def _no_ids_scan(ids: object) -> int:
    return -1


def _no_bytes_scan(items: object, max_len: int) -> int:
    return -1


# ids -> their max when it vouches (an exact tuple/list of exact ints >= 0), else -1.
_scan_ids: Callable[[object], int] = _no_ids_scan
# (items, max_len) -> their common length when it vouches (exact bytes, one length in
# 1..max_len), else -1.
_scan_bytes: Callable[[object, int], int] = _no_bytes_scan


def install_scans(ids: Callable[[object], int], items: Callable[[object, int], int]) -> None:
    """Use these scans from now on (kvcore passes its C ones; see the comment above)."""
    global _scan_ids, _scan_bytes
    _scan_ids, _scan_bytes = ids, items


# -- type-level checks (shared by the hook dataclasses, the scheduler and the model) ------
# They look at one value and nothing else: no config, no state. Each raises
# ArgumentTypeError or ArgumentRangeError naming the argument, the bound and the fix.


def check_int(where: str, name: str, value: object, low: int = 0,
              high: int = MAX_TOKENS) -> int:
    """``value`` as an int in ``low..high`` (a ``bool`` is not an int here)."""
    if type(value) is not int:
        raise ArgumentTypeError(where, name, value, "int", f"pass a plain int in {low}..{high}")
    if not low <= value <= high:
        raise ArgumentRangeError(where, name, value, f"{low}..{high}",
                                 f"pass an int in {low}..{high}")
    return value


def check_bool(where: str, name: str, value: object) -> bool:
    """``value`` as a ``bool``: "no", 0 and None are not booleans."""
    if type(value) is not bool:
        raise ArgumentTypeError(where, name, value, "bool", "pass True or False")
    return value


def check_request_id(where: str, value: object) -> str:
    """A request id: a non-empty ``str`` of at most ``MAX_REQUEST_ID_CHARS`` characters."""
    if type(value) is not str:
        raise ArgumentTypeError(where, "request_id", value, "str",
                                "pass the engine's request id as a str")
    if not 0 < len(value) <= MAX_REQUEST_ID_CHARS:
        raise ArgumentRangeError(where, "request_id", value,
                                 f"1..{MAX_REQUEST_ID_CHARS} characters",
                                 "pass the engine's (non-empty) request id")
    return value


def _sequence(where: str, name: str, value: object, items: str) -> tuple[object, ...]:
    if not isinstance(value, _SEQUENCES):
        raise ArgumentTypeError(where, name, value, f"a list or tuple of {items}",
                                f"wrap the {items} in a tuple")
    return tuple(value)


def check_ids(where: str, name: str, value: object) -> tuple[int, ...]:
    """GPU block ids as a tuple of ints >= 0 (the config's upper bound is the caller's)."""
    ids = _sequence(where, name, value, "ints")
    if ids and _scan_ids(ids) < 0 and (not set(map(type, ids)) <= _INT
                                       or min(cast("tuple[int, ...]", ids)) < 0):
        for i, x in enumerate(ids):
            check_int(where, f"{name}[{i}]", x, 0, MAX_TOKENS)
    return cast("tuple[int, ...]", ids)


def _fine_ids(ids: object) -> bool:
    """The fast path: a tuple of ints >= 0 (what engines pass every step)."""
    return type(ids) is tuple and (not ids or _scan_ids(ids) >= 0
                                   or (set(map(type, ids)) <= _INT and min(ids) >= 0))


def check_id_tables(where: str, name: str, value: object) -> tuple[tuple[int, ...], ...]:
    """Per-group block id lists: a sequence of sequences of ints >= 0."""
    if type(value) is tuple and all(map(_fine_ids, value)):
        return value
    tables = _sequence(where, name, value, "per-group block id lists")
    return tuple(check_ids(where, f"{name}[{g}]", t) for g, t in enumerate(tables))


def check_hashes(where: str, name: str, value: object) -> tuple[bytes, ...]:
    """Block hashes: ``bytes``, 1..``MAX_HASH_BYTES`` long, all of one length."""
    hashes = _sequence(where, name, value, "bytes hashes")
    if not hashes:
        return ()
    if _scan_bytes(hashes, MAX_HASH_BYTES) > 0:
        return hashes  # type: ignore[return-value]
    if not set(map(type, hashes)) <= _BYTES:
        bad = next(i for i, h in enumerate(hashes) if type(h) is not bytes)
        raise ArgumentTypeError(where, f"{name}[{bad}]", hashes[bad], "bytes",
                                "pass the engine's block hashes as bytes")
    lengths = set(map(len, hashes))  # type: ignore[arg-type]
    size = len(hashes[0])  # type: ignore[arg-type]
    if len(lengths) > 1 or not 0 < size <= MAX_HASH_BYTES:
        bad = next((i for i, h in enumerate(hashes) if len(h) != size),  # type: ignore[arg-type]
                   0)
        raise ArgumentRangeError(where, f"len({name}[{bad}])",
                                 len(hashes[bad]),  # type: ignore[arg-type]
                                 f"1..{MAX_HASH_BYTES} bytes, one length for every hash",
                                 "pass every hash from the same hash function")
    return hashes  # type: ignore[return-value]


@dataclass(frozen=True)
class RequestInfo:
    """A new request: its prompt length and chained block hashes so far.

    ``block_hashes`` are at ``hash_block_tokens`` granularity and grow as tokens are
    generated (pass the new ones in ``ScheduledRequest.new_hashes``).
    ``max_offload_tokens`` caps what this request stores; ``skip_reading`` means it must
    not load from the CPU tier (it still stores).
    """

    request_id: str
    prompt_tokens: int
    block_hashes: tuple[bytes, ...] = ()
    max_offload_tokens: int | None = None
    skip_reading: bool = False

    def __post_init__(self) -> None:
        where = "RequestInfo"
        check_request_id(where, self.request_id)
        check_int(where, "prompt_tokens", self.prompt_tokens)
        object.__setattr__(self, "block_hashes",
                           check_hashes(where, "block_hashes", self.block_hashes))
        if self.max_offload_tokens is not None:
            check_int(where, "max_offload_tokens", self.max_offload_tokens)
        check_bool(where, "skip_reading", self.skip_reading)


@dataclass(frozen=True, init=False)
class ScheduledRequest:
    """One request's part of an engine step.

    ``new_block_ids`` holds, per group, the GPU block ids appended to its block table this
    step (0 = null block); when ``resumed`` the table is rebuilt from them (re-admission
    after preemption). ``computed_tokens`` is what existed before the step,
    ``scheduled_tokens`` what the step computes, ``num_tokens`` the request's real length
    (prompt plus accepted output; unverified draft tokens excluded).
    """

    request_id: str
    scheduled_tokens: int
    computed_tokens: int
    num_tokens: int
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    new_hashes: tuple[bytes, ...] = ()
    resumed: bool = False

    def __init__(self, request_id: str, scheduled_tokens: int, computed_tokens: int,
                 num_tokens: int, new_block_ids: tuple[tuple[int, ...], ...] = (),
                 new_hashes: tuple[bytes, ...] = (), resumed: bool = False) -> None:
        # The dataclass's own __init__ of a frozen class writes each field through
        # object.__setattr__: 1.3 of the 2 us one cost, built for every running request
        # of every step. The fields go straight into the instance dict instead (still
        # frozen: assignment afterwards raises), then the same checks run.
        fields = self.__dict__
        fields["request_id"] = request_id
        fields["scheduled_tokens"] = scheduled_tokens
        fields["computed_tokens"] = computed_tokens
        fields["num_tokens"] = num_tokens
        fields["new_block_ids"] = new_block_ids
        fields["new_hashes"] = new_hashes
        fields["resumed"] = resumed
        self.__post_init__()

    def __post_init__(self) -> None:
        # Built for every scheduled request of every step: cheap checks first, the
        # error-building helpers only when one fails.
        where = "ScheduledRequest"
        rid = self.request_id
        if type(rid) is not str or not 0 < len(rid) <= MAX_REQUEST_ID_CHARS:
            check_request_id(where, rid)
        s, c, n = self.scheduled_tokens, self.computed_tokens, self.num_tokens
        if not (type(s) is int and type(c) is int and type(n) is int
                and 0 <= s <= MAX_TOKENS and 0 <= c <= MAX_TOKENS and 0 <= n <= MAX_TOKENS):
            for name, value in (("scheduled_tokens", s), ("computed_tokens", c),
                                ("num_tokens", n)):
                check_int(where, name, value)
        # computed_tokens may exceed num_tokens: an asynchronous engine counts a step's
        # scheduled (and draft) tokens as computed before their output arrives.
        ids = self.new_block_ids
        fine = type(ids) is tuple
        if fine:
            for t in ids:
                if type(t) is not tuple or (t and _scan_ids(t) < 0
                                            and not (set(map(type, t)) <= _INT
                                                     and min(t) >= 0)):
                    fine = False
                    break
        if not fine:
            object.__setattr__(self, "new_block_ids",
                               check_id_tables(where, "new_block_ids", ids))
        h = self.new_hashes
        # Type first: ``h != ()`` would ask a tuple subclass's own __ne__, which may lie.
        if not (type(h) is tuple and (
                not h or _scan_bytes(h, MAX_HASH_BYTES) > 0
                or (set(map(type, h)) <= _BYTES and len(set(map(len, h))) == 1
                    and 0 < len(h[0]) <= MAX_HASH_BYTES))):
            object.__setattr__(self, "new_hashes", check_hashes(where, "new_hashes", h))
        if type(self.resumed) is not bool:
            check_bool(where, "resumed", self.resumed)


@dataclass(frozen=True)
class StepInput:
    """An engine step: scheduled requests, preempted ids, every GPU id allocated this step."""

    requests: tuple[ScheduledRequest, ...] = ()
    preempted: tuple[str, ...] = ()
    allocated_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        where = "StepInput"
        requests = _sequence(where, "requests", self.requests, "ScheduledRequest")
        for i, sr in enumerate(requests):
            if type(sr) is not ScheduledRequest:
                if not isinstance(sr, ScheduledRequest):
                    raise ArgumentTypeError(where, f"requests[{i}]", sr, "ScheduledRequest",
                                            "describe each scheduled request with one")
                # An engine's own subclass is served too, but checked by kvcore's rules:
                # an override of __post_init__ cannot skip them, and a field it redefines
                # (a property could answer differently at each read) is refused.
                _check_plain_subclass(where, f"requests[{i}]", sr)
                ScheduledRequest.__post_init__(sr)
        preempted = _sequence(where, "preempted", self.preempted, "request ids")
        for rid in preempted:
            check_request_id(where, rid)
        ids = self.allocated_ids
        if not isinstance(ids, Set | list | tuple) or isinstance(ids, str | bytes):
            raise ArgumentTypeError(where, "allocated_ids", ids, "a frozenset of ints",
                                    "pass every GPU id handed out this step")
        if isinstance(ids, list | tuple):
            # Items first: a list inside (unhashable) must be named, not fail in frozenset.
            check_ids(where, "allocated_ids", ids)
            allocated = frozenset(ids)
        else:  # a set's items are hashable already
            allocated = frozenset(ids)
            if _scan_ids(allocated) < 0:
                check_ids(where, "allocated_ids", tuple(allocated))
        object.__setattr__(self, "requests", requests)
        object.__setattr__(self, "preempted", preempted)
        object.__setattr__(self, "allocated_ids", allocated)


# Subclasses of ScheduledRequest seen to redefine none of its fields (a few per engine;
# bounded all the same: past the limit each is checked again, not remembered).
_PLAIN_SUBCLASSES: set[type] = set()
_PLAIN_SUBCLASSES_LIMIT = 64
_READS = ("__getattribute__", "__getattr__")


def _check_plain_subclass(where: str, name: str, sr: ScheduledRequest) -> None:
    """Refuse a ScheduledRequest subclass that redefines a field or attribute reads: the
    scheduler reads each field several times and trusts the answers it checked."""
    cls = type(sr)
    if cls in _PLAIN_SUBCLASSES:
        return
    fields = (*ScheduledRequest.__dataclass_fields__, *_READS)
    for klass in cls.__mro__[:cls.__mro__.index(ScheduledRequest)]:
        redefined = [f for f in fields if f in vars(klass)]
        if redefined:
            raise ArgumentTypeError(where, name, sr, "ScheduledRequest",
                                    f"{klass.__name__} redefines {redefined[0]}; keep "
                                    "ScheduledRequest's fields as they are in a subclass")
    if len(_PLAIN_SUBCLASSES) < _PLAIN_SUBCLASSES_LIMIT:
        _PLAIN_SUBCLASSES.add(cls)


@dataclass(frozen=True)
class StepPlan:
    """What the workers do this step: loads, stores, and jobs to wait for first."""

    loads: tuple[TransferPlan, ...] = ()
    stores: tuple[TransferPlan, ...] = ()
    flush: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerReport:
    """One worker's word on one job."""

    worker: int
    job_id: int
    success: bool = True
    bytes: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        where = "WorkerReport"
        check_int(where, "worker", self.worker, 0, MAX_REPORT_INT)
        check_int(where, "job_id", self.job_id, 1, MAX_REPORT_INT)
        check_bool(where, "success", self.success)
        check_int(where, "bytes", self.bytes, 0, MAX_REPORT_INT)
        seconds = self.seconds
        if type(seconds) not in (float, int):
            raise ArgumentTypeError(where, "seconds", seconds, "float",
                                    "pass the job's duration in seconds")
        # An int beyond a float's range (2**1024) overflows isfinite: out of range too.
        if not (seconds >= 0 and (type(seconds) is int or math.isfinite(seconds))
                and seconds <= MAX_REPORT_INT):
            raise ArgumentRangeError(where, "seconds", seconds, "a finite float in 0..2**62",
                                     "pass the job's duration in seconds")


@dataclass(frozen=True)
class LoadFailure:
    """A load that failed: the engine must recompute these blocks (per group)."""

    request_id: str
    job_id: int
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class OutputResult:
    """What ``worker_output`` settled: finished jobs, loads done, loads to recompute."""

    completed: tuple[int, ...] = ()
    finished_loads: tuple[str, ...] = ()
    failed_loads: tuple[LoadFailure, ...] = ()
    failed_stores: tuple[int, ...] = ()


@dataclass(frozen=True)
class KeyEvent:
    """A key stored in or removed from the CPU tier, with its group."""

    key: Key
    group: int
    removed: bool


@dataclass
class SchedulerStats:
    """Counters since construction (or the last reset of the stats)."""

    lookups: int = 0
    deferrals: int = 0
    hit_tokens: int = 0
    loads: int = 0
    stores: int = 0
    chunks_loaded: int = 0
    chunks_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    store_skipped_no_room: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    events_dropped: int = 0


# -- manager arguments (type checks shared by kvcore's tier and the reference) -----------

# A key is a hash plus the group's bytes (``make_key``); anything longer is not a key.
MAX_KEY_BYTES = MAX_HASH_BYTES + KEY_GROUP_BYTES


def check_key(where: str, key: object) -> None:
    """Raise BadKeyError unless ``key`` is ``bytes`` of 1..MAX_KEY_BYTES (a type check)."""
    if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
        raise BadKeyError(where, key, MAX_KEY_BYTES)


def own_items(seq: list[object] | tuple[object, ...]) -> tuple[object, ...]:
    """A list's or tuple's items as a tuple, read once through the built-in type's own
    iterator: a subclass's ``__iter__`` could answer differently from one read to the
    next, and the caller keeps and checks this copy instead."""
    if type(seq) is tuple:
        return seq
    return tuple(list.__iter__(seq) if isinstance(seq, list) else tuple.__iter__(seq))


def check_keys(where: str, keys: object) -> tuple[bytes, ...]:
    """The keys as a tuple, checked; raise unless ``keys`` is a list or tuple of valid
    keys (a ``str`` or ``bytes`` is not a sequence of keys: iterating it would give
    characters or ints).

    The caller uses the tuple returned, never ``keys`` again: a list subclass can iterate
    differently the second time (valid keys for the check, a 100-byte one for the
    store), and a list can change while a policy runs. The copy reads the list's or
    tuple's own items (``list.__iter__``), not what a subclass's ``__iter__`` says.
    """
    if not isinstance(keys, list | tuple):
        raise ArgumentTypeError(where, "keys", keys, "a list or tuple of bytes keys",
                                "wrap the keys in a list")
    got = cast("tuple[bytes, ...]", own_items(keys))
    # Two C passes (types, then lengths into a set, usually of one size), not three.
    if got and _scan_bytes(got, MAX_KEY_BYTES) < 0 and (
            not set(map(type, got)) <= _BYTES
            or not 0 < min(sizes := set(map(len, got))) <= max(sizes) <= MAX_KEY_BYTES):
        for key in got:
            check_key(where, key)
    return got


def check_success(where: str, success: object) -> None:
    """``success`` must be a ``bool``: "no" or 0 must not count as an outcome."""
    if type(success) is not bool:
        raise ArgumentTypeError(where, "success", success, "bool",
                                "pass True if every byte landed, else False")


# A limit on everything: a capacity beyond this is a units mistake (bytes for chunks).
MAX_CAPACITY_CHUNKS = 1 << 40


def check_capacity(capacity: object) -> int | tuple[int, ...]:
    """The capacity as checked: a positive int in range, or a tuple of them (from a
    non-empty list or tuple, one per group, at most MAX_GROUPS); else ConfigError(field=
    "capacity").

    Exactly ``int``, never a subclass: one whose ``<=`` and ``>`` answer False passed as
    a capacity of -3 or 2**80. The caller keeps what is returned, not its argument (a
    list subclass could iterate differently the second time).
    """
    if isinstance(capacity, list | tuple):
        per_group = own_items(capacity)
        if len(per_group) == 0 or len(per_group) > MAX_GROUPS:
            raise ConfigError("capacity", f"capacity has {len(per_group)} per-group entries; "
                              f"give one per group, 1..{MAX_GROUPS}, or one int for all")
        for one in per_group:
            if isinstance(one, list | tuple):  # one level: an int per group, no deeper
                raise ConfigError("capacity", f"capacity={capacity!r} nests a list; give "
                                  "one int per group")
            check_capacity(one)
        return cast("tuple[int, ...]", per_group)
    if type(capacity) is not int:
        raise ConfigError("capacity", f"capacity={capacity!r} must be an int: the CPU tier's "
                          "size in chunks per group")
    if capacity <= 0:
        raise ConfigError("capacity", f"capacity={capacity} must be positive: the CPU tier "
                          "needs room for at least one chunk")
    if capacity > MAX_CAPACITY_CHUNKS:
        raise ConfigError("capacity", f"capacity={capacity} exceeds {MAX_CAPACITY_CHUNKS} "
                          "chunks; it counts chunks, not bytes")
    return capacity
