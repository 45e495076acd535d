"""Events that production code fires where they belong, as observers see them:
`register_failed` (bank), `incarnation_changed` (group) and `reject` (part).

Each test has its negative control: the event is not fired where it does not belong.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import attrs
import pytest

from support.errors import raises

from conftest import DEPLOYMENT, GEOMETRY, make_exporter
from kvstate.core.descriptor import decode, decode_cached, encode
from kvstate.core.errors import GroupRejected, ImportFailed, NativeError
from kvstate.core.reasons import ImportReason, NativeReason
from kvstate.core.identity import Incarnation
from kvstate.core.machine import StateChange
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.share.importer import Group, ImportConfig, Importer
from kvstate.share.part import lease_fields
from kvstate.transport.host import HostTransport
from support.faults import FaultyTransport
from support.reuse import REUSE_ON


def _changes(log: list[StateChange], machine: str) -> list[tuple[str, str, str]]:
    return [(c.event, c.source, c.dest) for c in log if c.machine == machine]


@pytest.mark.parametrize("step", ["reserve", "map", "set_access", "export"])
def test_failed_registration_records_register_failed(step: str, transport: HostTransport) -> None:
    """INV-REGISTER-ATOMIC, observed: `bank.register()` records the failure and re-raises."""
    log: list[StateChange] = []
    faulty = FaultyTransport(transport)
    ex = Exporter(ExportConfig(DEPLOYMENT, Path(tempfile.mkdtemp()) / "s", bytes(16), 1), faulty,  # type: ignore[arg-type]
                  observers=[log.append])
    bank = ex.add_bank(0, GEOMETRY)
    faulty.fail(step)
    with raises(NativeError, NativeReason.REGISTRATION) as info:
        bank.register()
    assert info.value.step == step
    assert (bank.state, bank.owner) == ("allocated", "engine")
    assert _changes(log, "bank") == [("register_failed", "allocated", "allocated")]
    bank.register()  # negative control: a registration that works records only `register`
    assert _changes(log, "bank")[1:] == [("register", "allocated", "registered")]
    ex.drain(1.0)
    assert bank.state == "released"


def _importer(transport: HostTransport, log: list[StateChange]) -> Importer:
    return Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), transport, observers=[log.append])


def test_lease_refused_as_stale_incarnation_fires_incarnation_changed(transport: HostTransport) -> None:
    ex = make_exporter(2, transport)
    old = [ex.descriptor(r) for r in range(2)]
    ex.incarnation = Incarnation.new()  # the exporter "restarted"
    log: list[StateChange] = []
    importer = _importer(transport, log)
    try:
        with pytest.raises(ImportFailed, match="stale_incarnation") as info:
            importer.import_group(old)
        assert info.value.reason is ImportReason.REFUSED
        assert ("incarnation_changed", "importing", "failed") in _changes(log, "group")
        assert "part_failed" not in [e for e, _, _ in _changes(log, "group")]
    finally:
        importer.close()


def test_other_import_failures_fire_part_failed(transport: HostTransport) -> None:
    ex = make_exporter(2, transport)
    log: list[StateChange] = []
    faulty = FaultyTransport(transport)
    importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), faulty, observers=[log.append])  # type: ignore[arg-type]
    try:
        faulty.fail("map")
        with pytest.raises(ImportFailed):
            importer.import_group([ex.descriptor(r) for r in range(2)])
        events = [e for e, _, _ in _changes(log, "group")]
        assert "part_failed" in events and "incarnation_changed" not in events
    finally:
        importer.close()


def test_a_new_incarnation_of_a_live_source_drains_its_groups(transport: HostTransport) -> None:
    """Exporter A serves (source, rank 0); B is the same source and rank from a new
    process. Importing from B shows A's process was replaced: A's ready group drains
    (incarnation_changed), its mapping still readable until unmapped. Importing again from
    A, or from another source, leaves A's group ready (negative controls)."""
    source = os.urandom(16)
    a = make_exporter(1, transport, name="a", source=source)
    log: list[StateChange] = []
    importer = _importer(transport, log)
    try:
        first: Group = importer.import_group([a.descriptor(0)])
        again = importer.import_group([a.descriptor(0)])
        other = importer.import_group([make_exporter(1, transport, name="other").descriptor(0)])
        assert (first.state, again.state, other.state) == ("ready", "ready", "ready")
        assert "incarnation_changed" not in [c.event for c in log]

        b = make_exporter(1, transport, name="b", source=source)
        assert b.incarnation != a.incarnation
        renewed = importer.import_group([b.descriptor(0)])
        assert renewed.state == "ready" and other.state == "ready"
        assert [(c.label, c.source, c.dest) for c in log if c.event == "incarnation_changed"] == \
            [(first.label, "ready", "draining"), (again.label, "ready", "draining")]
        for group in (first, again, other, renewed):
            group.drain()
        assert all(g.state == "closed" for g in (first, again, other, renewed))
    finally:
        importer.close()


def test_a_replayed_descriptor_of_an_old_incarnation_leaves_live_groups_ready(transport: HostTransport) -> None:
    """Only a lease granted under a new incarnation shows a restart: a descriptor of the
    previous one (a router may still hold it, unexpired) is refused at its lease, and the
    live group of the current incarnation stays ready."""
    source, where = os.urandom(16), Path(tempfile.mkdtemp(prefix="kvs-replay-"))
    where.chmod(0o700)
    first = make_exporter(1, transport, name="decode-0", source=source, socket_dir=where / "sock")
    old = [first.descriptor(0)]
    first.stop()  # the decode worker restarts at the same socket path
    again = make_exporter(1, transport, name="decode-0", source=source, socket_dir=where / "sock")
    assert again.incarnation != first.incarnation
    log: list[StateChange] = []
    importer = _importer(transport, log)
    try:
        live = importer.import_group([again.descriptor(0)])
        with pytest.raises(ImportFailed, match="stale_incarnation"):
            importer.import_group(old)
        assert live.state == "ready"
        assert [c.label for c in log if c.event == "incarnation_changed"] == [importer.groups[-1].label]
        live.drain()
    finally:
        importer.close()


def test_a_rejected_group_rejects_every_part_it_received(transport: HostTransport) -> None:
    """INV-REJECT-BEFORE-OPEN, observed per rank: every decoded part is rejected, unopened."""
    ex = make_exporter(2, transport)
    bad = encode(attrs.evolve(decode(ex.descriptor(1), DEPLOYMENT), rank=5), DEPLOYMENT)
    log: list[StateChange] = []
    importer = _importer(transport, log)
    try:
        with pytest.raises(GroupRejected):
            importer.import_group([ex.descriptor(0), bad])
        assert _changes(log, "part") == [("reject", "received", "rejected")] * 2
        assert _changes(log, "group") == [("reject", "advertised", "rejected")]
        assert all(p.mapping is None for p in importer.groups[-1].parts)
        log.clear()
        with pytest.raises(GroupRejected):  # a part that does not decode has no part machine
            importer.import_group([ex.descriptor(0), b"garbage"])
        assert _changes(log, "part") == [("reject", "received", "rejected")]
    finally:
        importer.close()


def test_the_exporters_observers_hear_of_a_natively_served_lease_at_once(transport: HostTransport) -> None:
    """The native lease server answers first and wakes its Python observer thread after
    (kvs_lease_answer_frame): that wake-up must still come. Without it the exporter's
    Python pumps its events only on its other rounds (measured: every lease heard of
    about 50 ms late, from the exporter's sweep); with it, well under 1 ms.
    Each lease is taken alone (a rank's phase 1: no mapped note, nothing else for the
    exporter's Python to do) and given back once heard of."""
    heard = threading.Condition()
    leases: list[float] = []

    def observe(change: StateChange) -> None:
        if change.machine == "bank" and change.event == "grant_lease":
            with heard:
                leases.append(time.monotonic())
                heard.notify_all()

    ex = Exporter(ExportConfig(DEPLOYMENT, Path(tempfile.mkdtemp()) / "s", bytes(16), 1), transport,
                  observers=[observe])
    bank = ex.add_bank(0, GEOMETRY)
    bank.register()
    bank.advertise()
    ex.start()
    importer = _importer(transport, [])
    d = decode_cached(ex.descriptor(0), DEPLOYMENT)  # made once: the exporter's own calls pump its events
    delays = []
    try:
        for i in range(15):
            grant = importer.peers.lease_one(d.socket_path, lease_fields(d, None), importer.config.request_timeout_s)
            granted = time.monotonic()
            with heard:
                assert heard.wait_for(lambda: len(leases) > i, timeout=10.0), "the observers never heard of it"
                delays.append(leases[i] - granted)
            grant.give_back()
    finally:
        importer.close()
        ex.drain(5.0)
        ex.stop()
    assert statistics.median(delays) < 0.02, delays
