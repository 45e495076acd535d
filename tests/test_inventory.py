"""The retained inventory: events, budget and LRU eviction, pins, atomic leases, threads.

Checks INV-LEASE-ATOMIC, INV-INVENTORY-EVICTION and INV-INVENTORY-BUDGET; the stateful
test against a model is in test_inventory_stateful.py.
"""

from __future__ import annotations

import threading

import pytest

from support.errors import raises
from hypothesis import given
from hypothesis import strategies as st

from kvstate.core.errors import KvStateError, ArgumentInvalid, Busy
from kvstate.core.reasons import ArgumentReason, BusyReason
from kvstate.reuse.inventory import (
    MAX_GROUP_NAME,
    BlocksRemoved,
    BlocksStored,
    GroupCleared,
    Inventory,
    LeaseGrant,
    Stale,
    StaleReason,
)


def test_store_remove_clear_emit_events_with_the_epoch() -> None:
    inv = Inventory(budget_blocks=8)
    out = inv.store("g", [1, 2, 3])
    assert out.events == (BlocksStored("g", 0, (1, 2, 3)),) and out.not_retained == ()
    assert inv.store("g", [3]).events == ()  # already held: refreshed, nothing new to publish
    assert inv.remove("g", [2, 99]) == (BlocksRemoved("g", 0, (2,), evicted=False),)
    assert inv.clear("g") == (GroupCleared("g", 1),)
    assert inv.hashes("g") == frozenset() and inv.epoch("g") == 1
    assert inv.store("g", [7]).events == (BlocksStored("g", 1, (7,)),)


def test_lru_eviction_skips_pinned_and_leased_blocks() -> None:
    """INV-INVENTORY-EVICTION and INV-INVENTORY-BUDGET."""
    inv = Inventory(budget_blocks=3)
    inv.store("g", [1, 2, 3])
    inv.pin("g", [1])
    grant = inv.lease("g", 0, [2])
    assert isinstance(grant, LeaseGrant)
    out = inv.store("h", [10])
    assert out.events == (BlocksRemoved("g", 0, (3,), evicted=True), BlocksStored("h", 0, (10,)))
    out = inv.store("h", [11])  # 1 pinned, 2 leased, 10 part of nothing: 10 is the idle LRU one
    assert out.events == (BlocksRemoved("h", 0, (10,), evicted=True), BlocksStored("h", 0, (11,)))
    inv.pin("h", [11])
    out = inv.store("h", [12])  # every block is busy: not retained, budget kept
    assert out.events == () and out.not_retained == (12,) and len(inv) == 3
    inv.release(grant)
    out = inv.store("h", [12])
    assert out.events == (BlocksRemoved("g", 0, (2,), evicted=True), BlocksStored("h", 0, (12,)))


def test_a_store_never_evicts_its_own_batch() -> None:
    inv = Inventory(budget_blocks=2)
    out = inv.store("g", [1, 2, 3])
    assert out.events == (BlocksStored("g", 0, (1, 2)),) and out.not_retained == (3,)


def test_lease_is_all_or_nothing() -> None:
    """INV-LEASE-ATOMIC: a stale request pins nothing."""
    inv = Inventory(budget_blocks=8)
    inv.store("g", [1, 2, 3])
    stale = inv.lease("g", 0, [1, 2, 4])
    assert stale == Stale(StaleReason.MISSING_BLOCKS, "g", 0, 0, (4,)) and not stale.granted
    assert all(inv.busy("g", h) == (0, 0) for h in (1, 2, 3))
    assert inv.lease("g", 1, [1]) == Stale(StaleReason.EPOCH, "g", 1, 0)
    assert inv.lease("nope", 0, [1]) == Stale(StaleReason.UNKNOWN_GROUP, "nope", 0, None)
    grant = inv.lease("g", 0, [1, 2])
    assert isinstance(grant, LeaseGrant) and grant.granted and grant.hashes == (1, 2)
    assert inv.busy("g", 1) == (0, 1)
    with raises(Busy, BusyReason.BLOCKS):
        inv.remove("g", [3, 1])
    assert inv.hashes("g") == {1, 2, 3}  # the refused remove removed nothing
    with raises(Busy, BusyReason.BLOCKS):
        inv.clear("g")
    inv.release(grant)
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_LEASE):
        inv.release(grant)
    assert inv.clear("g") == (GroupCleared("g", 1),)
    assert inv.lease("g", 0, [1]).granted is False  # old epoch after the clear


def test_bad_input_is_a_typed_error_and_changes_nothing() -> None:
    inv = Inventory(budget_blocks=4)
    inv.store("g", [1])
    for bad in ([-1], [2**64], [True], ["1"], [], [1, 1], "12"):
        with raises(ArgumentInvalid, ArgumentReason.BLOCK_HASH):
            inv.store("g", bad)  # type: ignore[arg-type]
        with raises(ArgumentInvalid, ArgumentReason.BLOCK_HASH):
            inv.lease("g", 0, bad)  # type: ignore[arg-type]
    with raises(ArgumentInvalid, ArgumentReason.INVENTORY):
        inv.lease("g", -1, [1])
    with raises(ArgumentInvalid, ArgumentReason.INVENTORY):
        inv.store("", [1])
    with raises(ArgumentInvalid, ArgumentReason.INVENTORY):
        inv.pin("g", [1, 2])
    with raises(ArgumentInvalid, ArgumentReason.NOT_PINNED):
        inv.unpin("g", [1])
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_LEASE):
        inv.release(12345)
    with raises(ArgumentInvalid, ArgumentReason.INVENTORY):
        Inventory(budget_blocks=-1)
    for not_a_mirror in (None, 3, object()):  # attached, it broke every later store and clear
        with raises(ArgumentInvalid, ArgumentReason.TYPE):
            inv.attach(not_a_mirror)  # type: ignore[arg-type]
    inv.clear("g")
    inv.store("g", [1])
    assert inv.hashes("g") == {1} and inv.busy("g", 1) == (0, 0)


#: Names no lease can carry: a NUL or a lone surrogate (a bare UnicodeEncodeError from the
#: exporter's mirror), JSON escapes the native lease server does not read (every lease a
#: malformed frame), and more than MAX_GROUP_NAME characters.
UNLEASABLE_GROUPS = ["a\0b", "a\ud800", "\u00e9t\u00e9", 'a"b', "a\\b", "a\tb", "a\x7fb", "g" * (MAX_GROUP_NAME + 1)]


@pytest.mark.parametrize("group", UNLEASABLE_GROUPS)
def test_a_group_name_no_lease_can_carry_is_refused_and_changes_nothing(group: str) -> None:
    inv = Inventory(budget_blocks=4)
    printable = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in '"\\')
    for taken in (printable, "g" * MAX_GROUP_NAME, " "):  # the names a lease can carry
        inv.store(taken, [1])
    before = inv.lru_order()
    for call in (lambda: inv.store(group, [1]), lambda: inv.clear(group), lambda: inv.lease(group, 0, [1]),
                 lambda: inv.epoch(group)):
        with raises(ArgumentInvalid, ArgumentReason.INVENTORY):
            call()
    assert inv.lru_order() == before and not inv.active_leases()


def test_full_64_bit_hashes() -> None:
    inv = Inventory(budget_blocks=2)
    inv.store("g", [0, 2**64 - 1])
    assert inv.lease("g", 0, [2**64 - 1]).granted


ops = st.lists(st.tuples(st.sampled_from(["store", "lease", "release", "pin", "unpin"]),
                         st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True)), max_size=40)


@given(st.integers(0, 6), ops)
def test_budget_and_busy_blocks_hold_under_any_sequence(budget: int, seq: list[tuple[str, list[int]]]) -> None:
    """INV-INVENTORY-BUDGET and INV-INVENTORY-EVICTION, and INV-LEASE-ATOMIC for each lease."""
    inv = Inventory(budget_blocks=budget)
    grants: list[LeaseGrant] = []
    pinned: list[list[int]] = []
    for op, hashes in seq:
        before = inv.hashes("g")
        if op == "store":
            inv.store("g", hashes)
        elif op == "lease":
            r = inv.lease("g", 0, hashes)
            if isinstance(r, LeaseGrant):
                assert set(hashes) <= before
                grants.append(r)
            else:
                assert r.reason is StaleReason.UNKNOWN_GROUP or not set(hashes) <= before
        elif op == "release" and grants:
            inv.release(grants.pop(0))
        elif op == "pin" and set(hashes) <= before:
            inv.pin("g", hashes)
            pinned.append(hashes)
        elif op == "unpin" and pinned:
            inv.unpin("g", pinned.pop())
        assert len(inv) <= budget
        held = inv.hashes("g")
        for g in grants:
            assert set(g.hashes) <= held
        for p in pinned:
            assert set(p) <= held


def test_concurrent_leases_are_atomic_and_never_lose_leased_blocks() -> None:
    """INV-LEASE-ATOMIC and INV-INVENTORY-EVICTION under threads: storers evict while lessees lease."""
    inv = Inventory(budget_blocks=16)
    inv.store("g", list(range(16)))
    failures: list[str] = []
    stop = threading.Event()

    def lessee(seed: int) -> None:
        n = 0
        while not stop.is_set() and n < 2000:
            n += 1
            want = [(seed * 7 + n + k) % 64 for k in range(3)]
            r = inv.lease("g", 0, want)
            if isinstance(r, LeaseGrant):
                held = inv.hashes("g")
                if not set(want) <= held:
                    failures.append(f"granted {want} but held {sorted(held)}")
                inv.release(r)
            elif r.reason is not StaleReason.MISSING_BLOCKS or not r.missing:
                failures.append(f"unexpected stale {r}")

    def storer() -> None:
        for i in range(3000):
            inv.store("g", [i % 64])
            if len(inv) > 16:
                failures.append("budget exceeded")

    threads = [threading.Thread(target=lessee, args=(s,)) for s in range(3)] + [threading.Thread(target=storer)]
    for t in threads:
        t.start()
    threads[-1].join(timeout=60)
    stop.set()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert failures == []
    assert inv.active_leases() == ()
    assert all(inv.busy("g", h) == (0, 0) for h in inv.hashes("g"))
