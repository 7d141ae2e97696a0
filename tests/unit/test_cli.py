"""The command line: what engine CI and fuzz runners see.

Goal: `kvcore check --json` has the documented shape, a bad `--config` is exit code 2
naming the field, presets and TOML layouts load, and `simulate` reports. Method: call
``kvcore.cli.main`` in-process with small budgets (the full battery runs in tests/zoo and
tests/integrity).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcore._configfile import load_config
from kvcore.cli import EXIT_OK, EXIT_USAGE, main
from kvcore.presets import PRESETS, preset
from kvcore.spec.errors import ConfigError
from kvcore.spec.invariants import INVARIANT_IDS

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


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid(name: str) -> None:
    assert preset(name).groups


def test_simulate_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--preset", "qwen3-next-mtp", "--requests", "4",
                 "--context", "300", "--prefill-budget", "128"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "offload_hit_rate" in text and "invariants checked" in text
