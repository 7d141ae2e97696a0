#!/usr/bin/env python3
"""Mutation score: how many small, realistic bugs in kvcore the checks catch.

``make mutate`` runs this. It mutates kvcore's scheduler, manager and transfer engine and
the C copy library's validation functions, one mutant at a time in a private copy of the
tree, and reports two kill rates over a seeded sample:

(a) ``make test``'s test suite (``pytest -x tests proofs``, the derandomized CI profile):
    any failure kills; a run longer than ``--hang-factor`` times the unmutated run counts
    as a kill by timeout (a mutant that loops), and is shown as such.
(b) ``kvcore check --no-proofs`` on the default preset, the contract engines rely on: only
    exit code 1 with a named invariant, byte-integrity or canary failure kills (a canary
    names the invariant whose run-time check did not catch the zoo bug planted for it),
    or exit 5 naming an invariant no stage evaluated. A crash, a traceback, a liveness
    exit or a timeout is not a kill.

Why cosmic-ray plus a little of our own. The Python mutants come from cosmic-ray (a
maintained mutation tool): ``cosmic-ray init`` enumerates them and ``cosmic-ray apply``
writes one to disk. It reads source files by path, so kvcore's layout (``spec/`` imported
as ``kvcore.spec``, a cffi extension in ``kvcore/``) does not matter to it. Three things it
does not do are done here: (1) sampling, seeded, from a chosen set of its operators (its
full set has 3,000+ mutants here, most of them ``a + b -> a << b`` swaps that any test
kills by crashing); (2) C: textual operator mutations on the ``if`` lines of the
validation functions of ``native/kvcore_copy.c`` (those whose name contains ``check`` or
``validate``), rebuilt per mutant with the project's own cffi build, and of every function
of ``native/kvcore_scan.c`` (the hook-input scans, compiled straight into the copy's
``kvcore/_scan*.so``); (3) the two runners and the rule for (b). mutmut 3 was the other
candidate; it runs the tests from a copied ``mutants/`` tree through per-function
trampolines and has no C at all, so the copy-and-build part would have been needed anyway.

The copy: tracked and unignored files plus the built ``kvcore/*.so`` (the copy library and
the C scans of hook inputs), with ``kvcore/spec`` and ``kvcore/proofs`` linked to ``spec/``
and ``proofs/`` so the copy imports as the installed package does, never the checkout.
Byte-code writing is off, so a mutant of the same size and mtime cannot be served from a
stale ``.pyc``. An unmutated baseline of both runners must pass first. Bounded:
``--sample`` mutants (default 60), ``--timeout`` per run, nice'd.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The runtime check funnel (enforce, tally, checks_enabled) sat in kvcore/scheduler until
# the manager needed it too; it stays in the population.
PY_TARGETS = ("kvcore/scheduler", "kvcore/manager", "kvcore/transfer", "kvcore/_checks.py")
C_TARGET = "native/kvcore_copy.c"
# The C scans of hook inputs (kvcore._scan): every function is validation, and an `if`
# there is often braceless (`if (v < 0)` on its own line).
SCAN_TARGET = "native/kvcore_scan.c"
# cosmic-ray operators kept, by family (the names are cosmic-ray's).
FAMILIES = {
    "boundary": ["Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt"],
    "flip": ["Lt_GtE", "LtE_Gt", "Gt_LtE", "GtE_Lt", "Eq_NotEq", "NotEq_Eq", "Is_IsNot",
             "IsNot_Is"],
}
OPERATORS = {f"core/ReplaceComparisonOperator_{op}": fam
             for fam, ops in FAMILIES.items() for op in ops}
OPERATORS.update({
    "core/ReplaceBinaryOperator_Add_Sub": "arith", "core/ReplaceBinaryOperator_Sub_Add": "arith",
    "core/NumberReplacer": "const", "core/ReplaceAndWithOr": "bool",
    "core/ReplaceOrWithAnd": "bool", "core/AddNot": "negate",
    "core/ReplaceUnaryOperator_Delete_Not": "negate", "core/ReplaceTrueWithFalse": "bool",
    "core/ReplaceFalseWithTrue": "bool", "core/ZeroIterationForLoop": "remove",
    "core/ReplaceContinueWithBreak": "remove",
})
C_SWAPS = [("<=", "<"), (">=", ">"), ("==", "!="), ("!=", "=="), ("&&", "||"), ("||", "&&"),
           (" - ", " + "), (" + ", " - ")]
C_SINGLE = [(re.compile(r"(?<![<>-])<(?![<=])"), "<="), (re.compile(r"(?<![<>-])>(?![>=])"), ">=")]
# Survivors reviewed as equivalent (no input tells them from the original), with the
# argument for each; matched by file and the mutated line's text before and after, so an
# entry outlives edits elsewhere and lapses when its line changes.
EQUIVALENT = ROOT / "tools" / "mutate_equivalent.toml"
# A named failure (exit 1), or an invariant no stage evaluated (exit 5: the run is not
# "ok", and it names the rule).
INVARIANT_FAIL = re.compile(r"^(?:FAILED \((invariant|integrity|canary)"
                            r"|INCONCLUSIVE \((coverage)): ([^)]+)\)", re.M)


@dataclass
class Mutant:
    """One mutation: where, which operator, and what each runner made of it."""

    ident: str
    path: str
    line: int
    family: str
    operator: str
    occurrence: int = 0
    before: str = ""
    after: str = ""
    tests: str = "not run"
    tests_by: str = ""
    check: str = "not run"
    check_by: str = ""
    seconds: float = 0.0
    equivalent: str = ""


@dataclass
class Options:
    cosmic_ray: Path
    timeout: float
    hang_factor: float
    pytest_args: list[str]
    runners: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable


def copy_tree(dest: Path) -> None:
    """The files git would ship plus the built extension, and the installed layout's links."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    built = sorted((ROOT / "kvcore").glob("*.so"))  # the copy library, scans, tier tables
    if not all(any(so.name.startswith(p) for so in built)
               for p in ("_kvcore_native", "_scan", "_index")):
        sys.exit("mutate: kvcore/_kvcore_native*.so, _scan*.so and _index*.so must all be "
                 "built; run `make setup` first")
    for so in built:
        shutil.copy2(so, dest / "kvcore" / so.name)
    for name, folder in (("spec", "spec"), ("proofs", "proofs")):
        link = dest / "kvcore" / name
        if not link.exists():
            link.symlink_to(Path("..") / folder)


def python_mutants(tree: Path, opts: Options) -> list[Mutant]:
    """cosmic-ray's mutants of the Python targets, restricted to OPERATORS."""
    cfg = tree / "build" / "cosmic-ray.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    paths = ", ".join(f'"{p}"' for p in PY_TARGETS)
    cfg.write_text(f'[cosmic-ray]\nmodule-path = [{paths}]\ntimeout = {opts.timeout}\n'
                   'excluded-modules = []\ntest-command = "true"\n\n'
                   '[cosmic-ray.distributor]\nname = "local"\n')
    session = tree / "build" / "cosmic-ray.sqlite"
    run([str(opts.cosmic_ray), "init", str(cfg), str(session)], tree, check=True)
    dump = run([str(opts.cosmic_ray), "dump", str(session)], tree, check=True).stdout
    out: list[Mutant] = []
    for line in dump.splitlines():
        item = json.loads(line)[0]
        for m in item["mutations"]:
            fam = OPERATORS.get(m["operator_name"])
            if fam is not None:
                out.append(Mutant("", m["module_path"], m["start_pos"][0], fam,
                                  m["operator_name"].removeprefix("core/"), m["occurrence"]))
    return out


def c_functions(text: str) -> list[tuple[int, int]]:
    """Line ranges (1-based, inclusive) of the validation functions of the C file."""
    lines = text.splitlines()
    ranges: list[tuple[int, int]] = []
    for i, line in enumerate(lines):
        m = re.match(r"^(?:static\s+)?(?:inline\s+)?int\s+(kvc_\w+)\s*\(", line)
        if m and ("check" in m.group(1) or "validate" in m.group(1)):
            end = next(j for j in range(i, len(lines)) if lines[j].startswith("}"))
            ranges.append((i + 1, end + 1))
    return ranges


def scan_functions(text: str) -> list[tuple[int, int]]:
    """Line ranges of every function of the scan extension but the module's init."""
    lines = text.splitlines()
    ranges: list[tuple[int, int]] = []
    for i, line in enumerate(lines):
        if re.match(r"^static [^=;]*\b\w+\([^;]*\)$", line):
            end = next(j for j in range(i, len(lines)) if lines[j].startswith("}"))
            ranges.append((i + 1, end + 1))
    return ranges


def c_mutants(tree: Path) -> list[Mutant]:
    """Operator swaps, negations and removals on the `if` lines of the validation functions
    (the copy library's) and of the hook-input scans (all of them)."""
    out: list[Mutant] = []
    for path, functions, if_line in (
            (C_TARGET, c_functions, r"^(\s*if \()(.*)(\) \{)$"),
            (SCAN_TARGET, scan_functions, r"^(\s*if \()(.*)(\)(?: \{)?)$")):
        text = (tree / path).read_text()
        lines = text.splitlines()
        for start, end in functions(text):
            for n in range(start, end + 1):
                m = re.match(if_line, lines[n - 1])
                if m:
                    out += _if_mutants(path, n, lines[n - 1], m)
    return out


def _if_mutants(path: str, n: int, line: str, m: re.Match[str]) -> list[Mutant]:
    cond = m.group(2)
    variants: list[tuple[str, str]] = []
    for old, new in C_SWAPS:
        for pos in [k.start() for k in re.finditer(re.escape(old), cond)]:
            variants.append((f"{old.strip()}->{new.strip()}",
                             cond[:pos] + new + cond[pos + len(old):]))
    for pattern, new in C_SINGLE:
        for k in pattern.finditer(cond):
            variants.append((f"{k.group(0)}->{new}", cond[:k.start()] + new + cond[k.end():]))
    variants.append(("negate", f"!({cond})"))
    variants.append(("remove-check", f"0 && ({cond})"))
    out = []
    for op, new_cond in variants:
        family = "remove" if op == "remove-check" else "negate" if op == "negate" else "c-op"
        out.append(Mutant("", path, n, family, op, before=line.strip(),
                          after=f"{m.group(1)}{new_cond}{m.group(3)}".strip()))
    return out


def build_scan(tree: Path, opts: Options) -> subprocess.CompletedProcess[str]:
    """Compile the scan extension in place with the flags setup.py uses (the interpreter's
    CFLAGS and CCSHARED, which carry -DNDEBUG: without it CPython's header asserts stay
    live and abort on a mutant the shipped build would run, a kill the tests did not
    earn; then setup.py's -O2 -Wall). Calling the compiler directly takes a second;
    setup.py would rebuild the copy library too."""
    var = sysconfig.get_config_var
    out = tree / "kvcore" / f"_scan{var('EXT_SUFFIX')}"
    flags = [*(var("CFLAGS") or "").split(), *(var("CCSHARED") or "-fPIC").split()]
    return run([*(var("CC") or "cc").split(), "-shared", *flags, "-O2", "-Wall",
                f"-I{sysconfig.get_paths()['include']}", SCAN_TARGET, "-o", str(out)],
               tree, env=opts.env, timeout=600)


def run(cmd: list[str], cwd: Path, *, check: bool = False, timeout: float | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=full_env, check=False)
    if check and proc.returncode != 0:
        sys.exit(f"mutate: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc


def apply_mutant(tree: Path, m: Mutant, opts: Options) -> bool:
    """Write the mutant into the copy; False when it does not change the file or build."""
    target = tree / m.path
    original = target.read_bytes()
    if m.path in (C_TARGET, SCAN_TARGET):
        lines = original.decode().splitlines(keepends=True)
        indent = lines[m.line - 1][: len(lines[m.line - 1]) - len(lines[m.line - 1].lstrip())]
        lines[m.line - 1] = indent + m.after + "\n"
        target.write_text("".join(lines))
        if m.path == SCAN_TARGET:
            return build_scan(tree, opts).returncode == 0
        built = run([opts.python, "native/build_native.py"], tree, env=opts.env, timeout=600)
        return built.returncode == 0
    run([str(opts.cosmic_ray), "apply", m.path, f"core/{m.operator}", str(m.occurrence)], tree)
    mutated = target.read_bytes()
    if mutated == original:
        return False
    old = original.decode().splitlines()
    new = mutated.decode().splitlines()
    m.before = old[m.line - 1].strip() if m.line <= len(old) else ""
    m.after = new[m.line - 1].strip() if m.line <= len(new) else ""
    return True


def run_tests(tree: Path, opts: Options, limit: float) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        proc = run([opts.python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                    *opts.pytest_args], tree, timeout=limit, env=opts.env)
    except subprocess.TimeoutExpired:
        return "killed (timeout)", f"> {limit:.0f}s", time.monotonic() - start
    took = time.monotonic() - start
    if proc.returncode == 0:
        return "survived", "", took
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+\.py\S*)", proc.stdout, re.M)
    return "killed", (failed[0] if failed else f"rc {proc.returncode}"), took


def run_check(tree: Path, opts: Options, limit: float) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        proc = run([opts.python, "-m", "kvcore.cli", "check", "--no-proofs"], tree,
                   timeout=limit, env=opts.env)
    except subprocess.TimeoutExpired:
        return "survived (timeout)", "", time.monotonic() - start
    took = time.monotonic() - start
    named = INVARIANT_FAIL.search(proc.stdout)
    if named and (proc.returncode, bool(named.group(2))) in ((1, False), (5, True)):
        return "killed", f"{named.group(1) or named.group(2)} {named.group(3)}", took
    if proc.returncode == 0:
        return "survived", "", took
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    why = next((ln for ln in lines if ln.startswith("FAILED (")), lines[-1] if lines else "")
    return f"survived (rc {proc.returncode}, not a named failure)", why[:100], took


def baseline(tree: Path, opts: Options) -> dict[str, float]:
    """Both runners on the unmutated copy: they must pass, and give the hang limit."""
    took: dict[str, float] = {}
    if "tests" in opts.runners:
        result, by, took["tests"] = run_tests(tree, opts, opts.timeout)
        if result != "survived":
            sys.exit(f"mutate: the unmutated test suite does not pass in the copy ({by}); "
                     "fix that first")
    if "check" in opts.runners:
        result, by, took["check"] = run_check(tree, opts, opts.timeout)
        if result != "survived":
            sys.exit(f"mutate: kvcore check fails on the unmutated copy ({result} {by})")
    print(f"baseline: {', '.join(f'{k} {v:.0f}s' for k, v in took.items())}", flush=True)
    return took


def evaluate(tree: Path, m: Mutant, opts: Options, base: dict[str, float]) -> None:
    """Apply one mutant, run the runners, restore the copy (and the built extension)."""
    target = tree / m.path
    original = target.read_bytes()
    so_files = {p: p.read_bytes() for p in (tree / "kvcore").glob("*.so")}
    start = time.monotonic()
    try:
        if not apply_mutant(tree, m, opts):
            m.tests = m.check = "not a mutant (no change, or does not build)"
            return
        if "tests" in opts.runners:
            limit = min(opts.timeout, max(120.0, opts.hang_factor * base["tests"]))
            m.tests, m.tests_by, _ = run_tests(tree, opts, limit)
        if "check" in opts.runners:
            limit = min(opts.timeout, max(120.0, opts.hang_factor * base["check"]))
            m.check, m.check_by, _ = run_check(tree, opts, limit)
    finally:
        target.write_bytes(original)
        for p, data in so_files.items():
            p.write_bytes(data)
        m.seconds = round(time.monotonic() - start, 1)


def load_equivalent(path: Path = EQUIVALENT) -> dict[tuple[str, str, str], str]:
    """(path, line before, line after) -> why, from the reviewed list."""
    entries = tomllib.loads(path.read_text()).get("mutant", []) if path.exists() else []
    return {(e["path"], e["before"], e["after"]): e["why"] for e in entries}


def mark_equivalent(mutants: list[Mutant], reviewed: dict[tuple[str, str, str], str]) -> None:
    """Attach the review's argument to each mutant it covers (killed or not: a reviewed
    mutant that some runner kills means the review was wrong, and the report says so)."""
    for m in mutants:
        m.equivalent = reviewed.get((m.path, m.before, m.after), "")


def rate(mutants: list[Mutant], attr: str, *, drop_equivalent: bool = False) -> str:
    """Killed over valid mutants; with ``drop_equivalent``, reviewed equivalents that
    survived leave the denominator (the usual mutation score: nothing can kill them)."""
    valid = [m for m in mutants if not getattr(m, attr).startswith(("not ",))]
    if drop_equivalent:
        valid = [m for m in valid
                 if not (m.equivalent and getattr(m, attr).startswith("survived"))]
    killed = [m for m in valid if getattr(m, attr).startswith("killed")]
    if not valid:
        return "n/a"
    return f"{len(killed)}/{len(valid)} = {100 * len(killed) / len(valid):.0f}%"


def report(mutants: list[Mutant], opts: Options, out: Path | None) -> None:
    print("\nid    target:line                        operator          tests     check")
    for m in mutants:
        print(f"{m.ident:5} {m.path + ':' + str(m.line):34} {m.operator[:17]:17} "
              f"{m.tests.split(' ')[0]:9} {m.check.split(' ')[0]}")
    for name, attr in (("tests", "tests"), ("kvcore check", "check")):
        if attr in opts.runners:
            print(f"kill rate, {name}: {rate(mutants, attr)}; reviewed equivalents left "
                  f"out: {rate(mutants, attr, drop_equivalent=True)}")
    for attr in opts.runners:
        survivors = [m for m in mutants if getattr(m, attr).startswith("survived")]
        if survivors:
            print(f"\nsurvivors of {attr}:")
        for m in survivors:
            print(f"  {m.ident} {m.path}:{m.line} {m.family}/{m.operator}: "
                  f"{m.before!r} -> {m.after!r} ({getattr(m, attr)})"
                  + (f"\n      equivalent: {m.equivalent}" if m.equivalent else ""))
    wrong = [m for m in mutants if m.equivalent
             and any(getattr(m, a).startswith("killed") for a in opts.runners)]
    for m in wrong:  # a kill disproves the review: the entry must go
        print(f"REVIEW WRONG: {m.ident} {m.path}:{m.line} is listed as equivalent in "
              f"{EQUIVALENT.name} but was killed; remove the entry")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rates": {a: rate(mutants, a) for a in opts.runners},
                                   "rates_equivalent_left_out": {
                                       a: rate(mutants, a, drop_equivalent=True)
                                       for a in opts.runners},
                                   "mutants": [asdict(m) for m in mutants]}, indent=2))
        print(f"\nwrote {out}")


def pool_reports(paths: list[Path]) -> int:
    """Pooled rates of earlier samples; the equivalents are re-read, so a review written
    after a run counts (and one a runner disproved is named)."""
    mutants: list[Mutant] = []
    runners: list[str] = []
    for path in paths:
        data = json.loads(path.read_text())
        runners += [r for r in data["rates"] if r not in runners]
        for raw in data["mutants"]:
            m = Mutant(**{k: v for k, v in raw.items() if k in Mutant.__dataclass_fields__})
            m.ident = f"{path.stem}:{m.ident}"
            mutants.append(m)
    mark_equivalent(mutants, load_equivalent())
    # Each runner's rate counts only the samples that ran it.
    report(mutants, Options(Path(), 0.0, 0.0, [], tuple(runners)), None)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sample", type=int, default=60, help="mutants to run (default 60)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="ceiling per run in seconds (default 1800)")
    p.add_argument("--hang-factor", type=float, default=3.0,
                   help="a run this many times slower than the baseline is a hang")
    p.add_argument("--runners", default="tests,check",
                   help="tests, check or tests,check (the default; 'both' means it too)")
    p.add_argument("--only", choices=["python", "c"], help="mutate only one language")
    p.add_argument("--pytest-args", default="tests proofs",
                   help="what (a) runs (default: make test's `tests proofs`, in its order)")
    p.add_argument("--cosmic-ray", type=Path,
                   default=ROOT / "build" / "mutate-venv" / "bin" / "cosmic-ray")
    p.add_argument("--json", type=Path, default=ROOT / "build" / "mutate" / "report.json")
    p.add_argument("--list", action="store_true", help="print the sampled mutants and stop")
    p.add_argument("--ids", default="",
                   help="run only these idents of the sample (m03,m17): re-run survivors")
    p.add_argument("--keep", action="store_true", help="keep the temporary copy")
    p.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                   help="run nothing: pool earlier reports (--json files) and print their "
                        "rates and survivors, judged by today's list of equivalents")
    args = p.parse_args(argv)
    if args.pool:
        return pool_reports(args.pool)
    if not args.cosmic_ray.exists():
        sys.exit(f"mutate: {args.cosmic_ray} not found; `make mutate` installs cosmic-ray "
                 "into build/mutate-venv")
    runners = ("tests", "check") if args.runners.strip() == "both" else \
        tuple(dict.fromkeys(r.strip() for r in args.runners.split(",")))
    if not set(runners) <= {"tests", "check"}:
        # An unknown name used to run nothing and fail only at the report, after the sample.
        p.error(f"--runners {args.runners!r}: name tests, check or both")
    opts = Options(args.cosmic_ray, args.timeout, args.hang_factor, args.pytest_args.split(),
                   runners)
    opts.env = {"CI": "true", "PYTHONDONTWRITEBYTECODE": "1", "KVCORE_EXPLORE_SECONDS": "",
                "PYTHONWARNINGS": "ignore::UserWarning"}
    os.nice(10)
    tree = Path(tempfile.mkdtemp(prefix="kvcore-mutate."))
    try:
        copy_tree(tree)
        pool = [] if args.only == "c" else python_mutants(tree, opts)
        c_pool = [] if args.only == "python" else c_mutants(tree)
        # cosmic-ray's session order follows random job ids: sort first, so a seed is a sample.
        everything = sorted(pool + c_pool, key=lambda m: (m.path, m.line, m.operator,
                                                          m.occurrence, m.after))
        rng = random.Random(args.seed)
        sample = sorted(rng.sample(everything, min(args.sample, len(everything))),
                        key=lambda m: (m.path, m.line, m.operator, m.occurrence))
        for i, m in enumerate(sample):
            m.ident = f"m{i:02d}"
        print(f"mutate: {len(pool)} Python and {len(c_pool)} C mutants in the chosen operators; "
              f"sample {len(sample)} (seed {args.seed}); copy in {tree}", flush=True)
        if args.ids:
            wanted = set(args.ids.split(","))
            sample = [m for m in sample if m.ident in wanted]
        if args.list:
            for m in sample:
                print(f"  {m.ident} {m.path}:{m.line} {m.family}/{m.operator}#{m.occurrence}")
            return 0
        base = baseline(tree, opts)
        reviewed = load_equivalent()
        for m in sample:
            evaluate(tree, m, opts, base)
            mark_equivalent([m], reviewed)
            print(f"{m.ident} {m.path}:{m.line} {m.operator}: tests {m.tests} {m.tests_by} | "
                  f"check {m.check} {m.check_by} ({m.seconds}s)", flush=True)
        report(sample, opts, args.json)
    finally:
        if args.keep:
            print(f"kept {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
