"""The command line: what engine CI and fuzz runners see.

Goal: `kvcore check --json` has the documented shape, a bad `--config` is exit code 2
naming the field, presets and TOML layouts load, `simulate` reports, and every error
class gets its documented exit code: 2 (usage, config, an unwritable output, an
unreachable database; one line, nothing run), 1 (correctness), 3 (liveness), 4 (a crash,
with the path of its traceback), 5 (a proof inconclusive, nothing failed).
Method: call ``kvcore.cli.main`` in-process with small budgets (the full battery runs in
tests/zoo and tests/integrity); the exit-2 table runs ``python -m kvcore.cli`` in a
subprocess, as CI does; the codes a real bug would give (1, 3, 4, 5) replace the battery
or the simulator with a stub that fails in the way under test.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from kvcore import _check
from kvcore._configfile import load_config
from kvcore._proofs import ProofReport
from kvcore.cli import (
    EXIT_CRASH,
    EXIT_FAIL,
    EXIT_INCONCLUSIVE,
    EXIT_LIVENESS,
    EXIT_OK,
    EXIT_USAGE,
    _saved_note,
    main,
)
from kvcore.presets import PRESETS, preset
from kvcore.sim import IntegrityError
from kvcore.spec.errors import ConfigError, InvariantViolation
from kvcore.spec.invariants import INVARIANT_IDS, Violation

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--no-proofs", "--seeds", "2", "--examples", "5", "--steps", "10"]


def test_check_json_shape(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    assert main(["check", "--preset", "gpt-oss", *SMALL, "--json", str(out)]) == EXIT_OK
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert set(report["invariants"]) == set(INVARIANT_IDS)
    assert all(set(v) == {"checked", "violations"} for v in report["invariants"].values())
    assert report["invariants"]["E2"]["checked"] > 0


def test_check_with_mutants_reports_each(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    main(["check", "--preset", "llama3-eagle3", *SMALL, "--mutants", "--json", str(out)])
    report = json.loads(out.read_text())
    assert len(report["mutants"]) >= 10
    for entry in report["mutants"].values():
        assert set(entry) >= {"killed", "by"}


def test_example_layout_loads() -> None:
    cfg = load_config(ROOT / "docs" / "example-layout.toml")
    assert cfg.num_workers == 2 and len(cfg.groups) == 2


@pytest.mark.parametrize(("text", "field"), [
    ("hash_block_tokens = 16\nnum_gpu_blocks = 8\nnum_cpu_blocks = 8\n", "groups"),
    ('preset = "gemma3"\nwindow = 3\n', "window"),
    ('preset = "gemma3"\n[[groups]]\nkind = "full"\ntokens_per_block = 16\n'
     'window_tokens = 8\n', "groups[0].window_tokens"),
    ('preset = "gemma3"\n[[groups]]\nkind = "diagonal"\ntokens_per_block = 16\n',
     "groups[0].kind"),
    ('preset = "nope"\n', "preset"),
    ("not toml at all [", "config"),
    # Booleans are TOML booleans: a quoted "no" or "false", or 1, is refused, not truthy.
    ('preset = "gemma3"\nspeculative = true\n[[groups]]\nkind = "full"\n'
     'tokens_per_block = 16\nis_draft = "no"\n', "groups[0].is_draft"),
    ('preset = "llama3-eagle3"\nspeculative = "false"\n', "speculative"),
    ('preset = "gemma3"\nprompt_only = 1\n', "prompt_only"),
    ('preset = "gemma3"\nstore_alignment = "true"\n', "store_alignment"),
    # Ints are TOML integers within their limits; enums are their documented names.
    ('preset = "gemma3"\nnum_gpu_blocks = 1000000000000000\n', "num_gpu_blocks"),
    ('preset = "gemma3"\nnum_cpu_blocks = 4096.0\n', "num_cpu_blocks"),
    ('preset = "gemma3"\nnum_workers = "2"\n', "num_workers"),
    ('preset = "gemma3"\n[[groups]]\nkind = "full"\ntokens_per_block = 16\n[[groups]]\n'
     'kind = "sliding"\ntokens_per_block = 16\nwindow_tokens = 1000000000000\n',
     "groups[1].window_tokens"),
    ('preset = "gemma3"\n[[groups]]\nkind = 1\ntokens_per_block = 16\n', "groups[0].kind"),
    ('preset = "gemma3"\n[[groups]]\nkind = "full"\n', "groups[0].tokens_per_block"),
    ('preset = "gemma3"\nstore_level = 2\n', "store_level"),
    ('preset = "gemma3"\nstore_level = "page"\n', "store_level"),
    ("preset = 3\n", "preset"),
    ('preset = "gemma3"\nname = 5\n', "name"),
])
def test_bad_config_names_the_field(tmp_path: Path, text: str, field: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "layout.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == field
    assert main(["check", "--config", str(path), *SMALL]) == EXIT_USAGE
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/tmp/a\0b", 5, None, b"layout.toml"])
def test_a_path_no_file_can_have_is_a_config_error(path: object) -> None:
    """A NUL byte (os.stat's bare ValueError), an int (read as a file descriptor), None
    or bytes (bare TypeErrors): each a ConfigError naming ``config``."""
    with pytest.raises(ConfigError) as info:
        load_config(path)  # type: ignore[arg-type]
    assert info.value.field == "config"


def test_any_path_object_names_a_layout() -> None:
    """Not only ``str`` and ``Path``: any ``os.PathLike`` that gives a str (pytest's
    ``tmpdir``, for one). Mutant: the type test narrowed to ``str | Path``."""
    class Where:
        def __fspath__(self) -> str:
            return str(ROOT / "docs" / "example-layout.toml")

    assert load_config(Where()) == load_config(ROOT / "docs" / "example-layout.toml")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid(name: str) -> None:
    assert preset(name).groups


def test_simulate_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--preset", "qwen3-next-mtp", "--requests", "4",
                 "--context", "300", "--prefill-budget", "128"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "offload_hit_rate" in text and "invariants checked" in text


# -- exit codes: one row per error class ------------------------------------------------

HUGE_WINDOW = ('preset = "gemma3"\n[[groups]]\nkind = "full"\ntokens_per_block = 16\n'
               '[[groups]]\nkind = "sliding"\ntokens_per_block = 16\n'
               'window_tokens = 1000000000000\n')


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# (case id, arguments with {tmp} and {port} placeholders, exit code, text stderr must hold)
USAGE_ROWS: list[tuple[str, list[str], int, str]] = [
    ("no command", [], EXIT_USAGE, "required"),
    ("unknown option", ["check", "--bogus"], EXIT_USAGE, "--bogus"),
    ("unknown preset", ["check", "--preset", "nope"], EXIT_USAGE, "--preset"),
    ("--examples 0", ["check", "--examples", "0"], EXIT_USAGE, "--examples"),
    ("--examples over its bound", ["check", "--examples", "100001"], EXIT_USAGE, "100000"),
    ("--steps -3", ["check", "--steps", "-3"], EXIT_USAGE, "--steps"),
    ("--seeds -1", ["check", "--seeds", "-1"], EXIT_USAGE, "--seeds"),
    ("--seeds not a number", ["check", "--seeds", "many"], EXIT_USAGE, "'many'"),
    ("fuzz --examples 0", ["fuzz", "--examples", "0"], EXIT_USAGE, "--examples"),
    ("fuzz --steps -3", ["fuzz", "--steps", "-3"], EXIT_USAGE, "--steps"),
    ("--duration not a duration", ["fuzz", "--duration", "soon"], EXIT_USAGE, "'soon'"),
    ("--duration 0", ["fuzz", "--duration", "0s"], EXIT_USAGE, "--duration"),
    ("--duration over a week", ["fuzz", "--duration", "200h"], EXIT_USAGE, "168h"),
    ("--requests -1", ["simulate", "--requests", "-1"], EXIT_USAGE, "--requests"),
    ("--context -5", ["simulate", "--context", "-5"], EXIT_USAGE, "--context"),
    ("--seed -1", ["simulate", "--seed", "-1"], EXIT_USAGE, "--seed"),
    ("--prefill-budget 0", ["simulate", "--prefill-budget", "0"], EXIT_USAGE, "--prefill"),
    ("--max-new-tokens 0", ["simulate", "--max-new-tokens", "0"], EXIT_USAGE, "--max-new"),
    # The bad twins would reach the reference model, which fails the run on correct code.
    ("--lockstep with --hostile", ["simulate", "--lockstep", "--hostile"], EXIT_USAGE,
     "not allowed with"),
    ("bad config", ["check", "--config", "{tmp}/bad.toml"], EXIT_USAGE, "groups[0].is_draft"),
    ("missing config", ["check", "--config", "{tmp}/none.toml"], EXIT_USAGE, "cannot read"),
    ("simulate on a 10**12-token window", ["simulate", "--config", "{tmp}/huge.toml"],
     EXIT_USAGE, "groups[1].window_tokens"),
    ("--json is a directory", ["check", "--no-proofs", "--json", "{tmp}"], EXIT_USAGE,
     "--json"),
    ("--json in a missing directory", ["check", "--no-proofs", "--json", "{tmp}/no/r.json"],
     EXIT_USAGE, "--json"),
    ("simulate --json unwritable", ["simulate", "--json", "{tmp}/no/r.json"], EXIT_USAGE,
     "--json"),
    ("Redis unreachable", ["fuzz", "--duration", "5s", "--db", "redis://127.0.0.1:{port}/0"],
     EXIT_USAGE, "Redis is unreachable"),
    ("--db is a file", ["fuzz", "--duration", "5s", "--db", "{tmp}/bad.toml"], EXIT_USAGE,
     "--db"),
    # A second hostile-input review: each hung, crashed (exit 4) or silently fell back.
    ("--config empty (fell back to the default preset)", ["simulate", "--config", ""],
     EXIT_USAGE, "the path is empty"),
    ("--config a FIFO (hung)", ["check", "--config", "{tmp}/fifo.toml"], EXIT_USAGE,
     "not a regular file"),
    ("--json a FIFO (hung)", ["simulate", "--json", "{tmp}/fifo.toml"], EXIT_USAGE,
     "not a regular file"),
    ("--json /dev/full (failed after the run)", ["simulate", "--json", "/dev/full"],
     EXIT_USAGE, "not a regular file"),
    ("--json name too long (crashed)", ["simulate", "--json", "{tmp}/" + "a" * 300],
     EXIT_USAGE, "cannot write"),
    ("config int of 5000 digits (crashed)", ["simulate", "--config", "{tmp}/bigint.toml"],
     EXIT_USAGE, "not a layout"),
    ("config arrays 5000 deep (crashed)", ["simulate", "--config", "{tmp}/deep.toml"],
     EXIT_USAGE, "not a layout"),
    # A review of the command line: each replaced the user's file, ignored an option, or
    # printed an error over several lines or 200 KB.
    ("--json is the --config file (replaced the layout)",
     ["check", "--no-proofs", "--config", "{tmp}/good.toml", "--json", "{tmp}/./good.toml"],
     EXIT_USAGE, "is the layout file --config reads"),
    ("simulate --json is the --config file", ["simulate", "--config", "{tmp}/good.toml",
                                              "--json", "{tmp}/good.toml"], EXIT_USAGE,
     "is the layout file --config reads"),
    ("--check-options with --requests (ignored it)",
     ["simulate", "--check-options", "--requests", "1"], EXIT_USAGE,
     "--requests would be ignored"),
    ("--check-options with --faults (ignored it)", ["simulate", "--check-options", "--faults"],
     EXIT_USAGE, "--faults would be ignored"),
    ("a key holding a newline (read as two fields)", ["check", "--config", "{tmp}/nl.toml"],
     EXIT_USAGE, "'num_gpu_blocks\\nnum_cpu_blocks': unknown field"),
    ("a 200,000-character key (a 200 KB error)", ["check", "--config", "{tmp}/longkey.toml"],
     EXIT_USAGE, "kkk...kkk"),
    ("--seeds of 5000 digits (echoed whole)", ["check", "--seeds", "9" * 5000], EXIT_USAGE,
     "(5000 chars)"),
    ("--db empty (fell back)", ["fuzz", "--duration", "5s", "--db", ""], EXIT_USAGE,
     "--db is empty"),
    ("--db not a Redis URL (became a folder)", ["fuzz", "--duration", "5s", "--db",
                                                 "htp://host/0"], EXIT_USAGE,
     "not a Redis URL"),
    ("an abbreviated option (check --seed ran as --seeds)", ["check", "--seed", "7"],
     EXIT_USAGE, "unrecognized arguments: --seed 7"),
    ("a 300,000-character preset name (a 300 KB error)", ["check", "--config",
                                                          "{tmp}/longpreset.toml"],
     EXIT_USAGE, "...> is unknown"),
]


@pytest.mark.parametrize(("args", "code", "text"),
                         [pytest.param(a, c, t, id=n) for n, a, c, t in USAGE_ROWS])
def test_usage_and_config_errors_exit_2_with_one_line_and_nothing_run(
        tmp_path: Path, args: list[str], code: int, text: str) -> None:
    (tmp_path / "bad.toml").write_text('preset = "gemma3"\nspeculative = true\n[[groups]]\n'
                                       'kind = "full"\ntokens_per_block = 16\nis_draft = "no"\n')
    (tmp_path / "huge.toml").write_text(HUGE_WINDOW)
    (tmp_path / "bigint.toml").write_text("num_gpu_blocks = " + "9" * 5000 + "\n")
    (tmp_path / "deep.toml").write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    (tmp_path / "good.toml").write_text('preset = "gemma3"\n')
    (tmp_path / "nl.toml").write_text('"num_gpu_blocks\\nnum_cpu_blocks" = 1\n')
    (tmp_path / "longkey.toml").write_text(f'"{"k" * 200_000}" = 1\n')
    (tmp_path / "longpreset.toml").write_text(f'preset = "{"x" * 300_000}"\n')
    os.mkfifo(tmp_path / "fifo.toml")
    argv = [a.format(tmp=tmp_path, port=_closed_port()) for a in args]
    # A hang (the 10**12 window once never returned) fails here instead of stalling.
    done = subprocess.run([sys.executable, "-m", "kvcore.cli", *argv], capture_output=True,
                          text=True, timeout=300, check=False, cwd=tmp_path)
    assert done.returncode == code, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert text in lines[0]
    assert "Traceback" not in done.stderr
    # Nothing ran: no header, no progress, no "saved to the example database".
    assert done.stdout == ""
    assert not (tmp_path / "no").exists()
    assert len(done.stderr) < 1000  # one line, not an echo of whatever was given
    assert (tmp_path / "good.toml").read_text() == 'preset = "gemma3"\n'


def test_version_prints_the_installed_version() -> None:
    done = subprocess.run([sys.executable, "-m", "kvcore.cli", "--version"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == EXIT_OK
    assert done.stdout.strip() == f"kvcore {metadata.version('kvcore')}"


def test_writable_check_leaves_no_file_behind(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    assert main(["check", "--no-proofs", "--json", str(target), "--config",
                 str(tmp_path / "absent.toml")]) == EXIT_USAGE
    assert not target.exists()


# In-process rows: the failure is injected by replacing the battery (or the simulator)
# with a stub, so each code is pinned without needing a real kvcore bug.


def _failure(kind: str, ids: list[str]) -> _check.Failure:
    return _check.Failure(kind, ids, f"{kind} failure for the test",
                          "kvcore simulate --preset gpt-oss --seed 3 --check-options")


def _stub_battery(monkeypatch: pytest.MonkeyPatch, failure: _check.Failure | None,
                  proofs: str = "confirmed") -> None:
    """The battery stubbed; the proofs stubbed with a real ``ProofReport`` of that status
    (a stub of another shape once hid that the CLI misread the real one)."""
    def battery(*_args: Any, **_kwargs: Any) -> _check.BatteryResult:
        return _check.BatteryResult(checked={"E1": 1}, failure=failure)
    monkeypatch.setattr(_check, "run_battery", battery)
    monkeypatch.setattr(_check, "run_proofs", lambda: ProofReport(proofs, reason="stub"))


CHECK_ROWS: list[tuple[str, str | None, str, int]] = [
    ("clean", None, "confirmed", EXIT_OK),
    ("invariant broken", "invariant", "confirmed", EXIT_FAIL),
    ("wrong bytes", "integrity", "confirmed", EXIT_FAIL),
    ("did not settle", "liveness", "confirmed", EXIT_LIVENESS),
    ("crash in the battery", "crash", "confirmed", EXIT_CRASH),
    ("proof failed", None, "failed", EXIT_FAIL),
    ("proof inconclusive", None, "inconclusive", EXIT_INCONCLUSIVE),
    ("inconclusive under a failure", "invariant", "inconclusive", EXIT_FAIL),
    ("inconclusive under a liveness failure", "liveness", "inconclusive", EXIT_LIVENESS),
    ("proofs skipped (installed wheel)", None, "skipped", EXIT_OK),
]


@pytest.mark.parametrize(("kind", "proofs", "code"),
                         [pytest.param(k, p, c, id=n) for n, k, p, c in CHECK_ROWS])
def test_check_exit_code_per_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str], kind: str | None,
                                     proofs: str, code: int) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _stub_battery(monkeypatch, _failure(kind, ["E1"]) if kind else None, proofs)
    out = tmp_path / "report.json"
    assert main(["check", "--preset", "gpt-oss", "--json", str(out)]) == code
    report = json.loads(out.read_text())
    assert report["exit_code"] == code and report["ok"] is (code == EXIT_OK)
    captured = capsys.readouterr()
    crash_files = list(tmp_path.glob("kvcore-crash-*.txt"))
    if code == EXIT_CRASH:
        # Where the details went is printed, and the file holds the reproducer.
        (path,) = crash_files
        assert str(path) in captured.err
        assert "--seed 3 --check-options" in path.read_text()
    else:
        assert crash_files == []
    shown = {"confirmed": "passed", "failed": "FAILED", "inconclusive": "inconclusive",
             "skipped": "skipped"}[proofs]
    assert report["proofs"]["status"] == shown and f"proofs: {shown} (" in captured.out
    if code == EXIT_INCONCLUSIVE:
        assert "INCONCLUSIVE" in captured.out and "FAILED" not in captured.out


def test_a_surviving_mutant_is_a_correctness_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_battery(monkeypatch, None)
    survivor = _check.MutantOutcome("m", "upstream#1", "E1", "survived", "", "gpt-oss", 0.0)
    monkeypatch.setattr(_check, "run_mutants", lambda *_a, **_k: [survivor])
    assert main(["check", "--preset", "gpt-oss", "--mutants"]) == EXIT_FAIL


def test_an_uncaught_crash_writes_its_traceback_and_exits_4(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def explode(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("kvcore broke inside the battery")
    monkeypatch.setattr(_check, "run_battery", explode)
    assert main(["check", "--preset", "gpt-oss", "--no-proofs"]) == EXIT_CRASH
    err = capsys.readouterr().err
    (path,) = tmp_path.glob("kvcore-crash-*.txt")
    assert f"traceback written to {path}" in err and "Traceback" not in err
    text = path.read_text()
    assert "Traceback" in text and "RuntimeError: kvcore broke inside the battery" in text
    assert "in explode" in text


@pytest.mark.parametrize(("exc", "code"), [
    (InvariantViolation([Violation("E1", "e1 broken", {})]), EXIT_FAIL),
    (IntegrityError("wrong bytes loaded"), EXIT_FAIL),
    (AssertionError("the run did not settle in 100 steps"), EXIT_LIVENESS),
    (RuntimeError("boom"), EXIT_CRASH),
], ids=["invariant", "integrity", "liveness", "crash"])
def test_simulate_failures_keep_their_exit_codes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: Exception, code: int) -> None:
    import kvcore.sim
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise exc
    monkeypatch.setattr(kvcore.sim, "simulate", fail)
    assert main(["simulate", "--preset", "gpt-oss"]) == code
    assert len(list(tmp_path.glob("kvcore-crash-*.txt"))) == (code == EXIT_CRASH)


def test_fuzz_failure_exit_code_and_database_note(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def machine(_cfg: Any, _ex: int, _st: int, result: _check.BatteryResult,
                **_kw: Any) -> None:
        result.failure = _failure("liveness", ["liveness"])
    monkeypatch.setattr(_check, "run_machine", machine)
    db = tmp_path / "db"
    assert main(["fuzz", "--preset", "gpt-oss", "--duration", "60s", "--db", str(db)]) \
        == EXIT_LIVENESS
    assert "saved to the example database" in capsys.readouterr().out
    assert db.is_dir()


def test_preset_overrides_are_validated() -> None:
    assert preset("gemma3", num_workers=4).num_workers == 4
    with pytest.raises(ConfigError) as info:
        preset("gemma3", num_gpu_blocks=10**15)
    assert info.value.field == "num_gpu_blocks"
    with pytest.raises(ConfigError) as info:
        preset("gemma3", gpu_blocks=8)
    assert info.value.field == "gpu_blocks"
    with pytest.raises(ConfigError) as info:
        preset(["gemma3"])  # type: ignore[arg-type]
    assert info.value.field == "preset"


def test_no_saved_claim_when_the_database_went_away() -> None:
    """A Redis server that stops answering mid-run has not kept the counterexample."""
    class Gone:
        def ping(self) -> None:
            raise ConnectionError("connection refused")

    class Up:
        def ping(self) -> bool:
            return True

    gone, up = type("Db", (), {"redis": Gone()})(), type("Db", (), {"redis": Up()})()
    assert "not saved" in _saved_note(gone) and "saved to" not in _saved_note(gone)
    assert "saved to the example database" in _saved_note(up)


def test_a_layout_file_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    """Windows editors write one; tomllib read it as an invalid statement at 1:1."""
    path = tmp_path / "bom.toml"
    path.write_text('preset = "gemma3"\nnum_gpu_blocks = 4096\n', encoding="utf-8-sig")
    assert load_config(path).num_gpu_blocks == 4096


def test_fuzz_that_checks_nothing_is_inconclusive(capsys: pytest.CaptureFixture[str]) -> None:
    """Rounds too short to reach any check passed as "ok: no counterexample found"."""
    from kvcore.cli import EXIT_INCONCLUSIVE
    assert main(["fuzz", "--duration", "2s", "--steps", "1", "--examples", "1", "--db",
                 str(Path(tempfile.mkdtemp()) / "db")]) == EXIT_INCONCLUSIVE
    assert "evaluated no invariant" in capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["check"], ["fuzz"], ["simulate"]])
def test_help_lists_the_exit_codes(command: list[str],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--help"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "exit codes:" in out and "5  inconclusive" in out and "3  liveness" in out


# -- a review of the command line: exit codes that hid a failure, output that crashed ------

def test_a_failed_proof_is_not_hidden_by_a_coverage_gap(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 5 says "nothing failed"; the battery's coverage gap overwrote the proofs' 1."""
    _stub_battery(monkeypatch, _failure("coverage", ["E1"]), "failed")
    assert main(["check", "--preset", "gpt-oss"]) == EXIT_FAIL
    assert capsys.readouterr().out.rstrip().endswith("FAILED")


def test_a_surviving_mutant_is_not_hidden_by_a_coverage_gap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_battery(monkeypatch, _failure("coverage", ["E1"]))
    survivor = _check.MutantOutcome("m", "upstream#1", "E1", "survived", "", "gpt-oss", 0.0)
    monkeypatch.setattr(_check, "run_mutants", lambda *_a, **_k: [survivor])
    assert main(["check", "--preset", "gpt-oss", "--mutants"]) == EXIT_FAIL


class _Clock:
    """time.monotonic for the CLI: each example the stubbed machine runs takes a second."""

    def __init__(self) -> None:
        self.now = 0.0
        self.examples = 0

    def monotonic(self) -> float:
        return self.now

    def machine(self, _cfg: Any, examples: int, _steps: int, result: _check.BatteryResult,
                **_kw: Any) -> None:
        self.examples += examples
        self.now += examples
        result.checked["E1"] = result.checked.get("E1", 0) + examples


def test_fuzz_ends_within_an_example_of_its_duration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A first round of 1,000 one-second examples ran 1,000 s past --duration 10s."""
    import kvcore.cli
    clock = _Clock()
    monkeypatch.setattr(kvcore.cli.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(_check, "run_machine", clock.machine)
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--preset", "gpt-oss", "--duration", "10s",
                 "--examples", "1000"]) == EXIT_OK
    assert clock.examples == 10 and clock.now == 10
    out = capsys.readouterr().out
    # The header names the database it writes to, not "None".
    assert "db .kvcore-fuzz-db" in out and (tmp_path / ".kvcore-fuzz-db").is_dir()


def test_fuzz_whose_duration_ends_first_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """It said "raise --steps or --examples" when the duration was the cause."""
    import kvcore.cli
    readings = iter([0.0, 5.0])
    monkeypatch.setattr(kvcore.cli.time, "monotonic", lambda: next(readings))
    monkeypatch.setattr(_check, "run_machine", _Clock().machine)
    assert main(["fuzz", "--preset", "gpt-oss", "--duration", "1s", "--db",
                 str(tmp_path / "db")]) == EXIT_INCONCLUSIVE
    assert "--duration 1s ended before the first example" in capsys.readouterr().out


class _BrokenPipe(io.StringIO):
    """stdout after ``| head -1`` has read its line: every write fails."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_goes_away_does_not_turn_the_run_into_a_crash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvcore check | head -1`` exited 4, "crash inside kvcore (BrokenPipeError)"."""
    _stub_battery(monkeypatch, _failure("invariant", ["E1"]))
    monkeypatch.setattr(sys, "stdout", _BrokenPipe())
    assert main(["check", "--preset", "gpt-oss", "--no-proofs"]) == EXIT_FAIL


def test_a_name_the_terminal_cannot_encode_is_escaped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout file named with a character stdout's encoding lacks crashed the header."""
    _stub_battery(monkeypatch, None)
    layout = tmp_path / "layout\u00fc.toml"
    layout.write_text('preset = "gemma3"\n')
    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    assert main(["check", "--config", str(layout), "--no-proofs"]) == EXIT_OK
    ascii_out.flush()
    assert b"layout\\xfc" in raw.getvalue()


@pytest.mark.parametrize(("failure", "code"), [(None, EXIT_USAGE),
                                                ("invariant", EXIT_FAIL)])
def test_a_report_that_cannot_be_written_is_one_line_and_keeps_the_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        failure: str | None, code: int) -> None:
    """A disk full at the end was "crash inside kvcore" (4), over the battery's own code."""
    _stub_battery(monkeypatch, _failure(failure, ["E1"]) if failure else None)

    def full(*_a: Any, **_k: Any) -> int:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full)
    assert main(["check", "--preset", "gpt-oss", "--no-proofs", "--json",
                 str(tmp_path / "r.json")]) == code
    assert "cannot write --json" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C in a fuzz run printed a bare KeyboardInterrupt traceback."""
    def interrupted(*_a: Any, **_k: Any) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(_check, "run_battery", interrupted)
    assert main(["check", "--preset", "gpt-oss", "--no-proofs"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


# -- fuzz for hours (a review of long unattended runs) -------------------------------------

def test_fuzz_rounds_reuse_one_machine_class() -> None:
    """Hypothesis keeps every state machine class it runs (its per-class set-up state):
    a new class per round grew a fuzz run by about 50 KB a round, gigabytes over hours of
    short rounds. The rounds of one run now share one class."""
    from hypothesis.stateful import RuleBasedStateMachine
    config = preset("gpt-oss")
    result = _check.BatteryResult()
    built = _check.fuzz_machine(config, result)
    kept = RuleBasedStateMachine._setup_state_per_class
    before = len(kept)
    for _ in range(4):
        _check.run_machine(config, 1, 3, result, built=built)
    assert len(kept) - before <= 1
    assert result.failure is None


def test_each_layout_and_device_has_its_own_database_key() -> None:
    """The example database's key came from the machine's source alone: a fleet sharing
    one database replayed a layout's counterexample on every other layout, and deleted
    it where it did not fail."""
    from hypothesis.internal.reflection import function_digest

    from kvcore.sim._machine import make_machine
    keys = {function_digest(make_machine(preset(name), device=device))
            for name in ("gemma3", "gpt-oss") for device in ("cpu", "cuda")}
    assert len(keys) == 4
    assert function_digest(make_machine(preset("gemma3"))) == \
        function_digest(make_machine(preset("gemma3")))  # stable across runs


def test_a_database_folder_that_refuses_writes_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An existing folder that refuses writes passed mkdir, Hypothesis ignored each failed
    save, and the run said the counterexample was saved."""
    def refuse(*_a: Any, **_kw: Any) -> Any:
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    assert main(["fuzz", "--duration", "5s", "--db", str(tmp_path)]) == EXIT_USAGE
    assert "cannot write there (Read-only file system)" in capsys.readouterr().err


def test_a_failing_database_does_not_end_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    """A Redis restart mid-run was a "crash inside kvcore" (exit 4). The database's own
    failures are counted and said once; the failure report says what may be lost."""
    from kvcore.cli import _guarded

    class Down:
        def save(self, key: bytes, value: bytes) -> None:
            raise ConnectionError("Error 111 connecting: Connection refused")

        def fetch(self, key: bytes) -> list[bytes]:
            raise ConnectionError("Error 111 connecting: Connection refused")

    db = _guarded(Down())
    db.save(b"k", b"v")
    assert db.fetch(b"k") == []
    assert db.failures == 2
    assert capsys.readouterr().err.count("the example database failed") == 1
    assert "may not be saved" in _saved_note(db)


def test_sigterm_ends_fuzz_with_its_own_code_and_the_totals(tmp_path: Path) -> None:
    """SIGTERM (what CI sends at its timeout) killed the run silently: exit 143 from the
    shell, no line saying why, no totals."""
    import signal
    import time as clock
    proc = subprocess.Popen([sys.executable, "-m", "kvcore.cli", "fuzz", "--preset",
                             "gpt-oss", "--duration", "120s", "--db", str(tmp_path / "db")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the header: the run has started
    assert first.startswith("kvcore fuzz:")
    clock.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out, err)
    assert "kvcore: terminated (SIGTERM)" in err
    assert "stopped after" in out and "invariant checks" in out


def test_a_directory_database_that_loses_a_save_is_counted(tmp_path: Path) -> None:
    """Hypothesis's directory database swallows its own OSErrors (a full disk): the run
    said "saved" of a value that was never written. The guard reads each save back."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    from kvcore.cli import _guarded
    inner = DirectoryBasedExampleDatabase(str(tmp_path))
    db = _guarded(inner)
    db.save(b"k", b"kept")
    assert db.failures == 0 and set(inner.fetch(b"k")) == {b"kept"}
    inner.save = lambda key, value: None  # type: ignore[method-assign]
    db.save(b"k", b"lost")
    assert db.failures == 1 and "may not be saved" in _saved_note(db)


def test_an_ignored_sigterm_stays_ignored(tmp_path: Path) -> None:
    """A parent's ``trap '' TERM`` was overridden: the run ended at the first SIGTERM."""
    import signal
    import time as clock

    def ignore_term() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    proc = subprocess.Popen([sys.executable, "-m", "kvcore.cli", "fuzz", "--preset",
                             "gpt-oss", "--duration", "4s", "--db", str(tmp_path / "db")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ignore_term)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("kvcore fuzz:")
    clock.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 5), (out, err)
    assert "terminated" not in err


def test_a_quick_first_example_does_not_size_a_long_round(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hypothesis's first example is its minimal one: timed on it alone, the next round
    was sized for hundreds of examples (--duration 5s ran about 8 s; here 10 s would have
    run 1,000 one-second examples). Each round is at most twice the last."""
    import kvcore.cli

    class Clock(_Clock):
        def machine(self, _cfg: Any, examples: int, _steps: int,
                    result: _check.BatteryResult, **_kw: Any) -> None:
            self.now += 0.01 if not self.examples else examples  # the first is quick
            self.examples += examples
            result.checked["E1"] = result.checked.get("E1", 0) + examples
    clock = Clock()
    monkeypatch.setattr(kvcore.cli.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(_check, "run_machine", clock.machine)
    assert main(["fuzz", "--preset", "gpt-oss", "--duration", "10s", "--examples", "1000",
                 "--db", str(tmp_path / "db")]) == EXIT_OK
    assert clock.now <= 11, clock.now
