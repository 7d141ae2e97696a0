"""benchmarks/bench_scheduler.py --quick does the work it times: stores, keys and loads.

Goal: the benchmark's figures are only worth reading if its steps store and its admitted
requests load (issue 11: the old bench timed steps that almost never stored). Method: run
it as a developer does, on a tiny workload, and read the work counters of every row; never
a time. ``--no-vllm``: the SUMMARY must then not carry the vLLM ratios. (The vLLM side is
not run here: importing vLLM alone takes longer than this test may.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_scheduler.py"
TINY = ["--quick", "--requests", "16", "--steps", "8", "--lookups", "1",
        "--contexts", "1024"]


def run(*extra: str) -> str:
    proc = subprocess.run([sys.executable, str(BENCH), *TINY, *extra], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def rows(text: str, header: str) -> list[dict[str, str]]:
    """The table that starts with ``header``, as dicts of its columns."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    names = [c.strip() for c in lines[start].strip("|").split("|")]
    out = []
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        out.append(dict(zip(names, (c.strip() for c in line.strip("|").split("|")),
                            strict=True)))
    return out


def test_every_configuration_stores_and_loads_and_the_summary_has_no_vllm_keys() -> None:
    text = run("--no-vllm")
    table = rows(text, "| layout ")
    assert {r["layout"] for r in table} == {"deepseek-v4-mtp", "llama3-eagle3"}
    for r in table:
        assert float(r["stores"]) > 0 and float(r["keys"]) >= float(r["stores"]), r
        assert float(r["load"]) > 0, r
    summary = text.splitlines()[-1]
    assert summary.startswith("SUMMARY decode_us_per_req_128k=") and "vllm" not in summary


def test_a_layout_not_run_reads_nan_in_the_summary() -> None:
    # Before, a Llama-only run printed Llama's cold lookup as lookup_cold_ms_128k_dsv4.
    text = run("--no-vllm", "--layouts", "llama")
    summary = dict(kv.split("=") for kv in text.splitlines()[-1].split()[1:])
    assert summary["lookup_cold_ms_128k_dsv4"] == "nan"
    assert summary["lookup_cold_ms_128k_llama"] != "nan"
    assert "context 1024" in text.splitlines()[-2]
