"""``KvStateConnector``: vLLM's KV connector API mapped onto kvstate. Imports vLLM.

vLLM (0.32) builds one instance per process of an engine: the scheduler side in the
EngineCore process (``role=SCHEDULER``) and the worker side in each TP rank's worker
process (``role=WORKER``); the front end only uses the class methods (stats, Prometheus).
This module is the only one of the integration that touches vLLM objects; it reads what
it needs from them and hands plain values to :mod:`.scheduler_side`,
:mod:`.decode_rank` and :mod:`.prefill_rank`.

Errors: a wrong ``kv_connector_extra_config`` or an engine kvstate cannot serve (not the
CPU backend, a hybrid cache, an MLA cache of another backend than CPU_MLA, FP8 KV with
scales other than 1, pipeline parallelism) raises
:class:`~kvstate.core.errors.ConfigInvalid` when the engine starts. After that nothing
raises into the engine: a step hook that fails logs the error and fails its loads, which
vLLM recomputes (with ``kv_load_failure_policy="recompute"``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstate.core.errors import ConfigInvalid
from kvstate.integrations.vllm.affinity import starts_unpinned, unpinned
from kvstate.integrations.vllm.amx import request_amx_tiles
from kvstate.integrations.vllm.config import ROUTE_KEY, ConnectorConfig, parse
from kvstate.integrations.vllm.gil import share_the_gil
from kvstate.integrations.vllm.hashing import Compat
from kvstate.integrations.vllm.layout import (FP8_CACHE_DTYPES, MLA_ISA, TORCH_DTYPES, is_mla, scales_problem,
                                              tensor_problem)
from kvstate.integrations.vllm.orders import LoadFailures, StepOrders
from kvstate.integrations.vllm.stats import Tally
from kvstate.integrations.vllm.tp import source_view

log = logging.getLogger(__name__)

#: The longest an idle step waits for kvstate's transfers, and how often it looks (see
#: get_finished): the bound is what a request that arrives meanwhile may wait for its step.
IDLE_WAIT_S = 0.002
IDLE_POLL_S = 0.00025
_nap = time.sleep  # one home for the idle wait's sleeps (a test counts them)

T = TypeVar("T")


@attrs.frozen
class KvStateMetadata(KVConnectorMetadata):
    """The step's orders, pickled to every worker."""

    orders: StepOrders


@attrs.frozen
class KvStateWorkerMetadata(KVConnectorWorkerMetadata):
    """Why a rank's loads failed this step; vLLM merges the ranks' before the scheduler
    side reads it (``update_connector_output``)."""

    failures: LoadFailures

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvStateWorkerMetadata):
            return self
        return KvStateWorkerMetadata(self.failures.merge(other.failures))


def _guarded(default: Callable[[], object]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Never raise into the engine from a step hook: log, and return ``default()``."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> T:
            try:
                return fn(*args, **kwargs)
            except Exception:
                log.exception("kvstate connector: %s failed", fn.__name__)
                return cast(T, default())  # the hook's "nothing happened" answer
        return run
    return wrap


def compat_of(vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig) -> Compat:
    """The engine's compatibility key, from its config (every process of the engine
    computes the same); ConfigInvalid for an engine kvstate does not serve."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ConfigInvalid.of("platform", "kvstate's vLLM connector supports vLLM's CPU backend (the one tested)")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigInvalid.of("pipeline_parallel_size", "pipeline parallelism is not supported")
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    kind = type(spec).__name__
    if spec is None or kind not in ("FullAttentionSpec", "MLAAttentionSpec"):
        raise ConfigInvalid.of("kv_cache_groups", "one full-attention or MLA KV cache group is supported (no "
                               f"hybrid or sliding-window caches): {[type(g.kv_cache_spec).__name__ for g in groups]}")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    fp8 = FP8_CACHE_DTYPES.get(cache_dtype)
    dtype = fp8 if fp8 is not None and str(spec.dtype) == "torch.uint8" else TORCH_DTYPES.get(str(spec.dtype))
    if dtype is None or (fp8 is None and cache_dtype not in ("auto", "bfloat16", "float16", "float32")):
        raise ConfigInvalid.of("cache_dtype", f"KV dtype {spec.dtype} ({cache_dtype}) is not supported")
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # private: how blocks are packed

        if kind == "MLAAttentionSpec":
            isa = _mla_isa(vllm_config, spec)
        elif fp8 is None:
            isa = str(_get_attn_isa(spec.dtype, spec.block_size, spec.head_size))
        else:
            # FP8 blocks are quantized from the model's dtype by the kernel of that ISA: both
            # decide the bytes, so both are in the key.
            model_dtype = vllm_config.model_config.dtype
            isa = f"{_get_attn_isa(model_dtype, spec.block_size, spec.head_size, cache_dtype)}:{model_dtype}"
    except (ImportError, NotImplementedError) as exc:
        raise ConfigInvalid.of("attention", f"cannot tell the CPU attention ISA: {exc}") from None
    return Compat(model=cfg.model_id or str(vllm_config.model_config.model), dtype=dtype.value,
                  block_size=int(spec.block_size), head_dim=int(spec.head_size), kv_heads=int(spec.num_kv_heads),
                  layers=tuple(groups[0].layer_names), tp=int(parallel.tensor_parallel_size), isa=isa,
                  engine=f"vllm-{vllm.__version__}")


def _mla_isa(vllm_config: Any, spec: Any) -> str:
    """The key's ``isa`` of an MLA cache: only vLLM's reference CPU_MLA backend (chosen
    where the CPU has no AMX, or when asked for) is run here; AMX_MLA and DeepSeek-V4's
    sparse caches lay blocks out otherwise, untested."""
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    if getattr(spec, "model_version", None) is not None or (
            amx and vllm_config.attention_config.backend != AttentionBackendEnum.CPU_MLA):
        raise ConfigInvalid.of("attention", "MLA KV is shared from vLLM's CPU_MLA backend only (set "
                               "attention_config.backend to CPU_MLA on a CPU with AMX); not DeepSeek-V4")
    return MLA_ISA


def _supported(request: Any) -> bool:
    """Plain token prompts only: LoRA, multimodal inputs and prompt embeddings change the
    KV without changing the token ids."""
    return (request.lora_request is None and not request.mm_features and request.prompt_embeds is None
            and request.prompt_token_ids is not None)


class KvStateConnector(KVConnectorBase_V1):
    """kvstate's KV connector; see docs/vllm.md. Enable it with ``KVTransferConfig(
    kv_connector="KvStateConnector", kv_connector_module_path="kvstate.integrations.vllm",
    kv_role=..., kv_connector_extra_config={...}, kv_load_failure_policy="recompute")``."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._vllm_config = vllm_config
        transfer = vllm_config.kv_transfer_config
        self._cfg = parse(transfer.kv_connector_extra_config, transfer.kv_role)
        self._compat = compat_of(vllm_config, kv_cache_config, self._cfg)
        # MLA: one latent per token on every rank (replicated, like one KV head over any TP size)
        total_heads = 1 if is_mla(self._compat) else int(vllm_config.model_config.get_total_num_kv_heads())
        self._view = source_view(self._compat, total_heads, self._cfg.source_tp)
        self._cfg.check_remote(self._view.mixed)
        share_the_gil(self._cfg.gil_switch_interval_s)
        self._engine_id = str(transfer.engine_id)
        self._tally = Tally()
        self._sched: Any = None
        self._decode: Any = None
        self._prefill: Any = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            from kvstate.integrations.vllm.scheduler_side import SchedulerSide

            with unpinned():  # its threads (coordinator, index) are kvstate's, not the engine's compute
                self._sched = SchedulerSide(self._cfg, self._compat, self._engine_id, self._view)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = int(get_tensor_model_parallel_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a store dropped on preemption is a later miss

    # -- worker side --------------------------------------------------------------------------------

    # Worker hooks that may start kvstate threads run unpinned: those threads may use every
    # CPU, not only the cores vLLM binds this worker to (.affinity says why). The step hooks
    # unpin only when they hand kvstate work (a store, a load), which may start a thread:
    # unpinning costs more than the rest of the hooks together (.affinity, "Cost").
    @starts_unpinned
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        problem = tensor_problem(self._compat, kv_caches)
        if problem is not None:
            raise ConfigInvalid.of("kv_caches", problem)
        caches = {name: kv_caches[name] for name in self._compat.layers}
        if self._compat.dtype in {d.value for d in FP8_CACHE_DTYPES.values()}:
            layers = self._vllm_config.compilation_config.static_forward_context
            problem = scales_problem({name: (getattr(layers.get(name), "_k_scale_float", None),
                                             getattr(layers.get(name), "_v_scale_float", None))
                                      for name in self._compat.layers})
            if problem is not None:
                raise ConfigInvalid.of("kv_scales", problem)
        if self._compat.isa == "amx":
            request_amx_tiles()  # a prefill worker's first forward may run over loaded KV (see .amx)
        if self._cfg.producer:
            from kvstate.integrations.vllm.decode_rank import DecodeRank

            self._decode = DecodeRank(self._cfg, self._compat, self._rank, caches, self._tally)
        if self._cfg.consumer:
            from kvstate.integrations.vllm.prefill_rank import PrefillRank

            path = self._cfg.socket_dir / f"{self._cfg.coordinator_name(self._engine_id)}.sock"
            self._prefill = PrefillRank(self._cfg, self._compat, self._rank, caches, self._tally, path, self._view)

    @_guarded(lambda: None)
    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KvStateMetadata):
            return
        orders = connector_metadata.orders
        stores = orders.stores if self._decode is not None else ()
        loads = orders.loads if self._prefill is not None else ()
        if not (stores or loads):
            return
        with unpinned():
            for store in stores:
                self._decode.store(store)
            for load in loads:
                self._prefill.load(load)

    @_guarded(lambda: None)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._prefill is None or not self._prefill.busy():
            return
        with unpinned():
            if self._cfg.layer_loads:
                self._prefill.start_layers()  # started, not ended: the layers wait for them
            else:
                self._prefill.progress()

    @_guarded(lambda: None)
    def wait_for_layer_load(self, layer_name: str) -> None:
        # Asynchronous loads finished before the request ran; per-layer ones wait here. It
        # starts no thread, so it keeps the worker's binding (it runs for every layer of
        # every step: two affinity calls each would cost more than the wait).
        if self._prefill is not None and self._cfg.layer_loads:
            self._prefill.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # stores run when a request finished, from its pages

    def wait_for_save(self) -> None:
        return None

    @_guarded(lambda: (None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Only loads start threads from here (a load starts once its shares are ready).
        with unpinned() if self._prefill is not None and self._prefill.busy() else contextlib.nullcontext():
            return self._get_finished(finished_req_ids)

    def _get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._finished(set(finished_req_ids))
        if self._idle_step() and not (sending or recving) and self._busy():
            # A step with no tokens only polls for finished transfers, and vLLM steps again
            # at once, its workers spinning on os.sched_yield in between. Measured (issue
            # 28, tp=2 prefill whose loads waited, 2 cores): its two workers took 37 of 44
            # CPU-seconds for 22 s, and the engine its loads waited for barely ran. So an
            # idle step waits here, off the CPU, until a transfer ends or IDLE_WAIT_S; a
            # step that computes never waits.
            deadline = time.monotonic() + IDLE_WAIT_S
            while not (sending or recving) and time.monotonic() < deadline and self._busy():
                _nap(IDLE_POLL_S)
                sending, recving = self._finished(set())
        return sending or None, recving or None

    def _idle_step(self) -> bool:
        """The bound step schedules no tokens (vLLM asks get_finished before it unbinds)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return isinstance(meta, KvStateMetadata) and meta.orders.idle

    def _busy(self) -> bool:
        return any(part is not None and part.busy() for part in (self._decode, self._prefill))

    def _finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending = self._decode.finished(finished_req_ids) if self._decode is not None else set()
        recving: set[str] = set()
        if self._prefill is not None:
            recving, failed = self._prefill.finished()
            self._load_errors |= failed
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    @_guarded(lambda: None)
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        failures = self._prefill.failures() if self._prefill is not None else LoadFailures()
        return KvStateWorkerMetadata(failures) if failures else None

    def get_kv_connector_stats(self) -> Any:
        data = (self._sched.tally if self._sched is not None else self._tally).take()
        if not data:
            return None
        from kvstate.integrations.vllm.metrics import KvStateStats

        return KvStateStats(data=data)

    @starts_unpinned
    def shutdown(self) -> None:
        for part in (self._sched, self._prefill, self._decode):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.exception("kvstate connector: shutdown of %s failed", type(part).__name__)

    # -- scheduler side -----------------------------------------------------------------------------

    @_guarded(lambda: (0, False))
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not _supported(request):
            return 0, False
        params = getattr(request, "kv_transfer_params", None)
        route = params.get(ROUTE_KEY) if isinstance(params, dict) else None
        n = self._sched.match(request.request_id, request.all_token_ids, request.num_tokens, num_computed_tokens,
                              request.cache_salt, route)
        if n is None:
            return None, False  # a decode index's reply is on its way: vLLM asks again at its next step
        return n, n > 0 and not self._cfg.layer_loads  # per-layer: the request runs now, its layers wait

    @_guarded(lambda: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._sched.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        try:
            orders = self._sched.step_orders(idle=getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0)
            if self._cfg.layer_loads and orders.loads and hasattr(scheduler_output, "has_sync_kv_loads"):
                # vLLM starts loads after the forward pass unless the step has a sync load;
                # it sets this for the requests it schedules so, and it must hold for ours.
                scheduler_output.has_sync_kv_loads = True
            return KvStateMetadata(orders)
        except Exception:
            log.exception("kvstate connector: build_connector_meta failed")
            return KvStateMetadata(StepOrders())

    @_guarded(lambda: None)
    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        self._sched.worker_output(sorted(connector_output.finished_recving or ()),
                                  set(connector_output.invalid_block_ids or ()),
                                  meta.failures if isinstance(meta, KvStateWorkerMetadata) else LoadFailures())

    @_guarded(lambda: (False, None))
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched.request_done(request.request_id)
        if not self._cfg.producer or not _supported(request):
            return False, None
        delay = self._sched.request_finished(request.request_id, request.all_token_ids, request.num_computed_tokens,
                                             block_ids, request.cache_salt)
        # What a router passes on to a prefill engine's request, as NixlConnector users route.
        address = self._cfg.index_address()
        return delay, ({ROUTE_KEY: address} if delay and address is not None else None)

    # -- front end ----------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from kvstate.integrations.vllm.metrics import KvStateStats

        return KvStateStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        from kvstate.integrations.vllm.metrics import KvStatePromMetrics

        return KvStatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
