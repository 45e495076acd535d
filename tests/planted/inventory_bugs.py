"""Deliberately broken inventories, for the stateful test's self-test."""

from __future__ import annotations

from collections.abc import Sequence

from kvstate.reuse.inventory import Inventory, LeaseGrant, Stale


class EvictsLeasedBlocks(Inventory):
    """Planted bug: eviction ignores pins and leases (breaks INV-INVENTORY-EVICTION)."""

    def _evict_one(self, evicted: dict[str, list[int]], *, protect: str, hashes: tuple[int, ...]) -> bool:
        for key in self._lru:
            name, h = key
            if name == protect and h in hashes:
                continue
            del self._lru[key]
            del self._groups[name].blocks[h]
            evicted.setdefault(name, []).append(h)
            return True
        return False


class GrantsPartially(Inventory):
    """Planted bug: a lease grants the blocks still held and drops the rest (breaks INV-LEASE-ATOMIC)."""

    def lease(self, group: str, epoch: int, hashes: Sequence[int]) -> LeaseGrant | Stale:
        present = [h for h in hashes if h in self.hashes(group)]
        if present and len(present) < len(hashes) and self.epoch(group) == epoch:
            return super().lease(group, epoch, present)
        return super().lease(group, epoch, hashes)
