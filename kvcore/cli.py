"""The ``kvcore`` command: ``check`` for engine CI, ``fuzz`` for GPU runners, ``simulate``.

Exit codes say what failed (as the VOPR separates them): 0 clean, 1 a correctness failure
(an invariant, byte integrity, or a surviving mutant), 2 bad usage or config, 3 liveness
(a run did not settle), 4 a crash inside kvcore. The human table and ``--json`` render
the same data.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvcore.spec.errors import ConfigError
from kvcore.spec.types import OffloadConfig

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_LIVENESS, EXIT_CRASH = 0, 1, 2, 3, 4
KIND_EXIT = {"invariant": EXIT_FAIL, "integrity": EXIT_FAIL, "liveness": EXIT_LIVENESS,
             "crash": EXIT_CRASH}


def _layout(args: argparse.Namespace) -> tuple[str, OffloadConfig]:
    from kvcore._configfile import load_config
    from kvcore.presets import DEFAULT_PRESET, preset
    if getattr(args, "config", None):
        return Path(args.config).stem, load_config(args.config)
    name = args.preset or DEFAULT_PRESET
    return name, preset(name)


def _print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, [("-" * w) for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


def cmd_check(args: argparse.Namespace) -> int:
    from kvcore import _check
    name, config = _layout(args)
    print(f"kvcore check: layout {name} ({len(config.groups)} groups), "
          f"seeds={args.seeds} examples={args.examples} steps={args.steps}", flush=True)
    report: dict[str, Any] = {"ok": True, "layout": name}
    if not args.no_proofs:
        ok, line = _check.run_proofs()
        report["proofs"] = {"ok": ok, "summary": line}
        print(f"proofs: {'passed' if ok else 'skipped' if ok is None else 'FAILED'} ({line})",
              flush=True)
        report["ok"] &= ok is not False
    def progress(line: str) -> None:
        print(line, flush=True)
    print("battery:", flush=True)
    result = _check.run_battery(config, preset=name, seeds=args.seeds,
                                examples=args.examples, steps=args.steps, progress=progress)
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
    code = EXIT_OK if report["ok"] else EXIT_FAIL
    if result.failure is not None:
        report["ok"] = False
        report["failure"] = asdict(result.failure)
        print(f"\nFAILED ({result.failure.kind}: {', '.join(result.failure.ids)}): "
              f"{result.failure.message}\nreproduce with:\n{result.failure.reproducer}")
        code = KIND_EXIT[result.failure.kind]
    if args.mutants:
        # The user's layout: each mutant that can matter there must be caught on it.
        print(f"\nbug zoo on {name}:", flush=True)
        outcomes = _check.run_mutants({name: config}, seeds=args.seeds,
                                      examples=args.examples, steps=args.steps,
                                      progress=progress)
        report["mutants"] = {o.name: {"status": o.status, "killed": o.killed, "by": o.by,
                                      "expected": o.expected, "fired": o.fired,
                                      "stage": o.stage,
                                      "seed": o.seed, "preset": o.preset, "origin": o.origin,
                                      "seconds": round(o.seconds, 2)}
                             for o in outcomes}
        print()
        _print_table([[o.name, o.describe(), o.expected, o.stage, o.seed, f"{o.seconds:.1f}s"]
                      for o in outcomes],
                     ["mutant", "result", "expected", "stage", "seed", "time"])
        if not all(o.ok for o in outcomes):
            report["ok"] = False
            code = code or EXIT_FAIL
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"\n{'ok' if report['ok'] else 'FAILED'}")
    return code


def _duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not m:
        raise ConfigError("duration", f"duration={text!r}; use e.g. 90s, 30m or 2h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _database(spec: str | None) -> Any:
    from hypothesis.database import DirectoryBasedExampleDatabase
    if spec is None:
        return DirectoryBasedExampleDatabase(".kvcore-fuzz-db")
    if spec.startswith("redis://"):
        import redis  # optional dependency: only --db redis:// needs it
        from hypothesis.extra.redis import RedisExampleDatabase
        return RedisExampleDatabase(redis.Redis.from_url(spec), key_prefix=b"kvcore-fuzz:")
    return DirectoryBasedExampleDatabase(spec)


def cmd_fuzz(args: argparse.Namespace) -> int:
    from kvcore import _check
    name, config = _layout(args)
    if args.device == "cuda":
        from kvcore.transfer import cuda_available, cuda_unavailable_reason
        if not cuda_available():
            raise ConfigError("device", f"--device cuda but kvcore's CUDA library is "
                              f"unavailable: {cuda_unavailable_reason()}")
    budget = _duration(args.duration)
    db = _database(args.db)
    print(f"kvcore fuzz: layout {name}, device {args.device}, {budget:.0f}s, db {args.db}",
          flush=True)
    start = time.monotonic()
    result = _check.BatteryResult()
    rounds = 0
    while time.monotonic() - start < budget:
        rounds += 1
        _check.run_machine(config, args.examples, args.steps, result, database=db,
                           device=args.device)
        total = sum(result.checked.values())
        print(f"[{time.monotonic() - start:6.0f}s] round {rounds}: "
              f"{rounds * args.examples} examples, {total} invariant checks", flush=True)
        if result.failure is not None:
            print(f"\nFAILED ({result.failure.kind}: {', '.join(result.failure.ids)}): "
                  f"{result.failure.message}\n{result.failure.reproducer}\n"
                  f"(saved to the example database; the next run replays it first)")
            return KIND_EXIT[result.failure.kind]
    print("ok: no counterexample found")
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from kvcore import _check
    from kvcore.sim import SimOptions, simulate
    name, config = _layout(args)
    if args.check_options:
        opts = _check.sim_options(args.seed)
    else:
        calm: dict[str, Any] = {} if args.faults else {
            "fail_rate": 0.0, "delay_rate": 0.2, "abort_rate": 0.0, "reset_rate": 0.0}
        opts = SimOptions(seed=args.seed, requests=args.requests, context_tokens=args.context,
                          prefill_budget=args.prefill_budget, follow_up_rate=0.5,
                          max_new_tokens=args.max_new_tokens, **calm)
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
        Path(args.json).write_text(json.dumps(data, indent=2))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from kvcore.presets import PRESETS
    p = argparse.ArgumentParser(prog="kvcore", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def layout_args(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--preset", choices=sorted(PRESETS), help="a built-in layout")
        g.add_argument("--config", help="a TOML file describing the engine's groups")

    c = sub.add_parser("check", help="contract checks for engine CI")
    layout_args(c)
    c.add_argument("--json", help="write the results as JSON to this file")
    c.add_argument("--mutants", action="store_true", help="also run the bug zoo")
    c.add_argument("--no-proofs", action="store_true", help="skip the CrossHair proofs")
    c.add_argument("--seeds", type=int, default=24, help="seeded simulations (default 24)")
    c.add_argument("--examples", type=int, default=150,
                   help="state-machine examples (default 150)")
    c.add_argument("--steps", type=int, default=50, help="rules per example (default 50)")
    c.set_defaults(func=cmd_check)

    f = sub.add_parser("fuzz", help="long stateful fuzzing, sharing counterexamples")
    layout_args(f)
    f.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    f.add_argument("--duration", default="30m", help="e.g. 90s, 30m, 2h (default 30m)")
    f.add_argument("--db", help="example database: a directory or redis://HOST:PORT/N")
    f.add_argument("--examples", type=int, default=50, help="examples per round")
    f.add_argument("--steps", type=int, default=50, help="rules per example")
    f.set_defaults(func=cmd_fuzz)

    s = sub.add_parser("simulate", help="run a workload end to end and report")
    layout_args(s)
    s.add_argument("--requests", type=int, default=8)
    s.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--prefill-budget", type=int, default=8192)
    s.add_argument("--max-new-tokens", type=int, default=24)
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    s.add_argument("--no-checks", action="store_true", help="turn runtime checks off")
    s.add_argument("--faults", action="store_true",
                   help="draw fault rates (failed/late reports, aborts, resets) from the seed")
    s.add_argument("--check-options", action="store_true",
                   help="use the options `kvcore check` ran this seed with (to replay it)")
    s.add_argument("--json", help="write the report as JSON to this file")
    s.set_defaults(func=cmd_simulate)
    return p


def main(argv: list[str] | None = None) -> int:
    # torch warns at first use that NumPy is absent; kvcore does not need NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kvcore: ConfigError: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return code


if __name__ == "__main__":
    sys.exit(main())
