"""Exporter and importer end to end in one process: real sockets, fds, memfds, native ops."""

from __future__ import annotations

import threading
import time

import attrs
import pytest

from support.errors import raises

from conftest import DEPLOYMENT, GEOMETRY, expected_blocks, make_exporter
from kvstate.core.errors import Busy
from kvstate.core.reasons import BusyReason
from kvstate.transport.nixl.handle import HandleDefect
from kvstate.core.capabilities import Access
from kvstate.core.descriptor import decode, encode
from kvstate.core.errors import (
    ArgumentInvalid, GroupRejected, ImportFailed, KvStateError, ChannelError, NativeError, TransitionError,
    TimedOut,
)
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.identity import Incarnation
from kvstate.share.importer import ImportConfig, Importer
from kvstate.core.machine import StateChange
from kvstate.core.reasons import (
    ArgumentReason, ImportReason, RejectReason, ImportDefect, ChannelReason, TimeoutReason, NativeReason,
    TransitionReason,
)
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.transport.host import HostTransport
from support.faults import FaultyTransport
from support.reuse import REUSE_ON


def buffers(tp: int, nblocks: int) -> list[bytearray]:
    return [bytearray(nblocks * GEOMETRY.block_bytes) for _ in range(tp)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_import_load_drain_release(tp: int, transport: HostTransport, importer: Importer) -> None:
    """INV-LOAD-BYTES and INV-RELEASE-QUIESCENT on the real path."""
    ex = make_exporter(tp, transport)
    try:
        group = importer.import_group([ex.descriptor(r) for r in range(tp)])
        assert group.state == "ready"
        deadline = time.monotonic() + 2  # `mapped` is a notification: the bank follows shortly
        while any(b.state != "ready" for b in ex.banks.values()) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert [b.state for b in ex.banks.values()] == ["ready"] * tp
        blocks = [7, 0, 31, 3]
        dst = buffers(tp, len(blocks))
        result = group.load_prefix(blocks, dst)
        assert result.bytes == tp * len(blocks) * GEOMETRY.block_bytes
        for r in range(tp):
            assert bytes(dst[r]) == expected_blocks(r, blocks)
        group.drain()
        assert group.state == "closed" and all(p.mapping is None for p in group.parts)
        ex.drain(5.0)
        assert all(b.state == "released" for b in ex.banks.values())
    finally:
        ex.stop()


def test_nobody_but_its_part_or_bank_unmaps_an_idle_mapping(transport: HostTransport, importer: Importer) -> None:
    """``transport.unmap(part.mapped())`` and the like are refused (Busy, OWNED) and change
    nothing: the group still loads, and the part and the bank still close and release
    all they hold. (Accepted, the owner's own unmap later failed and leaked the rest.)"""
    ex = make_exporter(1, transport)
    try:
        group = importer.import_group([ex.descriptor(0)])
        part, bank = group.parts[0], ex.banks[0]
        for mapping in (part.mapped(), bank.mapped()):
            with raises(Busy, BusyReason.OWNED):
                transport.unmap(mapping)
            with raises(Busy, BusyReason.OWNED):
                transport.set_access(mapping, Access.NONE)
            with raises(Busy, BusyReason.MAPPED):
                transport.release(mapping.allocation)
            with raises(Busy, BusyReason.MAPPED):
                transport.free(mapping.reservation)
        dst = buffers(1, 2)
        group.load_prefix([3, 9], dst)
        assert bytes(dst[0]) == expected_blocks(0, [3, 9])
        mappings = (part.mapped(), bank.mapped())
        group.drain()
        assert group.state == "closed" and part.mapping is None and part.allocation is None
        ex.drain(5.0)
        assert bank.state == "released" and bank.mapping is None
        for mapping in mappings:  # each unmapped by its owner, its reservation freed
            with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
                transport.stats(mapping)
            with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
                transport.free(mapping.reservation)
    finally:
        ex.stop()


def test_rejected_group_opens_nothing(transport: HostTransport, importer: Importer) -> None:
    """INV-REJECT-BEFORE-OPEN: one bad descriptor, no lease asked, nothing mapped."""
    ex = make_exporter(2, transport)
    try:
        before = transport.native.stats()
        good = ex.descriptor(0)
        bad = encode(attrs.evolve(decode(ex.descriptor(1), DEPLOYMENT), rank=5), DEPLOYMENT)
        with pytest.raises(GroupRejected) as info:
            importer.import_group([good, bad])
        assert RejectReason.RANK_RANGE in info.value.reasons
        with pytest.raises(GroupRejected) as info:
            importer.import_group([good, b"garbage"])
        assert RejectReason.MALFORMED in info.value.reasons
        assert all(not b.leases and b.state == "advertised" for b in ex.banks.values())
        after = transport.native.stats()
        assert (after.allocations, after.regions) == (before.allocations, before.regions)
    finally:
        ex.stop()


def test_the_importers_own_expectations_reject_before_open(transport: HostTransport, importer: Importer) -> None:
    """INV-REJECT-BEFORE-OPEN for what the importer itself fixes in its config: the banks'
    geometry, the block format its pages hold, the devices it accepts. A group that
    differs in one of them is rejected whole with that reason, before any lease is asked;
    with matching expectations the same group imports."""
    ex = make_exporter(2, transport)
    try:
        wire = [ex.descriptor(r) for r in range(2)]
        other = Geometry.uniform(layers=2, kv_heads=2, head_dim=16, block_tokens=8, dtype=DType.FP16,
                                 layout=Layout.LAYER_MAJOR, num_blocks=32)
        for field, value, reason in [("geometry_fingerprint", other.fingerprint(), RejectReason.GEOMETRY),
                                     ("block_format", other.format_fingerprint(), RejectReason.GEOMETRY),
                                     ("device_uuids", frozenset({bytes(16)}), RejectReason.DEVICE_UUID)]:
            im = Importer(attrs.evolve(importer.config, **{field: value}), transport)
            try:
                with pytest.raises(GroupRejected) as info:
                    im.import_group(wire)
                assert set(info.value.reasons) == {reason}, field
            finally:
                im.close()
        assert all(not b.leases and b.state == "advertised" for b in ex.banks.values())
        im = Importer(attrs.evolve(importer.config, geometry_fingerprint=GEOMETRY.fingerprint(),
                                   block_format=GEOMETRY.format_fingerprint(),
                                   device_uuids=frozenset({transport.device_uuid()})), transport)
        try:
            group = im.import_group(wire)
            assert group.state == "ready"
            group.drain()
        finally:
            im.close()
    finally:
        ex.stop()


@pytest.mark.parametrize(("cause", "reason"), [
    (ImportFailed.lease_refused("stale_generation", "re-advertised"), ImportReason.REFUSED),
    (ImportFailed.lease_refused("stale_inventory", "evicted"), ImportReason.STALE),
    (ChannelError(ChannelReason.PEER_DIED, "exporter gone"), ImportReason.PEER),
    (ChannelError(ChannelReason.FRAME, "not JSON"), ImportReason.MALFORMED),
    (ImportFailed.handle(ImportDefect.FD_UNSEALED, "no seals", call="receive_handle", code=-1), ImportReason.HANDLE),
    (ImportFailed.handle(ImportDefect.FDS, "two fds"), ImportReason.HANDLE),
    (NativeError.native("map", -12, "ENOMEM", NativeReason.OS, errno=12), ImportReason.NATIVE),
    (Busy.native(BusyReason.PINNED, "kvs_unmap", -3, "pinned"), ImportReason.NATIVE),
    (ArgumentInvalid.native("kvs_map", -2, "no such region", ArgumentReason.UNKNOWN_OBJECT), ImportReason.NATIVE),
    (ArgumentInvalid.of("blocks", ArgumentReason.TYPE, "not a list"), ImportReason.FAILED),
    (ChannelError(ChannelReason.TIMEOUT, "silent exporter"), ImportReason.PEER),
    (TimedOut.nixl("transfer", "stopped exporter"), ImportReason.NATIVE),
    (ImportFailed.nixl_handle(HandleDefect.STALE_GENERATION, "older"), ImportReason.HANDLE),
    (NativeError.effect("part", "leased", "open", "effect native_import", OSError(5, "EIO")), ImportReason.NATIVE),
    (NativeError.effect("part", "leased", "open", "effect native_import", RuntimeError("bug")), ImportReason.FAILED),
    (TransitionError.illegal("group", "failed", "complete"), ImportReason.INTERRUPTED),
    (TransitionError.guard("group", "importing", "complete", ["parts_compatible"]), ImportReason.FAILED),
    (ImportFailed.of(1, ImportReason.INTERRUPTED, "no lease"), ImportReason.INTERRUPTED),
])
def test_an_import_failure_names_the_step_that_failed(cause: Exception, reason: ImportReason) -> None:
    exc = ImportFailed.wrap(2, cause)
    assert exc.reason is reason and exc.cause is cause and exc.rank == 2
    assert str(exc).startswith(f"import of rank 2 failed ({reason.value}): ") and str(exc).count("import of rank") == 1


@pytest.mark.parametrize("failing_rank", [0, 1, 2])
@pytest.mark.parametrize("step", ["import_", "reserve", "map", "set_access"])
def test_part_import_failure_rolls_back_every_part(step: str, failing_rank: int, transport: HostTransport) -> None:
    """INV-ROLLBACK-COMPLETE: any part failing leaves nothing mapped and no lease behind."""
    ex = make_exporter(3, transport)
    faulty = FaultyTransport(transport)
    importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), faulty)  # type: ignore[arg-type]
    try:
        before = transport.native.stats()
        faulty.fail(step, after=failing_rank)
        with pytest.raises(ImportFailed) as info:
            importer.import_group([ex.descriptor(r) for r in range(3)])
        assert info.value.rank in range(3)  # parts open concurrently: any rank may take the fault
        assert info.value.reason is ImportReason.NATIVE
        after = transport.native.stats()
        assert (after.allocations, after.reservations, after.regions) == \
            (before.allocations, before.reservations, before.regions)
        deadline = time.monotonic() + 2
        while any(b.leases for b in ex.banks.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(not b.leases and b.state == "advertised" for b in ex.banks.values())
    finally:
        importer.close()
        ex.stop()


@pytest.mark.parametrize("step", ["reserve", "map", "set_access", "export"])
def test_registration_failure_preserves_owner_and_leaves_nothing(step: str, transport: HostTransport) -> None:
    """INV-REGISTER-ATOMIC: a failure at any registration step restores owner and state."""
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    import tempfile
    from pathlib import Path
    faulty = FaultyTransport(transport)
    ex = Exporter(ExportConfig(DEPLOYMENT, Path(tempfile.mkdtemp()) / "s", bytes(16), 1), faulty)  # type: ignore[arg-type]
    bank = ex.add_bank(0, GEOMETRY)
    before = transport.native.stats()
    faulty.fail(step)
    with raises(NativeError, NativeReason.REGISTRATION) as info:
        bank.fire("register")
    assert info.value.step == step
    assert (bank.state, bank.owner, bank.mapping, bank.reservation) == ("allocated", "engine", None, None)
    after = transport.native.stats()
    assert (after.reservations, after.regions) == (before.reservations, before.regions)
    bank.fire("register_failed")
    bank.fire("register")
    assert bank.owner == "kvstate"
    ex.drain(1.0)
    assert bank.state == "released"


def test_peer_death_after_ready_drains_group(transport: HostTransport, importer: Importer) -> None:
    ex = make_exporter(2, transport)
    group = importer.import_group([ex.descriptor(r) for r in range(2)])
    for bank in ex.banks.values():  # the exporter's side of every connection goes away
        for lease in list(bank.leases.values()):
            lease.channel.close()
    deadline = time.monotonic() + 3
    while group.state == "ready" and time.monotonic() < deadline:
        time.sleep(0.01)
    # Drained; and, its leases unrenewable, the group lets go of the banks on its own
    # once nothing pins them (issue 14, class 7), so it may be closed already.
    assert group.state in ("draining", "quiescent", "closed")
    dst = buffers(2, 1)
    with raises(TransitionError, TransitionReason.ILLEGAL):  # INV-DRAIN-NO-NEW: no load after peer death
        group.load_prefix([0], dst)
    group.drain()
    assert group.state == "closed"
    ex.stop()


def test_restarted_exporter_makes_old_descriptors_stale(transport: HostTransport, importer: Importer) -> None:
    """INV-STALE-REJECTED at lease time: a new incarnation refuses old descriptors."""
    ex = make_exporter(2, transport)
    try:
        old = [ex.descriptor(r) for r in range(2)]
        ex.incarnation = Incarnation.new()
        with pytest.raises(ImportFailed, match="stale_incarnation"):
            importer.import_group(old)
        with pytest.raises(GroupRejected) as info:
            importer.import_group(old, incarnations={0: ex.incarnation.value, 1: ex.incarnation.value})
        assert info.value.reasons == {RejectReason.INCARNATION}
    finally:
        ex.stop()


def test_drain_during_import_fails_group_and_rolls_back(transport: HostTransport) -> None:
    """Drain arrives after rank 0 is imported and before rank 1 is: the group fails and
    rank 0 is rolled back (INV-ROLLBACK-COMPLETE)."""

    def drain_after_rank0(change: StateChange) -> None:
        if change.machine == "part" and change.dest == "imported" and change.label.endswith("part[0]"):
            importer.groups[-1].drain(5.0)

    ex = make_exporter(3, transport)
    importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), transport, observers=[drain_after_rank0])
    try:
        with pytest.raises(ImportFailed, match="failed during import") as info:
            importer.import_group([ex.descriptor(r) for r in range(3)])
        assert info.value.reason is ImportReason.INTERRUPTED
        group = importer.groups[-1]
        assert group.state == "failed"
        assert [p.state for p in group.parts] == ["closed", "closed", "closed"]
        assert all(p.mapping is None for p in group.parts)
    finally:
        importer.close()
        ex.stop()


def test_an_import_cut_short_by_an_exporter_leaving_names_its_rank(transport: HostTransport) -> None:
    """Rank 1's exporter goes away while the group imports: ImportFailed names rank 1 and
    the reason PEER, so an engine drops that rank's descriptor, not rank 0's."""

    def gone_after_rank1_leased(change: StateChange) -> None:
        if change.machine == "part" and change.dest == "leased" and change.label.endswith("part[1]"):
            group = importer.groups[-1]
            group.peer_closed(group.parts[1])

    ex = make_exporter(3, transport)
    importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), transport, observers=[gone_after_rank1_leased])
    try:
        with pytest.raises(ImportFailed, match="exporter of rank 1 went away") as info:
            importer.import_group([ex.descriptor(r) for r in range(3)])
        assert info.value.rank == 1 and info.value.reason is ImportReason.PEER
        assert importer.groups[-1].state == "failed"
    finally:
        importer.close()
        ex.stop()


def test_exporter_drain_waits_for_pins_on_its_bank(transport: HostTransport) -> None:
    """INV-RELEASE-QUIESCENT on the exporter side: with no lease and no store left, a pin on
    the bank's region (an in-flight op; here an explicit pin) still keeps the bank from
    quiescent, so the drain times out and releases nothing; once unpinned it releases."""
    ex = make_exporter(1, transport)
    bank = ex.banks[0]
    try:
        transport.pin(bank.mapped())
        try:
            with raises(TimedOut, TimeoutReason.DRAIN):
                ex.drain(0.05)
            assert bank.state == "draining" and bank.owner == "kvstate" and bank.pins() == 1
        finally:
            transport.unpin(bank.mapped())
        ex.drain(5.0)
        assert bank.state == "released"
    finally:
        ex.stop()


def test_exporter_calls_out_of_order_are_refused_typed(transport: HostTransport, importer: Importer) -> None:
    """An engine's mistakes on the exporting side get a typed refusal naming the state,
    and change nothing: a descriptor before advertise or after drain (a released bank's
    old descriptor was handed out), a second register (it named register_failed), and a
    start after stop (it was accepted, then served nothing: a stopped exporter drops
    every connection and expires no lease)."""
    ex = make_exporter(1, transport)
    try:
        with raises(TransitionError, TransitionReason.ILLEGAL) as info:
            ex.banks[0].register()
        assert info.value.event == "register" and ex.banks[0].state == "advertised"
        with pytest.raises(ArgumentInvalid) as refused:
            ex.start()
        assert refused.value.reason is ArgumentReason.STATE
        group = importer.import_group([ex.descriptor(0)])  # still serving as before
        group.drain()
    finally:
        ex.stop()
    ex.drain(5.0)
    with pytest.raises(ArgumentInvalid) as refused:
        ex.descriptor(0)
    assert refused.value.reason is ArgumentReason.STATE and "released" in str(refused.value)
    with pytest.raises(ArgumentInvalid) as refused:
        ex.start()
    assert refused.value.reason is ArgumentReason.STATE

    fresh = Exporter(ExportConfig(DEPLOYMENT, ex.config.socket_dir, ex.config.source_id, 1), transport, name="fresh")
    fresh.add_bank(0, GEOMETRY).register()
    with pytest.raises(ArgumentInvalid) as refused:
        fresh.descriptor(0)
    assert refused.value.reason is ArgumentReason.STATE and "registered" in str(refused.value)
    fresh.drain(5.0)


def test_drain_during_load_waits_for_native_ops(transport: HostTransport, importer: Importer) -> None:
    """INV-NO-UNMAP-PINNED: a drain never unmaps under an in-flight op."""
    ex = make_exporter(2, transport)
    try:
        group = importer.import_group([ex.descriptor(r) for r in range(2)])
        dst = buffers(2, 4)
        transport.native.pause(True)
        loader = threading.Thread(target=group.load_prefix, args=([1, 2, 3, 4], dst))
        loader.start()
        deadline = time.monotonic() + 3
        while not group.loads and time.monotonic() < deadline:
            time.sleep(0.001)
        with raises(TimedOut, TimeoutReason.DRAIN):
            group.drain(timeout=0.05)
        assert group.state == "draining" and all(p.mapping is not None for p in group.parts)
        assert sum(p.pins() for p in group.parts) > 0
        transport.native.pause(False)
        loader.join(5)
        for r in range(2):
            assert bytes(dst[r]) == expected_blocks(r, [1, 2, 3, 4])
        group.drain()
        assert group.state == "closed"
    finally:
        transport.native.pause(False)
        ex.stop()
