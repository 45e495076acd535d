"""The importer: a prefill worker's rank groups, driven by ``spec/group.toml`` and
``spec/part.toml``.

Theory of operation
-------------------

:meth:`Importer.import_group` takes the wire descriptors of one group (one per rank).
Every descriptor is decoded and the whole group validated *before* any connection is
made or handle opened (INV-REJECT-BEFORE-OPEN, INV-GROUP-ATOMIC); a rejected group ends
``rejected`` and nothing was touched. Then each rank part is imported: lease requested
over the exporter's channel, fd received and checked, address reserved, mapped, read
access set. If any part fails, every part imported so far is unmapped and closed and
the group ends ``failed`` (INV-ROLLBACK-COMPLETE). The group becomes ``ready`` only when
every rank 0..tp-1 has an imported, compatible part (INV-GROUP-COMPLETE).

:meth:`Group.load` scatters bank blocks into the engine's paged KV tensors at the
engine's block ids, one native op per (rank, region), and returns a
:class:`~kvstate.share.transfer.TransferHandle` at once (wait per region, cancel, failed
blocks, callback, fd); :meth:`Group.load_prefix` gathers blocks into dense caller
buffers and waits. Everything is checked before the first op is submitted, and a load
is submitted all or nothing (:mod:`kvstate.share.plan`). Ops pin the part mappings until
they finish, so a drain or close never unmaps memory under a copy
(INV-NO-UNMAP-PINNED). A finished load fires ``loaded`` (the load-complete change).
:meth:`Group.drain` refuses new loads, waits until every load is collected and the
native layer reports zero pins, then closes.

Faults reported by the environment (:meth:`Group.fault`): the exporter's connection
closing or its process exiting (``peer_died``, detected by a watcher on every part's
channel), a lease reaching its expiry (``expired``), an exporter restart
(``incarnation_changed``: a lease refused as ``stale_incarnation`` while importing, or a
validated descriptor of the same source and rank from a new incarnation while the group
lives). Before ready they fail the group and roll back; after ready they drain it:
existing mappings stay readable until unmapped, but nothing new starts.
"""

from __future__ import annotations

import os
import threading
import time
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, Generic, Literal, Protocol

import attrs

from kvstate import channel as chan
from kvstate.core.descriptor import Descriptor, decode
from kvstate.core.errors import (
    ChannelError,
    DescriptorRejected,
    DrainTimeout,
    GroupRejected,
    IllegalTransition,
    ImportFailed,
    InventoryError,
    KvStateError,
    LeaseRefused,
    LoadFailed,
    ReuseStale,
    TransferRejected,
    TransitionError,
)
from kvstate.core.reasons import TransferReason
from kvstate.core.identity import Deployment, host_boot_id
from kvstate.core.machine import Lifecycle, Observer, effect, guard
from kvstate.core.spec import load_machine
from kvstate.core.capabilities import Access, MemoryKind
from kvstate.transport.protocol import A, E, H, M, MappedTransport, R, require_mapped
from kvstate.core.validate import Expectation, ValidatedGroup, group_complete, validate_group
from kvstate.share import load as loads
from kvstate.share.plan import Plan
from kvstate.share.transfer import TransferHandle, check_timeout, stop_dispatcher_if_idle

log = logging.getLogger(__name__)


#: The group events that report a fault from the environment (see :meth:`Group.fault`).
GroupFault = Literal["part_failed", "peer_died", "incarnation_changed", "expired"]


def _epochs(value: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not value or \
            not all(type(e) is int and e >= 0 for e in value):
        raise InventoryError(f"epochs must be a non-empty sequence of non-negative ints (one per rank), "
                             f"not {value!r:.80}")
    return tuple(value)


@attrs.frozen
class BlockRequest:
    """Inventory blocks every rank's lease must pin, as the decode workers advertised them.

    Each rank's bank keeps its own inventory, so each rank has its own epoch: ``epochs[r]``
    is the epoch rank ``r``'s bank advertised for ``group`` (one entry per rank)."""

    group: str
    epochs: tuple[int, ...] = attrs.field(converter=_epochs)
    hashes: tuple[int, ...]

    def epoch(self, rank: int) -> int:
        """The epoch rank ``rank``'s lease names."""
        if not 0 <= rank < len(self.epochs):
            raise InventoryError(f"no epoch for rank {rank}: the request names {len(self.epochs)} rank(s)")
        return self.epochs[rank]


class PartOwner(Protocol[H, A, R, M, E]):
    """What a :class:`Part` needs of the object it belongs to: an importer-side
    :class:`Group` (every rank in one process), or one worker's share of a coordinated group
    (:class:`kvstate.share.rank_worker.RankShare`, its own rank only)."""

    label: str
    observers: tuple[Observer, ...]

    @property
    def importer(self) -> Importer[H, A, R, M, E]: ...

    @property
    def blocks(self) -> BlockRequest | None: ...

    @property
    def validated(self) -> object: ...

    @property
    def state(self) -> str: ...

    def peer_closed(self, part: Part[H, A, R, M, E]) -> None:
        """The exporter of ``part`` closed its channel or exited."""


@attrs.frozen
class ImportConfig:
    deployment: Deployment
    request_timeout_s: float = 5.0
    max_tp: int = 64
    max_parallel_imports: int = 8    # threads opening rank parts at once
    geometry_fingerprint: bytes | None = None   # Geometry.fingerprint() of the banks, if fixed
    block_format: bytes | None = None           # Geometry.format_fingerprint() the engine's pages hold
    device_uuids: frozenset[bytes] | None = None


class Part(Lifecycle, Generic[H, A, R, M, E]):
    """One rank part, driven by spec/part.toml. ``H, A, R, M, E``: the transport's types."""

    table = load_machine("part")

    def __init__(self, group: PartOwner[H, A, R, M, E], descriptor: Descriptor) -> None:
        super().__init__(label=f"{group.label}/part[{descriptor.rank}]", observers=group.observers)
        self.group = group
        self.transport = group.importer.transport
        self.descriptor = descriptor
        self.rank = descriptor.rank
        self.channel: chan.Channel | None = None
        self.lease_id: int | None = None
        self.lease_expires_at = 0.0
        self.allocation: A | None = None
        self.reservation: R | None = None
        self.mapping: M | None = None

    def pins(self) -> int:
        return 0 if self.mapping is None else self.transport.stats(self.mapping).pins

    def mapped(self) -> M:
        """The part's mapping (LoadFailed when it has none: not imported, or closed)."""
        if self.mapping is None:
            raise LoadFailed(f"{self.label} is not mapped")
        return self.mapping

    @guard("group_admitted")
    def _admitted(self, **kw: Any) -> bool:
        return self.group.state == "importing" and self.group.validated is not None

    @guard("part_unpinned")
    def _unpinned(self, **kw: Any) -> bool:
        return self.pins() == 0

    @effect("native_import")
    def _import(self, **kw: Any) -> Callable[[], None]:
        d, t = self.descriptor, self.transport
        timeout = self.group.importer.config.request_timeout_s
        with ExitStack() as undo:
            ch = chan.connect(d.socket_path, timeout=timeout)
            undo.callback(ch.close)
            ch.send(lease_request(d, self.group.blocks), timeout=timeout)
            with ch.recv(timeout=timeout) as msg:
                reply = chan.decode(msg.payload)
                if not reply.get("ok"):
                    raise LeaseRefused(str(reply.get("code")), str(reply.get("detail")))
                lease_id, expires_in_s = _grant_fields(reply, d.rank)
                handle = t.receive_handle(d.handle_kind, d.handle, msg.fds)
                allocation = t.import_(handle, d.size)
            undo.callback(t.release, allocation)
            reservation = t.reserve(d.size)
            undo.callback(t.free, reservation)
            mapping = t.map(reservation, 0, allocation)
            undo.callback(t.unmap, mapping)
            t.set_access(mapping, Access.READ)
            # A notification (no answer awaited): the bank moves from importing to ready.
            ch.send(chan.encode({"op": "mapped", "rank": d.rank, "lease": lease_id}), timeout=timeout)
            undo.pop_all()
        self.channel, self.lease_id = ch, lease_id
        self.lease_expires_at = time.monotonic() + expires_in_s
        self.allocation, self.reservation, self.mapping = allocation, reservation, mapping
        self.group.importer.watch(self)
        return self._unmap_close  # the undo of an import is its teardown

    @effect("unmap_close")
    def _unmap_close(self, **kw: Any) -> None:
        """Unmap and release first (pins were checked by the guard), then return the lease.
        The transport calls straight into C: row -> this effect -> transport -> C."""
        t = self.transport
        if self.mapping is not None:
            t.unmap(self.mapping)
        if self.reservation is not None:
            t.free(self.reservation)
        if self.allocation is not None:
            t.release(self.allocation)
        self.mapping = self.reservation = self.allocation = None
        self._return_lease()

    def _return_lease(self) -> None:
        """Return the lease and close its channel (after the memory is gone)."""
        ch, self.channel = self.channel, None
        if ch is not None:
            self.group.importer.unwatch(ch)
            try:
                ch.send(chan.encode({"op": "release", "rank": self.rank, "lease": self.lease_id}), timeout=1.0)
                _expect_ok(ch, 1.0)
            except (ChannelError, LeaseRefused):
                pass  # exporter gone or lease already ended: closing the channel ends it too
            ch.close()


def lease_request(d: Descriptor, blocks: BlockRequest | None) -> bytes:
    """The lease request of one rank part (whatever transport then opens its handle)."""
    return chan.encode({"op": "lease", "rank": d.rank, "generation": d.generation, "incarnation": d.incarnation.hex(),
                        "blocks": None if blocks is None else {"group": blocks.group, "epoch": blocks.epoch(d.rank),
                                                               "hashes": list(blocks.hashes)}})


def _grant_fields(reply: dict[str, Any], rank: int) -> tuple[int, float]:
    """The lease id and seconds to expiry of a grant, checked: the exporter is a peer."""
    lease: Any = reply.get("lease")
    expires: Any = reply.get("expires_in_s")
    if type(lease) is not int or type(expires) not in (int, float) or not 0 <= expires < 1e9:
        raise ImportFailed(rank, KvStateError(f"malformed lease grant {reply!r:.200}"))
    return lease, float(expires)


def _expect_ok(ch: chan.Channel, timeout: float) -> None:
    with ch.recv(timeout=timeout) as msg:
        reply = chan.decode(msg.payload)
    if not reply.get("ok"):
        raise LeaseRefused(str(reply.get("code")), str(reply.get("detail")))


@attrs.frozen
class LoadResult:
    blocks: int
    bytes: int
    seconds: float


class Group(Lifecycle, Generic[H, A, R, M, E]):
    """One rank group on the importer side, driven by spec/group.toml."""

    table = load_machine("group")

    def __init__(self, importer: Importer[H, A, R, M, E], label: str, observers: Iterable[Observer]) -> None:
        super().__init__(label=label, observers=observers)
        self.importer = importer
        self.observers = tuple(observers)
        self.validated: ValidatedGroup | None = None
        self.blocks: BlockRequest | None = None
        self.parts: list[Part[H, A, R, M, E]] = []
        #: Loads submitted and not yet collected (their `loaded` has not fired).
        self.loads: set[TransferHandle] = set()

    @property
    def tp(self) -> int:
        return len(self.parts)

    # -- guards -----------------------------------------------------------------------

    @guard("group_validated")
    def _validated(self, **kw: Any) -> bool:
        return self.validated is not None and len(self.parts) == self.validated.tp

    @guard("all_parts_imported")
    def _all_imported(self, **kw: Any) -> bool:
        return self.validated is not None and group_complete(
            self.validated.tp, [p.rank for p in self.parts if p.state == "imported"])

    @guard("parts_compatible")
    def _compatible(self, **kw: Any) -> bool:
        first = self.parts[0].descriptor
        return all(p.descriptor.geometry == first.geometry and p.descriptor.tp == first.tp
                   and p.descriptor.generation == first.generation and p.mapping is not None
                   and p.mapping.size == p.descriptor.size for p in self.parts)

    @guard("native_quiescent")
    def _quiescent(self, **kw: Any) -> bool:
        return not self.loads and all(p.pins() == 0 for p in self.parts)

    # -- effects ----------------------------------------------------------------------

    @effect("rollback_parts")
    def _rollback(self, **kw: Any) -> None:
        self._close_parts()

    @effect("unmap_parts")
    def _unmap(self, **kw: Any) -> None:
        self._close_parts()

    def _close_parts(self) -> None:
        p: Part[H, A, R, M, E]
        for p in self.parts:
            if p.may("close"):
                p.fire("close")

    @effect("submit_load")
    def _submit(self, *, plan: object = None, **kw: Any) -> None:
        if not isinstance(plan, Plan) or plan.kind != "load":
            raise TransferRejected(TransferReason.PLAN, "fire('load')", "needs the plan Group.load builds")
        handle = plan.submit(self.importer.transport)  # all or nothing; raises LoadFailed
        self.loads.add(handle)
        handle._activate(self._load_finished)

    def _load_finished(self, handle: TransferHandle) -> None:
        try:
            self.fire("loaded", handle=handle)
        except TransitionError as exc:  # cannot happen while the table keeps `loaded` where loads run
            log.error("%s: a finished load was not collected: %s", self.label, exc)
            self.loads.discard(handle)

    @effect("collect_load")
    def _collect(self, *, handle: object = None, **kw: Any) -> None:
        self.loads.discard(handle)

    # -- what the engine calls --------------------------------------------------------

    def load(self, bank_block_ids: Sequence[int], dst_tensors: Mapping[Any, Any], dst_block_ids: Sequence[int], *,
             rank: int | None = None) -> TransferHandle:
        """Scatter bank blocks into the engine's paged KV cache: for every region, bank
        block ``bank_block_ids[i]`` into page ``dst_block_ids[i]`` of ``dst_tensors[name]``
        (torch tensors, numpy arrays, DLPack objects or buffers; see
        :mod:`kvstate.share.tensors`). ``dst_tensors`` maps region names to tensors for the
        part of ``rank`` (optional at tp=1), or ranks to such mappings.

        Returns at once; copies run on the op engine's threads. Every argument is checked
        first (TransferRejected with a reason, nothing submitted); IllegalTransition unless
        the group is ready; LoadFailed if submitting failed (everything submitted was
        cancelled or awaited). See TransferHandle for waiting per region and failures."""
        if not self.may("load"):
            raise IllegalTransition(self.table.name, self.state, "load")
        plan = loads.paged(self, bank_block_ids, dst_tensors, dst_block_ids, rank)
        return self._fire_load(plan)

    def _fire_load(self, plan: Plan) -> TransferHandle:
        try:
            self.fire("load", plan=plan)
        finally:
            plan.release()  # a plan the group refused still holds its tensors
        assert plan.handle is not None
        return plan.handle

    def load_prefix(self, blocks: Sequence[int], destinations: Sequence[Any] | Mapping[int, Any], *,
                    timeout: float = 30.0) -> LoadResult:
        """Gather ``blocks`` (in order) of each rank into its destination buffer, and wait.

        ``destinations`` is one buffer per rank (a sequence of tp buffers), or a mapping
        from rank to buffer to load only some ranks (a TP worker loading its own share).
        Each holds at least ``len(blocks) * block_bytes`` bytes. Raises LoadFailed, and
        the data must not be used, if any op fails or the load outlasts ``timeout`` (it
        is then cancelled; ops already copying finish on their own)."""
        t = check_timeout(timeout)
        if not self.may("load"):
            raise IllegalTransition(self.table.name, self.state, "load")
        # Host memory is reached through the caller's tensors (tensors.adapt); device memory
        # (the cuda backend) goes to the transport as it is.
        host = MemoryKind.HOST in self.importer.transport.capabilities.memory_kinds
        handle = self._fire_load(loads.dense(self, blocks, destinations, host))
        if not handle.wait(t):
            handle.cancel()
            raise LoadFailed(f"prefix load of {len(handle._blocks)} block(s) still running after {timeout} s; "
                             "cancelled")
        result = handle.result()
        assert result is not None
        if not result.ok:
            raise LoadFailed(f"prefix load failed: op(s) of rank(s) "
                             f"{sorted({e.rank for e in handle._entries if e.state != 'done'})} did not complete")
        return LoadResult(result.blocks, result.bytes, result.seconds)

    def peer_closed(self, part: Part[H, A, R, M, E]) -> None:
        """A part's exporter went away (its channel closed or its process exited)."""
        try:
            self.fault("peer_died")
        except TransitionError:
            pass  # a concurrent transition already moved the group on

    def fault(self, event: GroupFault) -> bool:
        """Report a fault event; False when it is not declared in the current state (for
        example a terminal one). Check and transition are one atomic step."""
        with self.locked():
            if not self.may(event):
                return False
            self.fire(event)
            return True

    def drain(self, timeout: float = 30.0) -> float:
        """Refuse new loads, wait for native quiescence, close. Returns seconds to quiescent."""
        start = time.monotonic()
        if self.may("drain"):
            self.fire("drain")
        if self.state != "draining":
            return 0.0  # an import in progress was aborted (failed), or already quiescent/closed
        while True:
            for handle in list(self.loads):
                handle.done()  # finishes loads of backends without completion fds
            try:
                self.fire("quiesce")
                break
            except TransitionError:
                if time.monotonic() - start > timeout:
                    raise DrainTimeout(f"{self.label}: pins still held after {timeout} s; nothing unmapped") from None
                time.sleep(0.002)
        waited = time.monotonic() - start
        self.fire("close")
        return waited


class Importer(Generic[H, A, R, M, E]):
    """A prefill worker's importing side: validates, imports, watches, loads."""

    group_class: type[Group[H, A, R, M, E]] = Group

    def __init__(self, config: ImportConfig, transport: MappedTransport[H, A, R, M, E], *,
                 observers: Iterable[Observer] = ()) -> None:
        require_mapped(transport)
        self.config = config
        self.transport = transport
        self.observers = tuple(observers)
        self.boot_id = host_boot_id()
        self._watcher = chan.Watcher(name="kvstate-importer-watch")
        self._owners: dict[int, Part[H, A, R, M, E]] = {}
        self._count = 0
        #: Groups this importer made and that have not reached a terminal state.
        self.groups: list[Group[H, A, R, M, E]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._stopping = threading.Event()
        self._expiry = threading.Thread(target=self._expire_loop, name="kvstate-importer-expiry", daemon=True)
        self._expiry.start()

    def close(self) -> None:
        """Stop watching and expiring (idempotent). Groups stay as they are."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._expiry.join(2.0)
        self._watcher.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        stop_dispatcher_if_idle()

    def expectation(self, **overrides: Any) -> Expectation:
        e = Expectation(deployment=self.config.deployment, now_ns=time.time_ns(),
                        handle_kinds=self.transport.capabilities.handle_kinds, host_boot_id=self.boot_id, uid=os.getuid(),
                        geometry_fingerprint=self.config.geometry_fingerprint,
                        block_format=self.config.block_format,
                        device_uuids=self.config.device_uuids, max_tp=self.config.max_tp)
        return attrs.evolve(e, **overrides)

    def import_group(self, wire: Sequence[bytes], *, blocks: BlockRequest | None = None,
                     **expect: Any) -> Group[H, A, R, M, E]:
        """Validate the whole group, then import every part; see the module docstring.

        ``blocks`` names inventory blocks every part's lease must pin; if the decode
        worker no longer holds them (the inventory is advisory) this raises ReuseStale
        and the caller recomputes. ``expect`` overrides fields of the Expectation.
        """
        if blocks is not None and len(blocks.epochs) != len(wire):
            raise InventoryError(f"the block request names {len(blocks.epochs)} epoch(s) for a group of "
                                 f"{len(wire)} descriptor(s): one per rank")
        self._count += 1
        group: Group[H, A, R, M, E] = self.group_class(self, f"group#{self._count}", self.observers)
        self.groups = [g for g in self.groups if not g.is_terminal] + [group]
        descriptors: list[Descriptor] = []
        problems: list[DescriptorRejected] = []
        for i, data in enumerate(wire):
            try:
                descriptors.append(decode(data, self.config.deployment))
            except DescriptorRejected as exc:
                exc.rank = i if exc.rank is None else exc.rank
                problems.append(exc)
        try:
            if problems:
                raise GroupRejected(problems)
            validated = validate_group(descriptors, self.expectation(**expect))
        except GroupRejected:
            part: Part[H, A, R, M, E]
            group.parts = [Part(group, d) for d in descriptors]  # the ranks that decoded
            for part in group.parts:
                part.fire("reject")
            group.fire("reject")
            raise
        self._note_restarts(validated)
        group.validated = validated
        group.blocks = blocks
        group.parts = [Part(group, d) for d in validated.parts]
        group.fire("begin_import")
        for part in group.parts:
            part.fire("validate")
        failures = self._open_parts(group.parts)
        for rank in sorted(failures):
            part = group.parts[rank]
            if part.may("import_failed"):
                part.fire("import_failed")
        # Either fault rolls back every part imported so far.
        if any(isinstance(c, LeaseRefused) and c.code == "stale_incarnation" for c in failures.values()):
            group.fault("incarnation_changed")
        elif failures:
            group.fault("part_failed")
        if failures:
            first, cause = min(failures.items())
            if isinstance(cause, LeaseRefused) and cause.code == "stale_inventory":
                raise ReuseStale(first, cause) from cause
            raise ImportFailed(first, cause) from cause
        if group.state != "importing":  # a fault arrived while importing
            raise ImportFailed(0, KvStateError(f"group {group.state} during import"))
        group.fire("complete")
        return group

    def _note_restarts(self, validated: ValidatedGroup) -> None:
        """A validated descriptor of a (source, rank) that a live group imported, from
        another incarnation, shows that exporter restarted: the group hears it."""
        current = {(d.source_id, d.rank): d.incarnation for d in validated.parts}
        group: Group[H, A, R, M, E]
        for group in list(self.groups):
            if any(current.get((p.descriptor.source_id, p.rank), p.descriptor.incarnation)
                   != p.descriptor.incarnation for p in group.parts):
                try:
                    group.fault("incarnation_changed")
                except TransitionError:
                    pass  # a concurrent transition already moved the group on

    def _open_parts(self, parts: Sequence[Part[H, A, R, M, E]]) -> dict[int, BaseException]:
        """Open every part, concurrently: each waits on its own exporter's channel, so the
        group's import costs about one round trip, not tp of them. Returns failures by rank."""
        failures: dict[int, BaseException] = {}

        def open_one(part: Part[H, A, R, M, E]) -> None:
            try:
                # A fault may fail the group (and close this part) before its open starts:
                # that is the group's failure, reported below, not this part's.
                with part.locked():
                    if part.may("open"):
                        part.fire("open")
            except (KvStateError, OSError) as exc:
                failures[part.rank] = exc

        if len(parts) == 1:
            open_one(parts[0])
        else:
            list(self._pool().map(open_one, parts))
        return failures

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.config.max_parallel_imports,
                                                thread_name_prefix="kvstate-import")
        return self._executor

    # -- fault detection ------------------------------------------------------------------

    def watch(self, part: Part[H, A, R, M, E]) -> None:
        assert part.channel is not None
        self._owners[id(part.channel)] = part
        self._watcher.watch(part.channel, self._peer_closed)

    def unwatch(self, ch: chan.Channel) -> None:
        self._owners.pop(id(ch), None)
        self._watcher.unwatch(ch)

    def _peer_closed(self, ch: chan.Channel) -> None:
        part = self._owners.pop(id(ch), None)
        if part is not None:
            part.group.peer_closed(part)

    def _expire_loop(self) -> None:
        while not self._stopping.wait(0.05):
            try:
                self.expire_leases([g for g in self.groups if g.state == "ready"])
            except TransitionError:
                pass  # the group moved on concurrently; the next round looks again

    def expire_leases(self, groups: Iterable[Group[H, A, R, M, E]]) -> list[Group[H, A, R, M, E]]:
        """Fire ``expired`` on every group holding a lease past its expiry; return them."""
        now = time.monotonic()
        expired: list[Group[H, A, R, M, E]] = []
        group: Group[H, A, R, M, E]
        for group in groups:
            if any(p.lease_id is not None and p.lease_expires_at <= now for p in group.parts) \
                    and group.fault("expired"):
                expired.append(group)
        return expired
