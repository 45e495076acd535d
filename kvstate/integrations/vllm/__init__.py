"""kvstate's vLLM KV connector (the optional extra ``kvstate[vllm]``); see docs/vllm.md.

Enable it in vLLM with::

    KVTransferConfig(kv_connector="KvStateConnector",
                     kv_connector_module_path="kvstate.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config={...},
                     kv_load_failure_policy="recompute")

vLLM imports this module in every process of an engine (front end, EngineCore, each
worker), so importing it is cheap: ``KvStateConnector`` (which imports vLLM) and the stats
classes load on first access (PEP 562). The modules that do not touch vLLM (config,
hashing, slots, wire, index, orders, stats, layout, scheduler_side, decode_rank,
prefill_rank) import without it.

Modules: :mod:`.config` (``kv_connector_extra_config``), :mod:`.hashing` (compatibility
key, prefix hashes), :mod:`.slots` and :mod:`.index` (the decode side's table of retained
blocks and the index serving lookups), :mod:`.wire` (its protocol), :mod:`.scheduler_side`,
:mod:`.decode_rank` and :mod:`.prefill_rank` (the two halves of the connector),
:mod:`.orders` (per-step metadata), :mod:`.stats` and :mod:`.metrics` (counters, vLLM stats
and Prometheus), :mod:`.connector` (the vLLM class).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "KvStateConnector": "kvstate.integrations.vllm.connector",
    "KvStateMetadata": "kvstate.integrations.vllm.connector",
    "KvStateStats": "kvstate.integrations.vllm.metrics",
    "KvStatePromMetrics": "kvstate.integrations.vllm.metrics",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from kvstate.integrations.vllm.connector import KvStateConnector as KvStateConnector
    from kvstate.integrations.vllm.connector import KvStateMetadata as KvStateMetadata
    from kvstate.integrations.vllm.metrics import KvStatePromMetrics as KvStatePromMetrics
    from kvstate.integrations.vllm.metrics import KvStateStats as KvStateStats


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
