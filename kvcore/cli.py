"""The ``kvcore`` command: ``check`` for engine CI, ``fuzz`` for GPU runners, ``simulate``.

Exit codes say what failed (as the VOPR separates them): 0 clean, 1 a correctness failure
(an invariant, byte integrity, or a surviving mutant), 2 bad usage or config (nothing was
run), 3 liveness (a run did not settle), 4 a crash inside kvcore (the traceback goes to a
file whose path is printed), 5 inconclusive (a proof ran out of budget without a
counterexample, or an invariant no stage evaluated; nothing else failed), 130 interrupted
(Ctrl-C), 143 terminated (SIGTERM). The human table and ``--json`` render the same data.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from kvcore.spec.errors import ConfigError
from kvcore.spec.types import MAX_CONTEXT_TOKENS, OffloadConfig

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_LIVENESS, EXIT_CRASH = 0, 1, 2, 3, 4
EXIT_INCONCLUSIVE = 5
EXIT_INTERRUPTED = 130  # the shell's code for a run stopped by SIGINT
EXIT_TERMINATED = 143  # and by SIGTERM (what CI sends at its timeout)
# What --help says of them: a CI job branches on the code, so it must not need the source.
EXIT_CODES_HELP = """exit codes:
  0  clean
  1  a correctness failure: an invariant, byte integrity, a failed proof, a surviving mutant
     or a check that is not live (a planted bug its check did not catch)
  2  bad usage or config (reported in one line; nothing, or nothing more, was run)
  3  liveness: a run did not settle
  4  a crash inside kvcore (the traceback goes to a file whose path is printed)
  5  inconclusive: a proof ran out of budget without a counterexample, or a check that
     never ran (an invariant no stage evaluated); nothing else failed
  130  interrupted (Ctrl-C)
  143  terminated (SIGTERM, as CI sends at its timeout)"""
# Every parser's --help ends with the exit codes, laid out as written.
# No abbreviated options: `check --seed 7` ran as `--seeds 7` (simulate's `--seed` is a
# different thing), and a prefix that is unique today is ambiguous after the next option.
_HELP: dict[str, Any] = {"epilog": EXIT_CODES_HELP,
                         "formatter_class": argparse.RawDescriptionHelpFormatter,
                         "allow_abbrev": False}
KIND_EXIT = {"invariant": EXIT_FAIL, "integrity": EXIT_FAIL, "canary": EXIT_FAIL,
             "coverage": EXIT_INCONCLUSIVE,
             "liveness": EXIT_LIVENESS, "crash": EXIT_CRASH}

# Bounds of the numeric options. Each is far above what a useful run asks for, so only a
# typo (a sign, a unit, an extra digit) meets one, and it is refused before anything runs.
MAX_SEEDS = 10_000  # seeded simulations; ~1 s each, so 10k is hours of one CI job
MAX_EXAMPLES = 100_000  # state-machine examples per run (kvcore check uses 150)
MAX_STEPS = 10_000  # rules per example (kvcore check uses 50)
MAX_REQUESTS = 100_000  # simulated requests; each carries its own prompt in memory
MAX_SIM_TOKENS = MAX_CONTEXT_TOKENS  # prompt, prefill budget, new tokens: any context
MAX_SEED = (1 << 64) - 1  # seeds are strings to random.Random; 64 bits name any run
MAX_DURATION_S = 7 * 24 * 3600  # a fuzz job longer than a week is restarted anyway


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong, and where help is)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(what: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an int in [lo, hi], refused with the bound and what it counts."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not an integer ({what})"
                                             ) from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {lo}..{hi} ({what})")
        return value
    parse.__name__ = what
    return parse


def _shown(text: str) -> str:
    """An argument as an error echoes it: quoted, and cut at 40 characters (a 5,000-digit
    number is a typo, not something to print back whole)."""
    return repr(text) if len(text) <= 40 else repr(text[:40]) + f"... ({len(text)} chars)"


def _duration(text: str) -> float:
    """An argparse type: ``90s``, ``30m``, ``2h`` or plain seconds, above 0 and <= 7 days."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a duration; use e.g. 90s, "
                                         "30m or 2h")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if not 0 < seconds <= MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"{_shown(text)} must be above 0s and at most "
                                         f"{MAX_DURATION_S // 3600}h")
    return seconds


def _require_writable(option: str, path: str | None) -> None:
    """Refuse an output path that cannot be written, before any work is done.

    Opening the file is the only test that root, read-only mounts and ACLs all answer
    truly; a file this check creates is removed again.
    """
    if path is None:
        return
    if path == "":
        raise ConfigError(option, f"{option} is an empty path; name a file")
    target = Path(path)
    try:
        if target.is_dir():
            raise ConfigError(option, f"{option} {path} is a directory; name a file")
        existed = target.exists()
        # A FIFO would block the open, /dev/full accept it and fail the final write:
        # only a regular file (or a new one) takes the report.
        if existed and not target.is_file():
            raise ConfigError(option, f"{option} {path} is not a regular file; name a file")
        with target.open("a"):
            pass
    except OSError as exc:  # a name too long, a path through a file, permissions
        raise ConfigError(option, f"cannot write {option} {path}: {exc.strerror}; name a "
                          "file in a writable directory") from None
    if not existed:
        target.unlink(missing_ok=True)


def _require_not_layout(args: argparse.Namespace) -> None:
    """Refuse ``--json`` naming the file ``--config`` reads: the report would replace the
    user's layout, and the next run would fail on it."""
    config = getattr(args, "config", None)
    if not args.json or not config:
        return
    out, layout = Path(args.json), Path(config)
    try:
        same = out.resolve() == layout.resolve() or (
            out.exists() and layout.exists() and out.samefile(layout))
    except (OSError, RuntimeError):  # a loop or an unreadable path: the checks name it
        return
    if same:
        raise ConfigError("--json", f"--json {args.json} is the layout file --config "
                          "reads; writing the report there would replace it; name another "
                          "file")


def _write_json(option: str, path: str, data: dict[str, Any], code: int) -> int:
    """Write the report; a disk that fails now (full, a quota) is said in one line, and
    the run's own failure code wins over it (the report is extra, the verdict is not)."""
    try:
        Path(path).write_text(json.dumps(data, indent=2))
    except OSError as exc:
        print(f"kvcore: cannot write {option} {path}: {exc.strerror or exc}", file=sys.stderr)
        return code if code not in (EXIT_OK, EXIT_INCONCLUSIVE) else EXIT_USAGE
    return code


def _worse(code: int, other: int) -> int:
    """The exit code of a run with both outcomes: any failure beats inconclusive, which
    beats clean; between failures, the first one reported stays."""
    if code in (EXIT_OK, EXIT_INCONCLUSIVE):
        return other if other != EXIT_OK else code
    return code


def _require_device(device: str) -> None:
    if device == "cuda":
        from kvcore.transfer import cuda_available, cuda_unavailable_reason
        if not cuda_available():
            raise ConfigError("--device", f"--device cuda but kvcore's CUDA library is "
                              f"unavailable: {cuda_unavailable_reason()}; use --device cpu")


def _layout(args: argparse.Namespace) -> tuple[str, OffloadConfig]:
    from kvcore._configfile import load_config
    from kvcore.presets import DEFAULT_PRESET, preset
    if getattr(args, "config", None) is not None:  # "" is an error, not "no file"
        return Path(args.config).stem, load_config(args.config)
    name = args.preset or DEFAULT_PRESET
    return name, preset(name)


def _print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, [("-" * w) for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


def _crash_file(text: str) -> str:
    """Write a crash's traceback (or report) to a file; its path, or where it went instead."""
    try:
        with tempfile.NamedTemporaryFile("w", prefix="kvcore-crash-", suffix=".txt",
                                         delete=False) as f:
            f.write(text)
            return f.name
    except OSError:
        print(text, file=sys.stderr)
        return "stderr (no temporary file could be written)"


def _report_failure(failure: Any) -> int:
    """Print a battery failure and return its exit code; a crash also gets a crash file."""
    head = "INCONCLUSIVE" if failure.kind == "coverage" else "FAILED"
    print(f"\n{head} ({failure.kind}: {', '.join(failure.ids)}): {failure.message}\n"
          f"reproduce with:\n{failure.reproducer}")
    if failure.kind == "crash":
        details = getattr(failure, "traceback", "") or "(no traceback was recorded)"
        path = _crash_file(f"{failure.message}\n\nreproduce with:\n{failure.reproducer}\n\n"
                           f"{details}\n")
        print(f"kvcore: crash inside kvcore; details written to {path}", file=sys.stderr)
    return KIND_EXIT[failure.kind]


def _proof_status(status: str) -> str:
    """passed, FAILED, skipped or inconclusive, from the proof report's status.

    "skipped" means no proofs/ folder or no CrossHair (an installed wheel), and
    "inconclusive" an obligation that ran out of budget (twice) without a counterexample:
    not a correctness failure, so it gets its own exit code.
    """
    return {"confirmed": "passed", "failed": "FAILED"}.get(status, status)


def _run_mutants(args: argparse.Namespace, report: dict[str, Any], name: str,
                 config: Any, progress: Any) -> bool:
    """Run the bug zoo on the user's layout; True when every mutant that can matter there
    was killed by its declared check."""
    from kvcore import _check
    print(f"\nbug zoo on {name}:", flush=True)
    outcomes = _check.run_mutants({name: config}, seeds=args.seeds, examples=args.examples,
                                  steps=args.steps, progress=progress)
    report["mutants"] = {o.name: {"status": o.status, "killed": o.killed, "by": o.by,
                                  "expected": o.expected, "fired": o.fired,
                                  "stage": o.stage, "seed": o.seed, "preset": o.preset,
                                  "origin": o.origin, "seconds": round(o.seconds, 2)}
                         for o in outcomes}
    print()
    _print_table([[o.name, o.describe(), o.expected, o.stage, o.seed, f"{o.seconds:.1f}s"]
                  for o in outcomes],
                 ["mutant", "result", "expected", "stage", "seed", "time"])
    return all(o.ok for o in outcomes)


def cmd_check(args: argparse.Namespace) -> int:
    _require_writable("--json", args.json)
    _require_not_layout(args)
    name, config = _layout(args)
    from kvcore import _check
    print(f"kvcore check: layout {name} ({len(config.groups)} groups), "
          f"seeds={args.seeds} examples={args.examples} steps={args.steps}", flush=True)
    report: dict[str, Any] = {"ok": True, "layout": name}
    code = EXIT_OK
    inconclusive = False
    if not args.no_proofs:
        proofs = _check.run_proofs()
        status, line = _proof_status(proofs.status), proofs.summary
        report["proofs"] = {"ok": status in ("passed", "skipped"), "status": status,
                            "summary": line}
        print(f"proofs: {status} ({line})", flush=True)
        inconclusive = status == "inconclusive"
        if status == "FAILED":
            code = EXIT_FAIL

    def progress(line: str) -> None:
        print(line, flush=True)

    print("battery:", flush=True)
    # Reproducers name the layout as the user did: the preset, or the TOML file's path.
    ref = args.config or name
    # With --mutants the whole zoo runs below, reported mutant by mutant; without it the
    # battery's last stage plants each and asks that its check is live.
    result = _check.run_battery(config, preset=ref, seeds=args.seeds,
                                examples=args.examples, steps=args.steps, progress=progress,
                                canaries=not args.mutants,
                                layout_file=args.config is not None)
    table = _check.invariant_table(result)
    report["invariants"] = table
    report["seconds"] = round(result.seconds, 2)
    report["stages"] = {k: round(v, 2) for k, v in result.stages.items()}
    print()
    _print_table([[i, str(v["checked"]), str(v["violations"])] for i, v in table.items()],
                 ["invariant", "checked", "violations"])
    print("\nlegend:")
    for line in _check.invariant_legend():
        print(f"  {line}")
    if result.failure is not None:
        report["failure"] = asdict(result.failure)
        # A failed proof stays a failure even when the battery only lacked coverage.
        code = _worse(code, _report_failure(result.failure))
    if args.mutants and not _run_mutants(args, report, ref, config, progress):
        code = _worse(code, EXIT_FAIL)
    if code == EXIT_OK and inconclusive:
        code = EXIT_INCONCLUSIVE
    report["ok"] = code == EXIT_OK
    report["exit_code"] = code
    if args.json:
        code = _write_json("--json", args.json, report, code)
    unseen = result.failure is not None and result.failure.kind == "coverage"
    verdict = {EXIT_OK: "ok", EXIT_INCONCLUSIVE: "INCONCLUSIVE (" + (
        "an invariant no stage evaluated" if unseen else "a proof ran out of budget") +
        "; nothing failed)"}
    print(f"\n{verdict.get(code, 'FAILED')}")
    return code


_DEFAULT_DB = ".kvcore-fuzz-db"  # in the working directory, as Hypothesis's own


def _database(spec: str | None) -> Any:
    """The example database ``--db`` names, reached once now so a bad one runs nothing."""
    from hypothesis.database import DirectoryBasedExampleDatabase
    if spec == "":
        raise ConfigError("--db", "--db is empty; name a directory or redis://HOST:PORT/N "
                          "(or leave --db out for .kvcore-fuzz-db)")
    if spec is not None and spec.startswith(("redis://", "rediss://", "unix://")):
        return _redis_database(spec)
    if spec is not None and "://" in spec:  # a typo must not become a local folder
        raise ConfigError("--db", f"--db {spec}: not a Redis URL (redis://, rediss:// or "
                          "unix://) and not a directory name")
    folder = Path(spec or _DEFAULT_DB)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # An existing folder may still refuse writes, and Hypothesis's directory database
        # ignores a failed save: the run then said "saved" of a counterexample it lost.
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError("--db", f"--db {folder}: cannot write there "
                          f"({exc.strerror}); name a writable directory") from None
    return _guarded(DirectoryBasedExampleDatabase(str(folder)))


def _redis_database(spec: str) -> Any:
    try:
        import redis  # optional dependency: only --db redis:// needs it
    except ImportError:
        raise ConfigError("--db", f"--db {spec} needs the redis package: pip install "
                          "'kvcore[redis]'") from None
    from hypothesis.extra.redis import RedisExampleDatabase
    try:
        client = redis.Redis.from_url(spec, socket_connect_timeout=5, socket_timeout=60)
        client.ping()
    except (ValueError, redis.RedisError) as exc:
        raise ConfigError("--db", f"--db {spec}: Redis is unreachable ({exc}); start it, "
                          "fix the URL, or pass a directory") from None
    return _guarded(RedisExampleDatabase(client, key_prefix=b"kvcore-fuzz:"))


@functools.cache
def _guarded_database_class() -> type[Any]:
    from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

    class GuardedDatabase(ExampleDatabase):  # type: ignore[misc]
        """The example database, whose own failures do not end the run.

        A Redis restart or a network blip during hours of fuzzing was reported as a
        crash inside kvcore (exit 4). The database is storage, not the code under test:
        each failing call is counted, the first one said on stderr, and the run goes
        on; the failure report then says the counterexample may not be saved.
        """

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner
            self.failures = 0
            self.reads_back = isinstance(inner, DirectoryBasedExampleDatabase)

        def _guard(self, call: str, run: Callable[[], Any], default: Any = None) -> Any:
            try:
                return run()
            except Exception as exc:  # storage, not kvcore: counted and said once
                self.failures += 1
                if self.failures == 1:
                    print(f"kvcore fuzz: the example database failed ({call}: "
                          f"{type(exc).__name__}: {str(exc)[:200]}); fuzzing goes on, but "
                          "what it finds may not be saved", file=sys.stderr, flush=True)
                return default

        def _save(self, key: bytes, value: bytes) -> None:
            self.inner.save(key, value)
            # The directory database swallows its own OSErrors (a full disk): read the
            # value back, or its loss would go unreported.
            if self.reads_back and value not in set(self.inner.fetch(key)):
                raise OSError("the value was not found after saving it")

        def save(self, key: bytes, value: bytes) -> None:
            self._guard("save", lambda: self._save(key, value))

        def fetch(self, key: bytes) -> list[bytes]:
            got: list[bytes] = self._guard("fetch", lambda: list(self.inner.fetch(key)), [])
            return got

        def delete(self, key: bytes, value: bytes) -> None:
            self._guard("delete", lambda: self.inner.delete(key, value))

        def move(self, src: bytes, dest: bytes, value: bytes) -> None:
            self._guard("move", lambda: self.inner.move(src, dest, value))

    return GuardedDatabase


def _guarded(inner: Any) -> Any:
    """``inner`` behind ``GuardedDatabase`` (Hypothesis is imported only when fuzzing)."""
    return _guarded_database_class()(inner)


def _saved_note(db: Any) -> str:
    """Where the counterexample went; a Redis server that went away has not kept it."""
    if getattr(db, "failures", 0):
        return (f"(the example database failed {db.failures} times in this run; the "
                "counterexample may not be saved: keep the program above)")
    client = getattr(getattr(db, "inner", db), "redis", None)
    if client is not None:
        try:
            client.ping()
        except Exception:  # any failure to reach it means the example was not saved
            return "(the example database became unreachable; it was not saved)"
    return "(saved to the example database; the next run replays it first)"


def cmd_fuzz(args: argparse.Namespace) -> int:
    name, config = _layout(args)
    _require_device(args.device)
    db = _database(args.db)
    from kvcore import _check
    budget: float = args.duration
    print(f"kvcore fuzz: layout {name}, device {args.device}, {budget:g}s, db "
          f"{args.db or _DEFAULT_DB}", flush=True)
    start = time.monotonic()
    result = _check.BatteryResult()
    progress = {"rounds": 0, "examples": 0}
    try:
        built = _check.fuzz_machine(config, result, args.device)
        return _fuzz_rounds(args, config, db, built, result, start, progress)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the totals, then main's line and code
        print(f"stopped after {time.monotonic() - start:.0f}s: {progress['rounds']} rounds, "
              f"{progress['examples']} examples, {sum(result.checked.values())} invariant "
              "checks, no counterexample reported", flush=True)
        raise


def _fuzz_rounds(args: argparse.Namespace, config: OffloadConfig, db: Any, built: Any,
                 result: Any, start: float, progress: dict[str, int]) -> int:
    from kvcore import _check
    budget: float = args.duration
    rounds = done = 0
    per_example = 0.0
    while True:
        left = budget - (time.monotonic() - start)
        if left <= 0 or (rounds and left < per_example):
            break  # the next example would end past --duration
        # The first round runs one example to time it; later rounds fit what is left, so
        # the run ends within about one example of --duration, not a round past it. Each
        # round is at most twice the last: the first example is Hypothesis's minimal one,
        # too quick to size a whole round by (--duration 5s ran about 8 s).
        count = 1 if not rounds else min(args.examples, 2 ** min(rounds, 20),
                                         max(1, int(left / per_example)))
        began = time.monotonic()
        _check.run_machine(config, count, args.steps, result, database=db,
                           device=args.device, built=built)
        per_example = max(per_example, (time.monotonic() - began) / count)
        rounds, done = rounds + 1, done + count
        progress["rounds"], progress["examples"] = rounds, done
        total = sum(result.checked.values())
        print(f"[{time.monotonic() - start:6.0f}s] round {rounds}: "
              f"{done} examples, {total} invariant checks", flush=True)
        if result.failure is not None:
            code = _report_failure(result.failure)
            print(_saved_note(db))
            return code
    if not rounds:
        print(f"inconclusive: --duration {budget:g}s ended before the first example; give "
              "it longer")
        return EXIT_INCONCLUSIVE
    if not sum(result.checked.values()):
        # Rounds too short to reach a check (--steps 3) would pass without checking
        # anything: as kvcore check does for an invariant no stage evaluated.
        print(f"inconclusive: {done} examples in {rounds} rounds evaluated no invariant; "
              "raise --steps or --examples")
        return EXIT_INCONCLUSIVE
    failed = getattr(db, "failures", 0)
    print("ok: no counterexample found" + (
        f" (but the example database failed {failed} times: saved counterexamples may "
        "not have been replayed, nor new ones kept)" if failed else ""))
    return EXIT_OK


# simulate's workload options and their defaults: None in the parser, so that one given
# beside --check-options (which replaces them all) is refused instead of ignored.
_WORKLOAD = {"requests": 8, "context": 4096, "prefill_budget": 8192, "max_new_tokens": 24}


def cmd_simulate(args: argparse.Namespace) -> int:
    _require_writable("--json", args.json)
    _require_not_layout(args)
    given = [k for k in _WORKLOAD if getattr(args, k) is not None]
    if args.check_options and (given or args.faults):
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given + ["faults"] * args.faults)
        raise ConfigError("--check-options", f"--check-options replays kvcore check's own "
                          f"options for the seed, so {flags} would be ignored; drop them, "
                          "or drop --check-options")
    for key, default in _WORKLOAD.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    name, config = _layout(args)
    _require_device(args.device)
    from kvcore import _check
    from kvcore.sim import SimOptions, simulate
    if args.check_options:
        opts = _check.stage_options(args.seed, config, lockstep=args.lockstep,
                                    hostile=args.hostile)
    else:
        calm: dict[str, Any] = {} if args.faults else {
            "fail_rate": 0.0, "delay_rate": 0.2, "abort_rate": 0.0, "reset_rate": 0.0}
        if args.lockstep:
            calm["policy"] = "lru"
        opts = SimOptions(seed=args.seed, requests=args.requests, context_tokens=args.context,
                          prefill_budget=args.prefill_budget, follow_up_rate=0.5,
                          max_new_tokens=args.max_new_tokens, lockstep=args.lockstep,
                          hostile=args.hostile, **calm)
    print(f"kvcore simulate: layout {name}, options {asdict(opts.drawn())}", flush=True)
    report = simulate(config, opts, check=not args.no_checks, device=args.device)
    data = report.as_dict()
    for key in ("steps", "seconds", "requests_finished", "requests_aborted", "preemptions",
                "resets", "prompt_tokens", "offload_hit_tokens", "offload_hit_rate",
                "chunks_stored", "chunks_loaded", "chunks_evicted", "bytes_stored",
                "bytes_loaded", "deferrals", "failed_loads", "failed_stores",
                "loads_verified", "blocks_verified"):
        print(f"{key:>20}: {data[key]}")
    print(f"{'invariants checked':>20}: {sum(report.invariants_checked.values())} "
          f"({', '.join(f'{k}={v}' for k, v in report.invariants_checked.items())})")
    if args.json:
        return _write_json("--json", args.json, data, EXIT_OK)
    return EXIT_OK


def _version() -> str:
    """The installed distribution's version; the package's own when not installed."""
    from importlib import metadata
    try:
        return metadata.version("kvcore")
    except metadata.PackageNotFoundError:
        import kvcore
        return str(getattr(kvcore, "__version__", "unknown (not installed)"))


def _layout_args(sp: argparse.ArgumentParser) -> None:
    from kvcore.presets import PRESETS
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--preset", choices=sorted(PRESETS), help="a built-in layout")
    g.add_argument("--config", help="a TOML file describing the engine's groups")


_DEVICE_HELP = ("where the simulated engine's KV blocks live (default cpu); cuda needs "
                "kvcore's CUDA library, a driver and a visible device")


def _check_parser(sub: Any) -> None:
    c = sub.add_parser("check", help="contract checks for engine CI", **_HELP)
    _layout_args(c)
    c.add_argument("--json", help="write the results as JSON to this file")
    c.add_argument("--mutants", action="store_true", help="also run the bug zoo")
    c.add_argument("--no-proofs", action="store_true", help="skip the CrossHair proofs")
    # 24 is kvcore._check.CHECK_SEEDS (imported lazily: --help must not load torch);
    # tests/unit/test_check_edge_layouts.py holds the two equal.
    c.add_argument("--seeds", type=_count("seeded simulations", 1, MAX_SEEDS), default=24,
                   help=f"seeded simulations, 1..{MAX_SEEDS} (default 24)")
    c.add_argument("--examples", type=_count("state-machine examples", 1, MAX_EXAMPLES),
                   default=150, help=f"state-machine examples, 1..{MAX_EXAMPLES} (default 150)")
    c.add_argument("--steps", type=_count("rules per example", 1, MAX_STEPS), default=50,
                   help=f"rules per example, 1..{MAX_STEPS} (default 50)")
    c.set_defaults(func=cmd_check)


def _fuzz_parser(sub: Any) -> None:
    f = sub.add_parser("fuzz", help="long stateful fuzzing, sharing counterexamples", **_HELP)
    _layout_args(f)
    f.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help=_DEVICE_HELP)
    f.add_argument("--duration", type=_duration, default="30m",
                   help="e.g. 90s, 30m, 2h; at most 168h (default 30m)")
    f.add_argument("--db", help="example database: a directory or redis://HOST:PORT/N "
                   f"(default ./{_DEFAULT_DB})")
    f.add_argument("--examples", type=_count("examples per round", 1, MAX_EXAMPLES),
                   default=50, help=f"most examples per round, 1..{MAX_EXAMPLES} (default "
                   "50; the first round runs one to time it, later ones what fits the time "
                   "left)")
    f.add_argument("--steps", type=_count("rules per example", 1, MAX_STEPS), default=50,
                   help=f"rules per example, 1..{MAX_STEPS} (default 50)")
    f.set_defaults(func=cmd_fuzz)


def _simulate_parser(sub: Any) -> None:
    s = sub.add_parser("simulate", help="run a workload end to end and report", **_HELP)
    _layout_args(s)
    tokens = MAX_SIM_TOKENS
    s.add_argument("--requests", type=_count("requests", 1, MAX_REQUESTS), default=None,
                   help=f"requests to run, 1..{MAX_REQUESTS} (default 8)")
    s.add_argument("--context", type=_count("prompt tokens per request", 1, tokens),
                   default=None, help=f"prompt size, 1..{tokens} (default 4096): each "
                   "prompt is drawn at 70-100%% of it, one sharing a system prefix up to 31 "
                   "tokens past it")
    s.add_argument("--seed", type=_count("seed", 0, MAX_SEED), default=0,
                   help="the workload's seed, 0..2**64-1 (default 0)")
    s.add_argument("--prefill-budget", type=_count("prefill tokens per step", 1, tokens),
                   default=None, help=f"prefill tokens per step, 1..{tokens} (default 8192)")
    s.add_argument("--max-new-tokens", type=_count("new tokens per request", 1, tokens),
                   default=None, help=f"most new tokens per request, 1..{tokens} (default "
                   "24; each request draws its own count from 1 to it)")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help=_DEVICE_HELP)
    s.add_argument("--no-checks", action="store_true",
                   help="turn the scheduler's runtime invariant checks off (the simulator's "
                        "byte check of every load still runs and fails the run)")
    s.add_argument("--faults", action="store_true",
                   help="draw fault rates (failed reports, aborts, resets) from the seed; "
                        "without it those are 0 and 20%% of reports still come late")
    s.add_argument("--check-options", action="store_true",
                   help="use the options `kvcore check` ran this seed with (to replay it; "
                        "not with --requests, --context, --prefill-budget, --max-new-tokens "
                        "or --faults, which it replaces)")
    # One or the other, as kvcore check's stages run them: a bad twin sent through the
    # lock step reaches the reference model too, which is not built to bounce it.
    stages = s.add_mutually_exclusive_group()
    stages.add_argument("--lockstep", action="store_true",
                        help="run the scheduler in lock step with the reference model (R1; "
                             "LRU tier; what `kvcore check`'s refinement stage does)")
    stages.add_argument("--hostile", action="store_true",
                        help="make bad twins of a share of the calls, which must bounce (A1; "
                             "what `kvcore check`'s bad-calls stage does; not with "
                             "--lockstep)")
    s.add_argument("--json", help="write the report as JSON to this file")
    s.set_defaults(func=cmd_simulate)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvcore", description=(__doc__ or "").split("\n")[0],
                **_HELP)
    p.add_argument("--version", action="version", version=f"kvcore {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    _check_parser(sub)
    _fuzz_parser(sub)
    _simulate_parser(sub)
    return p


def _run_failure(exc: Exception) -> int:
    """The exit code of an exception a command raised, said in one line on stderr.

    An invariant, integrity or liveness failure (``kvcore simulate`` raises them) keeps its
    own code; anything else is a crash inside kvcore, whose traceback goes to a file.
    """
    try:
        from kvcore._check import classify
        kind, ids = classify(exc)
    except Exception:  # the crash may be that kvcore's own modules do not import
        kind, ids = "crash", [type(exc).__name__]
    if kind == "crash":
        path = _crash_file("".join(traceback.format_exception(exc)))
        print(f"kvcore: crash inside kvcore ({type(exc).__name__}: {str(exc)[:200]}); "
              f"traceback written to {path}", file=sys.stderr)
    else:
        print(f"kvcore: FAILED ({kind}: {', '.join(ids)}): {type(exc).__name__}: "
              f"{str(exc)[:500]}", file=sys.stderr)
    return KIND_EXIT[kind]


class _Output(io.TextIOBase):
    """stdout as the commands print to it: a reader that went away (``| head``) stops the
    printing, not the run, whose exit code still says how it went; a character the
    terminal's encoding lacks (a file name's stray byte) is escaped, not a crash."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.closed_by_reader = stream, False

    def write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                self.stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(self.stream, "encoding", None) or "utf-8"
                self.stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
            except BrokenPipeError:
                self.closed_by_reader = True
        return len(text)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self.closed_by_reader = True


class _Terminated(KeyboardInterrupt):
    """SIGTERM, turned into the interrupt path: a CI timeout killed the run silently
    (exit 143 from the shell, no line saying why, no totals)."""


def _on_sigterm(signum: int, frame: Any) -> NoReturn:
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    # torch warns at first use that NumPy is absent; kvcore does not need NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Output(out), _Output(err)
    previous = _install(signal.SIGTERM, _on_sigterm)
    try:
        return _main(argv)
    except _Terminated:
        print("kvcore: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("kvcore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        _install(signal.SIGTERM, previous)
        sys.stdout, sys.stderr = out, err


def _install(signum: int, handler: Any) -> Any:
    """Set a handler where Python may (the main thread) and where it can be put back:
    not over an ignored signal (a parent's ``trap '' TERM`` stays in force, as Python
    leaves an ignored SIGINT), nor over a handler set from C (``getsignal`` answers None:
    it could not be restored). Returns what to restore, or None to leave it."""
    if handler is None:
        return None
    try:
        current = signal.getsignal(signum)
        if current is None or current is signal.SIG_IGN:
            return None
        signal.signal(signum, handler)
        return current
    except ValueError:  # not the main thread: the embedding program owns its signals
        return None


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # usage errors, --help and --version end here
        if exc.code is None:
            return EXIT_OK
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kvcore: ConfigError: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # every other failure gets its documented exit code
        return _run_failure(exc)
    return code


if __name__ == "__main__":
    sys.exit(main())
