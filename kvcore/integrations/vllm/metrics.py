"""kvcore's scheduler counters as Prometheus counters (``vllm:kvcore_<counter>_total``).

vLLM's stats logger hands each interval's ``KvcoreConnectorStats`` data (counter deltas)
to ``observe``; each counter grows by its delta, per engine.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvcore.integrations.vllm import _compat as v
from kvcore.spec.hooks import SchedulerStats

COUNTERS = tuple(f.name for f in fields(SchedulerStats) if f.name != "extra")


class KvcorePromMetrics(v.KVConnectorPromMetrics):  # type: ignore[misc]
    """One Prometheus counter per ``SchedulerStats`` field."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            metric = self._counter_cls(name=f"vllm:kvcore_{name}_total",
                                       documentation=f"kvcore connector: {name}",
                                       labelnames=labelnames)
            self.counters[name] = {idx: metric.labels(*values)
                                   for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)
