"""The coordinator and its rank workers on real sockets, in this process (the multi-process
versions are test_processes.py and test_coordinated_stateful.py).

Each test names the invariant it checks; the leak check of this directory covers every
thread, fd and mapping the coordinator, the workers and the exporters took.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.errors import raises
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEPLOYMENT, GEOMETRY, expected_blocks, make_exporter
from kvstate import channel as chan
from kvstate.core.errors import (
    ArgumentInvalid, ConfigInvalid, GroupFailed, GroupRejected, KvStateError, ChannelError, TransitionError,
)
from kvstate.core.reasons import ArgumentReason, ConfigReason, RejectReason, ChannelReason, TransitionReason
from kvstate.share import protocol_msgs as msgs
from kvstate.share.coordinator import Coordinator, CoordinatorConfig
from kvstate.share.exporter import Exporter
from kvstate.share.rank_share import RankShare
from kvstate.share.rank_worker import RankWorker, WorkerConfig
from kvstate.transport.host import HostTransport
from kvstate.transport.native import default
from support.coordinated import CountingTransport, Prefill, socket_path
from support.reuse import REUSE_ON
from support.waiting import wait_until


#: Heartbeats and silence short enough that a stopped worker is noticed within a test.
FAST = {"heartbeat_s": 0.05, "silence_s": 0.5}


@pytest.fixture
def prefill_factory() -> Iterator[Any]:
    made: list[Prefill] = []

    def make(tp: int, *, config: dict[str, Any] | None = None, **kw: Any) -> Prefill:
        p = Prefill(DEPLOYMENT, tp, granularity=64 * 1024, config={**FAST, **(config or {})}, **kw)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


def _share_state(w: RankWorker[Any, Any, Any, Any, Any], gid: str) -> str | None:
    """The state of ``w``'s share of ``gid``; None while the worker has not made it yet
    (its commands are still on their way), so a wait keeps waiting instead of raising."""
    share = w.share(gid)
    return None if share is None else share.state


def _leases(ex: Exporter[Any, Any, Any, Any, Any]) -> int:
    return sum(len(b.leases) for b in ex.banks.values())



# -- the protocol, end to end -------------------------------------------------------------


def test_each_worker_leases_and_maps_only_its_own_rank(transport: HostTransport, prefill_factory: Any) -> None:
    """INV-COORD-LEASES and INV-COORD-READY-COMPLETE: tp leases in all, one per worker, and
    each worker loads its own rank's bytes (INV-LOAD-BYTES)."""
    ex = make_exporter(4, transport)
    p = prefill_factory(4)
    group = p.coordinator.import_group([ex.descriptor(r) for r in range(4)])
    assert group.state == "ready" and group.reports["imported"] == {0, 1, 2, 3}
    assert [w.leases() for w in p.workers] == [1, 1, 1, 1] and _leases(ex) == 4
    assert [len(b.leases) for b in ex.banks.values()] == [1, 1, 1, 1]
    assert [t.opens for t in p.transports] == [1, 1, 1, 1]
    for w in p.workers:
        share = w.wait(group.gid, ("ready",), 5.0)  # the ready command is on its way
        assert share is not None and share.state == "ready"
        dst = bytearray(3 * GEOMETRY.block_bytes)
        share.load_prefix([2, 9, 4], dst)
        assert bytes(dst) == expected_blocks(w.config.rank, [2, 9, 4])
        # the engine's path: bank blocks scattered into its pages, per region, one handle
        pages = {r.name: np.zeros((8, *r.block_shape), dtype=np.uint16) for r in GEOMETRY.regions}
        with share.load([2, 9], pages, [5, 1]) as handle:
            assert all(handle.wait_region(name, 5.0) for name in GEOMETRY.names) and handle.wait(5.0)
            assert not handle.failed_blocks()
        got = b"".join(pages[name][page].tobytes() for page in (5, 1) for name in GEOMETRY.names)
        assert got == expected_blocks(w.config.rank, [2, 9])
    group.drain(5.0)
    assert group.state == "closed" and wait_until(lambda: _leases(ex) == 0)
    states = [h for h, _ in group.history]
    assert [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]] == [
        "advertised", "checking", "importing", "ready", "draining", "quiescent", "closed"]
    assert all(w.share(group.gid).state == "closed" for w in p.workers)  # type: ignore[union-attr]


def test_loads_wait_for_the_coordinators_ready(transport: HostTransport, prefill_factory: Any) -> None:
    """INV-COORD-LOAD-AFTER-READY on the real worker: a share that is imported but not yet
    released refuses a load with TransitionError (ILLEGAL)."""
    from kvstate.harness.prefill_procs import HoldingWorker

    ex = make_exporter(2, transport)
    p = prefill_factory(2, worker_class=HoldingWorker)
    p.workers[1].hold({"open"})
    group = p.coordinator.start_group([ex.descriptor(r) for r in range(2)])
    share = p.workers[0].wait(group.gid, ("imported",), 5.0)
    # The coordinator sends "open" from the row that enters importing, before that state is
    # committed: a busy machine can show rank 0 imported while the group still reads checking.
    assert group.wait(("importing",), 5.0)
    assert share is not None and share.state == "imported" and group.state == "importing"
    with raises(TransitionError, TransitionReason.ILLEGAL) as info:
        share.load_prefix([0], bytearray(GEOMETRY.block_bytes))
    with raises(TransitionError, TransitionReason.ILLEGAL):
        share.load([0], {r.name: np.zeros((1, *r.block_shape), np.uint16) for r in GEOMETRY.regions}, [0])
    assert (info.value.state, info.value.event) == ("imported", "load")
    p.workers[1].release()
    assert group.wait(("ready",), 5.0)
    assert p.workers[0].wait(group.gid, ("ready",), 5.0) is share and share.state == "ready"
    share.load_prefix([0], bytearray(GEOMETRY.block_bytes))
    group.drain(5.0)


def test_descriptors_in_any_order_reach_the_worker_of_their_rank(transport: HostTransport,
                                                                  prefill_factory: Any) -> None:
    """The coordinator takes a group's descriptors in any order, as Importer.import_group
    does: each worker is sent its own rank's (rank 0's went to the worker of rank 1)."""
    ex = make_exporter(3, transport)
    p = prefill_factory(3)
    group = p.coordinator.import_group([ex.descriptor(r) for r in (2, 0, 1)])
    assert group.state == "ready" and [r.rank for r in group.ranks()] == [0, 1, 2]
    assert _leases(ex) == 3 and all(len(b.leases) == 1 for b in ex.banks.values())
    for wait in (lambda: group.wait(("raedy",), 1.0), lambda: p.workers[0].wait(group.gid, ["raedy"], 1.0)):
        with pytest.raises(ArgumentInvalid, match="raedy"):  # a misspelt state: refused, not waited out
            wait()
    group.drain(5.0)


def test_reports_read_after_the_phase_deadline_complete_nothing(transport: HostTransport,
                                                                prefill_factory: Any) -> None:
    """INV-COORD-READY-COMPLETE against a stalled coordinator: reports it reads only after
    the importing phase's deadline (a coordinator stopped that long reads them from its
    sockets while their workers gave up on it) do not make the group ready; the deadline
    fails it. Here the clock's first tick comes 5 s after the start, long after the reports."""
    from kvstate.harness.prefill_procs import HoldingWorker

    ex = make_exporter(2, transport)
    p = prefill_factory(2, worker_class=HoldingWorker,
                        config={"phase_timeout_s": 0.3, "heartbeat_s": 5.0, "silence_s": 20.0})
    p.workers[1].hold({"open"})
    group = p.coordinator.start_group([ex.descriptor(r) for r in range(2)])
    assert group.wait(("importing",), 5.0)
    time.sleep(0.5)                                  # past the deadline, before the next tick
    p.workers[1].release()
    assert wait_until(lambda: _share_state(p.workers[1], group.gid) == "imported"), group.history
    assert not group.wait(("ready",), 10.0)
    assert group.failure is not None and group.failure.event == "timeout", group.failure
    assert "ready" not in [s for s, _ in group.history]
    assert wait_until(lambda: _leases(ex) == 0)


def test_a_worker_whose_reader_was_busy_does_not_take_the_coordinator_for_dead(
        transport: HostTransport, prefill_factory: Any) -> None:
    """Silence means nothing came, not nothing read: a worker whose reader was held (here
    in a check; a stopped or starved process alike) for longer than the silence bound, with
    the coordinator's ticks waiting unread, stays connected and imports."""
    from kvstate.harness.prefill_procs import HoldingWorker

    ex = make_exporter(2, transport)
    p = prefill_factory(2, worker_class=HoldingWorker, config={"heartbeat_s": 0.05, "silence_s": 0.5})
    p.workers[1].hold({"check"})
    group = p.coordinator.start_group([ex.descriptor(r) for r in range(2)])
    time.sleep(1.2)                                  # the reader of rank 1 is held in the check
    p.workers[1].release()
    assert group.wait(("ready",), 5.0), group.history
    assert not p.workers[1].coordinator_gone
    group.drain(5.0)


@pytest.mark.parametrize("decode_tp, prefill_tp", [(4, 2), (4, 8), (2, 4)])
def test_heterogeneous_tp_is_refused_before_any_open(decode_tp: int, prefill_tp: int, transport: HostTransport,
                                                     prefill_factory: Any) -> None:
    """A decode group at one tp feeding a prefill group at another is refused by the
    coordinator with reason tp_mismatch, before any worker hears of it: zero opens, zero
    leases (INV-COORD-VALIDATE-BEFORE-OPEN)."""
    ex = make_exporter(decode_tp, transport)
    p = prefill_factory(prefill_tp)
    with pytest.raises(GroupRejected) as info:
        p.coordinator.import_group([ex.descriptor(r) for r in range(decode_tp)])
    assert RejectReason.TP_MISMATCH in info.value.reasons
    assert "heterogeneous TP" in str(info.value)
    group = list(p.coordinator.groups.values())[-1]
    assert group.state == "rejected" and [h for h, _ in group.history] == ["advertised", "rejected"]
    assert [t.opens for t in p.transports] == [0] * prefill_tp and _leases(ex) == 0
    assert all(not w.shares and not w.ended for w in p.workers)


def test_one_workers_rejection_leaves_every_rank_unopened(transport: HostTransport, prefill_factory: Any) -> None:
    """Per-rank validation is complete before any open: rank 1's worker accepts no device
    of this exporter, so it rejects its descriptor, and no rank opened anything."""
    ex = make_exporter(2, transport)
    p = prefill_factory(2, start_workers=False)
    p.workers[1].close()
    p.workers[1] = RankWorker(WorkerConfig(DEPLOYMENT, 1, 2, p.coordinator.socket_path, reuse=REUSE_ON,
                                           device_uuids=frozenset({bytes(16)})), p.transports[1])
    for w in p.workers:
        w.start()
    p.coordinator.wait_for_workers(5.0)
    with pytest.raises(GroupRejected) as info:
        p.coordinator.import_group([ex.descriptor(r) for r in range(2)])
    assert info.value.reasons == {RejectReason.DEVICE_UUID} and info.value.problems[0].rank == 1
    # rank 0 leased its bank while checking (phase 1); the abort returns that lease
    assert [t.opens for t in p.transports] == [0, 0] and wait_until(lambda: _leases(ex) == 0)
    assert wait_until(lambda: all(_share_state(w, list(p.coordinator.groups)[-1]) in ("failed", "rejected")
                             for w in p.workers))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_lease_refused_on_one_rank_leaves_every_rank_unopened(tp: int, transport: HostTransport,
                                                                prefill_factory: Any) -> None:
    """Two-phase import across processes (INV-COORD-VALIDATE-BEFORE-OPEN): the last rank's
    bank was re-advertised, so its exporter refuses that rank's lease (stale_generation),
    which no descriptor check can see. Every worker leases while checking and the
    coordinator says open only once every rank holds a checked lease, so no rank opens
    anything. (A one-phase worker leased and opened on ``open``: the other ranks opened
    while the last one was held at its open.)"""
    from kvstate.harness.prefill_procs import HoldingWorker

    ex = make_exporter(tp, transport)
    wires = [ex.descriptor(r) for r in range(tp)]
    ex.banks[tp - 1].advertise()  # generation 2: the wire above is stale for that rank only
    p = prefill_factory(tp, worker_class=HoldingWorker)
    p.workers[tp - 1].hold({"open"})
    try:
        with pytest.raises(GroupFailed) as info:
            p.coordinator.import_group(wires, timeout=5.0)
    finally:
        p.workers[tp - 1].release()
    assert [t.opens for t in p.transports] == [0] * tp  # whatever failed the group
    assert (info.value.event, info.value.rank) == ("part_failed", tp - 1)
    assert "stale_generation" in str(info.value)
    group = list(p.coordinator.groups.values())[-1]
    states = [h for h, _ in group.history]
    assert [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]] == ["advertised", "checking", "failed"]
    assert [t.opens for t in p.transports] == [0] * tp
    assert wait_until(lambda: all(_share_state(w, group.gid) == "failed" for w in p.workers))
    assert wait_until(lambda: _leases(ex) == 0) and all(w.leases() == 0 for w in p.workers)
    # the same workers import the fresh descriptors whole (one generation in a group)
    for r in range(tp - 1):
        ex.banks[r].advertise()
    fresh = p.coordinator.import_group([ex.descriptor(r) for r in range(tp)])
    assert fresh.state == "ready" and [t.opens for t in p.transports] == [1] * tp
    fresh.drain(5.0)


def test_workers_renew_their_leases_and_give_a_draining_bank_back(transport: HostTransport,
                                                                  prefill_factory: Any) -> None:
    """Lease renewal across processes (class 7): each worker renews its lease while it holds
    one, so a group outlives many lease terms with its banks ready. When the exporter
    drains, its banks refuse renewal: each worker drains its share (the bank is withdrawn),
    the coordinator drains and closes the group, and the exporter gets every bank back,
    never under a mapping (INV-NO-RELEASE-MAPPED). Without renewal each lease lapses after
    one term (the banks drain on their own) and the drain waits for mappings that stay."""
    ex = make_exporter(2, transport, lease_timeout_s=0.5)
    p = prefill_factory(2, renew_interval_s=0.1)
    group = p.coordinator.import_group([ex.descriptor(r) for r in range(2)])
    time.sleep(2.0)  # four lease terms
    assert [b.state for b in ex.banks.values()] == ["ready", "ready"]
    assert not any(lease.expired for b in ex.banks.values() for lease in b.leases.values())
    for w in p.workers:
        share = w.wait(group.gid, ("ready",), 5.0)
        assert share is not None and share.state == "ready"
        dst = bytearray(GEOMETRY.block_bytes)
        share.load_prefix([3], dst)
        assert bytes(dst) == expected_blocks(w.config.rank, [3])
    assert ex.drain(5.0) >= 0 and all(b.state == "released" for b in ex.banks.values())
    assert group.wait(("closed",), 5.0) and group.state == "closed"
    assert all(w.share(group.gid).state == "closed" for w in p.workers)  # type: ignore[union-attr]
    assert all(w.leases() == 0 for w in p.workers)


def test_a_load_whose_link_hung_up_before_its_copies_ended_fails(transport: HostTransport,
                                                                 prefill_factory: Any) -> None:
    """INV-LOAD-BYTES under a lease's end (tests/datapath/test_lease_end.py for the
    in-process group): the worker's link shuts while its load is queued (as on a
    timed-out request), the exporter ends the lease on the hang-up and writes the blocks
    again, and the load, which then copies the new bytes, reports every block failed."""
    ex = make_exporter(1, transport)
    p = prefill_factory(1)
    group = p.coordinator.import_group([ex.descriptor(0)])
    share = p.workers[0].wait(group.gid, ("ready",), 5.0)
    assert share is not None and share.state == "ready" and share.part is not None and share.part.link is not None
    ended = threading.Event()
    ex.banks[0].observe(lambda change: ended.set() if change.event == "peer_died" else None)
    pages = {r.name: np.zeros((4, *r.block_shape), dtype=np.uint16) for r in GEOMETRY.regions}
    native = default()
    native.pause(True)
    try:
        handle = share.load([2, 9], pages, [0, 1])
        share.part.link.native.close()  # type: ignore[union-attr]
        assert ended.wait(5.0)
        ex.banks[0].view()[:GEOMETRY.nbytes] = b"\xee" * GEOMETRY.nbytes  # a store into unpinned blocks
    finally:
        native.pause(False)
    with handle:
        assert handle.wait(5.0)
        assert all(pages[r.name][:2].tobytes() == b"\xee" * (2 * r.block_bytes) for r in GEOMETRY.regions)
        assert handle.failed_blocks() == frozenset({0, 1}), "a load across the lease's end was trusted"


def test_a_load_beside_a_store_into_its_blocks_fails(transport: HostTransport, prefill_factory: Any) -> None:
    """The same for a store (tests/datapath/test_block_epochs.py): the exporter stores into
    a block the worker's queued load reads; the load's block epochs moved, so it fails."""
    ex = make_exporter(1, transport)
    p = prefill_factory(1)
    group = p.coordinator.import_group([ex.descriptor(0)])
    share = p.workers[0].wait(group.gid, ("ready",), 5.0)
    assert share is not None and share.state == "ready" and share.part is not None
    pages = {r.name: np.zeros((4, *r.block_shape), dtype=np.uint16) for r in GEOMETRY.regions}
    with share.load([2, 9], pages, [0, 1]) as first:  # the epoch page is asked here, once
        assert first.wait(5.0) and first.failed_blocks() == frozenset()
    src = {r.name: np.full((1, *r.block_shape), 0xEEEE, dtype=np.uint16) for r in GEOMETRY.regions}
    native = default()
    native.pause(True)
    try:
        handle = share.load([2, 9], pages, [0, 1])
        store = ex.banks[0].store(src, [0], [9])
    finally:
        native.pause(False)
    with handle:
        assert handle.wait(5.0) and store.wait(5.0)
        assert handle.failed_blocks() == frozenset({0, 1}), "a load whose block a store rewrote was trusted"


def test_a_worker_that_dies_before_import_fails_the_group_at_once(transport: HostTransport,
                                                                    prefill_factory: Any) -> None:
    ex = make_exporter(2, transport)
    p = prefill_factory(2)
    p.workers[1].close()
    assert wait_until(lambda: 1 not in p.coordinator.links)
    with pytest.raises(GroupFailed) as info:
        p.coordinator.import_group([ex.descriptor(r) for r in range(2)])
    assert info.value.event == "worker_died" and info.value.rank == 1
    assert [t.opens for t in p.transports] == [0, 0]


def test_a_phase_timeout_fails_the_group_and_rolls_every_part_back(transport: HostTransport,
                                                                   prefill_factory: Any) -> None:
    """A worker stuck in its open: the coordinator's deadline fails the group (aborting,
    then failed once the others rolled back); the stuck one opens nothing afterwards."""
    from kvstate.harness.prefill_procs import HoldingWorker

    ex = make_exporter(2, transport)
    p = prefill_factory(2, worker_class=HoldingWorker, config={"phase_timeout_s": 0.3})
    p.workers[1].hold({"open"})
    with pytest.raises(GroupFailed) as info:
        p.coordinator.import_group([ex.descriptor(r) for r in range(2)])
    assert info.value.event == "timeout"
    group = list(p.coordinator.groups.values())[-1]
    assert "aborting" in [h for h, _ in group.history] and group.state == "failed"
    p.workers[1].release()
    assert wait_until(lambda: all(_share_state(w, group.gid) == "failed" for w in p.workers))
    assert wait_until(lambda: _leases(ex) == 0) and p.transports[1].opens == 0
    assert all(w.leases() == 0 for w in p.workers)


class LyingWorker(RankWorker[Any, Any, Any, Any, Any]):
    """Rank 1 reports a part of another size than its descriptor's."""

    def _imported_info(self, share: RankShare[Any, Any, Any, Any, Any]) -> dict[str, Any] | None:
        info = super()._imported_info(share)
        if info is not None and self.config.rank == 1:
            info["size"] *= 2
        return info


def test_an_incompatible_part_aborts_the_group(transport: HostTransport, prefill_factory: Any) -> None:
    ex = make_exporter(2, transport)
    p = prefill_factory(2, worker_class=LyingWorker)
    with pytest.raises(GroupFailed) as info:
        p.coordinator.import_group([ex.descriptor(r) for r in range(2)])
    assert (info.value.event, info.value.rank) == ("part_imported", 1)
    assert wait_until(lambda: _leases(ex) == 0)


def test_a_silent_coordinator_is_left_within_the_silence_bound(transport: HostTransport,
                                                               prefill_factory: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator that is alive but silent (hung): each worker cleans up alone within
    ``silence_s`` (after ready: drain, then close), and the exporter's leases end."""
    ex = make_exporter(2, transport)
    p = prefill_factory(2)
    group = p.coordinator.import_group([ex.descriptor(r) for r in range(2)])
    # Hung, not dead: its connections stay open and it sends nothing more, no tick and no
    # command. (Stopping it instead closes each connection within a read poll, and the
    # news of one worker leaving could reach the other as a command before its silence.)
    monkeypatch.setattr(p.coordinator, "_send_to", lambda rank, message: None)
    start = time.monotonic()
    assert wait_until(lambda: all(_share_state(w, group.gid) == "closed" for w in p.workers), 5.0)
    took = time.monotonic() - start
    assert took < p.workers[0].silence_s + 1.0
    assert wait_until(lambda: _leases(ex) == 0)
    # Each share ended because its worker heard nothing, not for another cause (a share
    # withdrawn by its exporter or its renewal closes too): say which, if one did not.
    ended = [(w.config.rank, w.coordinator_gone, getattr(w.share(group.gid), "cause", None),
              getattr(w.share(group.gid), "bank_withdrawn", None)) for w in p.workers]
    assert all(gone and not withdrawn for _, gone, _, withdrawn in ended), ended


def test_a_worker_closed_without_waiting_stops_once_its_shares_ended(transport: HostTransport,
                                                                      prefill_factory: Any) -> None:
    """``close(timeout=0)`` while a share still holds its part: the worker does not stop
    under it (that left the part mapped and its lease held for good, found by the API
    fuzz); the share ends as after a coordinator's death, then the worker stops by itself."""
    ex = make_exporter(2, transport)
    p = prefill_factory(2)
    group = p.coordinator.import_group([ex.descriptor(r) for r in range(2)])
    w = p.workers[0]
    share = w.share(group.gid)
    assert share is not None and share.part is not None and share.part.mapping is not None
    # Ready here too (the coordinator's ready may still be on its way), so the close drains
    # the share rather than rolling it back at once.
    assert wait_until(lambda: share.state == "ready", 10.0), share.state
    w.close(timeout=0.0)
    assert wait_until(lambda: share.state == "closed" and w._stopping.is_set(), 10.0), share.state
    assert share.part is None or share.part.mapping is None
    assert wait_until(lambda: len(ex.banks[0].leases) == 0)  # rank 0's lease came back
    w.close()  # idempotent once stopped


def test_a_worker_started_before_its_coordinator_joins_it_on_a_retry(transport: HostTransport) -> None:
    """Rank processes often come up before the coordinator listens: a start() that found no
    server leaves the worker able to start again (it closed its importer, which left the
    retried worker's every lease refused as "the importer is closed"); once connected, a
    second start() is refused."""
    ex = make_exporter(2, transport)
    path = socket_path().parent / "c.sock"
    workers = [RankWorker(WorkerConfig(DEPLOYMENT, r, 2, path, reuse=REUSE_ON), HostTransport(granularity=64 * 1024))
               for r in range(2)]
    coordinator = Coordinator(CoordinatorConfig(DEPLOYMENT, 2, path.parent, name="c", **FAST))
    try:
        for w in workers:
            with raises(ChannelError, ChannelReason.CLOSED):  # no server yet
                w.start()
        coordinator.start()
        for w in workers:
            w.start()
        coordinator.wait_for_workers(5.0)
        group = coordinator.import_group([ex.descriptor(r) for r in range(2)])
        assert group.state == "ready" and [w.leases() for w in workers] == [1, 1]
        with raises(ArgumentInvalid, ArgumentReason.STATE, match="started already"):
            workers[0].start()
        group.drain(5.0)
        assert group.state == "closed"
    finally:
        for w in workers:
            w.close()
        coordinator.close()


def test_a_worker_joins_one_coordinator_once(transport: HostTransport, prefill_factory: Any) -> None:
    """start() after the coordinator went away, or after close(), is refused with the way
    out (a new RankWorker): it was accepted, and the worker, still taking its coordinator
    for gone, never reported a step to the new one, which timed every group out."""
    ex = make_exporter(2, transport)
    p = prefill_factory(2)
    p.coordinator.close()  # the scheduler restarts
    assert wait_until(lambda: all(w.coordinator_gone for w in p.workers))
    coordinator = Coordinator(p.coordinator.config)
    coordinator.start()
    workers: list[RankWorker[Any, Any, Any, Any, Any]] = []
    try:
        for w in p.workers:
            with raises(ArgumentInvalid, ArgumentReason.STATE, match="make a new RankWorker"):
                w.start()
        p.workers[1].close()
        with raises(ArgumentInvalid, ArgumentReason.STATE, match="closed"):
            p.workers[1].start()
        workers = [RankWorker(WorkerConfig(DEPLOYMENT, r, 2, coordinator.socket_path, reuse=REUSE_ON),
                              HostTransport(granularity=64 * 1024)) for r in range(2)]
        for w in workers:
            w.start()
        coordinator.wait_for_workers(5.0)
        group = coordinator.import_group([ex.descriptor(r) for r in range(2)])
        assert group.state == "ready"
        group.drain(5.0)
    finally:
        for w in workers:
            w.close()
        coordinator.close()


# -- the coordinator's side of the protocol, spoken by hand --------------------------------


def _raw_worker(path: Path, rank: int, tp: int) -> tuple[chan.Channel, msgs.Message]:
    ch = chan.connect(path, timeout=5.0)
    ch.send(msgs.encode(msgs.Hello(rank, tp, os.getpid())), timeout=5.0)
    with ch.recv(timeout=5.0) as m:
        return ch, msgs.decode(m.payload)


@pytest.mark.parametrize("rank, tp, code", [(0, 2, "duplicate_rank"), (2, 2, "rank_range"), (0, 3, "tp_mismatch")])
def test_hello_is_refused_with_a_code(rank: int, tp: int, code: str, prefill_factory: Any) -> None:
    p = prefill_factory(2)
    ch, answer = _raw_worker(p.coordinator.socket_path, rank, tp)
    try:
        assert isinstance(answer, msgs.Refused) and answer.code == code
    finally:
        ch.close()
    w = RankWorker(WorkerConfig(DEPLOYMENT, 0, 2, p.coordinator.socket_path, reuse=REUSE_ON), HostTransport(granularity=64 * 1024))
    with raises(ChannelError, ChannelReason.COORDINATOR_REFUSED) as info:
        w.start()
    assert info.value.code == "duplicate_rank"


def test_a_repeated_report_counts_once(transport: HostTransport, prefill_factory: Any) -> None:
    """INV-COORD-READY-COMPLETE in Python: rank 0 reporting imported twice never stands in
    for rank 1 (the planted counting coordinator of tests/planted would be ready here)."""
    ex = make_exporter(2, transport)
    p = prefill_factory(2, start_workers=False)
    links = [_raw_worker(p.coordinator.socket_path, r, 2)[0] for r in range(2)]
    try:
        p.coordinator.wait_for_workers(5.0)
        group = p.coordinator.start_group([ex.descriptor(r) for r in range(2)])
        for r, ch in enumerate(links):
            ch.send(msgs.encode(msgs.Report(group.gid, r, "validated")), timeout=5.0)
        assert group.wait(("importing",), 5.0)
        d = group.validated.parts[0]  # type: ignore[union-attr]
        info = {"fingerprint": d.geometry.fingerprint(), "tp": 2, "generation": d.generation, "size": d.size,
                "leases": 1, "import_s": 0.001}
        for _ in range(2):
            links[0].send(msgs.encode(msgs.Report(group.gid, 0, "imported", info=info)), timeout=5.0)
        assert wait_until(lambda: len(group.history) >= 6)  # checking x3, importing, two reports
        time.sleep(0.05)
        assert group.state == "importing" and group.reports["imported"] == {0}
    finally:
        for ch in links:
            ch.close()
    assert wait_until(lambda: group.is_terminal) and group.state == "failed"  # both workers gone


def test_a_report_for_another_rank_closes_the_connection(transport: HostTransport, prefill_factory: Any) -> None:
    ex = make_exporter(2, transport)
    p = prefill_factory(2, start_workers=False)
    links = [_raw_worker(p.coordinator.socket_path, r, 2)[0] for r in range(2)]
    try:
        p.coordinator.wait_for_workers(5.0)
        group = p.coordinator.start_group([ex.descriptor(r) for r in range(2)])
        links[0].send(msgs.encode(msgs.Report(group.gid, 1, "validated")), timeout=5.0)
        assert wait_until(lambda: group.state == "failed")
        assert group.failure is not None and group.failure.event == "worker_died" and group.failure.rank == 0
    finally:
        for ch in links:
            ch.close()


def test_an_undeclared_command_is_the_coordinators_fault_and_the_worker_cleans_up(
        transport: HostTransport) -> None:
    """A coordinator that says ``ready`` to a share that is only validated breaks the rank
    table: the worker leaves it and ends the share alone, having opened nothing."""
    server = chan.Server(chan.make_socket_dir(socket_path()) / "fake.sock")
    w = RankWorker(WorkerConfig(DEPLOYMENT, 0, 2, server.path, reuse=REUSE_ON), CountingTransport(granularity=64 * 1024))
    ex = make_exporter(2, transport)
    try:
        from threading import Thread
        t = Thread(target=w.start)
        t.start()
        ch = server.accept(5.0)
        with ch.recv(5.0) as m:
            assert isinstance(msgs.decode(m.payload), msgs.Hello)
        ch.send(msgs.encode(msgs.Welcome(2, 0.05, 1.0)), timeout=5.0)
        t.join(5.0)
        ch.send(msgs.encode(msgs.Command("check", "g1", descriptor=ex.descriptor(0))), timeout=5.0)
        with ch.recv(5.0) as m:
            assert msgs.decode(m.payload) == msgs.Report("g1", 0, "validated")
        ch.send(msgs.encode(msgs.Command("ready", "g1")), timeout=5.0)
        assert wait_until(lambda: w.coordinator_gone and _share_state(w, "g1") == "failed")
        assert w.transport.opens == 0  # type: ignore[attr-defined]
        ch.close()
    finally:
        w.close()
        server.close()


# -- messages ------------------------------------------------------------------------------


def test_protocol_names_are_the_tables() -> None:
    msgs.check_against_tables()


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
                     | st.binary(max_size=8), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)
_fields = st.sampled_from(["kind", "rank", "tp", "pid", "version", "cmd", "group", "state", "descriptor", "blocks",
                           "why", "detail", "reasons", "info", "code", "heartbeat_s", "silence_s"])


@settings(max_examples=150, deadline=None)
@given(body=st.dictionaries(_fields, _json, max_size=7),
       kind=st.sampled_from(["hello", "welcome", "refused", "tick", "command", "report", "other"]))
def test_a_peers_message_decodes_or_is_refused_with_a_typed_error(body: dict[str, Any], kind: str) -> None:
    body = {**body, "kind": kind}
    try:
        data = chan.encode(body)
    except ChannelError as exc:
        if exc.reason is not ChannelReason.FRAME:
            raise
        return
    try:
        message = msgs.decode(data)
    except ChannelError as exc:
        if exc.reason not in (ChannelReason.PROTOCOL, ChannelReason.FRAME):
            raise
        return
    assert msgs.decode(msgs.encode(message)) == message  # what decodes, re-encodes the same


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_are_refused_with_a_typed_error(data: bytes) -> None:
    try:
        msgs.decode(data)
    except KvStateError:
        pass


_ints = st.integers(-(2**40), 2**40)
_messages = st.one_of(
    st.builds(msgs.Hello, _ints, _ints, _ints, _ints),
    st.builds(msgs.Welcome, _ints, st.floats(0, 1e6), st.floats(0, 1e6)),
    st.builds(msgs.Refused, st.text(max_size=10), st.text(max_size=10)),
    st.just(msgs.Tick()),
    st.builds(msgs.Command, st.sampled_from(msgs.COMMANDS), st.text(max_size=10), st.none() | st.binary(max_size=20),
              st.none() | st.just({"group": "g", "epochs": [1], "hashes": [2]}), st.text(max_size=10)),
    st.builds(msgs.Report, st.text(max_size=10), _ints, st.sampled_from(msgs.REPORTS), st.text(max_size=10),
              st.lists(st.text(max_size=5), max_size=3).map(tuple),
              st.none() | st.just({"fingerprint": b"f", "tp": 2, "generation": 1, "size": 4096, "leases": 1,
                                   "import_s": 0.5})))


@settings(max_examples=100, deadline=None)
@given(_messages)
def test_every_message_round_trips(message: msgs.Message) -> None:
    assert msgs.decode(msgs.encode(message)) == message


# -- class 1: only KvStateError leaves the coordinator's public API ------------------------


@pytest.mark.parametrize("field, value", [
    ("tp", 0), ("tp", "2"), ("tp", None), ("max_tp", 10 ** 6), ("socket_dir", "a\x00b"), ("socket_dir", 3),
    ("name", "a/b"), ("name", ".."), ("name", "\ud800"), ("phase_timeout_s", float("nan")),
    ("heartbeat_s", "1"), ("silence_s", 0.01), ("request_timeout_s", -1.0), ("check_socket", "yes"),
    ("handle_kinds", frozenset()), ("handle_kinds", {"memfd"}), ("deployment", b"demo"),
    # socket directories the channel would refuse only at start() (UNSAFE_PATH)
    ("socket_dir", "coord"), ("socket_dir", "/tmp/../coord"), ("socket_dir", "/tmp/" + "d" * 90),
])
def test_a_bad_coordinator_config_is_refused_by_name(field: str, value: object) -> None:
    kw: dict[str, Any] = {"deployment": DEPLOYMENT, "tp": 2, "socket_dir": socket_path(), field: value}
    with raises(ConfigInvalid, ConfigReason.FIELD) as info:
        CoordinatorConfig(**kw)
    assert info.value.field == f"CoordinatorConfig.{field}"


def test_a_coordinator_socket_dir_leaves_room_for_its_socket_name() -> None:
    """The socket's name counts: a directory that fits one name may not fit a longer one."""
    d = "/tmp/" + "d" * (107 - len("/tmp/") - len("/c.sock"))
    assert CoordinatorConfig(DEPLOYMENT, 2, d, name="c").socket_dir == d
    with raises(ConfigInvalid, ConfigReason.FIELD, match="socket_dir"):
        CoordinatorConfig(DEPLOYMENT, 2, d, name="cc")


@pytest.mark.parametrize("field, value", [
    ("rank", 2), ("rank", -1), ("rank", None), ("tp", 0), ("tp", 2.0), ("coordinator_path", 3),
    ("coordinator_path", "x\x00"), ("request_timeout_s", float("inf")), ("renew_interval_s", 0),
    ("drain_poll_s", None), ("device_uuids", {b"x"}), ("geometry_fingerprint", "ab"), ("keep_ended", 0),
    ("reuse", True), ("admission", "yes"), ("check_socket", 1),
    # socket paths the channel would refuse only at start() (UNSAFE_PATH)
    ("coordinator_path", "c.sock"), ("coordinator_path", "/tmp/../c.sock"), ("coordinator_path", "/" + "s" * 107),
])
def test_a_bad_worker_config_is_refused_by_name(field: str, value: object) -> None:
    kw: dict[str, Any] = {"deployment": DEPLOYMENT, "rank": 0, "tp": 2, "coordinator_path": socket_path() / "c.sock",
                          field: value}
    with raises(ConfigInvalid, ConfigReason.FIELD) as info:
        WorkerConfig(**kw)
    assert info.value.field == f"WorkerConfig.{field}"


def test_bad_arguments_to_the_coordinator_and_worker_are_typed_and_leave_them_working(
        transport: HostTransport, prefill_factory: Any) -> None:
    """Arguments are checked before any side effect; a valid call afterwards works."""
    ex = make_exporter(2, transport)
    p = prefill_factory(2)
    c, w = p.coordinator, p.workers[0]
    calls: list[Any] = [
        lambda: c.import_group(None), lambda: c.import_group([b"x"] * 10 ** 3), lambda: c.start_group("ab"),
        lambda: c.start_group([ex.descriptor(0)], blocks="b"), lambda: c.start_group([], bogus=1),
        lambda: c.wait_for_workers(float("nan")), lambda: c.expectation(nope=1),
        lambda: w.share(None), lambda: w.share("\x00"), lambda: w.wait("g", ["ready"], -1),
        lambda: w.wait("g", [1], 1.0), lambda: w.close("soon"),
        lambda: Coordinator("config"), lambda: RankWorker("config", transport),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(KvStateError):
            call()
    assert not c.groups and all(not x.shares for x in p.workers)
    group = c.import_group([ex.descriptor(r) for r in range(2)])
    assert group.state == "ready"
    with pytest.raises(KvStateError):
        group.drain("now")  # type: ignore[arg-type]
    with pytest.raises(KvStateError):
        group.wait(["ready"], None)  # type: ignore[arg-type]
    group.drain(5.0)
    assert group.state == "closed"
