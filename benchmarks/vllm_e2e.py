"""End to end on a GPU: a small model with an MTP/EAGLE drafter served by vLLM with kvcore.

Two runs of the same greedy workload: with ``KvcoreConnector`` and a GPU KV cache so
small that shared prefixes are evicted from the GPU between their uses (so they come back
from kvcore's CPU tier), and without offloading. Passes when the outputs are identical
token for token and the connector reports hit tokens loaded from the CPU tier.

    python benchmarks/vllm_e2e.py --model /path/to/model [--draft /path/to/drafter]
        [--method mtp|eagle|eagle3] [--json out.json]

No network: ``--model`` (and ``--draft`` for EAGLE) must be local directories. The engine
core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the connector's counters can
be read at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def prompts(n: int) -> list[str]:
    """Eight long shared prefixes, each used twice with other prefixes in between."""
    base = [f"Document {i}: " + " ".join(f"fact-{i}-{j}" for j in range(220)) for i in range(8)]
    return [base[k % 8] + f"\nQuestion {k}: summarise the facts." for k in range(n)]


def run(args: argparse.Namespace, offload: bool) -> tuple[list[list[int]], dict[str, Any]]:
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {"model": args.model, "enforce_eager": True, "seed": 0,
                          "enable_prefix_caching": True, "max_model_len": 4096,
                          "num_gpu_blocks_override": args.gpu_blocks,
                          "gpu_memory_utilization": 0.5}
    spec: dict[str, Any] = {"method": args.method, "num_speculative_tokens": 2}
    if args.draft:
        spec["model"] = args.draft
    kw["speculative_config"] = spec
    if offload:
        kw["kv_transfer_config"] = {
            "kv_connector": "KvcoreConnector",
            "kv_connector_module_path": "kvcore.integrations.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes": args.cpu_gib << 30,
                                          "eviction_policy": "lru", "check": True}}
    llm = LLM(**kw)
    outs = llm.generate(prompts(args.requests), SamplingParams(temperature=0.0, max_tokens=32))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    stats: dict[str, Any] = {}
    if offload:
        stats = connector_stats(llm)
    del llm
    return tokens, stats


def connector_stats(llm: Any) -> dict[str, Any]:
    """kvcore's scheduler counters, read through the in-process engine core."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler.connector.sched
        return {k: v for k, v in vars(sched.scheduler.stats()).items() if k != "extra"}
    except AttributeError as e:  # the engine's internals moved: report, do not guess
        return {"error": f"could not reach the connector: {e}"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--method", default="mtp")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--gpu-blocks", type=int, default=256)
    ap.add_argument("--cpu-gib", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with_kv, stats = run(args, offload=True)
    without, _ = run(args, offload=False)
    same = with_kv == without
    hits = int(stats.get("hit_tokens", 0))
    report = {"identical_outputs": same, "requests": len(with_kv), "connector": stats,
              "passed": same and hits > 0 and not stats.get("failed_loads")}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
