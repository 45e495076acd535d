"""The retained inventory of one decode worker: which KV blocks it still holds.

Theory of operation
-------------------

A decode worker keeps finished requests' KV blocks while it can, so that a prefill worker
may load a prefix instead of computing it. The inventory records those blocks as 64-bit
block hashes per *group* (one KV source, for example one rank group's bank), each group
with an *epoch*. The epoch names a generation of the group's contents: :meth:`clear`
starts a new one, and a lease names the epoch it expects, so nothing from an older
generation is ever granted.

The inventory is **advisory**. What it publishes (the :data:`Event` values returned by
:meth:`Inventory.store`, :meth:`Inventory.remove` and :meth:`Inventory.clear`) may be stale
by the time an importer acts on it. So an importer never trusts it: it asks for a lease,
and :meth:`Inventory.lease` re-validates and pins every requested block in **one atomic
step** (under the inventory's lock):

- every block present in the named group and epoch: a :class:`LeaseGrant`, with a lease
  id; every block now carries one more lease and cannot be evicted or removed until
  :meth:`Inventory.release`;
- otherwise: a :class:`Stale` result (old epoch, unknown group, or the blocks that were
  evicted or removed). It grants nothing; the caller recomputes. There is never a partial
  grant (INV-LEASE-ATOMIC).

Retention budget: the inventory holds at most ``budget_blocks`` blocks in all groups. A
store that would exceed it evicts the least recently used blocks (stores and lease grants
count as use) that are neither pinned by the engine (:meth:`Inventory.pin`) nor under
lease (INV-INVENTORY-EVICTION). If nothing can be evicted, the new block is not retained
and :attr:`StoreOutcome.not_retained` says so; the budget is never exceeded
(INV-INVENTORY-BUDGET).

The API the exporter wires to its bank leases is small: ``lease(group, epoch, hashes)``
-> ``LeaseGrant | Stale``, and ``release(grant)``. All methods are thread-safe and never
block except on the inventory's own short critical sections.

Leases granted elsewhere: an exporter's native lease server grants leases naming blocks
without this process's Python (its GIL may be the engine's). It keeps a *mirror* of the
groups, epochs and blocks (:class:`Mirror`, attached with :meth:`Inventory.attach`),
which this inventory updates under its lock at every change; the mirror re-validates and
pins under its own lock and is the authority for the leases it grants. So a block stays
while any mirror's lease pins it: removal, eviction and clear ask every mirror first, all
or nothing. :meth:`busy` counts those leases too; :meth:`active_leases` lists only the
leases granted here.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs

from kvstate.core.args import need_text
from kvstate.core.errors import ArgumentInvalid, Busy, KvStateError
from kvstate.core.reasons import ArgumentReason, BusyReason

HASH_LIMIT = 2**64


#: The ArgumentInvalid reasons the inventory raises (with Busy BLOCKS: the inventory is unchanged).
INVENTORY_REASONS = frozenset({ArgumentReason.INVENTORY, ArgumentReason.BLOCK_HASH, ArgumentReason.UNKNOWN_LEASE,
                               ArgumentReason.NOT_PINNED})


def refused_by_inventory(exc: KvStateError) -> bool:
    """Whether ``exc`` is the inventory's refusal of a request (nothing changed), not
    another failure of the call."""
    return (isinstance(exc, ArgumentInvalid) and exc.reason in INVENTORY_REASONS) or \
        (isinstance(exc, Busy) and exc.reason is BusyReason.BLOCKS)


def block_hashes(values: Iterable[int], *, allow_empty: bool = False) -> tuple[int, ...]:
    """``values`` as block hashes: distinct unsigned 64-bit ints (ArgumentInvalid (BLOCK_HASH) if not)."""
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(values, Iterable):
        raise ArgumentInvalid(ArgumentReason.BLOCK_HASH,
                              f"block hashes must be a sequence of integers, got {values!r:.60}")
    out = tuple(values)
    for h in out:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < HASH_LIMIT:
            raise ArgumentInvalid(ArgumentReason.BLOCK_HASH,
                                  f"block hash must be an unsigned 64-bit integer, got {h!r}")
    if not out and not allow_empty:
        raise ArgumentInvalid(ArgumentReason.BLOCK_HASH, "no block hashes given")
    if len(set(out)) != len(out):
        raise ArgumentInvalid(ArgumentReason.BLOCK_HASH, "repeated block hash in one request")
    return out


#: The longest group name, in characters (ASCII: bytes too). A lease request names its
#: group once per rank; this keeps the name a small part of the link's 64 KiB frame.
MAX_GROUP_NAME = 256


def group_name(group: object) -> str:
    """``group`` as an inventory group name (ArgumentInvalid (INVENTORY) if not): non-empty,
    at most :data:`MAX_GROUP_NAME` characters, printable ASCII other than '"' and '\\'.
    Those are the only names a lease can carry: the exporter's native lease server reads a
    request's strings without JSON escapes (ffi/kvs_json.c), so a lease naming any other
    would be refused as a malformed frame. Shared by :class:`Inventory` and ``BlockRequest``."""
    try:
        name = need_text("group", group, MAX_GROUP_NAME)
    except ArgumentInvalid as exc:  # the inventory's own reason: callers tell its refusals apart by it
        raise ArgumentInvalid(ArgumentReason.INVENTORY, f"group {exc.detail}, got {group!r:.60}") from None
    if not (name.isascii() and name.isprintable()) or '"' in name or "\\" in name:
        raise ArgumentInvalid(ArgumentReason.INVENTORY, "group must be printable ASCII without a quote or "
                              f"backslash (the only names a lease can carry), got {name!r:.60}")
    return name


# -- events: plain data for the engine to publish ----------------------------------------


@attrs.frozen
class BlocksStored:
    group: str
    epoch: int
    hashes: tuple[int, ...]


@attrs.frozen
class BlocksRemoved:
    """Blocks no longer held: removed by the engine or evicted for the budget."""

    group: str
    epoch: int
    hashes: tuple[int, ...]
    evicted: bool


@attrs.frozen
class GroupCleared:
    """Every block of ``group`` is gone; ``epoch`` is the new epoch now in force."""

    group: str
    epoch: int


Event = BlocksStored | BlocksRemoved | GroupCleared


@attrs.frozen
class StoreOutcome:
    events: tuple[Event, ...]
    #: hashes not retained because every other block is pinned or leased
    not_retained: tuple[int, ...]


# -- leases -----------------------------------------------------------------------------


@attrs.frozen
class LeaseGrant:
    """Every requested block is pinned until :meth:`Inventory.release` of this grant."""

    lease_id: int
    group: str
    epoch: int
    hashes: tuple[int, ...]

    granted = True


class StaleReason(enum.Enum):
    UNKNOWN_GROUP = "unknown_group"
    EPOCH = "epoch"  # the request names another epoch than the current one
    MISSING_BLOCKS = "missing_blocks"  # evicted, removed or never stored


@attrs.frozen
class Stale:
    """Nothing was granted: the inventory the caller saw is out of date. Recompute."""

    reason: StaleReason
    group: str
    requested_epoch: int
    current_epoch: int | None
    missing: tuple[int, ...] = ()

    granted = False


class Mirror(Protocol):
    """Another holder of this inventory's contents that grants leases on its blocks (see
    the module docstring). Called under the inventory's lock; each change is all or
    nothing."""

    def epoch(self, group: str, epoch: int) -> bool:
        """Group ``group`` now starts ``epoch`` with no blocks (made if new); False,
        changing nothing, when a lease of the mirror pins one of its blocks."""

    def stored(self, group: str, hashes: Sequence[int]) -> None:
        """The group (already known to the mirror) holds these blocks too."""

    def removed(self, group: str, hashes: Sequence[int]) -> bool:
        """The group no longer holds these; False, removing nothing, when a lease of the
        mirror pins any of them."""

    def leases(self, group: str, block_hash: int) -> int:
        """The mirror's leases on one block."""


@attrs.define
class _Block:
    pins: int = 0
    leases: int = 0

    @property
    def busy(self) -> bool:
        return self.pins > 0 or self.leases > 0


@attrs.define
class _Group:
    epoch: int
    blocks: dict[int, _Block] = attrs.Factory(dict)


class Inventory:
    """The retained inventory of one decode worker. See the module docstring."""

    def __init__(self, budget_blocks: int) -> None:
        if isinstance(budget_blocks, bool) or not isinstance(budget_blocks, int) or budget_blocks < 0:
            raise ArgumentInvalid(ArgumentReason.INVENTORY,
                                  f"budget_blocks must be a non-negative integer, got {budget_blocks!r}")
        self._budget = budget_blocks
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self._lru: OrderedDict[tuple[str, int], None] = OrderedDict()  # oldest first
        self._leases: dict[int, LeaseGrant] = {}
        self._ids = itertools.count(1)
        self._mirrors: list[Mirror] = []

    def attach(self, mirror: Mirror) -> None:
        """Keep ``mirror`` up to date from now on (it is told every group, epoch and block
        held now first); see the module docstring."""
        missing = [m for m in ("epoch", "stored", "removed", "leases") if not callable(getattr(mirror, m, None))]
        if missing:  # checked before the first change: a wrong mirror fails later calls instead
            raise ArgumentInvalid.of("mirror", ArgumentReason.TYPE, f"must be a Mirror, not "
                                     f"{type(mirror).__name__} (no {', '.join(missing)})")
        with self._lock:
            for name, g in self._groups.items():
                if not mirror.epoch(name, g.epoch):
                    raise Busy.blocks(name, [])  # a new mirror pins nothing: cannot happen
                if g.blocks:
                    mirror.stored(name, list(g.blocks))
            self._mirrors.append(mirror)

    def _mirror_removed(self, group: str, hashes: Sequence[int]) -> bool:
        """Remove from every mirror, or from none (False: a mirror's lease pins one)."""
        done: list[Mirror] = []
        for m in self._mirrors:
            if not m.removed(group, hashes):
                for d in done:
                    d.stored(group, hashes)
                return False
            done.append(m)
        return True

    def _mirror_leases(self, group: str, h: int) -> int:
        return sum(m.leases(group, h) for m in self._mirrors)

    @property
    def budget_blocks(self) -> int:
        return self._budget

    # -- engine side --

    def store(self, group: str, hashes: Sequence[int]) -> StoreOutcome:
        """Record blocks as retained in the current epoch of ``group`` (created at epoch 0).

        Storing a block already held refreshes its recency.
        """
        group, hashes = group_name(group), block_hashes(hashes)
        with self._lock:
            g = self._groups.get(group) or self._new_group(group)
            stored: list[int] = []
            not_retained: list[int] = []
            evicted: dict[str, list[int]] = {}
            for h in hashes:
                key = (group, h)
                if h in g.blocks:
                    self._lru.move_to_end(key)
                    continue
                if len(self._lru) >= self._budget and not self._evict_one(evicted, protect=group, hashes=hashes):
                    not_retained.append(h)
                    continue
                g.blocks[h] = _Block()
                self._lru[key] = None
                stored.append(h)
            events: list[Event] = [BlocksRemoved(name, self._groups[name].epoch, tuple(hs), evicted=True)
                                   for name, hs in evicted.items()]
            if stored:
                for m in self._mirrors:
                    m.stored(group, stored)
                events.append(BlocksStored(group, g.epoch, tuple(stored)))
            return StoreOutcome(tuple(events), tuple(not_retained))

    def _new_group(self, group: str) -> _Group:
        for m in self._mirrors:
            m.epoch(group, 0)  # a group a mirror does not know yet: nothing of it is leased
        g = self._groups[group] = _Group(epoch=0)
        return g

    def _evict_one(self, evicted: dict[str, list[int]], *, protect: str, hashes: tuple[int, ...]) -> bool:
        """Evict the least recently used idle block, not one of the batch being stored."""
        batch = set(hashes)
        for key in self._lru:
            name, h = key
            if self._groups[name].blocks[h].busy or (name == protect and h in batch):
                continue
            if not self._mirror_removed(name, [h]):
                continue  # a mirror's lease pins it
            del self._lru[key]
            del self._groups[name].blocks[h]
            evicted.setdefault(name, []).append(h)
            return True
        return False

    def remove(self, group: str, hashes: Sequence[int]) -> tuple[Event, ...]:
        """The engine no longer holds these blocks. Unknown hashes are ignored.

        Raises :class:`Busy` (BLOCKS), removing nothing, if any of them is pinned or leased.
        """
        group, hashes = group_name(group), block_hashes(hashes)
        with self._lock:
            g = self._groups.get(group)
            if g is None:
                return ()
            present = [h for h in hashes if h in g.blocks]
            busy = [h for h in present if g.blocks[h].busy]
            if busy:
                raise Busy.blocks(group, busy)
            if not self._mirror_removed(group, present):
                raise Busy.blocks(group, [h for h in present if self._mirror_leases(group, h)] or present)
            for h in present:
                del g.blocks[h]
                del self._lru[(group, h)]
            return (BlocksRemoved(group, g.epoch, tuple(present), evicted=False),) if present else ()

    def clear(self, group: str) -> tuple[Event, ...]:
        """Forget every block of ``group`` and start a new epoch.

        Raises :class:`Busy` (BLOCKS), changing nothing, if any block is pinned or leased.
        """
        group = group_name(group)
        with self._lock:
            g = self._groups.get(group) or self._new_group(group)
            busy = [h for h, b in g.blocks.items() if b.busy]
            if busy:
                raise Busy.blocks(group, busy)
            done: list[Mirror] = []
            for m in self._mirrors:  # all or nothing: a mirror that cleared gets the blocks back
                if not m.epoch(group, g.epoch + 1):
                    for d in done:
                        d.epoch(group, g.epoch)
                        if g.blocks:
                            d.stored(group, list(g.blocks))
                    raise Busy.blocks(group, [h for h in g.blocks if m.leases(group, h)])
                done.append(m)
            for h in g.blocks:
                del self._lru[(group, h)]
            g.blocks.clear()
            g.epoch += 1
            return (GroupCleared(group, g.epoch),)

    def pin(self, group: str, hashes: Sequence[int]) -> None:
        """Keep these blocks from eviction until :meth:`unpin`. All must be held."""
        group, hashes = group_name(group), block_hashes(hashes)
        with self._lock:
            g = self._groups.get(group)
            missing = [h for h in hashes if g is None or h not in g.blocks]
            if g is None or missing:
                raise ArgumentInvalid(ArgumentReason.INVENTORY, f"group {group!r}: cannot pin blocks it does not hold: "
                                      + ", ".join(f"{h:#018x}" for h in missing[:4]))
            for h in hashes:
                g.blocks[h].pins += 1

    def unpin(self, group: str, hashes: Sequence[int]) -> None:
        group, hashes = group_name(group), block_hashes(hashes)
        with self._lock:
            g = self._groups.get(group)
            unpinned = [h for h in hashes if g is None or h not in g.blocks or g.blocks[h].pins == 0]
            if g is None or unpinned:
                raise ArgumentInvalid(ArgumentReason.NOT_PINNED, f"group {group!r}: block(s) not pinned: "
                                      + ", ".join(f"{h:#018x}" for h in unpinned[:4]))
            for h in hashes:
                g.blocks[h].pins -= 1

    # -- importer side --

    def lease(self, group: str, epoch: int, hashes: Sequence[int]) -> LeaseGrant | Stale:
        """Re-validate and pin every block in one step: a grant, or Stale and nothing pinned."""
        group, hashes = group_name(group), block_hashes(hashes)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ArgumentInvalid(ArgumentReason.INVENTORY, f"epoch must be a non-negative integer, got {epoch!r}")
        with self._lock:
            g = self._groups.get(group)
            if g is None:
                return Stale(StaleReason.UNKNOWN_GROUP, group, epoch, None)
            if epoch != g.epoch:
                return Stale(StaleReason.EPOCH, group, epoch, g.epoch)
            missing = tuple(h for h in hashes if h not in g.blocks)
            if missing:
                return Stale(StaleReason.MISSING_BLOCKS, group, epoch, g.epoch, missing)
            for h in hashes:
                g.blocks[h].leases += 1
                self._lru.move_to_end((group, h))
            grant = LeaseGrant(next(self._ids), group, epoch, hashes)
            self._leases[grant.lease_id] = grant
            return grant

    def release(self, grant: LeaseGrant | int) -> None:
        """End a lease. Releasing an unknown or already released lease is an error."""
        lease_id = grant.lease_id if isinstance(grant, LeaseGrant) else grant
        with self._lock:
            held = self._leases.get(lease_id) if isinstance(lease_id, int) else None
            if held is None or (isinstance(grant, LeaseGrant) and held != grant):
                raise ArgumentInvalid(ArgumentReason.UNKNOWN_LEASE, f"lease {lease_id!r} is not held")
            del self._leases[lease_id]
            g = self._groups[held.group]
            for h in held.hashes:
                g.blocks[h].leases -= 1

    # -- views (for publication, tests and debugging) --

    def epoch(self, group: str) -> int | None:
        group_name(group)
        with self._lock:
            g = self._groups.get(group)
            return None if g is None else g.epoch

    def hashes(self, group: str) -> frozenset[int]:
        group_name(group)
        with self._lock:
            g = self._groups.get(group)
            return frozenset() if g is None else frozenset(g.blocks)

    def lru_order(self) -> tuple[tuple[str, int], ...]:
        """Every held block, least recently used first."""
        with self._lock:
            return tuple(self._lru)

    def busy(self, group: str, block_hash: int) -> tuple[int, int]:
        """(engine pins, leases) on one held block; (0, 0) if it is not held."""
        group_name(group)
        block_hashes([block_hash])
        with self._lock:
            g = self._groups.get(group)
            b = None if g is None else g.blocks.get(block_hash)
            return (0, 0) if b is None else (b.pins, b.leases + self._mirror_leases(group, block_hash))

    def active_leases(self) -> tuple[LeaseGrant, ...]:
        """The leases granted here (a mirror's are not listed: :meth:`busy` counts them)."""
        with self._lock:
            return tuple(self._leases.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)
