"""kvstate's counters in vLLM's stats path: a ``KVConnectorStats`` and a Prometheus
collector. Imports vLLM (and, through it, ``prometheus_client``).

vLLM takes each worker's and the scheduler's stats every step, merges them with
:meth:`KvStateStats.aggregate`, sends the plain dict to the front-end process, rebuilds a
:class:`KvStateStats` there (``build_kv_connector_stats``), logs :meth:`KvStateStats.reduce`
every log interval ("KV Transfer metrics: ..."), and hands the dict to
:class:`KvStatePromMetrics.observe`, which adds it to ``vllm:kvstate_*`` counters (the
labelled groups get a ``reason`` label; gauges are set). ``llm.get_metrics()`` and the
``/metrics`` endpoint show them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvstate.integrations.vllm.stats import COUNTERS, GROUPS, flatten, merge

PREFIX = "vllm:kvstate_"


class KvStateStats(KVConnectorStats):
    """kvstate's counters for one interval (``data``: see :mod:`.stats`)."""

    def reset(self) -> None:
        empty: dict[str, Any] = {}
        self.data = empty

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, KvStateStats):
            self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(flatten(self.data))

    def is_empty(self) -> bool:
        return not self.data


class KvStatePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per kvstate counter, per engine; ``misses`` and
    ``rejections`` carry a ``reason`` label; gauges are gauges."""

    def __init__(self, vllm_config: Any, metric_types: Mapping[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames)
                          for name, doc in COUNTERS.items()}
        self._groups = {name: self._counter_cls(name=PREFIX + name, documentation=doc,
                                                labelnames=[*labelnames, "reason"])
                        for name, doc in GROUPS.items() if name != "gauges"}
        self._gauge = self._gauge_cls(name=PREFIX + "level", documentation=GROUPS["gauges"],
                                      labelnames=[*labelnames, "name"], multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for name, value in transfer_stats_data.items():
            if isinstance(value, Mapping):
                for label, n in value.items():
                    if name == "gauges":
                        self._gauge.labels(*labels, str(label)).set(n)
                    elif name in self._groups and n:
                        self._groups[name].labels(*labels, str(label)).inc(n)
            elif name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)
