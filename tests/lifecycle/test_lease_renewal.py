"""Issue 14, class 7: lifetimes across processes.

Importers renew their leases while they map; a lease that runs out unrenewed drains its
bank but is kept until its importer unmaps (returning it) or its connection closes, so an
exporter never releases under a live mapping (INV-NO-RELEASE-MAPPED). A bank can be
advertised again before its TTL; TTL and lease expiry are observed events with reasons.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from support.errors import raises

from conftest import DEPLOYMENT, GEOMETRY, expected_blocks, make_exporter
from kvstate.core.errors import ImportFailed, TimedOut
from kvstate.core.reasons import TimeoutReason
from kvstate.core.machine import StateChange
from kvstate.share.importer import Group, ImportConfig, Importer
from kvstate.transport.host import HostTransport
from support.reuse import REUSE_ON
from support.waiting import wait_until



class HungImporter(Importer):  # type: ignore[type-arg]
    """An importer whose renewal is stuck: it maps, but never renews (renewal left to
    Python, whose rounds do nothing)."""

    def renew_leases(self, groups: Any) -> list[Group]:  # type: ignore[type-arg]
        return []

    def expire_leases(self, groups: Any) -> list[Group]:  # type: ignore[type-arg]
        return []


def load_ok(group: Group) -> None:  # type: ignore[type-arg]
    dst = [bytearray(2 * GEOMETRY.block_bytes) for _ in range(group.tp)]
    group.load_prefix([1, 5], dst)
    for part, buf in zip(group.parts, dst):
        assert bytes(buf) == expected_blocks(part.rank, [1, 5])


def test_renewal_keeps_a_mapped_group_past_many_lease_terms(transport: HostTransport, importer: Importer) -> None:
    ex = make_exporter(2, transport, name="renew", lease_timeout_s=0.3)
    group = importer.import_group([ex.descriptor(0), ex.descriptor(1)])
    time.sleep(1.5)  # five lease terms
    assert group.state == "ready" and group.expired_at is None
    assert all(b.state == "ready" and len(b.leases) == 1 and not next(iter(b.leases.values())).expired
               for b in ex.banks.values())
    load_ok(group)
    group.drain(5.0)
    assert all(not b.leases for b in ex.banks.values())


def test_expiry_while_mapped_drains_the_bank_and_never_releases_under_the_mapping(transport: HostTransport) -> None:
    """A hung importer stops renewing: the bank drains (an observed lease_expired with a
    reason), keeps the expired lease, and its release waits for the importer's unmap."""
    ex = make_exporter(1, transport, name="hung", lease_timeout_s=0.2)
    seen: list[StateChange] = []
    ex.banks[0].observe(seen.append)
    importer = HungImporter(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, native_renewal=False), transport)
    try:
        group = importer.import_group([ex.descriptor(0)])
        bank = ex.banks[0]
        assert wait_until(lambda: bank.state == "draining")
        expired = [c for c in seen if c.event == "lease_expired"]
        assert len(expired) == 1 and expired[0].reason and "not renewed within 0.2 s" in expired[0].reason
        assert len(bank.leases) == 1 and next(iter(bank.leases.values())).expired, "INV-NO-RELEASE-MAPPED"
        with raises(TimedOut, TimeoutReason.DRAIN):
            ex.drain(0.3)  # the importer still maps the bank
        assert bank.state == "draining" and group.parts[0].mapping is not None
        load_ok(group)    # its mapping is intact: nothing was released under it
        group.drain(5.0)  # the importer unmaps and returns the expired lease
        assert ex.drain(5.0) >= 0 and bank.state == "released"
    finally:
        importer.close()


def test_a_closed_connection_ends_an_expired_lease(transport: HostTransport) -> None:
    ex = make_exporter(1, transport, name="hung-dies", lease_timeout_s=0.2)
    importer = HungImporter(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, native_renewal=False), transport)
    try:
        group = importer.import_group([ex.descriptor(0)])
        bank = ex.banks[0]
        assert wait_until(lambda: bank.state == "draining")
        group.parts[0]._unmap()             # the importer's process exits: mapping gone,
        ch = group.parts[0].channel         # then its connection closes
        assert ch is not None
        ch.close()
        assert wait_until(lambda: not bank.leases)
        assert ex.drain(5.0) >= 0 and bank.state == "released"
    finally:
        importer.close()


def test_a_draining_bank_refuses_renewal_and_its_importer_lets_go(transport: HostTransport,
                                                                  importer: Importer) -> None:
    """The exporter drains; renewals are refused; the importer's group expires (with a
    reason) and closes itself once unpinned, so the exporter's drain completes without
    the application draining the group."""
    ex = make_exporter(2, transport, name="drain-refuses", lease_timeout_s=0.3)
    seen: list[StateChange] = []
    group = importer.import_group([ex.descriptor(0), ex.descriptor(1)])
    group.observe(seen.append)
    assert ex.drain(5.0) >= 0 and all(b.state == "released" for b in ex.banks.values())
    assert group.state == "closed" and all(p.mapping is None for p in group.parts)
    reasons = [c.reason for c in seen if c.event == "expired"]
    assert reasons and "renewal failed" in (reasons[0] or "") and "not_renewing" in (reasons[0] or "")


def test_readvertise_before_ttl_keeps_leases_and_serves_new_imports(transport: HostTransport,
                                                                    importer: Importer) -> None:
    ex = make_exporter(1, transport, name="readvertise")
    bank = ex.banks[0]
    old = ex.descriptor(0)
    group = importer.import_group([old])
    assert wait_until(lambda: bank.state == "ready")  # the importer's mapped notice arrived
    bank.advertise()              # before its TTL, while leased and mapped
    assert bank.state == "ready" and bank.generation == 2 and len(bank.leases) == 1
    load_ok(group)                # the lease granted on generation 1 stays good
    with pytest.raises(ImportFailed, match="stale_generation"):
        importer.import_group([old])
    fresh = importer.import_group([ex.descriptor(0)])
    load_ok(fresh)
    for g in (group, fresh):
        g.drain(5.0)


def test_ttl_expiry_is_an_observed_event_and_the_bank_can_advertise_again(transport: HostTransport,
                                                                          importer: Importer) -> None:
    ex = make_exporter(1, transport, name="ttl")
    bank = ex.banks[0]
    seen: list[StateChange] = []
    bank.observe(seen.append)
    bank.descriptor_expires_ns = time.time_ns()  # its TTL runs out now (the expiry thread sees it)
    assert wait_until(lambda: bank.state == "registered")
    change = [c for c in seen if c.event == "descriptor_expired"]
    assert len(change) == 1 and change[0].reason and "TTL" in change[0].reason
    with pytest.raises(Exception):
        ex.descriptor(0)          # withdrawn
    bank.advertise()
    assert bank.state == "advertised" and bank.generation == 2
    group = importer.import_group([ex.descriptor(0)])
    load_ok(group)
    group.drain(5.0)


def test_a_withdrawn_descriptor_gets_no_lease(transport: HostTransport, importer: Importer) -> None:
    """The exporter withdrew the descriptor at its TTL: a lease on it is refused in phase
    1 (nothing opened), even though the importer's clock still finds it fresh."""
    ex = make_exporter(1, transport, name="ttl-refused")
    wire = ex.descriptor(0)
    ex.banks[0].descriptor_expires_ns = time.time_ns()
    assert wait_until(lambda: ex.banks[0].state == "registered")
    with pytest.raises(ImportFailed, match="not_leasing"):
        importer.import_group([wire])
    assert importer.groups[-1].state == "failed" and not ex.banks[0].leases
