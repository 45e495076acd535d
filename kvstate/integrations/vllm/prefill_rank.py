"""The prefill side of one TP rank, in its worker process: a
:class:`~kvstate.share.rank_worker.RankWorker` for this rank, and the loads of each step.

- At registration a thread connects the rank's worker to the coordinator in the scheduler
  process, retrying until it is up (vLLM builds workers before the scheduler).
- Each :class:`~.orders.LoadOrder` waits for this rank's share of its group to be
  ``ready`` (the coordinator says so only once every rank imported its part), then
  scatters the bank blocks into the engine's pages with ``RankShare.load``.
- Every order finishes, one way or the other, within ``load_timeout_s``: a load that
  completed, or a failure (the group failed or was rejected, the share ended, the load
  failed, the time ran out, this rank never connected). A failure names every page of the
  order, which vLLM (``kv_load_failure_policy="recompute"``) then recomputes, and its
  reason goes to the scheduler side in the same step (:meth:`PrefillRank.failures`); the
  request is reported finished either way (:meth:`PrefillRank.finished`).

Loads are asynchronous in vLLM's sense: the request waits (``WAITING_FOR_REMOTE_KVS``)
until every rank reported its load finished, so no forward pass reads a page while it
loads and no per-layer wait is needed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kvstate.core.errors import ChannelError, KvStateError
from kvstate.core.reasons import ChannelReason
from kvstate.integrations.vllm.config import ConnectorConfig
from kvstate.integrations.vllm.hashing import Compat
from kvstate.integrations.vllm.orders import LoadFailures, LoadOrder, failure_code
from kvstate.integrations.vllm.stats import Tally
from kvstate.integrations.vllm.remote_load import RemoteLoad
from kvstate.share.rank_worker import RankWorker, WorkerConfig
from kvstate.share.remote_part import RemotePart
from kvstate.share.transfer import TransferHandle
from kvstate.transport.host import HostTransport

if TYPE_CHECKING:
    from kvstate.transport.nixl.transport import NixlTransport

log = logging.getLogger(__name__)

RETRY_S = 0.05
#: share states in which a load can no longer start
_ENDED = ("draining", "quiescent", "closed", "rejected", "failed")


@attrs.define(eq=False)
class _Load:
    order: LoadOrder
    started: float
    handle: TransferHandle | RemoteLoad | None = None


class PrefillRank:
    """See the module docstring."""

    def __init__(self, cfg: ConnectorConfig, compat: Compat, rank: int, kv_caches: Mapping[str, Any],
                 tally: Tally, coordinator_path: Path) -> None:
        self.cfg, self.compat, self.rank, self.tally = cfg, compat, rank, tally
        self.kv_caches = dict(kv_caches)
        self.coordinator_path = coordinator_path
        self.worker: RankWorker[Any, Any, Any, Any, Any] | None = None
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
        self._thread = threading.Thread(target=self._connect, name=f"kvstate-prefill-r{rank}", daemon=True)
        self._thread.start()

    def _connect(self) -> None:
        config = WorkerConfig(self.cfg.deployment, self.rank, self.compat.tp, self.coordinator_path,
                              request_timeout_s=max(self.cfg.load_timeout_s / 2, 1.0),
                              reuse=self.cfg.policy)  # the importer enforces the same switches
        while not self._stopping.is_set():
            worker: RankWorker[Any, Any, Any, Any, Any] = RankWorker(config, HostTransport(), remote=self.nixl)
            try:
                worker.start()
            except (ChannelError, OSError) as exc:
                if isinstance(exc, ChannelError) and exc.reason is ChannelReason.COORDINATOR_REFUSED:
                    log.error("kvstate: the coordinator refused prefill rank %d: %s", self.rank, exc)
                    worker.close(timeout=0.0)
                    return
                worker.close(timeout=0.0)  # its importer's threads, else one set per retry
                self._stopping.wait(RETRY_S)  # the scheduler side is not up yet
                continue
            self.worker = worker
            return

    # -- loads ------------------------------------------------------------------------------------

    def load(self, order: LoadOrder) -> None:
        self._loads[order.req_id] = _Load(order, time.monotonic())

    def progress(self) -> None:
        """Start the loads whose share is ready; finish those that ended either way."""
        now = time.monotonic()
        for req_id, load in list(self._loads.items()):
            why = self._step(load, now)
            if why is not None:
                self._end(req_id, load, why)

    def _step(self, load: _Load, now: float) -> str | None:
        """None while the load goes on; "" once it completed; else why it failed."""
        order = load.order
        if order.gid is None:
            return order.why or "not_started"
        late = now - load.started > self.cfg.load_timeout_s
        if load.handle is None:
            worker = self.worker
            if worker is None:
                return "rank_not_connected" if late else None
            share = worker.share(order.gid)
            if share is not None and share.state == "ready":
                try:
                    if isinstance(share.part, RemotePart):  # another node's bank: READ, then scatter
                        left = max(self.cfg.load_timeout_s - (now - load.started), 0.1)
                        load.handle = RemoteLoad(share, self.nixl, order.slots, self.kv_caches, order.dst_blocks,
                                                 timeout=left)
                    else:
                        load.handle = share.load(list(order.slots), self.kv_caches, list(order.dst_blocks))
                except KvStateError as exc:
                    return f"load_refused:{exc.reason.value}"  # TransitionError illegal: the share left ready
            elif share is not None and share.state in _ENDED:
                if share.problems:
                    return str(share.problems[0].reason.value)  # this rank rejected its descriptor
                return failure_code(share.cause) or f"share_{share.state}"
            elif late:
                return "timeout"
            else:
                return None
        handle = load.handle
        if not handle.done():
            if late:
                handle.cancel()  # what has not started is cancelled; the rest completes
            return None
        result = handle.result()
        if result is None or not result.ok:
            why = getattr(result, "why", "")
            return f"load_failed:{why}" if why else "load_failed"
        self.tally.add("bytes_loaded", result.bytes)
        return ""

    def _end(self, req_id: str, load: _Load, why: str) -> None:
        del self._loads[req_id]
        if load.handle is not None:
            load.handle.close()
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
        reported), and its worker's live shares."""
        worker = self.worker
        live = 0 if worker is None else sum(1 for s in list(worker.shares.values()) if not s.is_terminal)
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
        self._stopping.set()
        self._thread.join(2.0)
        for load in self._loads.values():
            if load.handle is not None:
                load.handle.close()
        self._loads.clear()
        if self.worker is not None:
            self.worker.close()
