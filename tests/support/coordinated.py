"""A prefill engine's coordinator and its rank workers, in this process on real sockets:
what the coordinator tests and the coordinator API fuzz both start."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from kvstate.core.identity import Deployment
from kvstate.share.coordinator import Coordinator, CoordinatorConfig
from kvstate.share.rank_worker import RankWorker, WorkerConfig
from kvstate.transport.host import HostTransport
from support.reuse import REUSE_ON


class CountingTransport(HostTransport):
    """The host transport, counting handle opens: a rejection must leave it at zero."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.opens = 0

    def import_(self, handle: Any, size: int) -> Any:
        self.opens += 1
        return super().import_(handle, size)


def socket_path(prefix: str = "kvs-coord-") -> Path:
    """A coordinator socket path in a fresh private directory."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(d, 0o700)
    return d / "s"


class Prefill:
    """A coordinator and ``tp`` workers, each worker with its own counting transport;
    started (and the workers registered) unless ``start_workers`` is False. ``config``:
    CoordinatorConfig fields over a 2 s phase timeout; ``worker_kw``: WorkerConfig fields."""

    def __init__(self, deployment: Deployment, tp: int, *, granularity: int,
                 worker_class: type[RankWorker[Any, Any, Any, Any, Any]] = RankWorker,
                 config: dict[str, Any] | None = None, start_workers: bool = True, **worker_kw: Any) -> None:
        cfg = {"phase_timeout_s": 2.0, **(config or {})}
        self.coordinator = Coordinator(CoordinatorConfig(deployment, tp, socket_path(), **cfg))
        self.coordinator.start()
        self.transports = [CountingTransport(granularity=granularity) for _ in range(tp)]
        self.workers = [worker_class(WorkerConfig(deployment, r, tp, self.coordinator.socket_path, reuse=REUSE_ON,
                                                  **worker_kw), self.transports[r]) for r in range(tp)]
        if start_workers:
            for w in self.workers:
                w.start()
            self.coordinator.wait_for_workers(5.0)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.coordinator.close()
