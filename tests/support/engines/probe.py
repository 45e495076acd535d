"""Probe connectors, loaded by vLLM through ``kv_connector_module_path="support.engines.probe"``.

They run inside vLLM's engine processes (scheduler side in ``VLLM::EngineCore``, worker
side in each ``VLLM::Worker``), so this module imports vLLM and torch.

- Both record, once per worker rank, the KV tensors that vLLM hands to
  ``register_kv_caches``: dtype, shape, strides, offsets, which layers share a buffer,
  the attention ISA that decides how a block's bytes are packed, and the
  ``KVCacheConfig``. tests/vllm/kv_geometry.py reads these records.
- :class:`ProbeExampleConnector` is vLLM's ExampleConnector (KV through files) with a
  planted fault: while ``<probe_dir>/fail-next-load`` exists, the next load is not
  performed and its blocks are reported through ``get_block_ids_with_load_errors``,
  which is how a real connector reports a failed load. The file is removed when the
  fault fires. With ``kv_load_failure_policy="recompute"`` vLLM recomputes those blocks,
  yet still counts the tokens as cached: the reason why reuse evidence must also show
  that no load failure was recovered (:mod:`.evidence`).
- :class:`ProbeNullConnector` loads and stores nothing.
- :class:`ProbeKvStateConnector` is kvstate's own connector, whose worker holds its
  process's GIL right after it submitted a step's stores, while
  ``$KVSTATE_PROBE_DIR/hold-gil-after-store`` exists (the file says for how many seconds;
  it is removed when the hold starts, and ``hold-ended`` then says when it ended, in
  ``time.monotonic()``): an engine step whose Python keeps the GIL while the
  stores complete, as vLLM's busy-polling worker nearly does on a loaded machine. Its
  scheduler side (the EngineCore, where the decode index lives) does the same with
  ``hold-scheduler-gil-after-store`` (and ``scheduler-hold-ended``), from a thread of its
  own, while its main thread waits for the step that hands the stores. The two sides meet
  through files so that the scheduler's hold surely covers the stores' end: the worker,
  given the stores, writes ``worker-bound`` and waits; the scheduler's thread, seeing it,
  writes ``scheduler-holding`` and holds; only then does the worker submit the stores
  (and hold its own GIL, when asked to).
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from kvstate.integrations.vllm.amx import request_amx_tiles
from kvstate.integrations.vllm.connector import KvStateConnector
from support.waiting import wait_until

FAIL_NEXT_LOAD = "fail-next-load"  # same name as kv_configs.FAIL_NEXT_LOAD
HOLD_GIL_AFTER_STORE = "hold-gil-after-store"  # same name as kv_configs.HOLD_GIL_AFTER_STORE
PROBE_DIR_ENV = "KVSTATE_PROBE_DIR"  # same name as kv_configs.PROBE_DIR_ENV
HOLD_ENDED = "hold-ended"  # same name as kv_configs.HOLD_ENDED
HOLD_SCHEDULER_GIL = "hold-scheduler-gil-after-store"  # same name as kv_configs.HOLD_SCHEDULER_GIL
SCHEDULER_HOLD_ENDED = "scheduler-hold-ended"  # same name as kv_configs.SCHEDULER_HOLD_ENDED
WORKER_BOUND, SCHEDULER_HOLDING = "worker-bound", "scheduler-holding"  # the two sides' meeting


def _hold(trigger: Path, ended: str) -> None:
    """Hold this process's GIL for the seconds ``trigger`` says (removed first), then write
    when the hold ended to ``ended`` beside it."""
    seconds = float(trigger.read_text())
    trigger.unlink()
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))  # a C call through PyDLL keeps the GIL
    (trigger.parent / ended).write_text(repr(time.monotonic()))  # CLOCK_MONOTONIC: one per machine


def jsonable(value: Any) -> Any:
    """Plain JSON data for configs made of dataclasses, enums, dtypes and containers."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__class__": type(value).__name__, **out}
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _attn_isa(t: torch.Tensor, block_size: int, head_size: int) -> str:
    # Private in vLLM 0.32; it decides how K and V are packed inside a block
    # ("vec": K transposed, V token-major; "amx" and "vec16" differ).
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:
        return f"unknown ({exc})"
    return str(_get_attn_isa(t.dtype, block_size, head_size))


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> dict[str, Any]:
    """The geometry of the tensors vLLM registered: per layer, and per backing buffer."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    bases: list[int] = []
    layers = {}
    for name, t in kv_caches.items():
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if base not in bases:
            bases.append(base)
        layers[name] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "device": str(t.device),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "element_size": t.element_size(),
            "contiguous": t.is_contiguous(),
            "storage": bases.index(base),
            "storage_nbytes": storage.nbytes(),
            "byte_offset": t.data_ptr() - base,
            "nbytes": t.numel() * t.element_size(),
            "block_nbytes": t[0].numel() * t.element_size(),
        }
    first = next(iter(kv_caches.values()))
    _, _, block_size, fused = first.shape  # [blocks, kv heads, block_size, 2 * head_dim]
    return {
        "tp_rank": get_tensor_model_parallel_rank(),
        "tp_size": get_tensor_model_parallel_world_size(),
        "attn_isa": _attn_isa(first, block_size, fused // 2),
        "layer_names": list(kv_caches),
        "storages": len(bases),
        "layers": layers,
        "kv_cache_config": jsonable(kv_cache_config),
    }


class _GeometryRecorder:
    """Mixin: writes ``<probe_dir>/geometry-rank<r>.json`` from ``register_kv_caches``."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # vLLM's ExampleConnector consumer died of SIGILL on AMX CPUs without this (see kvstate.integrations.vllm.amx).
        request_amx_tiles()
        record = describe_kv_caches(kv_caches, getattr(self, "_kv_cache_config"))
        record["pid"] = os.getpid()
        probe_dir = Path(getattr(self, "_kv_transfer_config").get_from_extra_config("probe_dir", ""))
        tmp = probe_dir / f".geometry-rank{record['tp_rank']}.json.tmp"
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        tmp.replace(probe_dir / f"geometry-rank{record['tp_rank']}.json")
        super().register_kv_caches(kv_caches)  # type: ignore[misc]  # a mixin: the connector's own registration


class ProbeExampleConnector(_GeometryRecorder, ExampleConnector):
    """ExampleConnector + geometry record + a planted load failure on request."""

    _planted_errors: set[int]

    def _probe_dir(self) -> Path:
        return Path(self._kv_transfer_config.get_from_extra_config("probe_dir", ""))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        loads = [r for r in getattr(meta, "requests", []) if not r.is_store]
        trigger = self._probe_dir() / FAIL_NEXT_LOAD
        if loads and forward_context.attn_metadata is not None and trigger.exists():
            trigger.unlink()
            # Skip the load; report every block it would have written.
            self._planted_errors = {int(b) for r in loads for b in (r.slot_mapping // self._block_size).tolist()}
            return
        super().start_load_kv(forward_context, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = getattr(self, "_planted_errors", set())
        self._planted_errors = set()
        return errors


class ProbeNullConnector(_GeometryRecorder, KVConnectorBase_V1):
    """Records the KV geometry; loads nothing and stores nothing."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class ProbeKvStateConnector(KvStateConnector):
    """kvstate's connector, holding the worker's or the scheduler's GIL after a step's
    stores on request."""

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        orders = getattr(connector_metadata, "orders", None)
        probes = Path(os.environ.get(PROBE_DIR_ENV, "/nonexistent"))
        if orders is not None and orders.stores and (probes / HOLD_SCHEDULER_GIL).exists():
            (probes / WORKER_BOUND).write_text("")
            wait_until((probes / SCHEDULER_HOLDING).exists, 60)
            time.sleep(0.02)  # from its file to its C call: the scheduler's thread needs a moment
        super().bind_connector_metadata(connector_metadata)
        trigger = probes / HOLD_GIL_AFTER_STORE
        if orders is not None and orders.stores and trigger.exists():
            _hold(trigger, HOLD_ENDED)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        orders = getattr(meta, "orders", None)
        probes = Path(os.environ.get(PROBE_DIR_ENV, "/nonexistent"))
        if orders is not None and orders.stores and (probes / HOLD_SCHEDULER_GIL).exists():
            def hold_once_the_step_is_out() -> None:
                wait_until((probes / WORKER_BOUND).exists, 60)  # the worker has the step: it was sent
                (probes / SCHEDULER_HOLDING).write_text("")
                _hold(probes / HOLD_SCHEDULER_GIL, SCHEDULER_HOLD_ENDED)
                for done in (WORKER_BOUND, SCHEDULER_HOLDING):
                    (probes / done).unlink(missing_ok=True)

            threading.Thread(target=hold_once_the_step_is_out, name="probe-scheduler-hold", daemon=True).start()
        return meta


#: The connector methods vLLM calls on the step path (scheduler and worker side): what
#: :class:`ProbeTimedKvStateConnector` times.
STEP_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
              "update_connector_output", "request_finished", "bind_connector_metadata", "start_load_kv",
              "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
              "get_block_ids_with_load_errors", "build_connector_worker_meta", "clear_connector_metadata",
              "get_kv_connector_stats")
HOOK_TIMES = "hook-times"  # same name as kv_configs.HOOK_TIMES
FLUSH_ON = ("build_connector_meta", "get_finished")  # the scheduler's and each worker's once per step


def _timed(name: str, fn: Any, totals: dict[str, list[int]], flush: Any) -> Any:
    clock, cpu = time.perf_counter_ns, time.thread_time_ns

    def run(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = clock(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            cell = totals[name]
            cell[0] += 1
            cell[1] += clock() - t0
            cell[2] += cpu() - c0
            if name in FLUSH_ON and cell[0] % 64 == 0:  # one hook per step on each side
                flush()
    return run


class ProbeTimedKvStateConnector(KvStateConnector):
    """kvstate's connector with every step hook timed in its own process (wall time, the
    hook's whole call: kvstate's wrappers included). Every 64 steps each process (the
    EngineCore's scheduler side, each worker) writes
    ``$KVSTATE_PROBE_DIR/hook-times-<pid>.json``: per hook, calls, nanoseconds, and the
    calling thread's CPU nanoseconds (the difference is time the thread waited, for the
    GIL or for a CPU)."""

    _totals: dict[str, list[int]] = {name: [0, 0, 0] for name in STEP_HOOKS}  # one per process

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        totals = ProbeTimedKvStateConnector._totals
        out = Path(os.environ.get(PROBE_DIR_ENV, "/nonexistent")) / f"{HOOK_TIMES}-{os.getpid()}.json"

        def flush() -> None:
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(totals))
            tmp.replace(out)
        for name in STEP_HOOKS:  # instance attributes: vLLM calls them through the instance
            setattr(self, name, _timed(name, getattr(self, name), totals, flush))
