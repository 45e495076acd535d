"""Parked leases (kvstate.share.parked): a closed part's lease and mapping stay on its link,
and the next import of the same bank adopts them without asking the exporter.

Real exporters and importers in this process, real sockets and memfds. What must hold:
the adopted group reads the right bytes; nothing is ever left mapped or leased when a
parked lease ends (its term, a drain, a hang-up, the importer's close, a rollback); and a
lease that pins blocks, an older descriptor or another bank's descriptor never adopts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import DEPLOYMENT, GEOMETRY, expected_blocks, make_exporter
from kvstate.core.errors import GroupRejected, ImportFailed
from kvstate.share.importer import Group, ImportConfig, Importer
from kvstate.share.part import BlockRequest
from kvstate.reuse.inventory import Inventory
from kvstate.transport.host import HostTransport
from support.faults import FaultyTransport
from support.reuse import REUSE_ON, reuse_for
from support.waiting import wait_until


@pytest.fixture
def parking(transport: HostTransport) -> Iterator[Importer]:
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, park_s=30.0), transport)
    yield im
    im.close()


def load_ok(group: Group) -> None:  # type: ignore[type-arg]
    dst = [bytearray(2 * GEOMETRY.block_bytes) for _ in range(group.tp)]
    group.load_prefix([1, 5], dst)
    for part, buf in zip(group.parts, dst):
        assert bytes(buf) == expected_blocks(part.rank, [1, 5])


def leases(ex: Any) -> list[int]:
    return sorted(lid for b in ex.banks.values() for lid in b.leases)


def parked(im: Importer) -> int:
    return im.peers.parked()


def test_the_next_import_adopts_the_parked_leases_without_asking(transport: HostTransport, parking: Importer) -> None:
    ex = make_exporter(2, transport, name="adopt")
    wire = [ex.descriptor(0), ex.descriptor(1)]
    first = parking.import_group(wire)
    load_ok(first)
    held = leases(ex)
    first.drain(5.0)
    assert first.state == "closed" and all(p.mapping is None for p in first.parts)
    assert leases(ex) == held and parked(parking) == 2  # parked, not returned
    asked = ex.lease_server.lease_requests()
    second = parking.import_group(wire)
    assert ex.lease_server.lease_requests() == asked, "an adopted lease asked the exporter"
    assert [p.lease_id for p in second.parts] == held and parked(parking) == 0
    load_ok(second)
    second.drain(5.0)
    parking.close()
    assert wait_until(lambda: leases(ex) == [])  # the importer's close returns what is parked


def test_off_by_default_a_closed_part_returns_its_lease(transport: HostTransport, importer: Importer) -> None:
    ex = make_exporter(1, transport, name="off")
    importer.import_group([ex.descriptor(0)]).drain(5.0)
    assert leases(ex) == [] and parked(importer) == 0


def test_a_parked_lease_ends_after_its_term(transport: HostTransport) -> None:
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, park_s=0.2), transport)
    try:
        ex = make_exporter(1, transport, name="term")
        im.import_group([ex.descriptor(0)]).drain(5.0)
        assert leases(ex) != []
        assert wait_until(lambda: leases(ex) == [] and parked(im) == 0)
        fresh = im.import_group([ex.descriptor(0)])  # the ordinary path again
        load_ok(fresh)
        fresh.drain(5.0)
    finally:
        im.close()


def test_a_drain_of_the_exporter_ends_a_parked_lease(transport: HostTransport) -> None:
    """The renewal is refused: the parked mapping goes and the lease is returned, so the
    exporter's drain completes without any import."""
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, park_s=30.0, renew_interval_s=0.05), transport)
    try:
        ex = make_exporter(2, transport, name="drain", lease_timeout_s=0.3)
        im.import_group([ex.descriptor(0), ex.descriptor(1)]).drain(5.0)
        assert parked(im) == 2
        assert ex.drain(5.0) >= 0 and all(b.state == "released" for b in ex.banks.values())
        assert wait_until(lambda: parked(im) == 0)
    finally:
        im.close()


def test_a_hang_up_drops_a_parked_lease(transport: HostTransport, parking: Importer) -> None:
    ex = make_exporter(1, transport, name="hangup")
    wire = [ex.descriptor(0)]
    parking.import_group(wire).drain(5.0)
    assert parked(parking) == 1
    ex.stop()  # every connection it served shuts down
    assert wait_until(lambda: parked(parking) == 0)
    with pytest.raises((ImportFailed, GroupRejected)):  # its socket is gone, or found dead
        parking.import_group(wire)


def test_a_lease_that_pins_blocks_is_not_parked(transport: HostTransport, parking: Importer) -> None:
    """Its pins must end with its import: it is returned at close."""
    ex = make_exporter(1, transport, name="pins")
    ex.inventory = Inventory(8)
    ex.inventory.store("g", [11, 12])
    epoch = ex.inventory.epoch("g")
    group = parking.import_group([ex.descriptor(0)], blocks=BlockRequest("g", (epoch,), (11, 12)))
    assert ex.inventory.busy("g", 11) == (0, 1)
    group.drain(5.0)
    assert parked(parking) == 0 and leases(ex) == [] and ex.inventory.busy("g", 11) == (0, 0)


def test_an_older_descriptor_of_the_same_bank_does_not_adopt(transport: HostTransport, parking: Importer) -> None:
    """The newer generation adopts (a re-advertise keeps the lease); the older one takes
    the ordinary path, where the exporter refuses it, and the parked lease goes."""
    ex = make_exporter(1, transport, name="generations")
    old = ex.descriptor(0)
    parking.import_group([old]).drain(5.0)
    ex.banks[0].advertise()
    new = ex.descriptor(0)
    group = parking.import_group([new])
    assert ex.lease_server.lease_requests() == 1  # adopted
    load_ok(group)
    group.drain(5.0)
    assert parked(parking) == 1
    with pytest.raises(ImportFailed, match="stale_generation"):
        parking.import_group([old])
    assert parked(parking) == 0 and wait_until(lambda: leases(ex) == [])


def test_a_descriptor_older_than_the_bank_does_not_adopt(transport: HostTransport) -> None:
    """A descriptor superseded by a re-advertise that a renewal answer has told of: the
    generation the lease was granted for no longer adopts (the exporter would call it
    stale), the current one does."""
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, park_s=30.0, renew_interval_s=0.05), transport)
    try:
        ex = make_exporter(1, transport, name="superseded", lease_timeout_s=1.0)
        old = ex.descriptor(0)
        im.import_group([old]).drain(5.0)
        ex.banks[0].advertise()
        key = next(iter(im.peers._parked.values())).renewal_key
        assert wait_until(lambda: im.renewal is not None and im.renewal.state(key) is not None
                          and im.renewal.state(key).generation == 2)  # type: ignore[union-attr]
        with pytest.raises(ImportFailed, match="stale_generation"):
            im.import_group([old])
        assert ex.lease_server.lease_requests() == 2  # it asked: not adopted
    finally:
        im.close()


def test_another_exporters_bank_never_adopts(transport: HostTransport, parking: Importer) -> None:
    """Two exporters on one socket directory: the parked lease is filed by address and by
    the bank's incarnation and memory, so the other's rank 0 takes its own lease."""
    a = make_exporter(1, transport, name="a")
    b = make_exporter(1, transport, name="b")
    parking.import_group([a.descriptor(0)]).drain(5.0)
    group = parking.import_group([b.descriptor(0)])
    assert group.parts[0].lease_id in leases(b) and parked(parking) == 1
    group.drain(5.0)


def test_a_failed_import_returns_its_leases(transport: HostTransport) -> None:
    """A rollback is no close after use: rank 0 opened, rank 1's map failed, and rank 0's
    lease is returned, not parked (the group table's rollback returns every lease)."""
    faulty = FaultyTransport(transport)
    im = Importer(ImportConfig(DEPLOYMENT, **reuse_for(faulty), park_s=30.0), faulty)  # type: ignore[arg-type]
    try:
        ex = make_exporter(2, transport, name="failed")
        faulty.fail("map", after=1, kind="memory")
        with pytest.raises(ImportFailed):
            im.import_group([ex.descriptor(0), ex.descriptor(1)])
        assert parked(im) == 0 and wait_until(lambda: leases(ex) == [])
    finally:
        faulty.clear()
        im.close()


def test_a_rollback_unmaps_and_returns_an_adopted_lease(transport: HostTransport) -> None:
    """Rank 0 adopts its parked lease; rank 1's bank drains, so its lease is refused and the
    group fails: the adopted lease is returned and its mapping unmapped like any leased
    part's."""
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, park_s=30.0, renew_interval_s=0.05), transport)
    try:
        ex = make_exporter(2, transport, name="rollback", lease_timeout_s=0.3)
        wire = [ex.descriptor(0), ex.descriptor(1)]
        im.import_group(wire).drain(5.0)
        parked_ids = leases(ex)
        ex.banks[1].fire("drain")  # its parked lease's renewal is refused: it goes
        assert wait_until(lambda: parked(im) == 1 and not ex.banks[1].leases)
        with pytest.raises(ImportFailed):
            im.import_group(wire)
        assert parked(im) == 0 and wait_until(lambda: not ex.banks[0].leases)
        assert parked_ids[0] not in leases(ex)
    finally:
        im.close()


class _Deaf(Importer):  # type: ignore[type-arg]
    """An importer whose expiry thread hears no renewal outcome and sweeps nothing: a
    parked lease whose renewal failed stays filed, as between an outcome and its handling."""

    def renew_leases(self, groups: Any) -> list[Group]:  # type: ignore[type-arg]
        return []

    def _sweep_parked(self) -> None:
        pass


def test_a_parked_lease_whose_renewal_failed_is_not_adopted(transport: HostTransport) -> None:
    im = _Deaf(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, park_s=30.0, renew_interval_s=0.05), transport)
    try:
        ex = make_exporter(1, transport, name="deaf", lease_timeout_s=0.3)
        wire = [ex.descriptor(0)]
        im.import_group(wire).drain(5.0)
        ex.banks[0].fire("drain")  # renewals are refused from now on
        assert im.renewal is not None and len(im.renewal._parts) == 1
        key = next(iter(im.renewal._parts))
        assert wait_until(lambda: im.renewal.state(key) is not None and im.renewal.state(key).failed)  # type: ignore[union-attr]
        assert parked(im) == 1
        with pytest.raises(ImportFailed):  # the ordinary path, which the draining bank refuses
            im.import_group(wire)
        assert parked(im) == 0
    finally:
        im.close()


def test_the_exporter_sees_one_lease_renewed_across_imports(transport: HostTransport) -> None:
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, park_s=30.0, renew_interval_s=0.05), transport)
    try:
        ex = make_exporter(1, transport, name="renewed", lease_timeout_s=0.3)
        wire = [ex.descriptor(0)]
        for _ in range(5):
            group = im.import_group(wire)
            load_ok(group)
            group.drain(5.0)
            time.sleep(0.2)  # parked across most of a lease term
        assert len(leases(ex)) == 1 and ex.lease_server.lease_requests() == 1
        assert not any(lease.expired for b in ex.banks.values() for lease in b.leases.values())
    finally:
        im.close()
