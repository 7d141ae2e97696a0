"""Run the implementation and the reference model side by side, comparing every answer (R1).

``Lockstep`` has the scheduler's hook methods; each call goes to ``OffloadScheduler`` and
to ``kvcore.spec.model.ReferenceScheduler`` with the same arguments, and then checks that
both returned the same value (or raised the same kind of error) and that their observable
state agrees: tracked requests, cursors, jobs, stats, and the CPU tier's contents, slots,
LRU order and stats. The two return their own dataclasses with the same fields, so values
are compared as ``dataclasses.astuple``. A difference is an R1 violation
(``spec.invariants.r1_refines_reference``). An engine, the simulator included, drives a
``Lockstep`` as it drives either scheduler alone; anything else it asks of the scheduler
(``checked``, ``cursors``...) is the implementation's.

This is a checker, not the implementation: with ``tests/refinement`` it is what
``kvcore check``'s "refinement" stage runs, the one place a plain behaviour change of the
scheduler (a smaller hit, a chunk not stored, another slot) is named even when every
safety invariant still holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvcore.spec.errors import InvariantViolation
from kvcore.spec.invariants import RefinementRecord, check


def plain(value: Any) -> Any:
    """A value as comparable plain data: dataclasses become (class name, fields)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__name__, dataclasses.astuple(value)
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def observable(s: Any) -> dict[str, Any]:
    """What a scheduler shows of its state: requests, cursors, jobs, stats, manager stats."""
    return {
        "requests": {r: (s.cursors(r), sorted(s.jobs_of(r))) for r in sorted(s.tracked_requests())},
        "pending": s.has_pending_work(),
        "stats": plain(s.stats()),
        "manager": s.manager.stats(),
    }


def manager_contents(impl: Any, model: Any) -> tuple[Any, Any]:
    """(impl, model) views of every stored key's state and slot, plus LRU order."""
    keys = sorted(model.state)
    mine = [(k, impl.state_of(k), impl.slot_of(k)) for k in keys]
    theirs = [(k, model.state_of(k), model.slot_of(k)) for k in keys]
    groups = sorted(model.recency)
    policies = [impl.policy_of(g) for g in groups]
    lru = all(hasattr(p, "order") for p in policies)
    mine_order = [p.order() for p in policies] if lru else None
    theirs_order = [tuple(model.recency[g]) for g in groups] if lru else None
    return (mine, impl.stats().used, mine_order), (theirs, model.stats().used, theirs_order)


class LockstepError(InvariantViolation):
    """The implementation and the reference model disagreed (R1)."""


def _refines(after: str, got: Any, want: Any, counts: dict[str, int] | None) -> None:
    record = RefinementRecord(after, got, want)
    if counts is not None:
        counts["R1"] = counts.get("R1", 0) + 1
    violations = check([record])
    if violations:
        raise LockstepError(violations)


def paired(impl: Any, config: Any, counts: dict[str, int] | None = None) -> Lockstep:
    """``impl`` in lock step with a fresh reference scheduler and LRU tier for ``config``."""
    from kvcore.manager import cpu_capacities
    from kvcore.spec.manager_model import ReferenceManager
    from kvcore.spec.model import ReferenceScheduler

    manager = ReferenceManager(cpu_capacities(config), config.max_pending_events)
    return Lockstep(impl, ReferenceScheduler(config, manager), counts)


class Lockstep:
    """Both schedulers behind one set of hooks; every call is compared."""

    def __init__(self, impl: Any, model: Any, counts: dict[str, int] | None = None) -> None:
        self.impl = impl
        self.model = model
        self.counts = counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.impl, name)

    def _both(self, name: str, *args: Any, **kwargs: Any) -> Any:
        got = _outcome(lambda: getattr(self.impl, name)(*args, **kwargs))
        want = _outcome(lambda: getattr(self.model, name)(*args, **kwargs))
        if got[0] == "error" and isinstance(got[1], AssertionError):
            raise got[1]
        if want[0] == "error" and isinstance(want[1], AssertionError):
            raise want[1]
        call = f"{name}{args!r}{'' if not kwargs else f' {kwargs!r}'}"[:300]
        if got[0] == "ok" and want[0] == "ok":
            _refines(call, plain(got[1]), plain(want[1]), self.counts)
        else:
            mine: Any = _error_kind(got)
            theirs: Any = _error_kind(want)
            if mine != theirs:  # the texts only to show which call broke
                mine, theirs = (mine, repr(got[1])[:200]), (theirs, repr(want[1])[:200])
            _refines(call, mine, theirs, self.counts)
        self.compare_state(name)
        if got[0] == "error":
            raise got[1]
        return got[1]

    def compare(self, call: str, got: Any, want: Any) -> None:
        """R1 on answers the two sides gave to calls made on each alone (a harness that
        checks the implementation's answer on its own first, to name a finer invariant),
        then on their state."""
        _refines(call, plain(got), plain(want), self.counts)
        self.compare_state(call)

    def compare_state(self, after: str) -> None:
        mine, theirs = observable(self.impl), observable(self.model)
        if mine != theirs:
            diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
            _refines(f"after {after}: observable state", {k: v[0] for k, v in diff.items()},
                     {k: v[1] for k, v in diff.items()}, None)
        got, want = manager_contents(self.impl.manager, self.model.manager)
        _refines(f"after {after}: CPU tier contents", got, want, None)

    # -- the hooks -------------------------------------------------------------------------

    def add_request(self, info: Any) -> None:
        self._both("add_request", info)

    def add_hashes(self, request_id: str, hashes: Any) -> None:
        self._both("add_hashes", request_id, hashes)

    def lookup(self, request_id: str, computed: int, num_tokens: int,
               **cap: Any) -> Any:
        return self._both("lookup", request_id, computed, num_tokens, **cap)

    def after_alloc(self, request_id: str, block_ids: Any, valid: Any, computed: int,
                    load_tokens: int) -> Any:
        return self._both("after_alloc", request_id, block_ids, valid, computed, load_tokens)

    def build_step(self, step: Any) -> Any:
        return self._both("build_step", step)

    def worker_output(self, reports: Any) -> Any:
        return self._both("worker_output", list(reports))

    def request_finished(self, request_id: str) -> None:
        self._both("request_finished", request_id)

    def reset(self) -> Any:
        return self._both("reset")

    def take_events(self) -> Any:
        return self._both("take_events")


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except (InvariantViolation, AssertionError) as e:
        return "error", e
    except Exception as e:  # compared by kind below, then re-raised
        return "error", e


def _error_kind(outcome: tuple[str, Any]) -> tuple[str, ...]:
    """An outcome's comparable kind: ok, or the error's class name and builtin base."""
    if outcome[0] == "ok":
        return ("ok",)
    e = outcome[1]
    base = "KeyError" if isinstance(e, KeyError) else "ValueError" if isinstance(
        e, ValueError) else type(e).__name__
    return ("error", type(e).__name__, base)
