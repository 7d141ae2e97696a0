"""kvcore's scheduler counters as Prometheus counters (``vllm:kvcore_<counter>_total``).

vLLM's stats logger hands each interval's ``KvcoreConnectorStats`` data (counter deltas)
to ``observe``; each counter grows by its delta, per engine.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvcore.integrations.vllm import _compat as v
from kvcore.spec.errors import ArgumentRangeError, ArgumentTypeError
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
        """Each counter grows by its delta; the whole interval is checked first, so a bad
        one moves no counter (a delta is an exact int: inf or "3" is no count)."""
        data = check_counts("KvcorePromMetrics.observe", transfer_stats_data)
        if not any(engine_idx in per_engine for per_engine in self.counters.values()):
            raise ArgumentRangeError("KvcorePromMetrics.observe", "engine_idx", engine_idx,
                                     f"one of {sorted(next(iter(self.counters.values())))}",
                                     "pass an engine index the metrics were built for")
        for name, value in data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)


def check_counts(where: str, data: object) -> dict[str, int]:
    """Counter deltas: a dict of str names to exact ints (what ``get_stats`` makes)."""
    if not isinstance(data, dict) or any(
            type(k) is not str or type(v) is not int for k, v in data.items()):
        raise ArgumentTypeError(where, "data", data, "a dict of counter names to ints",
                                "pass the data of a KvcoreConnectorStats")
    return data
