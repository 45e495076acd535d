"""The decode side's table of bank blocks: which prefix block each holds, on every rank.
Pure (a lock, no I/O).

One table per decode engine, in its scheduler process. It is the only place that assigns
bank blocks, so every rank stores the same prefix block in the same bank block. Each
rank's exporter keeps its own :class:`~kvstate.reuse.inventory.Inventory`, which is what
leases pin; this table drives those inventories in lockstep and never reuses a bank block
until **every** rank confirmed that block's key removed from its inventory (a rank refuses
while a lease pins the key). That is what keeps lookups and leases TP-consistent:

- ``storing``: assigned by :meth:`SlotTable.reserve`; each rank reports its store
  (``stored``) or its failure. Never evicted (a store in flight pins its block).
- ``stored``: every rank stored it: advertised (:meth:`lookup` finds it), in LRU order.
- ``evicting``: no longer advertised; waiting until every rank that holds the key removed
  it. Chosen least recently used first when free blocks run low, or after a store failed
  on some rank.
- free: no key.

A mirror (:class:`~.index_mirror.IndexMirror`, attached by the index) hears of every
block that becomes ``stored`` and of every one that stops being advertised, under the
table's lock, so it answers lookups as :meth:`lookup` would; its finds come back through
:meth:`touch`, for the LRU order. It also hears of every block reserved (``expect``): it
advertises such a block itself as soon as every rank's ``stored`` report reached it,
before this table hears of them, and forgets it (``settle``) when a store failed.

Bounded: at most ``capacity`` blocks (the bank's size, from ``retain_bytes``). A reserve
that finds no free block stops: a later block of a prefix is useless without the earlier
ones.

Every operation costs what it touches, never the table's size: the scheduler calls
:meth:`reserve`, :meth:`choose_evictions` and :meth:`counts` for each finished request,
inside an engine step. (They counted every block held: with 3,000 blocks held, 1.2 ms per
finished request in a profile of ``request_finished``, growing with the bank.) So the
blocks of each state are counted as they move: ``storing`` by a counter, ``stored`` by the
LRU order, ``evicting`` by its own ordered set.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import attrs


class SlotState(enum.Enum):
    STORING = "storing"
    STORED = "stored"
    EVICTING = "evicting"


@attrs.define
class _Entry:
    block_hash: bytes
    key: int
    state: SlotState
    stored: set[int] = attrs.Factory(set)    # ranks whose store completed
    failed: set[int] = attrs.Factory(set)    # ranks whose store failed
    removed: set[int] = attrs.Factory(set)   # ranks whose inventory dropped the key


@attrs.frozen
class Reservation:
    """Block ``index`` of a request goes to bank block ``slot`` under inventory ``key``."""

    index: int
    block_hash: bytes
    slot: int
    key: int


@attrs.frozen
class Held:
    slot: int
    key: int


class Mirror(Protocol):
    """What hears of advertised blocks (the index's native mirror)."""

    def advertise(self, block_hash: bytes, slot: int, key: int) -> None: ...

    def withdraw(self, block_hash: bytes) -> None: ...

    def expect(self, block_hash: bytes, slot: int, key: int, tp: int) -> None: ...

    def settle(self, slot: int, key: int) -> None: ...


#: The most ranks whose stores a mirror counts itself (ffi/kvs_index.h); above, only the table does.
MIRROR_MAX_TP = 64


class SlotTable:
    """See the module docstring. ``key_of(hash, slot)`` names a block in the inventories."""

    def __init__(self, capacity: int, tp: int, key_of: Callable[[bytes, int], int]) -> None:
        if capacity < 1 or tp < 1:
            raise ValueError(f"capacity {capacity} and tp {tp} must be >= 1")
        self.capacity, self.tp = capacity, tp
        self._key_of = key_of
        self._lock = threading.Lock()
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out block 0 first
        self._slots: dict[int, _Entry] = {}
        self._by_hash: dict[bytes, int] = {}            # storing or stored
        self._by_key: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # stored slots, oldest first
        self._storing = 0                                  # slots storing
        self._evicting: dict[int, None] = {}               # evicting slots, in the order they began
        self.low_water = max(1, capacity // 16)
        self.high_water = max(1, capacity // 8)
        self.evicted = 0
        self._mirror: Mirror | None = None

    def attach(self, mirror: Mirror) -> None:
        """From now on, tell ``mirror`` of every block advertised and withdrawn (those
        advertised already first)."""
        with self._lock:
            for slot, entry in self._slots.items():
                if entry.state is SlotState.STORED:
                    mirror.advertise(entry.block_hash, slot, entry.key)
                elif entry.state is SlotState.STORING and self.tp <= MIRROR_MAX_TP:
                    mirror.expect(entry.block_hash, slot, entry.key, self.tp)
            self._mirror = mirror

    # -- the scheduler: finished requests ------------------------------------------------

    def reserve(self, hashes: Sequence[bytes]) -> list[Reservation]:
        """Bank blocks for the blocks of ``hashes`` not yet retained, in order; stops at the
        first block no free bank block is left for. Blocks already held count as used."""
        out: list[Reservation] = []
        with self._lock:
            for i, h in enumerate(hashes):
                slot = self._by_hash.get(h)
                if slot is not None:
                    if slot in self._lru:
                        self._lru.move_to_end(slot)
                    continue
                if not self._free:
                    break
                slot = self._free.pop()
                key = self._key_of(h, slot)
                self._slots[slot] = _Entry(h, key, SlotState.STORING)
                self._storing += 1
                self._by_hash[h] = slot
                self._by_key[key] = slot
                if self._mirror is not None and self.tp <= MIRROR_MAX_TP:
                    self._mirror.expect(h, slot, key, self.tp)
                out.append(Reservation(i, h, slot, key))
        return out

    def choose_evictions(self) -> list[int]:
        """When free blocks run low, move least recently used stored blocks to evicting
        (no longer advertised) and return their keys, for every rank to remove."""
        keys: list[int] = []
        with self._lock:
            if len(self._free) >= self.low_water:
                return keys
            pending = len(self._evicting)
            while self._lru and len(self._free) + pending < self.high_water:
                slot, _ = self._lru.popitem(last=False)
                entry = self._slots[slot]
                entry.state = SlotState.EVICTING
                self._evicting[slot] = None
                del self._by_hash[entry.block_hash]
                if self._mirror is not None:  # before any rank is asked to remove it
                    self._mirror.withdraw(entry.block_hash)
                keys.append(entry.key)
                pending += 1
                self.evicted += 1
        return keys

    # -- the ranks' reports ----------------------------------------------------------------

    def stored(self, rank: int, keys: Iterable[int]) -> list[int]:
        """``rank`` stored these blocks; returns keys that now need removing everywhere
        (a store that failed on another rank)."""
        return self._outcome(rank, keys, ok=True)

    def store_failed(self, rank: int, keys: Iterable[int]) -> list[int]:
        return self._outcome(rank, keys, ok=False)

    def _outcome(self, rank: int, keys: Iterable[int], ok: bool) -> list[int]:
        again: list[int] = []
        with self._lock:
            for key in keys:
                entry = self._entry(key)
                if entry is None or entry.state is not SlotState.STORING:
                    continue
                (entry.stored if ok else entry.failed).add(rank)
                if len(entry.stored) + len(entry.failed) < self.tp:
                    continue
                slot = self._by_key[key]
                self._storing -= 1
                if not entry.failed:
                    entry.state = SlotState.STORED
                    self._lru[slot] = None
                    if self._mirror is not None:
                        self._mirror.advertise(entry.block_hash, slot, key)
                    continue
                entry.state = SlotState.EVICTING
                self._evicting[slot] = None
                del self._by_hash[entry.block_hash]
                if self._mirror is not None:  # it never had every rank's store: not advertised
                    self._mirror.settle(slot, key)
                entry.removed = set(range(self.tp)) - entry.stored  # nothing to remove where it failed
                if self._maybe_free(slot, entry):
                    continue
                again.append(key)
        return again

    def removed(self, rank: int, keys: Iterable[int]) -> None:
        """``rank``'s inventory no longer holds these keys."""
        with self._lock:
            for key in keys:
                entry = self._entry(key)
                if entry is None or entry.state is not SlotState.EVICTING:
                    continue
                entry.removed.add(rank)
                self._maybe_free(self._by_key[key], entry)

    def _maybe_free(self, slot: int, entry: _Entry) -> bool:
        if len(entry.removed) < self.tp:
            return False
        del self._slots[slot]
        del self._by_key[entry.key]
        del self._evicting[slot]
        self._free.append(slot)
        return True

    def _entry(self, key: int) -> _Entry | None:
        slot = self._by_key.get(key)
        return None if slot is None else self._slots.get(slot)

    # -- lookups ---------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[Held]:
        """The longest prefix of ``hashes`` stored on every rank (each counts as used)."""
        out: list[Held] = []
        with self._lock:
            for h in hashes:
                slot = self._by_hash.get(h)
                if slot is None or self._slots[slot].state is not SlotState.STORED:
                    break
                self._lru.move_to_end(slot)
                out.append(Held(slot, self._slots[slot].key))
        return out

    def touch(self, slots: Iterable[int]) -> None:
        """These bank blocks were found by lookups elsewhere (the mirror): used, in order."""
        with self._lock:
            for slot in slots:
                if slot in self._lru:
                    self._lru.move_to_end(slot)

    def evicting(self) -> list[int]:
        """Keys still waiting for some rank's removal (to ask again: a lease held them)."""
        with self._lock:
            return [self._slots[slot].key for slot in self._evicting]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"capacity": self.capacity, "free": len(self._free), SlotState.STORING.value: self._storing,
                    SlotState.STORED.value: len(self._lru), SlotState.EVICTING.value: len(self._evicting)}
