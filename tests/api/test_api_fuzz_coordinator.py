"""Issue 14, class 1, for the cross-process half of the API: the coordinator, its rank
workers, a coordinated group and a worker's share of it. Arbitrary arguments and calls in
any order raise only KvStateError (with a reason) and leak nothing; afterwards a valid
import through a coordinator still works.

The world: a real exporter (tp 2), a :class:`Coordinator` and two :class:`RankWorker`\\ s
on real sockets in this process, and one coordinated group they imported (ready).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.harness import leaks
from kvstate.share.coordinator import Coordinator, CoordinatorConfig
from kvstate.share.rank_worker import RankWorker, WorkerConfig
from kvstate.transport.host import HostTransport
from surface import DEPLOYMENT, GRANULARITY, REUSE, World, _methods
from test_api_fuzz import call_some

TP = 2
#: Waits whose whole timeout an arbitrary argument may ask for (up to 1e9 s is valid):
#: each has its own tests; here they would only stall the run.
SKIP = {"CoordinatedGroup.wait", "RankWorker.wait", "Coordinator.wait_for_workers"}


class Prefill:
    """A coordinator and its workers, started; :meth:`close` stops them all."""

    def __init__(self, transport: HostTransport) -> None:
        d = Path(tempfile.mkdtemp(prefix="kvs-fuzzc-"))
        os.chmod(d, 0o700)
        self.coordinator = Coordinator(CoordinatorConfig(DEPLOYMENT, TP, d / "s", phase_timeout_s=2.0))
        self.coordinator.start()
        self.workers: list[RankWorker[Any, Any, Any, Any, Any]] = [
            RankWorker(WorkerConfig(DEPLOYMENT, r, TP, self.coordinator.socket_path, reuse=REUSE), transport)
            for r in range(TP)]
        for w in self.workers:
            w.start()
        self.coordinator.wait_for_workers(5.0)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.coordinator.close()


@settings(max_examples=int(os.environ.get("KVSTATE_API_FUZZ_EXAMPLES", "60")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_only_typed_errors_escape_the_coordinator_and_its_workers(data: st.DataObject) -> None:
    before = leaks.snapshot()
    w = World()
    prefill = Prefill(HostTransport(granularity=GRANULARITY))
    try:
        group = prefill.coordinator.import_group([w.exporter.descriptor(r) for r in range(TP)], timeout=5.0)
        share = prefill.workers[0].share(group.gid)
        assert share is not None
        surface = _methods(prefill.coordinator, "Coordinator") + _methods(group, "CoordinatedGroup") + \
            _methods(prefill.workers[0], "RankWorker") + _methods(share, "RankShare")
        call_some([(n, fn) for n, fn in surface if n not in SKIP], data)
        still_works(w)
    finally:
        prefill.close()
        w.close()
    found = leaks.settled_leaks(before, grace_s=3.0)
    assert not found, f"leaked: {found}"


def still_works(w: World) -> None:
    """A valid import through a fresh coordinator and workers, drained."""
    fresh = w.make_exporter(w.dir / "again")
    prefill = Prefill(HostTransport(granularity=GRANULARITY))
    try:
        group = prefill.coordinator.import_group([fresh.descriptor(r) for r in range(TP)], timeout=5.0)
        assert group.state == "ready"
        group.drain(5.0)
    finally:
        prefill.close()
        fresh.stop()
        fresh.drain(5.0)
