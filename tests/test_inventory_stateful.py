"""Stateful test: the real Inventory against a simple model with pins, leases and eviction.

Checks INV-LEASE-ATOMIC, INV-INVENTORY-EVICTION and INV-INVENTORY-BUDGET after every
step. The self-tests run the same machine on planted broken inventories and assert it
fails.
"""

from __future__ import annotations

from typing import Any

import pytest

from support.errors import raises
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvstate.core.errors import ArgumentInvalid, Busy
from kvstate.core.reasons import ArgumentReason, BusyReason
from kvstate.reuse.inventory import (
    BlocksRemoved,
    BlocksStored,
    Event,
    GroupCleared,
    Inventory,
    LeaseGrant,
    Stale,
    StaleReason,
)

GROUPS = ("a", "b")
HASHES = st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 2**64 - 1]), min_size=1, max_size=4, unique=True)

Key = tuple[str, int]


class Model:
    """The inventory as plain lists and counters; obviously right, slow, and enough."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.epochs: dict[str, int] = {}
        self.lru: list[Key] = []  # oldest first
        self.pins: dict[Key, int] = {}
        self.leases: dict[int, tuple[str, tuple[int, ...]]] = {}

    def lease_count(self, key: Key) -> int:
        return sum(1 for g, hs in self.leases.values() for h in hs if (g, h) == key)

    def busy(self, key: Key) -> bool:
        return self.pins.get(key, 0) > 0 or self.lease_count(key) > 0

    def store(self, group: str, hashes: list[int]) -> tuple[tuple[Event, ...], tuple[int, ...]]:
        self.epochs.setdefault(group, 0)
        stored, not_retained = [], []
        evicted: dict[str, list[int]] = {}
        for h in hashes:
            key = (group, h)
            if key in self.lru:
                self.lru.remove(key)
                self.lru.append(key)
                continue
            if len(self.lru) >= self.budget:
                victims = [k for k in self.lru if not self.busy(k) and not (k[0] == group and k[1] in hashes)]
                if not victims:
                    not_retained.append(h)
                    continue
                self.lru.remove(victims[0])
                self.pins.pop(victims[0], None)
                evicted.setdefault(victims[0][0], []).append(victims[0][1])
            self.lru.append(key)
            stored.append(h)
        events: list[Event] = [BlocksRemoved(g, self.epochs[g], tuple(hs), evicted=True) for g, hs in evicted.items()]
        if stored:
            events.append(BlocksStored(group, self.epochs[group], tuple(stored)))
        return tuple(events), tuple(not_retained)


def make_machine(factory: Any) -> type[RuleBasedStateMachine]:
    class InventoryMachine(RuleBasedStateMachine):
        @initialize(budget=st.integers(0, 5))
        def setup(self, budget: int) -> None:
            self.inv = factory(budget_blocks=budget)
            self.model = Model(budget)

        @rule(group=st.sampled_from(GROUPS), hashes=HASHES)
        def store(self, group: str, hashes: list[int]) -> None:
            out = self.inv.store(group, hashes)
            events, not_retained = self.model.store(group, hashes)
            assert out.events == events
            assert out.not_retained == not_retained

        @rule(group=st.sampled_from(GROUPS), hashes=HASHES)
        def remove(self, group: str, hashes: list[int]) -> None:
            present = [h for h in hashes if (group, h) in self.model.lru]
            if any(self.model.busy((group, h)) for h in present):
                with raises(Busy, BusyReason.BLOCKS):
                    self.inv.remove(group, hashes)
                return
            events = self.inv.remove(group, hashes)
            for h in present:
                self.model.lru.remove((group, h))
            expected = (BlocksRemoved(group, self.model.epochs[group], tuple(present), evicted=False),) \
                if present else ()
            assert events == expected

        @rule(group=st.sampled_from(GROUPS))
        def clear(self, group: str) -> None:
            held = [k for k in self.model.lru if k[0] == group]
            if any(self.model.busy(k) for k in held):
                with raises(Busy, BusyReason.BLOCKS):
                    self.inv.clear(group)
                return
            events = self.inv.clear(group)
            self.model.lru = [k for k in self.model.lru if k[0] != group]
            self.model.epochs[group] = self.model.epochs.get(group, 0) + 1
            assert events == (GroupCleared(group, self.model.epochs[group]),)

        @rule(group=st.sampled_from(GROUPS), hashes=HASHES)
        def pin(self, group: str, hashes: list[int]) -> None:
            if all((group, h) in self.model.lru for h in hashes):
                self.inv.pin(group, hashes)
                for h in hashes:
                    self.model.pins[(group, h)] = self.model.pins.get((group, h), 0) + 1
            else:
                with raises(ArgumentInvalid, ArgumentReason.INVENTORY):
                    self.inv.pin(group, hashes)

        @rule(group=st.sampled_from(GROUPS), hashes=HASHES)
        def unpin(self, group: str, hashes: list[int]) -> None:
            if all(self.model.pins.get((group, h), 0) > 0 for h in hashes):
                self.inv.unpin(group, hashes)
                for h in hashes:
                    self.model.pins[(group, h)] -= 1
            else:
                with raises(ArgumentInvalid, ArgumentReason.NOT_PINNED):
                    self.inv.unpin(group, hashes)

        @rule(group=st.sampled_from(GROUPS), hashes=HASHES, epoch_offset=st.sampled_from([0, 0, 0, -1, 1]))
        def lease(self, group: str, hashes: list[int], epoch_offset: int) -> None:
            current = self.model.epochs.get(group)
            epoch = max(0, (current or 0) + epoch_offset)
            r = self.inv.lease(group, epoch, hashes)
            missing = tuple(h for h in hashes if (group, h) not in self.model.lru)
            if current is None:
                assert r == Stale(StaleReason.UNKNOWN_GROUP, group, epoch, None)
            elif epoch != current:
                assert r == Stale(StaleReason.EPOCH, group, epoch, current)
            elif missing:
                assert r == Stale(StaleReason.MISSING_BLOCKS, group, epoch, current, missing)
            else:
                assert isinstance(r, LeaseGrant) and r.hashes == tuple(hashes) and r.epoch == epoch
                assert r.lease_id not in self.model.leases
                self.model.leases[r.lease_id] = (group, tuple(hashes))
                for h in hashes:  # a grant counts as use
                    self.model.lru.remove((group, h))
                    self.model.lru.append((group, h))

        @precondition(lambda self: bool(self.model.leases))
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            lease_id = data.draw(st.sampled_from(sorted(self.model.leases)))
            self.inv.release(lease_id)
            del self.model.leases[lease_id]
            with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_LEASE):
                self.inv.release(lease_id)

        @invariant()
        def matches_model(self) -> None:
            # INV-INVENTORY-BUDGET, INV-INVENTORY-EVICTION (busy blocks held, LRU order), INV-LEASE-ATOMIC
            assert len(self.inv) <= self.model.budget
            for key in self.model.lru:
                if self.model.busy(key):
                    assert key[1] in self.inv.hashes(key[0]), f"busy block {key} is gone"
            assert list(self.inv.lru_order()) == self.model.lru
            for key in self.model.lru:
                assert self.inv.busy(*key) == (self.model.pins.get(key, 0), self.model.lease_count(key))
            for g, e in self.model.epochs.items():
                assert self.inv.epoch(g) == e

    return InventoryMachine


TestInventoryAgainstModel = make_machine(Inventory).TestCase
TestInventoryAgainstModel.settings = settings(TestInventoryAgainstModel.settings, stateful_step_count=40)


@pytest.mark.parametrize("planted", ["EvictsLeasedBlocks", "GrantsPartially"])
def test_state_machine_catches_planted_inventory_bug(planted: str) -> None:
    """Self-test: the machine must fail on an inventory that breaks eviction or atomic leases."""
    from planted import inventory_bugs

    with pytest.raises(AssertionError):
        run_state_machine_as_test(make_machine(getattr(inventory_bugs, planted)),
                                  settings=settings(max_examples=300, derandomize=True, database=None,
                                                    stateful_step_count=40, deadline=None,
                                                    report_multiple_bugs=False,
                                                    phases=[Phase.generate]))  # no shrinking: fast
