"""``KVTransferConfig`` arguments, as plain dicts so they cross into engine processes.

:func:`build` turns one into vLLM's ``KVTransferConfig`` (in the engine process, or in a
test that checks vLLM accepts it). Every config here sets ``kv_load_failure_policy`` to
``"recompute"``: vLLM's default ``"fail"`` ends a request with an error when a load
fails, while the connector's contract is that vLLM recomputes exactly the failed blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROLES = ("kv_producer", "kv_consumer", "kv_both")

#: The public names a vLLM user writes to enable kvstate (issue 17).
KVSTATE_CONNECTOR = "KvStateConnector"
KVSTATE_MODULE = "kvstate.integrations.vllm"

#: The probe connectors' module, which vLLM imports by name in the engine processes.
PROBE_MODULE = "support.engines.probe"

#: A file in a probe's directory that makes the next load fail (see :mod:`.probe`).
FAIL_NEXT_LOAD = "fail-next-load"
#: A file in $KVSTATE_PROBE_DIR that makes ProbeKvStateConnector's worker hold its GIL
#: after its next stores, for the seconds the file says (see :mod:`.probe`).
HOLD_GIL_AFTER_STORE = "hold-gil-after-store"
PROBE_DIR_ENV = "KVSTATE_PROBE_DIR"
HOLD_ENDED = "hold-ended"  # written by the probe when the hold ended: its time.monotonic()
#: The same for the scheduler side (the EngineCore, the decode index's process): once it
#: handed stores and the worker's hold began, it holds its GIL, while this file exists.
HOLD_SCHEDULER_GIL = "hold-scheduler-gil-after-store"
SCHEDULER_HOLD_ENDED = "scheduler-hold-ended"
#: ProbeTimedKvStateConnector's files in $KVSTATE_PROBE_DIR: <name>-<pid>.json
HOOK_TIMES = "hook-times"


def _base(connector: str, role: str, extra: Mapping[str, Any], module: str | None) -> dict[str, Any]:
    if role not in ROLES:
        raise ValueError(f"kv_role {role!r} is not one of {ROLES}")
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": role,
                           "kv_connector_extra_config": dict(extra), "kv_load_failure_policy": "recompute"}
    if module is not None:
        cfg["kv_connector_module_path"] = module
    return cfg


def kvstate(role: str, extra: Mapping[str, Any] | None = None, *, probe: bool | str = False) -> dict[str, Any]:
    """kvstate's connector, loaded by module path like any out-of-tree connector; with
    ``probe``, a subclass of it in :mod:`.probe`: by default the one that holds a worker's
    GIL after stores on request, else the class ``probe`` names."""
    if probe:
        return _base(probe if isinstance(probe, str) else "ProbeKvStateConnector", role, extra or {}, PROBE_MODULE)
    return _base(KVSTATE_CONNECTOR, role, extra or {}, KVSTATE_MODULE)


def example(storage: Path, role: str = "kv_both") -> dict[str, Any]:
    """vLLM's ExampleConnector: stores each prompt's KV in files under ``storage`` and
    loads it for a later prompt with the same tokens (it ignores the role)."""
    return _base("ExampleConnector", role, {"shared_storage_path": str(storage)}, None)


def nixl(role: str = "kv_both") -> dict[str, Any]:
    """vLLM's NixlConnector with its KV in host memory (the CPU platform's only buffer).
    The engine whose KV is read also needs ``VLLM_NIXL_SIDE_CHANNEL_HOST`` and ``_PORT``:
    where the reading engine asks for its NIXL metadata."""
    return {**_base("NixlConnector", role, {}, None), "kv_buffer_device": "cpu"}


def probe_example(storage: Path, probe_dir: Path, role: str = "kv_both") -> dict[str, Any]:
    """ExampleConnector plus the probe: records the registered KV tensors in ``probe_dir``
    and fails the next load when ``probe_dir/fail-next-load`` exists."""
    return _base("ProbeExampleConnector", role, {"shared_storage_path": str(storage), "probe_dir": str(probe_dir)},
                 PROBE_MODULE)


def probe_only(probe_dir: Path, role: str = "kv_both") -> dict[str, Any]:
    """A connector that loads and stores nothing; it only records the KV tensors."""
    return _base("ProbeNullConnector", role, {"probe_dir": str(probe_dir)}, PROBE_MODULE)


def build(cfg: Mapping[str, Any]) -> Any:
    """vLLM's ``KVTransferConfig`` for ``cfg`` (imports vLLM)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**cfg)
