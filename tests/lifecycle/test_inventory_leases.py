"""The retained inventory wired to bank leases: pin on lease, stale means recompute."""

from __future__ import annotations

import time

import pytest

from support.errors import raises

from conftest import make_exporter
from kvstate.core.errors import ArgumentInvalid
from kvstate.core.reasons import ArgumentReason
from kvstate.core.errors import ImportFailed
from kvstate.core.reasons import ImportReason
from kvstate.share.exporter import Exporter
from kvstate.share.importer import BlockRequest, Importer
from kvstate.share.part import MAX_REQUEST_HASHES
from kvstate.reuse.inventory import MAX_GROUP_NAME, Inventory
from kvstate.transport.host import HostTransport


def exporter_with_inventory(transport: HostTransport, budget: int = 8):  # type: ignore[no-untyped-def]
    ex = make_exporter(2, transport)
    ex.inventory = Inventory(budget)
    ex.inventory.store("prefix-a", [11, 12, 13])
    return ex


def test_lease_pins_blocks_until_the_group_closes(transport: HostTransport, importer: Importer) -> None:
    """INV-LEASE-ATOMIC on the real lease path: every part's lease pins every block."""
    ex = exporter_with_inventory(transport)
    inv = ex.inventory
    assert inv is not None
    epoch = inv.epoch("prefix-a")
    assert epoch is not None
    group = importer.import_group([ex.descriptor(r) for r in range(2)],
                                  blocks=BlockRequest("prefix-a", (epoch, epoch), (11, 13)))
    assert group.state == "ready"
    assert inv.busy("prefix-a", 11) == (0, 2) and inv.busy("prefix-a", 12) == (0, 0)
    # Leased blocks are never evicted (INV-INVENTORY-EVICTION): fill past the budget.
    inv.store("other", list(range(100, 110)))
    assert {11, 13} <= inv.hashes("prefix-a")
    group.drain()
    deadline = time.monotonic() + 2
    while inv.busy("prefix-a", 11) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inv.busy("prefix-a", 11) == (0, 0) and not inv.active_leases()


@pytest.mark.parametrize("stale", ["epoch", "evicted", "unknown_group"])
def test_stale_request_is_refused_whole_and_says_recompute(stale: str, transport: HostTransport,
                                                           importer: Importer) -> None:
    ex = exporter_with_inventory(transport)
    inv = ex.inventory
    assert inv is not None
    epoch = inv.epoch("prefix-a")
    assert epoch is not None
    request = {"epoch": BlockRequest("prefix-a", (epoch, epoch + 1), (11,)),
               "evicted": BlockRequest("prefix-a", (epoch, epoch), (11, 99)),
               "unknown_group": BlockRequest("nope", (1, 1), (11,))}[stale]
    with raises(ImportFailed, ImportReason.STALE, match="recompute") as info:
        importer.import_group([ex.descriptor(r) for r in range(2)], blocks=request)
    assert isinstance(info.value, ImportFailed) and importer.groups[-1].state == "failed"
    assert info.value.reason is ImportReason.STALE
    assert not inv.active_leases() and inv.busy("prefix-a", 11) == (0, 0)
    assert all(not b.leases for b in ex.banks.values())


def _one_bank_exporter(transport: HostTransport, rank: int, source: bytes, socket_dir: object,
                       epochs: int) -> Exporter:
    """A decode worker process of one rank: its own bank and its own inventory."""
    from conftest import DEPLOYMENT, GEOMETRY, _created
    from kvstate.share.export_config import ExportConfig

    ex = Exporter(ExportConfig(DEPLOYMENT, socket_dir, source, 2), transport,  # type: ignore[arg-type]
                  name=f"rank{rank}", inventory=Inventory(8))
    assert ex.inventory is not None
    for _ in range(epochs):  # each clear starts a new epoch of this rank's inventory only
        ex.inventory.clear("prefix-a")
    ex.inventory.store("prefix-a", [11, 12])
    bank = ex.add_bank(rank, GEOMETRY)
    bank.register()
    bank.advertise()
    ex.start()
    _created.append(ex)
    return ex


def test_each_rank_names_its_own_banks_epoch(transport: HostTransport, importer: Importer, tmp_path: object) -> None:
    """Inventory epochs are per bank: two ranks whose banks are at different epochs are
    leased with each one's own epoch, and a request naming one epoch for both is stale."""
    import os
    from pathlib import Path

    socket_dir = Path(str(tmp_path)) / "s"
    source = os.urandom(16)
    exporters = [_one_bank_exporter(transport, r, source, socket_dir, epochs=r) for r in range(2)]
    epochs = tuple(ex.inventory.epoch("prefix-a") for ex in exporters)  # type: ignore[union-attr]
    assert epochs[0] != epochs[1]
    wire = [ex.descriptor(r) for r, ex in enumerate(exporters)]
    group = importer.import_group(wire, blocks=BlockRequest("prefix-a", epochs, (11, 12)))  # type: ignore[arg-type]
    assert group.state == "ready"
    assert all(ex.inventory.busy("prefix-a", 11) == (0, 1) for ex in exporters)  # type: ignore[union-attr]
    group.drain()
    with raises(ImportFailed, ImportReason.STALE) as info:
        importer.import_group(wire, blocks=BlockRequest("prefix-a", (epochs[0], epochs[0]), (11,)))  # type: ignore[arg-type]
    assert info.value.rank == 1


def test_a_request_with_the_wrong_number_of_epochs_is_refused_before_any_lease(
        transport: HostTransport, importer: Importer) -> None:

    ex = exporter_with_inventory(transport)
    with raises(ArgumentInvalid, ArgumentReason.INVENTORY, match="one per rank"):
        importer.import_group([ex.descriptor(r) for r in range(2)], blocks=BlockRequest("prefix-a", (1,), (11,)))
    assert all(not b.leases for b in ex.banks.values()) and not importer.groups
    with raises(ArgumentInvalid, ArgumentReason.INVENTORY):
        BlockRequest("prefix-a", (), (11,))
    with raises(ArgumentInvalid, ArgumentReason.INVENTORY):
        BlockRequest("prefix-a", (1, -1), (11,))


@pytest.mark.parametrize("group, hashes", [
    (None, (11,)), ("", (11,)), (b"prefix-a", (11,)),
    ("prefix-a", None), ("prefix-a", 5), ("prefix-a", ()), ("prefix-a", "11"), ("prefix-a", (object(),)),
    ("prefix-a", (True,)), ("prefix-a", (-1,)), ("prefix-a", (2**64,)), ("prefix-a", (11, 11)),
    # names no lease can carry (the exporter refused every lease as a malformed frame), and
    # a lease request larger than the link's frame
    ("a\0b", (11,)), ("a\ud800", (11,)), ("\u00e9t\u00e9", (11,)), ('a"b', (11,)), ("g" * (MAX_GROUP_NAME + 1), (11,)),
    ("g" * 100_000, (11,)), ("prefix-a", tuple(range(MAX_REQUEST_HASHES + 1))), ("prefix-a", tuple(range(20_000))),
])
def test_a_block_request_takes_only_what_an_exporter_would(group: object, hashes: object) -> None:
    """The exporter's inventory rules, checked when the request is made: a bad one never
    reached the lease as an untyped error, with the group left importing."""

    bad_group = hashes == (11,)  # else the hashes are what is wrong
    with raises(ArgumentInvalid, ArgumentReason.INVENTORY if bad_group else ArgumentReason.BLOCK_HASH):
        BlockRequest(group, (1,), hashes)  # type: ignore[arg-type]


def test_the_largest_block_request_leases_and_one_hash_more_is_refused_when_made(
        transport: HostTransport, importer: Importer) -> None:
    """MAX_REQUEST_HASHES hashes of 20 digits under the longest group name fit one frame on
    the real lease path; one more was accepted and its lease could never be sent."""
    group = "g" * MAX_GROUP_NAME
    hashes = tuple(range(2**64 - MAX_REQUEST_HASHES, 2**64))
    ex = make_exporter(1, transport)
    ex.inventory = Inventory(MAX_REQUEST_HASHES)
    ex.inventory.store(group, hashes)
    epoch = ex.inventory.epoch(group)
    assert epoch is not None
    with raises(ArgumentInvalid, ArgumentReason.BLOCK_HASH, match="at most"):
        BlockRequest(group, (epoch,), (*hashes, 11))
    leased = importer.import_group([ex.descriptor(0)], blocks=BlockRequest(group, (epoch,), hashes))
    assert leased.state == "ready" and ex.inventory.busy(group, hashes[0]) == (0, 1)
    leased.drain()


@pytest.mark.parametrize("group", ["a\ud800", "\u00e9t\u00e9", 'a"b', "a\\b", "a\tb"])
def test_a_group_name_no_lease_can_carry_is_refused_with_an_exporter_attached(
        group: str, transport: HostTransport, importer: Importer) -> None:
    """With an exporter attached, the inventory took names whose leases the native lease
    server could never read (a lone surrogate even raised UnicodeEncodeError from its
    mirror). They are refused, changing nothing; the names it takes are leased."""
    ex = exporter_with_inventory(transport)
    inv = ex.inventory
    assert inv is not None
    with raises(ArgumentInvalid, ArgumentReason.INVENTORY):
        inv.store(group, [21])
    taken = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in '"\\')  # every character a name may hold
    inv.store(taken, [21])  # the mirror took the refusal in stride
    leased = importer.import_group([ex.descriptor(r) for r in range(2)], blocks=BlockRequest(taken, (0, 0), (21,)))
    assert leased.state == "ready" and inv.busy(taken, 21) == (0, 2) and inv.hashes("prefix-a") == {11, 12, 13}
    leased.drain()


def test_a_draining_bank_refuses_leases_and_keeps_no_pin(transport: HostTransport, importer: Importer) -> None:
    """Drain stops new leases by the table alone (draining declares no grant_lease): a lease
    naming inventory blocks is refused, and the blocks it pinned on the way are given back."""
    ex = exporter_with_inventory(transport)
    inv = ex.inventory
    assert inv is not None
    epoch = inv.epoch("prefix-a")
    assert epoch is not None
    for bank in ex.banks.values():
        bank.fire("drain")
    with pytest.raises(ImportFailed) as info:
        importer.import_group([ex.descriptor(r) for r in range(2)],
                              blocks=BlockRequest("prefix-a", (epoch, epoch), (11, 13)))
    cause = info.value.__cause__
    assert (isinstance(cause, ImportFailed) and cause.reason is ImportReason.REFUSED) and cause.code == "not_leasing", cause
    assert "'grant_lease' is not declared in state 'draining'" in str(cause)
    assert importer.groups[-1].state == "failed"
    assert not inv.active_leases() and inv.busy("prefix-a", 11) == (0, 0)
    assert all(b.state == "draining" and not b.leases for b in ex.banks.values())
