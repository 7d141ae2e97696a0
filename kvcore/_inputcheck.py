"""The hook inputs an engine may build, in every form the docs allow, must be accepted as
given ("set-up" stage, X2).

The bad-calls stage holds kvcore to refusing bad inputs (A1); this is the other side. The
hook types (``RequestInfo``, ``ScheduledRequest``, ``StepInput``, ``WorkerReport``) and the
tier's key lists are validated by C scans that vouch for the usual forms (a frozenset of
ids, a tuple of hashes) and fall back to Python checks on a doubt. A scan that breaks on a
valid form (returns an error it did not set, or refuses ids a list would pass) stops
every engine at its first step; the simulations then end in a crash that names nothing.
Here each form is built once, directly, and what it reads back must equal what was
meant: a refusal or a changed value is X2, named.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from kvcore._checks import enforce
from kvcore._enginecheck import _valid
from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import OffloadScheduler
from kvcore.spec.hooks import MAX_REPORT_INT, RequestInfo, ScheduledRequest, StepInput, WorkerReport
from kvcore.spec.invariants import SetupRecord
from kvcore.spec.types import MAX_HASH_BYTES, OffloadConfig, Status, make_key


def _honoured(call: str, make: Callable[[], object], read: Callable[[Any], object],
              want: object, checked: dict[str, int]) -> Any:
    """``make()`` is accepted (``_valid``) and ``read`` of it gives ``want``; returns it."""
    made = _valid(call, make, checked)
    got = read(made)
    enforce([SetupRecord(call, None if got == want else
                         f"reads back as {str(got)[:120]}, not {str(want)[:120]}")], checked)
    return made


def run_inputs(config: OffloadConfig, checked: dict[str, int]) -> None:
    """Every documented form of each hook input, at the edges of its ranges, and the
    ``KVCORE_CHECK`` switch (``run_check_switch``)."""
    run_check_switch(config, checked)
    value: Any  # each form as an engine may pass it (the hook types normalize them)
    top = config.num_gpu_blocks - 1
    groups = len(config.groups)
    # Ids at both ends of the pool and between; enough of them that a scan's hashed path
    # (a set's iteration, a long tuple) runs as well as its short one.
    ids = sorted({0, 1, top, *range(2, min(top, 40))})
    want_ids = frozenset(ids)
    for form, value in (("frozenset", frozenset(ids)), ("set", set(ids)), ("list", ids),
                        ("tuple", tuple(ids)), ("empty frozenset", frozenset())):
        want = want_ids if value else frozenset()
        _honoured(f"StepInput(allocated_ids=a {form})",
                  partial(StepInput, allocated_ids=value),
                  lambda s: s.allocated_ids, want, checked)
    tables = tuple(tuple(ids[g::groups]) for g in range(groups))
    for form, value in (("tuple of tuples", tables),
                        ("list of lists", [list(t) for t in tables]),
                        ("tuple of lists", tuple(list(t) for t in tables))):
        _honoured(f"ScheduledRequest(new_block_ids=a {form})",
                  partial(ScheduledRequest, "r", 3, 0, 3, value),
                  lambda s: s.new_block_ids, tables, checked)
    for size in (1, 32, MAX_HASH_BYTES):
        hashes = tuple(bytes([i % 251 + 1]) * size for i in range(40))
        for form, value in (("tuple", hashes), ("list", list(hashes))):
            _honoured(f"RequestInfo(block_hashes=a {form} of {size}-byte hashes)",
                      partial(RequestInfo, "r", 40, value),
                      lambda s: s.block_hashes, hashes, checked)
            _honoured(f"ScheduledRequest(new_hashes=a {form} of {size}-byte hashes)",
                      partial(ScheduledRequest, "r", 1, 0, 1, (), value),
                      lambda s: s.new_hashes, hashes, checked)
    _honoured("StepInput(requests=a list, preempted=a list)",
              lambda: StepInput([ScheduledRequest("r", 1, 0, 1)], ["p"]),  # type: ignore[arg-type]
              lambda s: (len(s.requests), s.preempted),
              (1, ("p",)), checked)
    _honoured("WorkerReport at the top of its ranges",
              lambda: WorkerReport(MAX_REPORT_INT, MAX_REPORT_INT, False, MAX_REPORT_INT),
              lambda r: (r.worker, r.job_id), (MAX_REPORT_INT,) * 2,
              checked)
    # The tier's key lists, as lists and tuples, short keys and the longest.
    for size in (1, MAX_HASH_BYTES):
        keys = [make_key(bytes([i + 1]) * size, 0) for i in range(20)]
        for form, value in (("list", list(keys)), ("tuple", tuple(keys))):
            tier = CPUOffloadManager(64, "lru")
            _honoured(f"CPUOffloadManager.lookup_many(a {form} of {size}-byte-hash keys)",
                      partial(tier.lookup_many, value),
                      lambda s: s, [Status.MISS] * len(keys), checked)
            _honoured(f"CPUOffloadManager.prepare_store(a {form} of {size}-byte-hash keys)",
                      partial(tier.prepare_store, value),
                      lambda s: s.keys_to_store,
                      tuple(keys), checked)

    run_reads(config, checked)


def run_reads(config: OffloadConfig, checked: dict[str, int]) -> None:
    """The tier's and the scheduler's public reads, each asked once with a valid argument
    and read back (the tier's ``policy_of`` and ``capacity_of`` with its set-up): an
    engine's metrics, a router and kvcore's own lock step call them, and one that refuses
    a valid argument (an inverted type test) ends them in a crash that names nothing."""
    tier = CPUOffloadManager.for_config(config, "lru")
    key = make_key(bytes(range(1, 33)), 0)
    tier.prepare_store([key])
    reads: tuple[tuple[str, Callable[[], object], object], ...] = (
            ("lookup(a key being stored)", partial(tier.lookup, key), Status.PENDING),
            ("state_of(a key being stored)", partial(tier.state_of, key), "writing"),
            ("slot_of(a key being stored)", partial(tier.slot_of, key), 0),
            ("stats()", lambda: tier.stats().writing, 1))
    for call, ask, want in reads:
        _honoured(f"CPUOffloadManager.{call}", ask, lambda got: got, want, checked)
    sched = OffloadScheduler(config, tier, check=False)
    tokens = config.hash_block_tokens
    sched.add_request(RequestInfo("r", tokens, (bytes(32),)))
    reads = (
            ("cursors('r')", partial(sched.cursors, "r"), (0,) * len(config.groups)),
            ("jobs_of('r')", partial(sched.jobs_of, "r"), frozenset()),
            ("tracked_requests()", sched.tracked_requests, frozenset({"r"})),
            ("has_pending_work()", sched.has_pending_work, False),
            ("stats()", lambda: sched.stats().lookups, 0))
    for call, ask, want in reads:
        _honoured(f"OffloadScheduler.{call}", ask, lambda got: got, want, checked)


@contextlib.contextmanager
def _environment(value: str | None) -> Iterator[None]:
    """``KVCORE_CHECK`` set to ``value`` (None: unset) for the block, then restored."""
    before = os.environ.get("KVCORE_CHECK")
    try:
        if value is None:
            os.environ.pop("KVCORE_CHECK", None)
        else:
            os.environ["KVCORE_CHECK"] = value
        yield
    finally:
        if before is None:
            os.environ.pop("KVCORE_CHECK", None)
        else:
            os.environ["KVCORE_CHECK"] = before


def run_check_switch(config: OffloadConfig, checked: dict[str, int]) -> None:
    """The documented switch: ``check=None`` follows ``KVCORE_CHECK`` (``1`` on, anything
    else or unset off) and ``True``/``False`` win over it, for the scheduler and the tier.

    An engine runs its tests with ``KVCORE_CHECK=1`` to have every hook checked; a switch
    read the wrong way round leaves those runs unchecked while every check of kvcore's own
    (which passes the flag) still passes.
    """
    # The last case sets the variable, so a missing restore shows in the tests.
    for env, flag, want in ((None, True, True), (None, None, False), ("0", None, False),
                            ("1", None, True), ("1", False, False)):
        with _environment(env):
            shown = "unset" if env is None else repr(env)
            tier = _honoured(f"CPUOffloadManager(check={flag}) with KVCORE_CHECK {shown}",
                             partial(CPUOffloadManager.for_config, config, check=flag),
                             lambda t: t.check, want, checked)
            _honoured(f"OffloadScheduler(check={flag}) with KVCORE_CHECK {shown}",
                      partial(OffloadScheduler, config, tier, check=flag),
                      lambda s: s.check, want, checked)
