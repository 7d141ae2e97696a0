"""What ``kvcore check`` runs: the proofs, directed scenarios, seeded simulations and the
state machine, all on the user's layout.

The battery runs in stages (``STAGES``), each reported with its elapsed time as it ends.
Between them they exercise what the layout allows an engine to do: both eviction
policies, the storable prefix below the frontier (``prompt_only``, ``max_offload_tokens``
per config and per request), GPU prefix-cache hits (lookups with computed tokens),
preemption, failed and late reports, aborts, resets and several workers.

The same battery runs with every bug-zoo mutant applied, each stage (and each seed) in a
fresh patch; there a mutant must be caught by the check it declares. Everything is
bounded: simulation seeds, state-machine examples and steps, proof budgets.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from kvcore._proofs import ProofReport
from kvcore._scenarios import SCENARIOS, ScenarioFailure, check_fits, tallied
from kvcore.scheduler import OffloadScheduler
from kvcore.sim import IntegrityError, SimOptions, Simulator
from kvcore.sim._engine import HarnessLimit, NotSettled, two_request_pool
from kvcore.sim._machine import make_machine
from kvcore.spec.errors import InvariantViolation, KVCopyError, KVCoreError
from kvcore.spec.invariants import INVARIANT_IDS
from kvcore.spec.types import GroupKind, OffloadConfig
from kvcore.zoo import MUTANTS, Mutant, layout

Progress = Callable[[str], None]
# A context manager that yields a scheduler factory (None: the shipped scheduler); a
# mutant's ``apply``, entered afresh for each stage and each seed.
Apply = Callable[[], contextlib.AbstractContextManager[Any]]

# The state machine runs last: it shrinks what it finds, which for a crash can take
# minutes, and a stage before it (the refinement above all) may name the failure first.
# The canaries come after it, only in a user's ``kvcore check``: they ask whether the
# checks themselves are live, once every stage has found the code itself correct.
STAGES = ("set-up", "directed", "simulations", "refinement", "bad calls", "copy library",
          "transfer engine", "state machine", "canaries")
# Seeds the "bad calls" stage runs (each with at most 60 bad twins of real calls), every
# HOSTILE_STRIDE-th one: 6 seeds 5 apart meet every variant, profile and policy, where
# seeds 0..5 would meet the first variant only.
HOSTILE_SEEDS = 6
HOSTILE_STRIDE = 5
# Failure kinds that do not say which rule broke; the battery goes on past them.
UNNAMED = ("crash", "liveness")
# Failure kinds whose ids were not violated by the code under test: no id evaluated
# (coverage), or an id whose check did not fire on a bug planted to break it (canary).
NOT_VIOLATIONS = ("coverage", "canary")
# The stages a canary's battery runs (``run_canaries``).
CANARY_STAGES = ("directed", "simulations")
# ``kvcore check``'s seeded simulations by default. At this budget or more a canary that
# survives is a failure whatever it did; below it, one whose bug never changed a check's
# count is reported untested (``run_canaries``).
CHECK_SEEDS = 24
# The pressure profile's and the bad-calls stage's tier: slots per group (``pressure_slots``
# shrinks it, never below the minimum, for layouts whose runs store few chunks).
PRESSURE_SLOTS = 48
MIN_PRESSURE_SLOTS = 8
# A stage that runs longer than this (a loop that never ends) is stopped as a liveness
# failure, so an engine's CI gets an answer. Stages take 1-30 s on a busy 2-core machine.
STAGE_SECONDS = 900.0
# Hostile calls the "copy library" stage makes into the C library (about 0.15 ms each).
COPY_CASES = 6000
POLICIES = ("lru", "arc")
# Every this-many-th simulation seed (the last of each run of four) drops the draft groups.
SPECULATIVE_OFF_EVERY = 4
# Every this-many-th refinement seed (the last of each run of three) sends its steps in an
# engine's own ScheduledRequest type (``SimOptions.own_step_type``).
OWN_STEP_TYPE_EVERY = 3
# Every this-many-th simulation seed (4, 9, ...) serves the scheduler from a tier with only
# the base interface, whole keys and no hash batches (``SimOptions.keys_only_tier``).
KEYS_ONLY_EVERY = 5


class StageHang(AssertionError):
    """A stage ran past ``STAGE_SECONDS``: something in it does not terminate."""


@contextlib.contextmanager
def watchdog(stage: str, seconds: float = STAGE_SECONDS) -> Iterator[None]:
    """Interrupt the stage with StageHang after ``seconds`` (and every 5 s after that, so
    a shrinking state machine is stopped too); only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_sig: int, _frame: object) -> None:
        raise StageHang(f"stage {stage!r} ran past {seconds:.0f} s (a loop that never ends?)")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 5.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)

# Option sets the seeded simulations cycle through: calm, stormy (its copies on the
# transfer engine's stand-in stream, retired by events, some failed there by an injected
# device error), and under pressure.
PROFILES: tuple[dict[str, Any], ...] = (
    {"fail_rate": 0.0, "delay_rate": 0.0, "abort_rate": 0.0, "reset_rate": 0.0},
    {"fail_rate": 0.1, "delay_rate": 0.5, "abort_rate": 0.03, "reset_rate": 0.03,
     "preempt_rate": 0.05, "events_rate": 0.5, "simulate_stream": True,
     "stream_fault_rate": 0.05},
    {"fail_rate": 0.05, "delay_rate": 0.3, "abort_rate": 0.0, "reset_rate": 0.05,
     "num_cpu_blocks": PRESSURE_SLOTS, "num_gpu_blocks": 700, "preempt_rate": 0.1,
     "events_rate": 0.2, "max_pending_events": 24},
)
# What the config lets the engine vary, crossed with the profiles: the storable prefix U
# below the frontier V (prompt only; a config cap; per-request caps), GPU prefix-cache
# hits, so lookups start past token 0 and loads fill blocks after valid ones, prompts
# that end on a chunk boundary (where the N - 1 limit decides the hit), and lookups the
# engine caps (``max_tokens``: the hit is the largest boundary at or below the cap),
# requests that must not load (``skip_reading``) beside ones sharing their prefix, and
# hashes sent with the step (``ScheduledRequest.new_hashes``) instead of ``add_hashes``.
VARIANTS: tuple[dict[str, Any], ...] = (
    {"gpu_cache_rate": 0.3, "aligned_prompt_rate": 0.3, "lookup_cap_rate": 0.3,
     "skip_reading_rate": 0.1},
    {"prompt_only": True, "gpu_cache_rate": 0.5, "aligned_prompt_rate": 0.3,
     "step_hashes_rate": 0.5},
    {"max_offload_tokens_share": 0.75, "request_cap_rate": 0.3, "lookup_cap_rate": 0.5,
     "step_hashes_rate": 0.3},
    {"request_cap_rate": 0.5, "gpu_cache_rate": 0.5, "shared_prefix_rate": 0.9,
     "skip_reading_rate": 0.2},
)


@dataclass
class Failure:
    """The first failure a battery met: what broke, where, and how to replay it."""

    kind: str
    ids: list[str]
    message: str
    reproducer: str
    stage: str = ""
    seed: str = ""
    # A library hook's own check raised it (``InvariantViolation.at_runtime``), not a
    # harness: a simulator's byte check, a scenario's assertion, the lock step.
    at_runtime: bool = False


def raised_at_runtime(exc: BaseException) -> bool:
    """Whether a library hook's own check raised ``exc`` (any member of a group)."""
    if isinstance(exc, BaseExceptionGroup):
        return any(raised_at_runtime(e) for e in exc.exceptions)
    return isinstance(exc, InvariantViolation) and exc.at_runtime


@dataclass
class BatteryResult:
    """Per-invariant evaluation counts, seconds per stage and the first failure, if any."""

    checked: dict[str, int] = field(default_factory=dict)
    failure: Failure | None = None
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)


def classify(exc: BaseException, *, valid_calls: bool = False) -> tuple[str, list[str]]:
    """(kind, invariant ids) of a failure, for the tables and the exit code.

    Hypothesis raises an ExceptionGroup when it finds several distinct failures; the
    group is as severe as its most telling member (an invariant over a crash).

    ``valid_calls``: the failure ended a battery stage, whose harnesses (the simulator,
    the scenarios, the state machine, the set-up's valid constructions) call kvcore only
    as its rules allow and handle every refusal they provoke on purpose. A kvcore error
    that reaches the stage is then kvcore refusing a valid call: X2 (an engine making
    the same call would be refused alike), not an unnamed crash; except a
    ``HarnessLimit``, the simulator's own refusal of a layout its options cannot serve.
    ``kvcore simulate``'s own errors (a bad option) are usage errors, so the CLI leaves
    it off.
    """
    if isinstance(exc, BaseExceptionGroup):
        parts = [classify(e, valid_calls=valid_calls) for e in exc.exceptions]
        order = ("invariant", "integrity", "liveness", "crash")
        kind = min((k for k, _ in parts), key=order.index)
        return kind, sorted({i for _, ids in parts for i in ids})
    if isinstance(exc, InvariantViolation):
        return "invariant", list(exc.ids)
    if isinstance(exc, IntegrityError):
        return "integrity", ["integrity"]
    if isinstance(exc, ScenarioFailure):
        return "invariant" if exc.id in INVARIANT_IDS else "integrity", [exc.id]
    if isinstance(exc, KVCopyError):
        return "invariant", ["B1"]
    if isinstance(exc, StageHang | NotSettled) or (isinstance(exc, AssertionError)
                                                   and "settle" in str(exc)):
        return "liveness", ["liveness"]
    if valid_calls and isinstance(exc, KVCoreError) and not isinstance(exc, HarnessLimit):
        return "invariant", ["X2"]
    return "crash", [type(exc).__name__]


@contextlib.contextmanager
def _unmutated() -> Iterator[None]:
    yield None


def sim_options(seed: int, context: int = 400) -> SimOptions:
    """The options ``kvcore check`` runs seed ``seed`` with (``simulate --check-options``).

    Profiles cycle fastest, then the policy, then the variants, so every 24 seeds cover
    each (profile, policy) pair under every variant. Every fourth seed (3, 7, ..., 23: each
    profile twice, both policies, three of the variants) serves the layout with
    speculative decoding off, its draft groups dropped, since an engine may run the model
    without its drafter, and there the rules the draft group's extra chunk otherwise
    shadows (the N - 1 limit above all) decide the hit.
    """
    profile = PROFILES[seed % len(PROFILES)]
    policy = POLICIES[(seed // len(PROFILES)) % len(POLICIES)]
    variant = dict(VARIANTS[(seed // (len(PROFILES) * len(POLICIES))) % len(VARIANTS)])
    share = variant.pop("max_offload_tokens_share", None)
    if share is not None:
        variant["max_offload_tokens"] = int(context * share)
    base: dict[str, Any] = {"num_cpu_blocks": 256, "num_gpu_blocks": 1500, "policy": policy}
    if seed % SPECULATIVE_OFF_EVERY == SPECULATIVE_OFF_EVERY - 1:
        base["speculative_off"] = True
    base.update(profile)
    base.update(variant)
    return SimOptions(seed=seed, requests=12, context_tokens=context, max_running=3,
                      prefill_budget=160, **base)


# The simulations' prompts: long enough that every window binds (twice its reach plus a
# chunk), at least 400 tokens and at most 4096 (the cost grows with the context).
MIN_CONTEXT, MAX_CONTEXT = 400, 4096


def check_context(config: OffloadConfig) -> int:
    """Prompt length for the layout: a window longer than every prompt acts as FULL, so
    its rules would never be exercised."""
    reach = max((g.window_tokens + g.extra_retained_tokens for g in config.groups
                 if g.kind is GroupKind.SLIDING and g.window_tokens), default=0)
    chunk = max(g.tokens_per_chunk for g in config.groups)
    return max(MIN_CONTEXT, min(MAX_CONTEXT, 2 * reach + chunk))


def stage_options(seed: int, config: OffloadConfig | None = None, *, lockstep: bool = False,
                  hostile: bool = False) -> SimOptions:
    """Seed ``seed``'s options in the simulations (neither flag), refinement (``lockstep``:
    the LRU tier, R1) or bad-calls stage (``hostile``: a small tier and pool, since each
    bad call snapshots the whole state twice), with prompts sized to ``config``. Every
    third refinement seed (2, 5, ...: checks on and off alike) describes its steps with an
    engine's own ScheduledRequest type, so the scheduler's Python path, which kvcore's
    own type never takes, is held to the reference too; every fifth seed (4, 9, ...) of
    both asks for a tier with only the base interface (whole keys), which the simulator
    gives where it shadows the tier (checks on: the simulations' seeds, the even
    refinement seeds)."""
    opts = sim_options(seed, check_context(config) if config is not None else MIN_CONTEXT)
    if not hostile and seed % KEYS_ONLY_EVERY == KEYS_ONLY_EVERY - 1:
        opts = replace(opts, keys_only_tier=True)
    if lockstep:
        opts = replace(opts, policy="lru", lockstep=True,
                       own_step_type=seed % OWN_STEP_TYPE_EVERY == OWN_STEP_TYPE_EVERY - 1)
    if hostile:
        opts = replace(opts, hostile=True, num_cpu_blocks=PRESSURE_SLOTS, num_gpu_blocks=700,
                       preempt_rate=max(opts.preempt_rate, 0.05))
    if config is not None and opts.num_cpu_blocks == PRESSURE_SLOTS:
        opts = replace(opts, num_cpu_blocks=pressure_slots(config, opts))
    if config is not None:  # two requests at least; unchanged where the pool holds them
        opts = replace(opts, num_gpu_blocks=two_request_pool(config, opts))
    return opts


def pressure_slots(config: OffloadConfig, opts: SimOptions) -> int:
    """The small tier's slots per group: ``PRESSURE_SLOTS``, or fewer where a run stores
    fewer than six times that many chunks of its finest group. With 64-token chunks and
    400-token prompts a run stores about 75 chunks, and a 48-slot tier never evicted: no
    eviction choice of either policy met the checks on that layout."""
    finest = min(g.tokens_per_chunk for g in config.groups)
    stored = opts.requests * opts.context_tokens // finest
    return min(PRESSURE_SLOTS, max(MIN_PRESSURE_SLOTS, stored // 6))


def run_sims(config: OffloadConfig, seeds: int, result: BatteryResult, *,
             preset: str, apply: Apply = _unmutated, lockstep: bool = False,
             hostile: bool = False) -> None:
    """Seeded simulations, each in a fresh ``apply``; stops at the first failure.

    With ``lockstep`` (the "refinement" stage) every seed runs the LRU tier with the
    scheduler in lock step with the reference model (R1); with ``hostile`` (the "bad
    calls" stage) bad twins of real calls must bounce (A1).
    """
    stage = "refinement" if lockstep else "bad calls" if hostile else "simulations"
    for seed in range(0, seeds * HOSTILE_STRIDE, HOSTILE_STRIDE) if hostile else range(seeds):
        opts = stage_options(seed, config, lockstep=lockstep, hostile=hostile)
        with apply() as factory:
            sim: Simulator | None = None
            try:
                # Built inside the try: the lock step compares the two sides from the
                # first hook on, so a divergence can surface while the run is set up.
                # Odd refinement seeds run the scheduler as engines do, its own checks
                # off: paths taken only then (the no-chunk-completed fast path) meet the
                # lock step too, which needs no check of the scheduler's own.
                checks = not (lockstep and seed % 2)
                sim = Simulator(config, opts, check=checks, scheduler_factory=factory)
                sim.run()
            except Exception as exc:  # every failure is reported, whatever its type
                kind, ids = classify(exc, valid_calls=True)
                extra = " --lockstep" if lockstep else " --hostile" if hostile else ""
                extra += "" if checks else " --no-checks"
                result.failure = Failure(kind, ids, f"{type(exc).__name__}: {exc}",
                                         f"kvcore simulate {layout_flag(preset)} --seed "
                                         f"{seed} --check-options{extra}", stage, str(seed),
                                         raised_at_runtime(exc))
                return
            finally:
                if sim is not None:
                    sim.close(failing=True)  # a no-op after run() closed it
                    _add_counts(result.checked,
                                [sim.scheduler.checked, sim.checked, sim.manager.checked])


# -- reproducers --------------------------------------------------------------------------
# A stage's ``preset`` argument names the layout it ran on: a preset or zoo layout, or the
# path of the user's TOML file (``kvcore check --config``). Each failure prints a command
# that re-runs the failing part on that layout, so it must name it the way the user can.


class LayoutRef(str):
    """A layout reference that says what it names: ``is_file`` True for the path of the
    user's layout file (``kvcore check --config``), False for a preset or zoo layout.

    A path cannot be told from a preset by its spelling: a file may be called
    ``gemma3``, and its reproducers then named the built-in preset, not the file. The
    CLI knows which option it read, so it says (``run_battery(layout_file=...)``); being
    a ``str``, the reference flows through every stage's ``preset`` argument unchanged.
    """

    is_file: bool

    def __new__(cls, text: str, *, is_file: bool) -> LayoutRef:
        ref = super().__new__(cls, text)
        ref.is_file = is_file
        return ref


def _is_file(layout_ref: str) -> bool:
    """Whether ``layout_ref`` names a layout file: as its ``LayoutRef`` says, else (a
    caller that did not say: the zoo's own runs, tests) anything but a preset or zoo
    layout's name."""
    if isinstance(layout_ref, LayoutRef):
        return layout_ref.is_file
    from kvcore.presets import PRESETS
    from kvcore.zoo import LAYOUTS
    return layout_ref not in PRESETS and layout_ref not in LAYOUTS


def layout_flag(layout_ref: str) -> str:
    """The CLI option that selects the layout: ``--preset NAME`` or ``--config PATH``."""
    if _is_file(layout_ref):
        return f"--config {shlex.quote(layout_ref)}"
    return f"--preset {layout_ref}"


def layout_import(layout_ref: str) -> str:
    """The import that makes ``layout(layout_ref)`` build the layout in Python."""
    if _is_file(layout_ref):
        return "from kvcore._configfile import load_config as layout"
    return "from kvcore.zoo import layout"


def python_c(code: str) -> str:
    """``python -c CODE`` as one shell word: in double quotes where nothing in CODE is
    special inside them (so the layout's quoted name survives), else shlex's quoting."""
    if not set(code) & set('"$`\\!'):
        return f'python -c "{code}"'
    return f"python -c {shlex.quote(code)}"


MachineRun = tuple[type[Any], dict[str, Any]]


def fuzz_machine(config: OffloadConfig, result: BatteryResult, device: str = "cpu"
                 ) -> MachineRun:
    """One state machine class (and the dict it traces into) for many ``run_machine``
    rounds over ``result``: Hypothesis keeps every machine class it runs for good (its
    per-class set-up state), so a class per round grew a fuzz run by about 50 KB a round,
    gigabytes over hours of short rounds."""
    trace: dict[str, Any] = {}
    return make_machine(config, tally=result.checked, device=device, trace=trace), trace


def run_machine(config: OffloadConfig, examples: int, steps: int, result: BatteryResult,
                *, factory: Any = None, shrink: bool = True, database: Any = None,
                device: str = "cpu", apply: Apply | None = None,
                built: MachineRun | None = None) -> None:
    """The state machine over the simulator; ``apply`` (if given) wraps the whole run.
    ``built`` is a class from ``fuzz_machine`` for ``result`` (then ``factory``, ``apply``
    and ``device`` are its, not read here)."""
    if built is not None:
        apply = None  # the built class is the one that runs
    trace: dict[str, Any] = {} if built is None else built[1]
    with (apply or _unmutated)() as mutated:
        machine = built[0] if built is not None else make_machine(
            config, scheduler_factory=mutated or factory, tally=result.checked,
            device=device, trace=trace)
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
            kind, ids = classify(exc, valid_calls=True)
            program = "\n".join(_notes(exc)) or out.getvalue().strip()
            seed = " ".join(f"{k}={v}" for k, v in sorted(trace.items()))
            result.failure = Failure(kind, ids, f"{type(exc).__name__}: {exc}", program,
                                     "state machine", seed, raised_at_runtime(exc))


def _notes(exc: BaseException) -> list[str]:
    """Hypothesis attaches the failing program to the exception as notes (PEP 678)."""
    notes = [str(n) for n in getattr(exc, "__notes__", [])]
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            notes.append(f"-- {type(sub).__name__}: {str(sub)[:300]}")
            notes.extend(_notes(sub))
    return notes


def run_directed(config: OffloadConfig, result: BatteryResult, *, preset: str = "",
                 apply: Apply = _unmutated) -> None:
    """The directed scenarios on ``config``, each in a fresh ``apply``; stops at the first
    failure. Their checks count in the table (``_counting``)."""
    for scenario in SCENARIOS:
        with apply() as factory:
            made: list[Any] = []
            try:
                with tallied(result.checked):
                    scenario(_counting(factory or OffloadScheduler, made), config)
            except Exception as exc:  # every failure is reported, whatever its type
                kind, ids = classify(exc, valid_calls=True)
                result.failure = Failure(
                    kind, ids, f"{type(exc).__name__}: {exc}",
                    python_c(f"from kvcore._scenarios import *; {layout_import(preset)}; "
                             f"{scenario.__name__}(OffloadScheduler, layout({preset!r}))"),
                    "directed", scenario.__name__, raised_at_runtime(exc))
                return
            finally:
                _add_counts(result.checked, [c for sched in made for c in (
                    getattr(sched, "checked", {}),
                    getattr(getattr(sched, "manager", None), "checked", {}))])


def _add_counts(into: dict[str, int], sources: list[dict[str, int]]) -> None:
    """Add each distinct count dict of ``sources`` to ``into`` once (two schedulers of a
    scenario may share one tier)."""
    for source in {id(s): s for s in sources}.values():
        for key, n in source.items():
            into[key] = into.get(key, 0) + n


def _counting(factory: Any, made: list[Any]) -> Callable[..., Any]:
    """``factory``, remembering each scheduler it builds in ``made``."""
    def build(*args: Any, **kwargs: Any) -> Any:
        made.append(factory(*args, **kwargs))
        return made[-1]
    return build


def run_copy(config: OffloadConfig, cases: int, result: BatteryResult, preset: str) -> None:
    """The C library against seeded hostile tables (``kvcore._copycheck``)."""
    from kvcore._copycheck import run_copy_library

    try:
        run_copy_library(config, cases, result.checked)
    except Exception as exc:  # every failure is reported, whatever its type
        kind, ids = classify(exc, valid_calls=True)
        result.failure = Failure(kind, ids, f"{type(exc).__name__}: {exc}",
                                 python_c("from kvcore._copycheck import run_copy_library; "
                                          f"{layout_import(preset)}; run_copy_library(layout("
                                          f"{preset!r}), {cases}, {{}})"),
                                 "copy library", "0")


def run_engine_stage(config: OffloadConfig, result: BatteryResult, preset: str, *,
                     setup: bool) -> None:
    """The constructors' bad twins ("set-up") or the transfer engine's plans, bytes and
    refusals ("transfer engine"), ``kvcore._enginecheck``."""
    from kvcore import _enginecheck, _inputcheck

    try:
        if setup:
            _enginecheck.run_setup(config, result.checked)
            _inputcheck.run_inputs(config, result.checked)
        else:
            _enginecheck.run_transfer_engine(config, _enginecheck.ENGINE_CASES, result.checked)
    except Exception as exc:  # every failure is reported, whatever its type
        kind, ids = classify(exc, valid_calls=True)
        call = "run_setup(config, {}); run_inputs(config, {})" if setup else \
            f"run_transfer_engine(config, {_enginecheck.ENGINE_CASES}, {{}})"
        result.failure = Failure(kind, ids, f"{type(exc).__name__}: {exc}",
                                 python_c("from kvcore._enginecheck import *; from "
                                          "kvcore._inputcheck import run_inputs; "
                                          f"{layout_import(preset)}; config = layout("
                                          f"{preset!r}); {call}"),
                                 "set-up" if setup else "transfer engine", "0")


def run_canaries(config: OffloadConfig, result: BatteryResult, *, preset: str, seeds: int,
                 examples: int, steps: int) -> None:
    """Are the checks live on this layout? Each bug-zoo mutant that can matter here is
    planted in turn, and the battery must name it by the check it declares.

    A check that is switched off or fed the wrong record (``if self.check`` inverted, a
    record built from the wrong value) breaks no rule itself, so every other stage passes
    it; but an engine relying on ``KVCORE_CHECK=1`` is then unprotected. The battery under
    a mutant stops at its first failure, which for each of them on the presets is the
    directed stage or the first simulation seed: a few seconds in all.

    Only those two stages run: every scheduler in them has its checks on, as an engine's
    with ``KVCORE_CHECK=1`` has. Later stages run some schedulers with checks off (the
    refinement's odd seeds), where a check whose ``if`` was inverted would fire and
    pass for live.

    Below the default budget (``CHECK_SEEDS``), a surviving mutant may be a bug the few
    seeds never met (``--seeds 1``: no store's block reused while in flight). The stages
    are deterministic, so a run under the mutant whose every check counted exactly as
    often as in an unmutated run may have done nothing the bug changed: that canary is
    reported untested (a "coverage" failure, exit 5) naming the budget to raise. Equal
    counts do not prove the bug was not met (a bug can change bytes, not how many
    records are checked), so at the default budget or more, the one CI runs, every
    survivor stays a failure; and a survivor whose counts differ always is one.
    """
    budget = f"--seeds {seeds} --examples {examples} --steps {steps}"
    unmutated: dict[str, int] | None = None
    untested: list[MutantOutcome] = []
    for mutant in MUTANTS:
        outcome = run_mutant(mutant, {preset: config}, seeds=seeds, examples=examples,
                             steps=steps, only=CANARY_STAGES)
        if outcome.ok:
            continue
        if outcome.status == "survived" and seeds < CHECK_SEEDS:
            if unmutated is None:
                unmutated = run_battery(config, preset=preset, seeds=seeds,
                                        examples=examples, steps=steps, shrink=False,
                                        only=CANARY_STAGES).checked
            if outcome.checked == unmutated:
                untested.append(outcome)
                continue
        result.failure = Failure(
            "canary", [mutant.expect],
            f"the check of {mutant.expect} is not live: the planted bug {mutant.name!r} "
            f"({mutant.origin}) was {outcome.describe()}, not caught by {mutant.expect} as "
            "declared", f"kvcore check --no-proofs {layout_flag(preset)} {budget} --mutants",
            "canaries", mutant.name)
        return
    if untested:
        ids = list(dict.fromkeys(o.expected for o in untested))
        bugs = ", ".join(f"{o.name!r} ({o.origin}; its check: {o.expected})" for o in untested)
        result.failure = Failure(
            "coverage", ids,
            f"canaries not put to the test: with {budget} the planted bug(s) {bugs} never "
            "changed what the directed scenarios and simulations did (every check counted "
            "as often as without them), so whether their checks are live is unknown; "
            f"raise --seeds (now {seeds}; the default is 24), which plants each bug in "
            "more runs", f"kvcore check --no-proofs {layout_flag(preset)} {budget}",
            "canaries", ",".join(o.name for o in untested))


def run_battery(config: OffloadConfig, *, preset: str, seeds: int, examples: int,
                steps: int, factory: Any = None, shrink: bool = True,
                progress: Progress | None = None, apply: Apply | None = None,
                canaries: bool = False, only: tuple[str, ...] | None = None,
                layout_file: bool | None = None) -> BatteryResult:
    """Every stage in order, stopping at the first failure; ``progress`` gets one line per
    stage as it ends. ``apply`` (a mutant's) is entered afresh per stage and per seed.
    ``canaries`` (``kvcore check``'s own run; never under a mutant) ends with the bug
    zoo, each mutant of which must be caught by its declared check. ``only`` runs just
    those stages, with no coverage verdict (the others' ids stay at 0).

    ``layout_file``: whether ``preset`` is the path of the user's layout file (True) or
    a preset's name (False), for the reproducers; None guesses from the name.

    A layout the directed scenarios cannot exercise within their fixed budget (a window
    too wide, ``_scenarios.check_fits``) is refused before any stage runs, with a
    ``HarnessLimit`` naming the field: a limit of the harness, never a failure of kvcore.
    """
    if layout_file is not None:
        preset = LayoutRef(preset, is_file=layout_file)
    if only is None or "directed" in only:
        check_fits(config)
    start = time.perf_counter()
    result = BatteryResult()
    if apply is None:
        @contextlib.contextmanager
        def fixed() -> Iterator[Any]:
            yield factory
        apply = fixed
    runs: dict[str, Callable[[], None]] = {
        "directed": lambda: run_directed(config, result, preset=preset, apply=apply),
        "simulations": lambda: run_sims(config, seeds, result, preset=preset, apply=apply),
        "state machine": lambda: run_machine(config, examples, steps, result,
                                             shrink=shrink, apply=apply),
        "refinement": lambda: run_sims(config, seeds, result, preset=preset, apply=apply,
                                       lockstep=True),
        "bad calls": lambda: run_sims(config, min(seeds, HOSTILE_SEEDS), result,
                                      preset=preset, apply=apply, hostile=True),
        "copy library": lambda: run_copy(config, COPY_CASES, result, preset),
        "set-up": lambda: run_engine_stage(config, result, preset, setup=True),
        "transfer engine": lambda: run_engine_stage(config, result, preset, setup=False),
        "canaries": lambda: run_canaries(config, result, preset=preset, seeds=seeds,
                                         examples=examples, steps=steps),
    }
    unnamed: Failure | None = None
    for stage in STAGES if only is None else [s for s in STAGES if s in only]:
        if stage == "canaries" and (not canaries or unnamed is not None):
            continue  # a run that crashed or hung cannot tell a dead check from that
        t0 = time.perf_counter()
        try:
            with watchdog(stage):
                runs[stage]()
        except StageHang as exc:  # raised outside a stage's own error handling
            result.failure = Failure("liveness", ["liveness"], str(exc), "", stage, "")
        result.stages[stage] = time.perf_counter() - t0
        if progress is not None:
            state = "FAILED" if result.failure else "ok"
            progress(f"  {stage:<15} {state:<6} {result.stages[stage]:6.1f}s "
                     f"(total {time.perf_counter() - start:.1f}s)")
        if result.failure is not None and result.failure.kind in UNNAMED:
            # A crash or a hang says that something broke, not what: the later stages run
            # on, since one of them (the refinement's lock step above all) may name it.
            unnamed = unnamed or result.failure
            result.failure = None
        if result.failure is not None:
            break
    if result.failure is None:
        result.failure = unnamed
    if only is None and (result.failure is None or result.failure.kind == "coverage"):
        # Untested canaries (``run_canaries``) and unevaluated ids are both inconclusive:
        # one verdict names them all.
        zeros = unchecked(result, f"kvcore check --no-proofs {layout_flag(preset)} "
                          f"--seeds {seeds} --examples {examples} --steps {steps}")
        result.failure = _inconclusive(zeros, result.failure)
    result.seconds = time.perf_counter() - start
    return result


def _inconclusive(zeros: Failure | None, canaries: Failure | None) -> Failure | None:
    """One "coverage" failure from the ids no stage evaluated and the canaries no run put
    to the test (either may be None)."""
    if zeros is None or canaries is None:
        return zeros or canaries
    return replace(zeros, ids=list(dict.fromkeys(zeros.ids + canaries.ids)),
                   message=f"{zeros.message}; and {canaries.message}", seed=canaries.seed)


def unchecked(result: BatteryResult, reproducer: str = "") -> Failure | None:
    """A "coverage" failure naming every invariant no stage evaluated, else None.

    A row of zeros reads as "no violations" but says nothing: the run-time checks that
    feed it were switched off or bypassed (a store path that no longer hands E1 its
    records), or no stage reached the rule with this budget and layout (a run of one seed
    fails no transfer, so X1 never meets a failure). Every stage ran for this to be
    asked, so a zero is never a budget cut short by an earlier failure. It is not a
    violation: ``kvcore check`` reports the run inconclusive (exit 5), never "ok".
    """
    zeros = [i for i in INVARIANT_IDS if not result.checked.get(i)]
    if not zeros:
        return None
    return Failure("coverage", zeros,
                   f"{', '.join(zeros)} checked 0 times in a run of every stage: a check "
                   "that never runs cannot fail (run-time checks bypassed, or no stage "
                   "reaches the rule with this budget and layout: the defaults reach every "
                   "rule on each preset)", reproducer, "coverage", "")


def invariant_table(result: BatteryResult) -> dict[str, dict[str, int]]:
    # A coverage failure's ids were never evaluated, not violated.
    broken = set(result.failure.ids) if result.failure and \
        result.failure.kind not in NOT_VIOLATIONS else set()
    return {i: {"checked": result.checked.get(i, 0), "violations": int(i in broken)}
            for i in INVARIANT_IDS}


def invariant_legend() -> list[str]:
    """One line per invariant id, from the catalogue: the first sentence of its predicate's
    docstring (the rule it checks)."""
    from kvcore.spec import invariants
    lines: dict[str, str] = {}
    for fns in invariants.PREDICATES.values():
        for fn in fns:
            key = invariants.PREDICATE_IDS[fn.__name__]
            doc = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
            text = (doc.split(": ", 1)[1] if ": " in doc[:24] else doc).rstrip(".")
            lines[key] = f"{lines[key]}; {text}" if key in lines else text
    out = [f"{i}  {lines.get(i, '')}" for i in INVARIANT_IDS]
    out.append("integrity  every block a completed load promised holds its key's bytes "
               "(the simulator's byte check; directed scenarios' stale-block checks)")
    out.append("liveness   every run settles: all requests finish, all jobs complete")
    return out


@dataclass
class MutantOutcome:
    """How the battery fared against one mutant.

    ``status``: "killed" (by the declared check), "wrong check" (caught, but by another
    check), "crash" (only a crash), "survived", or "n/a" (cannot matter on the layout).
    """

    name: str
    origin: str
    expected: str
    status: str
    by: str
    preset: str
    seconds: float
    stage: str = ""
    seed: str = ""
    fired: str = ""  # every id the failure named (``by`` is the declared one when killed)
    # Per-invariant counts of the batteries that caught nothing (a survivor's), summed
    # over its layouts: ``run_canaries`` compares them with an unmutated run's.
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def killed(self) -> bool:
        return self.status == "killed"

    @property
    def ok(self) -> bool:
        """The zoo passes for this mutant: killed as declared, or not applicable."""
        return self.status in ("killed", "n/a")

    def describe(self) -> str:
        if self.status == "wrong check":
            return f"killed by {self.by}, expected {self.expected}"
        if self.status == "n/a":
            return "n/a on this layout"
        if self.status == "crash":
            return f"only crashed ({self.by})"
        if self.status == "killed":
            others = [i for i in self.fired.split(",") if i and i != self.by]
            also = f" (also {','.join(others)})" if others else ""
            return f"killed by {self.by}{also}"
        return f"{self.status} (expected {self.expected})"


def run_mutant(mutant: Mutant, layouts: dict[str, OffloadConfig] | None = None, *,
               seeds: int, examples: int, steps: int, only: tuple[str, ...] | None = None
               ) -> MutantOutcome:
    """The battery under ``mutant`` on each layout where it applies, until it is caught.

    ``layouts`` is the user's layout (or several); None runs the mutant's own layouts.
    ``only`` limits each battery to those stages (``run_battery``).
    """
    start = time.perf_counter()
    if layouts is None:
        layouts = {name: layout(name) for name in mutant.layouts}
    tried: list[str] = []
    quiet: dict[str, int] = {}
    for name, config in layouts.items():
        if not mutant.can_matter(config):
            continue
        tried.append(name)
        result = run_battery(config, preset=name, seeds=seeds, examples=examples,
                             steps=steps, shrink=False, apply=mutant.apply, only=only)
        failure = result.failure
        if failure is None or failure.kind == "coverage":
            _add_counts(quiet, [result.checked])
            continue  # a rule no stage reached is no catch: the next layout may catch it
        fired = ",".join(failure.ids)
        by = fired
        if failure.kind == "crash":
            status = "crash"  # a crash is not a catch: the checks must name what broke
            by = f"{fired}: {failure.message[:80]}"
        elif mutant.expect in failure.ids and mutant.at_runtime and not failure.at_runtime:
            # Named by a harness (the lock step, a scenario's assertion) while the hook's
            # own check stayed quiet: an engine with KVCORE_CHECK=1 would not see it.
            status, by = "wrong check", f"{mutant.expect} from the {failure.stage} harness"
        elif mutant.expect in failure.ids:
            status, by = "killed", mutant.expect
        else:
            status = "wrong check"
        return MutantOutcome(mutant.name, mutant.origin, mutant.expect, status, by, name,
                             time.perf_counter() - start, failure.stage, failure.seed, fired)
    status = "survived" if tried else "n/a"
    return MutantOutcome(mutant.name, mutant.origin, mutant.expect, status, "",
                         ",".join(tried or layouts), time.perf_counter() - start,
                         checked=quiet)


def run_mutants(layouts: dict[str, OffloadConfig] | None = None, *, seeds: int,
                examples: int, steps: int, progress: Progress | None = None
                ) -> list[MutantOutcome]:
    outcomes: list[MutantOutcome] = []
    for m in MUTANTS:
        outcome = run_mutant(m, layouts, seeds=seeds, examples=examples, steps=steps)
        outcomes.append(outcome)
        if progress is not None:
            where = f" in {outcome.stage} {outcome.seed}" if outcome.stage else ""
            progress(f"  {m.name:<30} {outcome.describe()}{where} ({outcome.seconds:.1f}s)")
    return outcomes


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
