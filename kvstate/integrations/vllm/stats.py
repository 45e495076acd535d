"""The connector's counters, as plain dicts that cross processes. Pure.

Each side (scheduler, every worker) counts into a :class:`Tally`; vLLM collects one dict
per step from each worker and from the scheduler and merges them with :func:`merge`
(sums; ``gauges`` keep the latest value), then hands the front end the merged dict:
vLLM's periodic log line shows :func:`flatten` of it, and the Prometheus collector
(:mod:`.metrics`) adds it to counters.

Names: flat counters (``lookups``, ``hits``, ``tokens_loaded``, ...) and three labelled
groups: ``misses`` and ``rejections`` by reason, ``gauges`` by name. :data:`COUNTERS`
documents each.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

#: counter -> meaning (docs/vllm.md lists these; a test keeps the two in step).
COUNTERS: Mapping[str, str] = {
    "lookups": "prefill: lookups sent to decode indexes",
    "hits": "prefill: prompts whose prefix load was scheduled",
    "tokens_matched": "prefill: prompt tokens scheduled to load",
    "loads_ok": "prefill: loads that completed on a rank",
    "loads_failed": "prefill: loads that failed on a rank (vLLM recomputes their blocks)",
    "tokens_loaded": "prefill: tokens loaded (per rank)",
    "bytes_loaded": "prefill: KV bytes loaded (per rank)",
    # milliseconds: vLLM's metric reader (LLM.get_metrics) keeps whole numbers
    "load_ms": "prefill: milliseconds from the load order to the load finished (per rank, summed)",
    "layer_waits": "prefill, layer_loads: layer waits in the forward pass (vLLM's wait_for_layer_load) over a load",
    "layer_waits_ahead": "prefill, layer_loads: layer waits that returned while a later layer was still loading",
    "reconnects": "prefill: rank workers that reconnected to their coordinator after losing it",
    "loads_late": "prefill: loads a rank started past load_timeout_s from their order, the engine having taken "
                  "no step meanwhile (shares ready: loaded, not recomputed)",
    "blocks_retained": "decode: prefix blocks assigned a bank block",
    "stores_ok": "decode: stores that completed on a rank",
    "stores_failed": "decode: stores that failed on a rank",
    "bytes_stored": "decode: KV bytes stored into banks (per rank)",
    "evictions": "decode: retained blocks evicted for room",
}
#: labelled groups: group -> meaning
GROUPS: Mapping[str, str] = {
    "misses": "prefill: prompts not loaded, by reason (reuse_disabled, no_eligible_source, unreachable, ...)",
    "rejections": "prefill: loads refused or failed after scheduling, by reason (stale_incarnation, timeout, ...)",
    "routes_ignored": "prefill: sources a router named in kv_transfer_params and not asked, by reason "
                      "(malformed, no_nixl, busy)",
    "gauges": "levels, latest value: retained_blocks, free_blocks (decode)",
}


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """``a`` and ``b`` combined: numbers add, groups merge per label, gauges take ``b``'s."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in a.items()}
    for k, v in b.items():
        if isinstance(v, Mapping):
            group = out.setdefault(k, {})
            for label, n in v.items():
                group[label] = n if k == "gauges" else group.get(label, 0) + n
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = out.get(k, 0) + v
    return out


def flatten(d: Mapping[str, Any]) -> dict[str, float]:
    """``{"misses": {"x": 1}}`` -> ``{"misses.x": 1}``: one number per name."""
    out: dict[str, float] = {}
    for k, v in sorted(d.items()):
        if isinstance(v, Mapping):
            for label, n in sorted(v.items()):
                out[f"{k}.{label}"] = float(n)
        else:
            out[k] = float(v)
    return out


class Tally:
    """Counts of one process since the last :meth:`take`; thread-safe (loads and stores
    finish on kvstate's dispatcher thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._data[name] = self._data.get(name, 0) + n

    def reason(self, group: str, reason: str, n: float = 1) -> None:
        with self._lock:
            g = self._data.setdefault(group, {})
            g[reason] = g.get(reason, 0) + n

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self._data.setdefault("gauges", {})[name] = value

    def take(self) -> dict[str, Any]:
        """What was counted since the last take (empty when nothing was)."""
        with self._lock:
            out, self._data = self._data, {}
        return out
