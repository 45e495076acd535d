"""vLLM's scheduler contract, driven request by request with no model.

An :class:`Engine` here is vLLM's own ``Scheduler`` (built from vLLM's config classes, on
CPU) with kvstate's connector on both sides: the scheduler side vLLM creates, and a
worker-side instance driven by vLLM's model-runner connector mixin
(``KVConnectorModelRunnerMixin._get_kv_connector_output``) exactly as a model runner does
each step. What the model would do is played by :meth:`Engine._forward`: it reads the
pages of the prompt prefix it is told is computed and checks that each holds the KV of
its own tokens (:func:`fill`), writes the pages of the tokens it computes, and samples
one fixed token. Every engine's worker side owns real KV tensors in vLLM's CPU layout,
a real bank, exporter, index and coordinator over real sockets: a source engine is just
another :class:`Engine` (``kv_producer`` or ``kv_both``).

One step is :meth:`Engine.step`, in EngineCore's order: schedule, execute (the worker
connector binds the orders, loads, reports), the aborts that arrived meanwhile, then
``update_from_output``. Faults are planted at the one boundary between the halves, the
step's metadata: a load order whose group is dropped (the ranks report it failed, as
for any refused load), a store order naming pages past the engine's KV (``Bank.store``
refuses it).

:func:`Engine.violations` lists every broken invariant of an idle engine: vLLM's (no
request left, every block back in the pool, each id reported once in each finished set
per load or delayed free) and kvstate's (no entry left in any per-request structure).
"""

from __future__ import annotations

import collections
import hashlib
import os
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus  # noqa: F401 (tests use h.RequestStatus)
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvstate.integrations.vllm.connector import KvStateMetadata
from kvstate.integrations.vllm.orders import LoadOrder, StepOrders, StoreOrder

BS = 32                      # vLLM's CPU attention needs a multiple of 32
KV_HEADS, HEAD_DIM = 2, 64   # the tiny Llama's (support.engines.tiny_llama)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KEY_HEX = bytes(range(32)).hex()
POLICY_ON = {"enable_decode_to_prefill_reuse": True, "minimum_transfer_prefix_blocks": 1,
             "minimum_estimated_ttft_saving_ms": 0.0, "transfer_source_lookup_budget_ms": 2000.0,
             "transfer_source_prefill_token_us": 1e6}
SAMPLED = 7                  # the token the "model" always samples


def fill(tokens: Iterable[int]) -> float:
    """What the "model" writes into a page: a value of the token prefix up to the page's
    end (a small integer, exact in bfloat16), so a page holding another prefix's KV, or
    none, is seen by the next read."""
    digest = hashlib.blake2b(repr(list(tokens)).encode(), digest_size=8).digest()
    return float(int.from_bytes(digest, "little") % 250 + 1)


_distributed = False


def init_distributed(config: VllmConfig) -> None:
    """vLLM's tp=1 process groups (gloo), once per process: the worker connector asks
    for its rank as a model runner's does."""
    global _distributed
    if _distributed:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
        parallel_state.ensure_model_parallel_initialized(1, 1)
    _distributed = True


@attrs.define
class Faults:
    """Faults planted in the next step's metadata, by request id."""

    loads: set[str] = attrs.Factory(set)     # load orders whose group is dropped: the ranks report them failed
    stores: set[str] = attrs.Factory(set)    # store orders naming pages past the KV tensors: Bank.store refuses


class Engine:
    """See the module docstring. ``role``: vLLM's kv_role; ``name``: the engine id and, for
    a producer, the source name it serves; ``sources``: the producers a consumer asks."""

    def __init__(self, name: str, role: str, model_dir: Path, sockets: Path, *, sources: tuple[str, ...] = (),
                 failure_policy: str = "recompute", num_blocks: int = 64, max_seqs: int = 32,
                 extra: dict[str, Any] | None = None, step_wait_s: float = 30.0) -> None:
        """``step_wait_s``: what the scheduler's lookups may wait in one step. The cases
        here stage each phase of a request in a given step, so by default a lookup is
        answered in the step that asks it (the connector's own is 5 ms: a reply not in by
        then is read at a later step); a case of a lookup in flight sets less."""
        os.environ.setdefault("KVSTATE_DEPLOYMENT_KEY", KEY_HEX)
        self.name, self.role, self.num_blocks = name, role, num_blocks
        kv_extra: dict[str, Any] = {"socket_dir": str(sockets), "source": name,
                                    "retain_bytes": 32 * len(LAYERS) * KV_HEADS * BS * 2 * HEAD_DIM * 2,
                                    "load_timeout_s": 5.0, **(extra or {})}
        if role != "kv_producer":
            kv_extra.update(sources=list(sources), policy=POLICY_ON)
        transfer = KVTransferConfig(kv_connector="KvStateConnector", kv_connector_module_path="kvstate.integrations.vllm",
                                    kv_role=role, engine_id=name, kv_connector_extra_config=kv_extra,
                                    kv_load_failure_policy=failure_policy)
        model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048)
        self.config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BS),
                                 scheduler_config=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048,
                                                                  max_model_len=2048, is_encoder_decoder=False),
                                 kv_transfer_config=transfer)
        self.config.cache_config.num_gpu_blocks = num_blocks
        init_distributed(self.config)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BS, hash_fn)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        self.caches = {layer: torch.zeros(num_blocks, KV_HEADS, BS, 2 * HEAD_DIM, dtype=torch.bfloat16)
                       for layer in LAYERS}
        self.worker.register_kv_caches(self.caches)
        self.scheduler = Scheduler(self.config, kv_cache_config, StructuredOutputManager(self.config),
                                   block_size=BS, log_stats=True)
        self.connector: Any = self.scheduler.connector
        self.connector._sched.step_wait_s = step_wait_s
        self._wait_ready()
        self.free_at_start = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.faults = Faults()
        self.aborts_in_step: list[str] = []
        self.sending: collections.Counter[str] = collections.Counter()
        self.recving: collections.Counter[str] = collections.Counter()
        self.loads_ordered: collections.Counter[str] = collections.Counter()
        self.stores_ordered: collections.Counter[str] = collections.Counter()
        self.bad_reads: list[str] = []
        self.finished: dict[str, str] = {}       # req id -> finish reason (vLLM's)
        self.steps = 0

    def _wait_ready(self, timeout: float = 20.0) -> None:
        """The ranks' links to this engine's index and coordinator are up (threads that
        retry until the scheduler side exists, which vLLM builds after the workers)."""
        sched = self.connector._sched
        if sched.coordinator is not None:
            sched.coordinator.wait_for_workers(timeout)
        deadline = time.monotonic() + timeout
        while sched.index is not None and not sched.index.ready():
            assert time.monotonic() < deadline, f"{self.name}: the index never saw its ranks"
            time.sleep(0.01)

    # -- requests ------------------------------------------------------------------------------

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        request = Request(req_id, list(tokens), params, None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        return request

    def abort(self, *req_ids: str) -> None:
        """Between steps, as EngineCore's abort queue."""
        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def preempt(self, req_id: str) -> None:
        """vLLM's own preemption of a running request (what ``schedule`` does when the pool
        is short: take it out of ``running``, ``_preempt_request``), between steps."""
        request = self.scheduler.requests[req_id]
        assert request.status == RequestStatus.RUNNING, request.status
        self.scheduler.running.remove(request)
        self.scheduler._preempt_request(request, time.monotonic())

    def status(self, req_id: str) -> RequestStatus | None:
        request = self.scheduler.requests.get(req_id)
        return None if request is None else request.status

    # -- one step --------------------------------------------------------------------------------

    @contextmanager
    def _as_worker(self) -> Iterator[None]:
        """This engine's worker connector as the process's kv transfer group (one engine per
        process in vLLM; several engines share this one)."""
        saved = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        try:
            yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = saved

    def _plant(self, meta: Any) -> Any:
        if not isinstance(meta, KvStateMetadata):
            return meta
        loads, stores = [], []
        for order in meta.orders.loads:
            self.loads_ordered[order.req_id] += 1
            if order.req_id in self.faults.loads and order.gid is not None:
                self.faults.loads.discard(order.req_id)
                order = LoadOrder(order.req_id, None, order.slots, order.dst_blocks, "planted")
            loads.append(order)
        for order in meta.orders.stores:
            self.stores_ordered[order.req_id] += 1
            if order.req_id in self.faults.stores:
                self.faults.stores.discard(order.req_id)
                order = StoreOrder(order.req_id, tuple(self.num_blocks + i for i in range(len(order.src_blocks))),
                                   order.slots, order.keys)
            stores.append(order)
        return KvStateMetadata(StepOrders(tuple(stores), tuple(loads), meta.orders.idle))

    def step(self) -> Any:
        so = self.scheduler.schedule()
        so.kv_connector_metadata = self._plant(so.kv_connector_metadata)
        with self._as_worker(), set_forward_context(None, self.config):
            with KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_output:
                sampled = self._forward(so)
        ids = list(sampled)
        output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[sampled[r] for r in ids], kv_connector_output=kv_output)
        if self.aborts_in_step:     # EngineCore: aborts that arrived during the model's execution
            self.abort(*self.aborts_in_step)
            self.aborts_in_step = []
        self.sending.update(kv_output.finished_sending or ())
        self.recving.update(kv_output.finished_recving or ())
        outputs = self.scheduler.update_from_output(so, output)
        for outs in outputs.values():
            for out in outs.outputs:
                if out.finish_reason is not None:
                    self.finished[out.request_id] = str(out.finish_reason)
        self.steps += 1
        return so

    def _forward(self, so: Any) -> dict[str, list[int]]:
        """The model's part: read the computed prefix's full pages (each must hold its
        tokens' KV), write the pages of the tokens computed now, sample at the end of the
        prompt (after the fact, as vLLM's scheduler already counted them computed)."""
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            (pages,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            end = request.num_computed_tokens            # already advanced by schedule()
            start = end - n
            tokens = request.all_token_ids
            for b in range(start // BS):                 # the prefix read: full pages only
                want = fill(tokens[:(b + 1) * BS])
                if float(self.caches[LAYERS[0]][pages[b]][0, 0, 0]) != want:
                    self.bad_reads.append(f"{req_id}: block {b} (page {pages[b]})")
                    break
            for b in range(start // BS, (end + BS - 1) // BS):
                value = fill(tokens[:min((b + 1) * BS, end)])
                for layer in LAYERS:
                    self.caches[layer][pages[b]].fill_(value)
            sampled[req_id] = [SAMPLED] if end >= request.num_tokens else []
        return sampled

    def run(self, until: Any = None, limit: int = 4000) -> None:
        """Step until ``until()`` holds (default: nothing left in the scheduler and no
        kvstate work in flight); a short sleep between idle steps lets kvstate's threads run."""
        for _ in range(limit):
            if (until() if until is not None else self.idle()):
                return
            so = self.step()
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.002)
        raise AssertionError(f"{self.name}: not done after {limit} steps: {self.violations()}")

    def idle(self) -> bool:
        return not self.scheduler.requests and not any(self.kvstate_sizes().values())

    # -- invariants -------------------------------------------------------------------------------

    def kvstate_sizes(self) -> dict[str, int]:
        """Every per-request structure of kvstate in this engine (both sides), by name."""
        sizes = {f"scheduler.{k}": v for k, v in self.connector._sched.sizes().items()}
        for side, part in (("decode", self.worker._decode), ("prefill", self.worker._prefill)):
            if part is not None:
                sizes.update({f"{side}.{k}": v for k, v in part.sizes().items()})
        return sizes

    def violations(self) -> list[str]:
        """What an idle engine breaks of vLLM's invariants and kvstate's."""
        s = self.scheduler
        out = []
        if s.requests:
            out.append(f"requests left in the scheduler: {sorted(s.requests)}")
        if len(s.waiting) or s.running or s.finished_recving_kv_req_ids or s.failed_recving_kv_req_ids:
            out.append(f"queues: waiting {len(s.waiting)}, running {len(s.running)}, recving "
                       f"{s.finished_recving_kv_req_ids}, failed {s.failed_recving_kv_req_ids}")
        free = s.kv_cache_manager.block_pool.get_num_free_blocks()
        if free != self.free_at_start:
            out.append(f"blocks not back in the pool: {self.free_at_start - free}")
        twice = [r for r, n in self.sending.items() if n > 1]
        if twice:
            out.append(f"reported twice in finished_sending: {twice}")
        unordered = [r for r in self.sending if not self.stores_ordered[r]]
        if unordered:
            out.append(f"finished_sending without a store order: {unordered}")
        mismatched = {r: (self.recving[r], self.loads_ordered[r]) for r in set(self.recving) | set(self.loads_ordered)
                      if self.recving[r] != self.loads_ordered[r]}
        if mismatched:
            out.append(f"finished_recving != loads ordered: {mismatched}")
        if self.bad_reads:
            out.append(f"pages read that hold other KV: {self.bad_reads[:5]}")
        left = {k: v for k, v in self.kvstate_sizes().items() if v}
        if left:
            out.append(f"kvstate entries left: {left}")
        return out

    def forget(self) -> None:
        """Drop the per-request bookkeeping above (once checked): long runs."""
        assert self.idle(), self.violations()
        for counter in (self.sending, self.recving, self.loads_ordered, self.stores_ordered):
            counter.clear()
        self.finished.clear()

    def close(self) -> None:
        with self._as_worker():
            self.worker.shutdown()
        self.scheduler.shutdown()


def run_all(engines: list[Engine], limit: int = 4000) -> None:
    """Step every engine that is not idle, in turn, until all are (a source's lease ends
    only when the consumer's steps report its load): vLLM's EngineCores run side by side."""
    for _ in range(limit):
        busy = [e for e in engines if not e.idle()]
        if not busy:
            return
        scheduled = 0
        for e in busy:
            scheduled += e.step().total_num_scheduled_tokens
        if not scheduled:
            time.sleep(0.002)
    raise AssertionError(f"not idle after {limit} rounds: {[(e.name, e.violations()) for e in engines]}")


def socket_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvs-contract-"))
    os.chmod(d, 0o700)
    return d
