"""What ``kvcore check`` runs: the proofs, seeded simulations and the state machine.

The same battery runs with every bug-zoo mutant applied; there it must fail. Everything
is bounded: simulation seeds, state-machine examples and steps, proof budgets.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from kvcore._proofs import ProofReport
from kvcore._scenarios import SCENARIOS, ScenarioFailure
from kvcore.scheduler import OffloadScheduler
from kvcore.sim import IntegrityError, SimOptions, Simulator
from kvcore.sim._machine import make_machine
from kvcore.spec.errors import InvariantViolation, KVCopyError
from kvcore.spec.invariants import INVARIANT_IDS
from kvcore.spec.types import OffloadConfig
from kvcore.zoo import MUTANTS, Mutant

# Option sets the seeded simulations cycle through: calm, stormy, and under pressure.
PROFILES: tuple[dict[str, Any], ...] = (
    {"fail_rate": 0.0, "delay_rate": 0.0, "abort_rate": 0.0, "reset_rate": 0.0},
    {"fail_rate": 0.1, "delay_rate": 0.5, "abort_rate": 0.03, "reset_rate": 0.03},
    {"fail_rate": 0.05, "delay_rate": 0.3, "abort_rate": 0.0, "reset_rate": 0.05,
     "num_cpu_blocks": 48, "num_gpu_blocks": 700},
)


@dataclass
class Failure:
    """The first failure a battery met: what broke, and how to replay it."""

    kind: str
    ids: list[str]
    message: str
    reproducer: str


@dataclass
class BatteryResult:
    """Per-invariant evaluation counts and the first failure, if any."""

    checked: dict[str, int] = field(default_factory=dict)
    failure: Failure | None = None
    seconds: float = 0.0


def classify(exc: BaseException) -> tuple[str, list[str]]:
    """(kind, invariant ids) of a failure, for the tables and the exit code.

    Hypothesis raises an ExceptionGroup when it finds several distinct failures; the
    group is as severe as its most telling member (an invariant over a crash).
    """
    if isinstance(exc, BaseExceptionGroup):
        parts = [classify(e) for e in exc.exceptions]
        order = ("invariant", "integrity", "liveness", "crash")
        kind = min((k for k, _ in parts), key=order.index)
        return kind, sorted({i for _, ids in parts for i in ids})
    if isinstance(exc, InvariantViolation):
        return "invariant", list(exc.ids)
    if isinstance(exc, IntegrityError):
        return "integrity", ["integrity"]
    if isinstance(exc, ScenarioFailure):
        return "integrity", ["scenario"]
    if isinstance(exc, KVCopyError):
        return "invariant", ["B1"]
    if isinstance(exc, AssertionError) and "settle" in str(exc):
        return "liveness", ["liveness"]
    return "crash", [type(exc).__name__]


def sim_options(seed: int, context: int = 400) -> SimOptions:
    profile = PROFILES[seed % len(PROFILES)]
    base: dict[str, Any] = {"num_cpu_blocks": 256, "num_gpu_blocks": 1500}
    base.update(profile)
    return SimOptions(seed=seed, requests=12, context_tokens=context, max_running=3,
                      prefill_budget=160, **base)


def run_sims(config: OffloadConfig, seeds: int, result: BatteryResult, *,
             preset: str, factory: Any = None) -> None:
    for seed in range(seeds):
        sim = Simulator(config, sim_options(seed), check=True, scheduler_factory=factory)
        try:
            sim.run()
        except Exception as exc:  # every failure is reported, whatever its type
            kind, ids = classify(exc)
            result.failure = Failure(kind, ids, f"{type(exc).__name__}: {exc}",
                                     f"kvcore simulate --preset {preset} --seed {seed} "
                                     "--check-options")
            return
        finally:
            sim.transfer.close()
            for source in (sim.scheduler.checked, sim.checked, sim.manager.checked):
                for key, n in source.items():
                    result.checked[key] = result.checked.get(key, 0) + n


def run_machine(config: OffloadConfig, examples: int, steps: int, result: BatteryResult,
                *, factory: Any = None, shrink: bool = True, database: Any = None,
                device: str = "cpu") -> None:
    machine = make_machine(config, scheduler_factory=factory, tally=result.checked,
                           device=device)
    phases = list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate]
    opts = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    derandomize=database is None, database=database, phases=phases,
                    suppress_health_check=list(HealthCheck), print_blob=True)
    out = io.StringIO()
    try:
        with with_reporter(lambda s: print(s, file=out)), \
                contextlib.redirect_stdout(out):
            run_state_machine_as_test(machine, settings=opts)
    except Exception as exc:  # the state machine re-raises the shrunk failure
        kind, ids = classify(exc)
        program = "\n".join(_notes(exc)) or out.getvalue().strip()
        result.failure = Failure(kind, ids, f"{type(exc).__name__}: {exc}", program)


def _notes(exc: BaseException) -> list[str]:
    """Hypothesis attaches the failing program to the exception as notes (PEP 678)."""
    notes = [str(n) for n in getattr(exc, "__notes__", [])]
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            notes.append(f"-- {type(sub).__name__}: {str(sub)[:300]}")
            notes.extend(_notes(sub))
    return notes


def run_directed(result: BatteryResult, *, factory: Any = None) -> None:
    """The directed scenarios (their own tiny layouts), stopping at the first failure."""
    for scenario in SCENARIOS:
        try:
            scenario(factory or OffloadScheduler)
        except Exception as exc:  # every failure is reported, whatever its type
            kind, ids = classify(exc)
            result.failure = Failure(kind, ids, f"{type(exc).__name__}: {exc}",
                                     f"python -c 'from kvcore._scenarios import *; "
                                     f"{scenario.__name__}(OffloadScheduler)'")
            return


def run_battery(config: OffloadConfig, *, preset: str, seeds: int, examples: int,
                steps: int, factory: Any = None, shrink: bool = True) -> BatteryResult:
    start = time.perf_counter()
    result = BatteryResult()
    run_directed(result, factory=factory)
    if result.failure is None:
        run_sims(config, seeds, result, preset=preset, factory=factory)
    if result.failure is None:
        run_machine(config, examples, steps, result, factory=factory, shrink=shrink)
    result.seconds = time.perf_counter() - start
    return result


def invariant_table(result: BatteryResult) -> dict[str, dict[str, int]]:
    broken = set(result.failure.ids) if result.failure else set()
    return {i: {"checked": result.checked.get(i, 0), "violations": int(i in broken)}
            for i in INVARIANT_IDS}


@dataclass
class MutantOutcome:
    name: str
    origin: str
    killed: bool
    by: str
    preset: str
    seconds: float


def run_mutant(mutant: Mutant, presets: dict[str, OffloadConfig], *, seeds: int,
               examples: int, steps: int) -> MutantOutcome:
    start = time.perf_counter()
    for name in mutant.presets:
        with mutant.apply() as factory:
            result = run_battery(presets[name], preset=name, seeds=seeds,
                                 examples=examples, steps=steps, factory=factory,
                                 shrink=False)
        failure = result.failure
        if failure is not None and failure.kind != "crash":
            return MutantOutcome(mutant.name, mutant.origin, True, ",".join(failure.ids),
                                 name, time.perf_counter() - start)
        if failure is not None:
            # A crash is not a catch: the checks must name what broke.
            return MutantOutcome(mutant.name, mutant.origin, False,
                                 f"crash: {failure.message[:80]}", name,
                                 time.perf_counter() - start)
    return MutantOutcome(mutant.name, mutant.origin, False, "", ",".join(mutant.presets),
                         time.perf_counter() - start)


def run_mutants(presets: dict[str, OffloadConfig], *, seeds: int, examples: int,
                steps: int) -> list[MutantOutcome]:
    return [run_mutant(m, presets, seeds=seeds, examples=examples, steps=steps)
            for m in MUTANTS]


def proofs_dir() -> Path | None:
    """The proofs folder: a source checkout's proofs/, or the installed kvcore.proofs."""
    from kvcore import _proofs

    source = _proofs.locate()
    return source.folder if source is not None else None


def run_proofs(progress: Callable[[str], None] | None = None) -> ProofReport:
    """Run the CrossHair obligations (``kvcore._proofs``); status "confirmed",
    "inconclusive" (a budget ran out: not a correctness failure), "failed" or "skipped"."""
    from kvcore import _proofs

    return _proofs.run_proofs(progress or (lambda line: print(line, flush=True)))
