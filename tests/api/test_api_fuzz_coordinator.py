"""Issue 14, class 1, for the cross-process half of the API: the coordinator, its rank
workers, a coordinated group and a worker's share of it. Arbitrary arguments and calls in
any order raise only KvStateError (with a reason) and leak nothing; afterwards a valid
import through a coordinator still works.

The world: a real exporter (tp 2), a :class:`Coordinator` and two :class:`RankWorker`\\ s
on real sockets in this process, and one coordinated group they imported (ready).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.harness import leaks
from support.coordinated import Prefill
from surface import DEPLOYMENT, GRANULARITY, World, _methods
from test_api_fuzz import call_some

TP = 2
#: Waits whose whole timeout an arbitrary argument may ask for (up to 1e9 s is valid):
#: each has its own tests; here they would only stall the run.
SKIP = {"CoordinatedGroup.wait", "RankWorker.wait", "Coordinator.wait_for_workers"}


@settings(max_examples=int(os.environ.get("KVSTATE_API_FUZZ_EXAMPLES", "60")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_only_typed_errors_escape_the_coordinator_and_its_workers(data: st.DataObject) -> None:
    before = leaks.snapshot()
    w = World()
    prefill = Prefill(DEPLOYMENT, TP, granularity=GRANULARITY)
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
    prefill = Prefill(DEPLOYMENT, TP, granularity=GRANULARITY)
    try:
        group = prefill.coordinator.import_group([fresh.descriptor(r) for r in range(TP)], timeout=5.0)
        assert group.state == "ready"
        group.drain(5.0)
    finally:
        prefill.close()
        fresh.stop()
        fresh.drain(5.0)
