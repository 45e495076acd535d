"""The prefill side of one TP rank, in its worker process: a
:class:`~kvstate.share.rank_worker.RankWorker` for this rank, and the loads of each step.

- At registration a thread connects the rank's worker to the coordinator in the scheduler
  process, retrying until it is up (vLLM builds workers before the scheduler).
- Each :class:`~.orders.LoadOrder` waits for this rank's share of its group to be
  ``ready`` (the coordinator says so only once every rank imported its part), then
  scatters the bank blocks into the engine's pages with ``RankShare.load``.
- Every order finishes, one way or the other: a load that completed, or a failure (the
  group failed or was rejected, the share ended, the load failed, the time ran out, this
  rank never connected). Two bounds, both ``load_timeout_s``: the shares must be ready
  that long after the order, and a started transfer must end that long after its start.
  A load whose shares are ready when the rank next looks starts even if the order's time
  ran out meanwhile (the engine stepped late: a fresh tp=2 prefill engine took no step for
  10 to 22 s while vLLM compiled, issue 28): its bank is mapped here, and loading beats
  recomputing. A failure names every page of the order, which vLLM
  (``kv_load_failure_policy="recompute"``) then recomputes, and its reason goes to the
  scheduler side in the same step (:meth:`PrefillRank.failures`); the request is reported
  finished either way (:meth:`PrefillRank.finished`).

Loads are asynchronous in vLLM's sense by default: the request waits
(``WAITING_FOR_REMOTE_KVS``) until every rank reported its load finished, so no forward
pass reads a page while it loads. With ``layer_loads`` the request runs in the step its
load is ordered: :meth:`PrefillRank.start_layers` (vLLM's ``start_load_kv``) starts the
load once the shares are ready, and :meth:`PrefillRank.wait_layer` (``wait_for_layer_load``,
called in each layer's attention) waits for that layer's region only
(``TransferHandle.wait_region``); the load is then never reported in ``finished_recving``,
and a failed one names its pages for vLLM to recompute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kvstate.core.errors import ChannelError, KvStateError
from kvstate.core.heads import Slice
from kvstate.core.reasons import ChannelReason
from kvstate.integrations.vllm.config import ConnectorConfig
from kvstate.integrations.vllm.hashing import Compat
from kvstate.integrations.vllm.orders import LoadFailures, LoadOrder, failure_code
from kvstate.integrations.vllm.stats import Tally
from kvstate.integrations.vllm.tp import SourceView, same_tp
from kvstate.integrations.vllm.remote_load import RemoteLoad
from kvstate.share.load import Sliced
from kvstate.share.rank_worker import RankWorker, WorkerConfig
from kvstate.share.remote_part import RemotePart
from kvstate.share.transfer import TransferHandle
from kvstate.transport.host import HostTransport

if TYPE_CHECKING:
    from kvstate.transport.nixl.transport import NixlTransport

log = logging.getLogger(__name__)

RETRY_S = 0.05
#: How often a connected rank checks that its workers still have their coordinator.
RECHECK_S = 0.25
#: The KV heads' dimension of vLLM's CPU cache tensors (:mod:`.layout`).
HEAD_AXIS = 1
#: share states in which a load can no longer start
_ENDED = ("draining", "quiescent", "closed", "rejected", "failed")


@attrs.define(eq=False)
class _Load:
    order: LoadOrder
    started: float                                             # when ordered
    handles: list[TransferHandle | RemoteLoad] | None = None   # one per part of this rank, once all started
    loading_since: float = 0.0                                 # when the handles started
    cancelled: bool = False                                    # its transfer outlasted load_timeout_s


class PrefillRank:
    """See the module docstring. ``view``: the decode sources' key and the slices of their
    banks this rank loads (heterogeneous TP); None: this engine's own TP size."""

    def __init__(self, cfg: ConnectorConfig, compat: Compat, rank: int, kv_caches: Mapping[str, Any],
                 tally: Tally, coordinator_path: Path, view: SourceView | None = None,
                 transport: Callable[[], HostTransport] = HostTransport) -> None:
        self.cfg, self.compat, self.rank, self.tally = cfg, compat, rank, tally
        self.kv_caches = dict(kv_caches)
        self.coordinator_path = coordinator_path
        self.transport = transport  # makes each part's worker its transport
        self.view = same_tp(compat) if view is None else view
        #: (coordinator part, slice) of every decode bank this rank loads heads from
        self.slices = self.view.of_rank(rank)
        self.workers: dict[int, RankWorker[Any, Any, Any, Any, Any]] = {}  # part -> its worker, once connected
        self._targets = {part: self._target(cut) for part, cut in self.slices}
        #: Reads banks of other nodes (transport nixl, or auto with a source by address).
        self.nixl: NixlTransport | None = None
        if cfg.reads_nixl:
            from kvstate.integrations.vllm.nixl_agent import process_agent
            self.nixl = process_agent()
        self._loads: dict[str, _Load] = {}
        self._finished: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._reasons: list[tuple[str, int, str]] = []
        self._stopping = threading.Event()
        #: Notified when a part's worker connects or is refused for good (start_layers waits on it).
        self._joined = threading.Condition()
        self._refused: set[int] = set()
        self._thread = threading.Thread(target=self._connect, name=f"kvstate-prefill-r{rank}", daemon=True)
        self._thread.start()

    @property
    def worker(self) -> RankWorker[Any, Any, Any, Any, Any] | None:
        """The worker of this rank's first part (its only one at equal TP sizes)."""
        return self.workers.get(self.slices[0][0]) if self.slices else None

    def _target(self, cut: Slice) -> tuple[Mapping[str, Any], Sliced | None]:
        """Where a part's slice lands: the pages' heads it fills (a view), and the heads of
        the bank block it reads; the whole tensors when it is every head of both."""
        if cut.src_head == cut.dst_head == 0 and cut.count == self.compat.kv_heads == self.view.compat.kv_heads:
            return self.kv_caches, None
        views = {name: t[:, cut.dst_head:cut.dst_head + cut.count] for name, t in self.kv_caches.items()}
        return views, Sliced(HEAD_AXIS, cut.src_head, cut.count)

    def _connect(self) -> None:
        """Connect every part's worker, then keep them connected: a worker whose
        coordinator went away (its connection closed, or silent past ``silence_s`` while
        this process or the scheduler's was starved) is replaced by a new connection. Its
        shares ended with it, so the loads they served fail and are recomputed; the next
        ones use the new worker. Only a coordinator's lasting refusal stops a part."""
        configs = {part: WorkerConfig(self.cfg.deployment, part, len(self.view.slices), self.coordinator_path,
                                      request_timeout_s=max(self.cfg.load_timeout_s / 2, 1.0),
                                      reuse=self.cfg.policy,  # the importer enforces the same switches
                                      source_rank=cut.src_rank, source_tp=self.view.compat.tp)
                   for part, cut in self.slices}
        while not self._stopping.is_set():
            for part, config in configs.items():
                old = self.workers.get(part)
                if part in self._refused or (old is not None and not old.coordinator_gone):
                    continue
                worker = self._connect_part(config, reconnect=old is not None)
                with self._joined:
                    if worker is None:
                        self._refused.add(part)
                    else:
                        self.workers[part] = worker
                    self._joined.notify_all()
                if worker is None:
                    continue
                if old is not None:
                    self.tally.add("reconnects")
                    log.warning("kvstate: prefill rank %d (part %d) reconnected to its coordinator", self.rank, part)
                    old.close(timeout=0.0)  # its shares already ended with their coordinator
            self._stopping.wait(RECHECK_S)

    def _connect_part(self, config: WorkerConfig, *, reconnect: bool) -> RankWorker[Any, Any, Any, Any, Any] | None:
        """A worker connected to the coordinator, retrying until it is up (vLLM builds
        workers before the scheduler) or this rank stops; None if the coordinator refuses
        it for good. ``duplicate_rank`` is retried on a reconnect: the coordinator may
        not have noticed the old connection end yet."""
        while not self._stopping.is_set():
            worker: RankWorker[Any, Any, Any, Any, Any] = RankWorker(config, self.transport(), remote=self.nixl)
            try:
                worker.start()
                return worker
            except (ChannelError, OSError) as exc:
                worker.close(timeout=0.0)  # its importer's threads, else one set per retry
                if (isinstance(exc, ChannelError) and exc.reason is ChannelReason.COORDINATOR_REFUSED
                        and not (reconnect and exc.code == "duplicate_rank")):
                    log.error("kvstate: the coordinator refused prefill rank %d (part %d): %s", self.rank,
                              config.rank, exc)
                    return None
            self._stopping.wait(RETRY_S)  # the scheduler side is not up yet
        return None

    # -- loads ------------------------------------------------------------------------------------

    def load(self, order: LoadOrder) -> None:
        self._loads[order.req_id] = _Load(order, time.monotonic())
        log.debug("t=%.6f %s: load order at rank %d", self._loads[order.req_id].started, order.req_id, self.rank)

    def progress(self) -> None:
        """Start the loads whose shares are ready; finish those that ended either way."""
        now = time.monotonic()
        for req_id, load in list(self._loads.items()):
            why = self._step(load, now)
            if why is not None:
                self._end(req_id, load, why)

    def _step(self, load: _Load, now: float) -> str | None:
        """None while the load goes on; "" once it completed; else why it failed. The load
        starts once every part of this rank is ready (the coordinator releases them
        together, once every part of every rank imported), each part its slice."""
        order = load.order
        if order.gid is None:
            return order.why or "not_started"
        late = now - load.started > self.cfg.load_timeout_s
        if load.handles is None:
            if self.cfg.layer_loads:
                return "not_ready"  # start_layers did not start it before its forward pass ran
            why = self._start(load, late)
            if why is not None or load.handles is None:
                return why
        if not all(h.done() for h in load.handles):
            if now - load.loading_since > self.cfg.load_timeout_s and not load.cancelled:
                load.cancelled = True
                for h in load.handles:
                    h.cancel()  # what has not started is cancelled; the rest completes
            return None
        results = [h.result() for h in load.handles]
        for r in results:
            if r is None or not r.ok:
                if load.cancelled:
                    return "timeout"
                why = getattr(r, "why", "")  # a remote load says why (a READ's timeout, a lost peer)
                return f"load_failed:{why}" if why else "load_failed"
        self.tally.add("bytes_loaded", sum(r.bytes for r in results if r is not None))
        return ""

    def _start(self, load: _Load, late: bool) -> str | None:
        """Start the load once every part of this rank is ready: None (started, or not
        yet), or why it cannot start."""
        order = load.order
        assert order.gid is not None
        if len(self.workers) < len(self.slices):
            return "rank_not_connected" if late else None
        shares = [self.workers[part].share(order.gid) for part, _ in self.slices]
        for share in shares:
            if share is not None and share.state in _ENDED:
                if share.problems:
                    return str(share.problems[0].reason.value)  # this rank rejected its descriptor
                return failure_code(share.cause) or f"share_{share.state}"
        if not all(share is not None and share.state == "ready" for share in shares):
            return "timeout" if late else None
        load.handles = []
        load.loading_since = time.monotonic()
        if late:
            self.tally.add("loads_late")
        log.debug("t=%.6f %s: shares ready, loading%s", load.loading_since, order.req_id,
                  f" ({load.loading_since - load.started:.3f} s after the order)" if late else "")
        for share, (part, _) in zip(shares, self.slices):
            assert share is not None
            dst, cut = self._targets[part]
            try:
                if isinstance(share.part, RemotePart):  # another node's bank: READ, then scatter
                    if cut is not None or self.nixl is None:
                        return "remote_not_supported"  # head slices are same-node only (config refuses them)
                    load.handles.append(RemoteLoad(share, self.nixl, order.slots, dst, order.dst_blocks,
                                                   timeout=self.cfg.load_timeout_s))
                else:
                    load.handles.append(share.load(list(order.slots), dst, list(order.dst_blocks), cut))
            except KvStateError as exc:
                return f"load_refused:{exc.reason.value}"  # TransitionError illegal: the share left ready
        return None

    # -- per-layer loads (cfg.layer_loads) ---------------------------------------------------------

    def start_layers(self) -> None:
        """Before the forward pass: start every load ordered for this step. Its shares must
        be ready first (the coordinator releases them once every part of every rank
        imported), so this waits for that, up to ``load_timeout_s`` from the order; a load
        that cannot start fails here, and its pages are recomputed."""
        for req_id, load in list(self._loads.items()):
            if load.handles is not None or load.order.gid is None:
                continue
            deadline = load.started + self.cfg.load_timeout_s
            for part, _ in self.slices:
                worker = self._connected(part, deadline)
                left = deadline - time.monotonic()
                if worker is not None and left > 0:
                    worker.wait(load.order.gid, ("ready", *_ENDED), left)
            # Started, not finished here: the layers wait for it (wait_layer), and it ends
            # after the forward pass (finished).
            why = self._start(load, time.monotonic() > deadline)
            if why is None and load.handles is None:
                why = "not_ready"  # the forward pass runs now: what is not loading is recomputed
            if why is not None:
                self._end(req_id, load, why)

    def _connected(self, part: int, deadline: float) -> RankWorker[Any, Any, Any, Any, Any] | None:
        """Part ``part``'s worker, waiting up to ``deadline`` for it to connect: a load
        ordered right after start-up may reach the forward pass before the connect thread
        joined the coordinator, and would otherwise be recomputed as not ready."""
        with self._joined:
            self._joined.wait_for(lambda: part in self.workers or part in self._refused or self._stopping.is_set(),
                                  timeout=max(0.0, deadline - time.monotonic()))
            return self.workers.get(part)

    def wait_layer(self, name: str) -> None:
        """In layer ``name``'s attention: wait until that layer's pages of every load
        running this step are in place (later layers may still be loading). A layer that
        fails or outlasts the load's time fails the whole load (its pages are recomputed)."""
        for req_id, load in list(self._loads.items()):
            if load.handles is None:
                continue
            left = load.loading_since + self.cfg.load_timeout_s - time.monotonic()
            handles = [h for h in load.handles if isinstance(h, TransferHandle)]  # no remote ones (config)
            ok = len(handles) == len(load.handles) and all(
                h.wait_region(name, max(0.0, left)) and h.region_ok(name) is not False for h in handles)
            self.tally.add("layer_waits")
            last = self.compat.layers[-1]
            if ok and name != last and any(h.region_ok(last) is None for h in handles):
                self.tally.add("layer_waits_ahead")  # this layer computes while a later one loads
            if not ok:
                for h in load.handles:
                    h.cancel()
                self._end(req_id, load, "load_failed" if left > 0 else "timeout")

    def _end(self, req_id: str, load: _Load, why: str) -> None:
        log.debug("t=%.6f %s: load ended at rank %d (%s)", time.monotonic(), req_id, self.rank, why or "ok")
        del self._loads[req_id]
        for h in load.handles or ():
            h.close()
        if not self.cfg.layer_loads:  # a per-layer load is the step's: vLLM never waits for it
            self._finished.add(req_id)
        self.tally.add("load_ms", 1000.0 * (time.monotonic() - load.started))
        if why:
            self._failed_blocks.update(load.order.dst_blocks)
            self._reasons.append((req_id, self.rank, why))
            self.tally.add("loads_failed")
            log.warning("kvstate: rank %d load of %s failed (%s): %d block(s) to recompute", self.rank, req_id, why,
                        len(load.order.dst_blocks))
        else:
            self.tally.add("loads_ok")
            self.tally.add("tokens_loaded", len(load.order.dst_blocks) * self.compat.block_size)

    def sizes(self) -> dict[str, int]:
        """Entries of every per-request structure of this rank (zero once every load was
        reported), and its workers' live shares."""
        live = sum(1 for w in list(self.workers.values()) for s in list(w.shares.values()) if not s.is_terminal)
        return {"loads": len(self._loads), "finished": len(self._finished), "failed_blocks": len(self._failed_blocks),
                "reasons": len(self._reasons), "live_shares": live}

    def busy(self) -> bool:
        """Loads in flight: this rank's threads (imports, leases) have work to do."""
        return bool(self._loads)

    def finished(self) -> tuple[set[str], set[int]]:
        """Loads that ended since the last call, and the pages of those that failed."""
        self.progress()
        done, failed = self._finished, self._failed_blocks
        self._finished, self._failed_blocks = set(), set()
        return done, failed

    def failures(self) -> LoadFailures:
        """Why each load reported failed since the last call (call it after :meth:`finished`)."""
        out, self._reasons = LoadFailures(tuple(self._reasons)), []
        return out

    def close(self) -> None:
        with self._joined:
            self._stopping.set()
            self._joined.notify_all()
        self._thread.join(2.0)
        for load in self._loads.values():
            for h in load.handles or ():
                h.close()
        self._loads.clear()
        for worker in self.workers.values():
            worker.close()
