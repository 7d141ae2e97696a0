"""A Hypothesis state machine over the simulator: engine events as rules.

Rules are the events an engine produces (a request arrives, a step runs, a worker report
fails or is late or is sent twice, a request is preempted or aborted, the cache is reset).
Safety is checked throughout by the scheduler's runtime checks, the simulator's own X1
check and byte integrity on every completed load; convergence is checked at the end (the
run must settle). A failure prints as a program of rule calls that replays it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvcore.scheduler import BadReportError, WorkerReport
from kvcore.sim._engine import Simulator, two_request_pool
from kvcore.sim._workload import SimOptions
from kvcore.spec.errors import InvariantViolation
from kvcore.spec.invariants import Violation
from kvcore.spec.types import OffloadConfig

SETTLE_STEPS = 400


def make_machine(config: OffloadConfig, *, scheduler_factory: Any = None,
                 tally: dict[str, int] | None = None, device: str = "cpu",
                 trace: dict[str, Any] | None = None, policies: tuple[str, ...] = ("lru", "arc")
                 ) -> type[RuleBasedStateMachine]:
    """A state machine class for ``config`` (optionally with a mutated scheduler).

    Each example draws the engine set-up too: workers, CPU pool, prompt sizes, the
    eviction policy, prompt-only storing, per-request store caps and GPU prefix-cache
    hits. ``trace`` (if given) receives the set-up of the latest example, so a failure
    can be replayed by hand.
    """

    class SimMachine(RuleBasedStateMachine):
        sim: Simulator

        @initialize(seed=st.integers(0, 2**16), workers=st.sampled_from([1, 2, 3]),
                    cpu=st.sampled_from([24, 96, 400]), context=st.sampled_from([96, 300, 700]),
                    policy=st.sampled_from(policies), prompt_only=st.booleans(),
                    caps=st.sampled_from([0.0, 0.5]), cached=st.sampled_from([0.0, 0.5]))
        def start(self, seed: int, workers: int, cpu: int, context: int, policy: str,
                  prompt_only: bool, caps: float, cached: float) -> None:
            if trace is not None:  # first: a failure below names this example's set-up
                trace.clear()
                trace.update(seed=seed, workers=workers, cpu=cpu, context=context,
                             policy=policy, prompt_only=prompt_only, caps=caps, cached=cached)
            options = SimOptions(seed=seed, requests=0, context_tokens=context,
                                 num_workers=workers, num_cpu_blocks=cpu,
                                 num_gpu_blocks=1500, prefill_budget=192, max_running=3,
                                 max_new_tokens=8,
                                 fail_rate=0.0, delay_rate=0.0, abort_rate=0.0,
                                 reset_rate=0.0, policy=policy, prompt_only=prompt_only,
                                 request_cap_rate=caps, gpu_cache_rate=cached)
            # Two requests at least on a layout of tiny blocks (as stage_options).
            options = replace(options, num_gpu_blocks=two_request_pool(config, options))
            self.sim = Simulator(config, options, check=True, device=device,
                                 scheduler_factory=scheduler_factory)

        broken = False

        @contextlib.contextmanager
        def guard(self) -> Iterator[None]:
            """Mark the machine broken when a rule fails, so teardown does not step a
            simulator left mid-hook (that would report a second, derived failure)."""
            try:
                yield
            except BaseException:
                self.broken = True
                raise

        def teardown(self) -> None:
            sim = getattr(self, "sim", None)
            if sim is None:
                return
            if self.broken:
                sim.close(failing=True)
                return
            try:
                for _ in range(SETTLE_STEPS):
                    if sim.done():
                        break
                    sim.step()
                else:
                    raise AssertionError(f"run did not settle in {SETTLE_STEPS} steps")
                sim.close()
            finally:
                if tally is not None:
                    for source in (sim.scheduler.checked, sim.checked, sim.manager.checked):
                        for key, n in source.items():
                            tally[key] = tally.get(key, 0) + n
                sim.close(failing=True)  # a no-op once closed above

        @rule(follow_up=st.booleans())
        def new_request(self, follow_up: bool) -> None:
            done = [r for r in self.sim.reqs.values() if r.state == "done"]
            with self.guard():
                if follow_up and done:
                    self.sim.add_request(done[-1].tokens + self.sim.prompts.tokens(7))
                else:
                    self.sim.add_request()

        @rule(n=st.integers(1, 4))
        def step(self, n: int) -> None:
            with self.guard():
                for _ in range(n):
                    self.sim.step()

        @precondition(lambda self: bool(self.sim.reports))
        @rule(pick=st.integers(0, 2**16))
        def fail_a_report(self, pick: int) -> None:
            when, r = self.sim.reports[pick % len(self.sim.reports)]
            self.sim.reports[pick % len(self.sim.reports)] = (
                when, WorkerReport(r.worker, r.job_id, False, r.bytes, r.seconds))
            self.sim.failed_jobs.add(r.job_id)

        @precondition(lambda self: bool(self.sim.reports))
        @rule(steps=st.integers(1, 3))
        def delay_reports(self, steps: int) -> None:
            self.sim.reports = [(w + steps, r) for w, r in self.sim.reports]

        @precondition(lambda self: any(self.sim.scheduler.job_in_flight(r.job_id)
                                       for _, r in self.sim.reports))
        @rule(pick=st.integers(0, 2**16))
        def duplicate_a_report(self, pick: int) -> None:
            live = [r for _, r in self.sim.reports if self.sim.scheduler.job_in_flight(r.job_id)]
            r = live[pick % len(live)]
            sched = self.sim.scheduler
            before = sched.has_pending_work(), asdict(sched.stats()), sched.tracked_requests()
            try:
                sched.worker_output([r, r])
            except BadReportError:
                pass
            except Exception as exc:  # not rejected as bad input: the job table broke
                raise InvariantViolation([Violation(
                    "J2", f"a duplicated report for job {r.job_id} was not rejected "
                    f"({type(exc).__name__}: {exc})", {"job": r.job_id})]) from exc
            else:
                raise InvariantViolation([Violation(
                    "J2", f"a duplicated report for job {r.job_id} was accepted",
                    {"job": r.job_id})])
            after = sched.has_pending_work(), asdict(sched.stats()), sched.tracked_requests()
            if after != before:
                raise AssertionError("a rejected report changed the scheduler's state")

        @precondition(lambda self: bool(self.sim.running))
        @rule(pick=st.integers(0, 2**16))
        def preempt(self, pick: int) -> None:
            self.sim.preempt(self.sim.running[pick % len(self.sim.running)].request_id)

        @precondition(lambda self: bool(self.sim.running or self.sim.waiting))
        @rule(pick=st.integers(0, 2**16))
        def abort(self, pick: int) -> None:
            live = list(self.sim.running) + list(self.sim.waiting)
            with self.guard():
                self.sim.abort(live[pick % len(live)].request_id)

        @rule()
        def reset(self) -> None:
            with self.guard():
                self.sim.reset()

    SimMachine.__name__ = f"SimMachine_{(config.name or 'custom').replace('-', '_')}"
    # Hypothesis keys its example database by the class's source, the same for every
    # layout: a fleet sharing one database replayed one layout's counterexample on
    # another, and deleted it where it did not fail. The layout, the device and the
    # policies drawn make the key too.
    SimMachine._hypothesis_internal_add_digest = hashlib.sha256(  # type: ignore[attr-defined]
        repr((config, device, policies)).encode()).digest()
    return SimMachine
