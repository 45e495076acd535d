"""The importer: a prefill worker's rank groups, driven by ``spec/group.toml`` and
``spec/part.toml``.

Theory of operation
-------------------

:meth:`Importer.import_group` takes the wire descriptors of one group (one per rank).
Every descriptor is decoded and the whole group validated *before* any connection is
made or handle opened (INV-REJECT-BEFORE-OPEN, INV-GROUP-ATOMIC); a rejected group ends
``rejected`` and nothing was touched. Then each rank part is imported: lease requested
over the exporter's channel, fd received and checked, address reserved, mapped, read
access set. The channel to each exporter is persistent and every rank an exporter serves
is leased in one request, whose answer carries every fd (:mod:`kvstate.share.peers`); the
parts then open one after another in the calling thread (native calls only: no thread
pool on this path). If any part fails, every part imported so far is unmapped and closed and
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
lease granted for the same source and rank under a new incarnation while the group
lives). Before ready they fail the group and roll back; after ready they drain it:
existing mappings stay readable until unmapped, but nothing new starts.
"""

from __future__ import annotations

import os
import threading
import time
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, Generic, Literal, NoReturn, Protocol, get_args

import attrs

from kvstate import channel as chan
from kvstate.core.descriptor import Descriptor, decode_group
from kvstate.core.errors import (
    ArgumentInvalid, ChannelError, ConfigInvalid, DescriptorRejected, GroupRejected, ImportFailed,
    KvStateError, ReuseRefused, TransitionError, TransferFailed, TimedOut,
)
from kvstate.core.args import (need, need_callables, need_choice, need_items, need_mapping_keys, need_seconds,
                               need_text, typed)
from kvstate.core.identity import Deployment, host_boot_id
from kvstate.core.reasons import (
    ArgumentReason, ImportReason, TransferFailReason, TimeoutReason, TransitionReason,
)
from kvstate.reuse.gates import import_refusal
from kvstate.reuse.inventory import block_hashes, group_name
from kvstate.reuse.policy import ReuseSettings
from kvstate.reuse.profile import Admitted
from kvstate.core.machine import Lifecycle, Observer, effect, guard
from kvstate.core.spec import load_machine
from kvstate.core.capabilities import Access, MemoryKind
from kvstate.transport.protocol import A, E, H, M, MappedTransport, R, require_mapped
from kvstate.core.validate import MAX_TP, Expectation, ValidatedGroup, group_complete, validate_group
from kvstate.share import load as loads
from kvstate.share import peers
from kvstate.share.plan import Plan
from kvstate.share.transfer import TransferHandle, check_timeout, stop_dispatcher_if_idle

log = logging.getLogger(__name__)


#: The group events that report a fault from the environment (see :meth:`Group.fault`).
GroupFault = Literal["part_failed", "peer_died", "incarnation_changed", "expired"]


def _epochs(value: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not value or \
            not all(type(e) is int and e >= 0 for e in value):
        raise ArgumentInvalid(ArgumentReason.INVENTORY,
                              f"epochs must be a non-empty sequence of non-negative ints (one per rank), "
                              f"not {value!r:.80}")
    return tuple(value)


@attrs.frozen
class BlockRequest:
    """Inventory blocks every rank's lease must pin, as the decode workers advertised them.

    Each rank's bank keeps its own inventory, so each rank has its own epoch: ``epochs[r]``
    is the epoch rank ``r``'s bank advertised for ``group`` (one entry per rank)."""

    group: str = attrs.field(converter=group_name)
    epochs: tuple[int, ...] = attrs.field(converter=_epochs)
    hashes: tuple[int, ...] = attrs.field(converter=block_hashes)  # the exporter's rules, checked here first

    def epoch(self, rank: int) -> int:
        """The epoch rank ``rank``'s lease names."""
        if not 0 <= rank < len(self.epochs):
            raise ArgumentInvalid(ArgumentReason.INVENTORY,
                                  f"no epoch for rank {rank}: the request names {len(self.epochs)} rank(s)")
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

    @property
    def leasing(self) -> bool:
        """True while the owner, validated whole, may take its parts' leases (phase 1)."""

    @property
    def parts(self) -> Sequence[Part[H, A, R, M, E]]:
        """The parts that import together: phase 2 (open) starts once every one holds a
        checked lease (a coordinated share owns its own rank's part only)."""

    @property
    def releasing(self) -> bool:
        """True only while the owner itself closes its parts (rolling back, or closing
        when nothing pins them): a part never closes on its own under a live owner."""

    def peer_closed(self, part: Part[H, A, R, M, E]) -> None:
        """The exporter of ``part`` closed its channel or exited."""


def _seconds(_: object, attribute: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e9 or value != value:
        raise ConfigInvalid.of(f"ImportConfig.{attribute.name}", f"must be a finite number of seconds > 0, "
                               f"not {value!r:.40}")


def _count(most: int) -> Callable[[object, attrs.Attribute[int], object], None]:
    def check(_: object, attribute: attrs.Attribute[int], value: object) -> None:
        if type(value) is not int or not 1 <= value <= most:
            raise ConfigInvalid.of(f"ImportConfig.{attribute.name}", f"must be an int in 1..{most}, not {value!r:.40}")
    return check


def _optional(kind: type) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None and not isinstance(value, kind):
            raise ConfigInvalid.of(f"ImportConfig.{attribute.name}", f"must be {kind.__name__} or None, "
                                   f"not {type(value).__name__}")
    return check


@attrs.frozen
class ImportConfig:
    deployment: Deployment = attrs.field(validator=typed(Deployment))
    request_timeout_s: float = attrs.field(default=5.0, validator=_seconds)
    max_tp: int = attrs.field(default=64, validator=_count(MAX_TP))
    max_parallel_imports: int = attrs.field(default=8, validator=_count(256))  # kept: parts open without threads now
    #: A channel to an exporter that no lease uses closes after this (kvstate.share.peers).
    link_idle_s: float = attrs.field(default=2.0, validator=_seconds)
    geometry_fingerprint: bytes | None = attrs.field(default=None, validator=_optional(bytes))  # of the banks
    block_format: bytes | None = attrs.field(default=None, validator=_optional(bytes))  # the engine's pages hold
    device_uuids: frozenset[bytes] | None = attrs.field(default=None, validator=_optional(frozenset))
    #: Leases are renewed every min(half the lease, this) seconds while leased or mapped,
    #: so a bank that drains (and refuses renewal) gets its mappings back within this.
    renew_interval_s: float = attrs.field(default=1.0, validator=_seconds)
    #: The reuse switches, enforced by import_group (kvstate.reuse.gates): off by default.
    reuse: ReuseSettings = attrs.field(default=ReuseSettings(), validator=typed(ReuseSettings))
    #: The deployment profile admission (kvstate.reuse.profile.admit); GPU imports need one.
    admission: Admitted | None = attrs.field(default=None, validator=_optional(Admitted))


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
        self.link: peers.PeerLink | None = None  # the persistent channel the lease is on, if any
        self._channel_lock = threading.Lock()  # one request and its answer at a time (own channel)
        self.lease_id: int | None = None
        self.lease_s = 0.0                # the lease's length as the exporter granted it
        self.renewed_at = 0.0             # time.monotonic() of the grant or last renewal
        self.lease_expires_at = 0.0       # time.monotonic()
        self.received: peers.Grant | None = None  # phase 1's grant, with the handle's fds
        self.handle: H | None = None      # checked, not opened (phase 1)
        self.allocation: A | None = None
        self.reservation: R | None = None
        self.mapping: M | None = None

    def pins(self) -> int:
        return 0 if self.mapping is None else self.transport.stats(self.mapping).pins

    def mapped(self) -> M:
        """The part's mapping (TransferFailed (LOAD) when it has none: not imported, or closed)."""
        if self.mapping is None:
            raise TransferFailed(TransferFailReason.LOAD, f"{self.label} is not mapped")
        return self.mapping

    @guard("group_importing")
    def _importing(self, **kw: Any) -> bool:
        return self.group.leasing

    @guard("group_admitted")
    def _admitted(self, **kw: Any) -> bool:
        """Phase 2 may start: every part of the group holds a checked lease."""
        return self.group.state == "importing" and self.group.validated is not None \
            and all(p.state in ("leased", "imported") for p in self.group.parts)

    @guard("group_releasing")
    def _releasing(self, **kw: Any) -> bool:
        # A ready or draining group may have loads on every part: only the owner's own rows
        # (rollback while importing, close when quiescent) let a part go. Stricter than the
        # model's reading (the group neither ready nor draining), which it implies.
        return self.group.releasing

    @guard("part_unpinned")
    def _unpinned(self, **kw: Any) -> bool:
        return self.pins() == 0

    @effect("native_lease")
    def _lease(self, *, grant: peers.Grant | None = None, **kw: Any) -> Callable[[], None]:
        """Phase 1: lease (unless the group's batched request already did: ``grant``),
        receive the handle, check the exporter's report. Opens nothing."""
        d, t = self.descriptor, self.transport
        importer = self.group.importer
        with ExitStack() as undo:
            if grant is None:
                grant = importer._lease_one(d, self.group.blocks)
            grant.taken = True
            # Refused below: give the lease back now, not when the exporter sees a close.
            undo.callback(grant.give_back)
            _check_report(grant.reply, d)
            handle = t.receive_handle(d.handle_kind, d.handle, grant.fds)
            importer._watch(self, grant.link.channel)  # raises if the importer is closing
            undo.pop_all()
        # The part takes the grant over: its fds, its lease and its hold on the link.
        self.link, self.channel, self.lease_id = grant.link, grant.link.channel, grant.lease_id
        self.received, self.handle = grant, handle
        grant.let_go = None
        self.lease_s = grant.expires_in_s
        self.renewed_at = time.monotonic()
        self.lease_expires_at = self.renewed_at + grant.expires_in_s
        return self._return_lease

    @effect("native_import")
    def _import(self, **kw: Any) -> None:
        """Phase 2: open the handle leased in phase 1, reserve, map, set access."""
        d, t = self.descriptor, self.transport
        link, handle, grant = self.link, self.handle, self.received
        if link is None or handle is None or grant is None:
            raise ImportFailed.of(d.rank, ImportReason.INTERRUPTED, f"{self.label} holds no lease to open")
        timeout = self.group.importer.config.request_timeout_s
        # Each object is recorded on the part as it is made: when undoing a failed step
        # fails too (the driver refuses an unmap), what is left stays known and counted
        # (pins, stats) instead of lost, and the step's own failure is the one raised.
        try:
            self.allocation = t.import_(handle, d.size)
            self.reservation = t.reserve(d.size)
            self.mapping = t.map(self.reservation, 0, self.allocation)
            t.set_access(self.mapping, Access.READ)
            # A notification (no answer awaited): the bank moves from importing to ready.
            # A group's opens report every rank of a link in one message instead.
            if grant.report_mapped:
                link.notify(peers.mapped_payload([(d.rank, grant.lease_id)]), timeout)
        except BaseException:
            try:
                self._unmap()
            except Exception as undo_failed:
                log.warning("%s: undoing a failed open failed too (%s); the part keeps what is left",
                            self.label, undo_failed)
            raise
        grant.close_fds()  # the transport holds its own duplicate of the fd now
        self.received = self.handle = None

    def renew(self) -> float:
        """Renew this part's lease: the importer's expiry thread calls this for every part
        that is leased or mapped, once half the lease has run (:meth:`Importer.renew_leases`).
        Returns the seconds to the new expiry. ImportFailed (REFUSED) when the exporter refuses (the
        lease expired there, or the bank drains: unmap and return it), ChannelError when
        the exporter is gone."""
        ch, link, lease_id = self.channel, self.link, self.lease_id
        if ch is None or lease_id is None:
            raise ImportFailed.lease_refused("not_leased", f"{self.label} holds no lease to renew")
        timeout = self.group.importer.config.request_timeout_s
        payload = chan.encode({"op": "renew", "rank": self.rank, "lease": lease_id})
        if link is not None:  # the link's lock keeps other parts' requests apart
            with link.request(payload, timeout) as msg:
                reply = chan.decode(msg.payload)
        else:
            with self._channel_lock:
                try:
                    ch.send(payload, timeout=timeout)
                    with ch.recv(timeout=timeout) as msg:
                        reply = chan.decode(msg.payload)
                except ChannelError:
                    ch.close()  # a late answer would be read as the next request's
                    raise
        if not reply.get("ok"):
            raise ImportFailed.lease_refused(str(reply.get("code")), str(reply.get("detail")))
        expires: Any = reply.get("expires_in_s")
        if type(expires) not in (int, float) or not 0 <= expires < 1e9:
            raise ImportFailed.lease_refused("malformed", f"malformed renewal {reply!r:.200}")
        self.renewed_at = time.monotonic()
        self.lease_expires_at = self.renewed_at + float(expires)
        return float(expires)

    @effect("return_lease")
    def _return(self, **kw: Any) -> None:
        try:
            self._unmap()  # what a failed open could not undo (as a rule, there is nothing)
        except Exception as exc:
            log.warning("%s: still cannot undo a failed open (%s); the part keeps what is left", self.label, exc)
        self._return_lease()

    @effect("unmap_close")
    def _unmap_close(self, **kw: Any) -> None:
        """Unmap and release first (pins were checked by the guard), then return the lease.
        The transport calls straight into C: row -> this effect -> transport -> C."""
        self._unmap()
        self._return_lease()

    def _unmap(self) -> None:
        """Unmap, free, release: each object forgotten only once it is gone (retryable)."""
        t = self.transport
        if self.mapping is not None:
            t.unmap(self.mapping)
            self.mapping = None
        if self.reservation is not None:
            t.free(self.reservation)
            self.reservation = None
        if self.allocation is not None:
            t.release(self.allocation)
            self.allocation = None

    def _return_lease(self) -> None:
        """Close the received handle, tell the exporter, and let go of the channel: a
        persistent link stays open for later imports (it closes if the release is not
        answered, which ends the lease too); a part's own channel closes."""
        grant, self.received, self.handle = self.received, None, None
        if grant is not None:
            grant.close_fds()
        link, self.link = self.link, None
        if link is not None:
            self.channel = None
            self.group.importer._unwatch_part(self, link)
            link.release(self.rank, self.lease_id)
            self.group.importer.peers.let_go(link)
            return
        ch, self.channel = self.channel, None
        if ch is not None:
            self.group.importer._unwatch(ch)
            with self._channel_lock:
                _release_quietly(ch, self.rank, self.lease_id)
            ch.close()


def _release_quietly(ch: chan.Channel, rank: int, lease_id: int | None) -> None:
    """Return a lease and wait for the answer; an exporter that is gone, or a lease that
    already ended, is fine: closing the channel ends the lease too."""
    try:
        ch.send(chan.encode({"op": "release", "rank": rank, "lease": lease_id}), timeout=1.0)
        _expect_ok(ch, 1.0)
    except (ChannelError, ImportFailed):  # gone, or a refusal (the only ImportFailed these raise)
        pass


def _check_report(reply: dict[str, Any], d: Descriptor) -> None:
    """Phase 1's check of what the exporter reports about the bank it leased against the
    descriptor: a restarted, re-advertised, resized or re-shaped bank is refused here,
    before anything is opened. Exporters that report nothing are checked by the grant's
    own refusals (incarnation and generation) only."""
    report = reply.get("bank")
    if report is None:
        return
    want = {"rank": d.rank, "generation": d.generation, "incarnation": d.incarnation.hex(),
            "geometry": d.geometry.fingerprint().hex(), "num_blocks": d.geometry.num_blocks,
            "device_uuid": d.device_uuid.hex(), "size": d.size}
    if not isinstance(report, dict):
        raise ImportFailed.lease_refused("lease_mismatch", f"malformed bank report {report!r:.100}")
    for key, value in want.items():
        if report.get(key) != value:
            raise ImportFailed.lease_refused("lease_mismatch", f"the exporter reports {key} {report.get(key)!r:.80}, "
                                             f"the descriptor says {value!r:.80}")


def lease_fields(d: Descriptor, blocks: BlockRequest | None) -> dict[str, Any]:
    """What a lease request of one rank part names (without its ``op``)."""
    return {"rank": d.rank, "generation": d.generation, "incarnation": d.incarnation.hex(),
            "blocks": None if blocks is None else {"group": blocks.group, "epoch": blocks.epoch(d.rank),
                                                   "hashes": list(blocks.hashes)}}


def lease_request(d: Descriptor, blocks: BlockRequest | None) -> bytes:
    """The lease request of one rank part (whatever transport then opens its handle)."""
    return chan.encode({"op": "lease", **lease_fields(d, blocks)})


def _grant_fields(reply: dict[str, Any], rank: int) -> tuple[int, float]:
    """The lease id and seconds to expiry of a grant, checked: the exporter is a peer."""
    lease: Any = reply.get("lease")
    expires: Any = reply.get("expires_in_s")
    if type(lease) is not int or type(expires) not in (int, float) or not 0 <= expires < 1e9:
        raise ImportFailed.of(rank, ImportReason.MALFORMED, f"malformed lease grant {reply!r:.200}")
    return lease, float(expires)


def _expect_ok(ch: chan.Channel, timeout: float) -> None:
    with ch.recv(timeout=timeout) as msg:
        reply = chan.decode(msg.payload)
    if not reply.get("ok"):
        raise ImportFailed.lease_refused(str(reply.get("code")), str(reply.get("detail")))


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
        #: Set only while the group's own rows close its parts (see Part's group_releasing).
        self.releasing = False
        #: When a lease of the group was lost (``expired``): it is then closed as soon as
        #: no load pins it, so the exporter gets its bank back (INV-NO-RELEASE-MAPPED).
        self.expired_at: float | None = None
        #: Loads submitted and not yet collected (their `loaded` has not fired).
        self.loads: set[TransferHandle] = set()

    @property
    def tp(self) -> int:
        return len(self.parts)

    @property
    def leasing(self) -> bool:
        """Phase 1 runs while the group, validated whole, is importing (PartOwner)."""
        return self.state == "importing" and self.validated is not None

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
        """Close every part that is open, trying each even when one refuses, so one
        failing part does not keep the others' mappings and leases; then raise the first
        failure (the group stays where it was and the caller may retry)."""
        first: KvStateError | None = None
        p: Part[H, A, R, M, E]
        self.releasing = True
        try:
            for p in self.parts:
                try:
                    if p.may("close"):
                        p.fire("close")
                except KvStateError as exc:
                    first = first or exc
        finally:
            self.releasing = False
        if first is not None:
            raise first

    @effect("submit_load")
    def _submit(self, *, plan: object = None, **kw: Any) -> None:
        if not isinstance(plan, Plan) or plan.kind != "load":
            raise ArgumentInvalid.transfer(ArgumentReason.PLAN, "fire('load')", "needs the plan Group.load builds")
        handle = plan.submit(self.importer.transport)  # all or nothing; raises TransferFailed (LOAD)
        self.loads.add(handle)
        try:
            handle._activate(self._load_finished)
        except BaseException:  # not watched: nothing of it is in flight (_activate)
            self.loads.discard(handle)
            raise

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
        first (ArgumentInvalid (a load/store reason) with a reason, nothing submitted); TransitionError (ILLEGAL) unless
        the group is ready; TransferFailed (LOAD) if submitting failed (everything submitted was
        cancelled or awaited). See TransferHandle for waiting per region and failures."""
        if not self.may("load"):
            raise TransitionError.illegal(self.table.name, self.state, "load")
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
        Each holds at least ``len(blocks) * block_bytes`` bytes. Raises TransferFailed (LOAD), and
        the data must not be used, if any op fails or the load outlasts ``timeout`` (it
        is then cancelled; ops already copying finish on their own)."""
        t = check_timeout(timeout)
        if not self.may("load"):
            raise TransitionError.illegal(self.table.name, self.state, "load")
        # Host memory is reached through the caller's tensors (tensors.adapt); device memory
        # (the cuda backend) goes to the transport as it is.
        host = MemoryKind.HOST in self.importer.transport.capabilities.memory_kinds
        handle = self._fire_load(loads.dense(self, blocks, destinations, host))
        if not handle.wait(t):
            handle.cancel()
            raise TransferFailed(TransferFailReason.LOAD,
                                 f"prefix load of {len(handle._blocks)} block(s) still running after {timeout} s; "
                                 "cancelled")
        result = handle.result()
        assert result is not None
        if not result.ok:
            raise TransferFailed(TransferFailReason.LOAD, f"prefix load failed: op(s) of rank(s) "
                                 f"{sorted({e.rank for e in handle._entries if e.state != 'done'})} did not complete")
        return LoadResult(result.blocks, result.bytes, result.seconds)

    def peer_closed(self, part: Part[H, A, R, M, E]) -> None:
        """A part's exporter went away (its channel closed or its process exited)."""
        try:
            self.fault("peer_died")
        except TransitionError:
            pass  # a concurrent transition already moved the group on

    def fault(self, event: GroupFault, *, reason: str | None = None) -> bool:
        """Report a fault event; False when it is not declared in the current state (for
        example a terminal one). Check and transition are one atomic step. ``reason``
        travels to the observers (StateChange.reason)."""
        need_choice("event", event, get_args(GroupFault))
        if reason is not None:
            need_text("reason", reason, allow_empty=True)
        with self.locked():
            if not self.may(event):
                return False
            self.fire(event, reason=reason)
            if event == "expired":  # the importer's expiry thread closes it once unpinned
                self.expired_at = time.monotonic()
            return True

    def drain(self, timeout: float = 30.0) -> float:
        """Refuse new loads, wait for native quiescence, close. Returns seconds to quiescent.
        Safe to call while the importer's expiry thread settles the same group."""
        timeout = need_seconds("timeout", timeout)
        start = time.monotonic()
        with self.locked():
            if self.may("drain"):
                self.fire("drain")
        while True:
            for handle in list(self.loads):
                handle.done()  # finishes loads of backends without completion fds
            if self.settle():
                break
            if self.state != "draining":
                return 0.0  # an import in progress was aborted (failed), or already closed
            if time.monotonic() - start > timeout:
                raise TimedOut(TimeoutReason.DRAIN,
                               f"{self.label}: pins still held after {timeout} s; nothing unmapped")
            time.sleep(0.002)
        return time.monotonic() - start

    def settle(self) -> bool:
        """One step of a drain that does not wait: a draining group with no pins left is
        quiesced, and a quiescent one closed (unmapped, its leases returned). True when
        this call closed the group."""
        with self.locked():
            if self.state == "draining":
                try:
                    self.fire("quiesce")
                except TransitionError as exc:
                    if exc.reason is not TransitionReason.GUARD:
                        raise
                    return False  # loads or pins still running
            if self.state == "quiescent":
                self.fire("close")
                return True
        return False


class Importer(Generic[H, A, R, M, E]):
    """A prefill worker's importing side: validates, imports, watches, loads."""

    group_class: type[Group[H, A, R, M, E]] = Group

    def __init__(self, config: ImportConfig, transport: MappedTransport[H, A, R, M, E], *,
                 observers: Iterable[Observer] = ()) -> None:
        if not isinstance(config, ImportConfig):
            raise ConfigInvalid.of("config", f"must be an ImportConfig, not {type(config).__name__}")
        observers = need_callables("observers", observers)
        require_mapped(transport)
        self.config = config
        self.transport = transport
        self.observers = tuple(observers)
        self.boot_id = host_boot_id()
        self._watcher = chan.Watcher(name="kvstate-importer-watch")
        #: Parts by the id of the channel their lease is on (one channel: many parts).
        self._owners: dict[int, dict[int, Part[H, A, R, M, E]]] = {}
        self._watched: set[int] = set()  # ids of the channels the watcher watches
        self._owners_lock = threading.Lock()
        #: One persistent channel per exporter address (kvstate.share.peers).
        self.peers = peers.Peers(self._connect, config.link_idle_s)
        self._count = 0
        #: Groups this importer made and that have not reached a terminal state.
        self.groups: list[Group[H, A, R, M, E]] = []
        self._stopping = threading.Event()
        self._expiry = threading.Thread(target=self._expire_loop, name="kvstate-importer-expiry", daemon=True)
        self._expiry.start()

    def close(self) -> None:
        """Stop watching and expiring (idempotent). Groups stay as they are."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._expiry.join(2.0)
        self.peers.close()  # idle channels now, busy ones when their last lease returns
        self._watcher.close()
        stop_dispatcher_if_idle()

    def check_gates(self) -> None:
        """ReuseRefused unless this importer's config enables reuse and, for a transport
        over device memory, GPU reuse under an admitted deployment profile
        (:mod:`kvstate.reuse.gates`). Every path that leases or opens calls it first."""
        refusal = import_refusal(self.config.reuse, self.config.admission, self.transport.name,
                                 self.transport.capabilities)
        if refusal is not None:
            raise ReuseRefused(*refusal)

    def expectation(self, **overrides: Any) -> Expectation:
        overrides = need_mapping_keys("overrides", overrides, [a.name for a in attrs.fields(Expectation)])
        e = Expectation(deployment=self.config.deployment, now_ns=time.time_ns(),
                        handle_kinds=self.transport.capabilities.handle_kinds, host_boot_id=self.boot_id, uid=os.getuid(),
                        geometry_fingerprint=self.config.geometry_fingerprint,
                        block_format=self.config.block_format,
                        device_uuids=self.config.device_uuids, max_tp=self.config.max_tp)
        return attrs.evolve(e, **overrides) if overrides else e

    def import_group(self, wire: Sequence[bytes], *, blocks: BlockRequest | None = None,
                     **expect: Any) -> Group[H, A, R, M, E]:
        """Validate the whole group, then import every part; see the module docstring.

        ``blocks`` names inventory blocks every part's lease must pin; if the decode
        worker no longer holds them (the inventory is advisory) this raises ImportFailed (STALE)
        and the caller recomputes. ``expect`` overrides fields of the Expectation.
        Refused with ReuseRefused, before anything is decoded or opened, unless the
        config enables reuse (and, for a GPU transport, GPU reuse under an admitted
        deployment profile): see :mod:`kvstate.reuse.gates`.
        """
        self.check_gates()
        need_items("wire", wire, object, max_len=self.config.max_tp)  # each item: decode checks it
        if blocks is not None:
            need("blocks", blocks, BlockRequest)
        expect = need_mapping_keys("expect", expect, [a.name for a in attrs.fields(Expectation)])
        if self._stopping.is_set():
            raise ArgumentInvalid.of("importer", ArgumentReason.STATE, "this importer is closed")
        if blocks is not None and len(blocks.epochs) != len(wire):
            raise ArgumentInvalid(ArgumentReason.INVENTORY,
                                  f"the block request names {len(blocks.epochs)} epoch(s) for a group of "
                                  f"{len(wire)} descriptor(s): one per rank")
        self._count += 1
        group: Group[H, A, R, M, E] = self.group_class(self, f"group#{self._count}", self.observers)
        self.groups = [g for g in self.groups if not g.is_terminal] + [group]
        descriptors, problems = decode_group(wire, self.config.deployment)
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
        group.validated = validated
        group.blocks = blocks
        group.parts = [Part(group, d) for d in validated.parts]
        group.fire("begin_import")
        for part in group.parts:
            part.fire("validate")
        # Phase 1 leases and checks every rank; phase 2 opens only when all passed.
        for phase in ("lease", "open"):
            failures = self._each_part(group.parts, phase)
            if failures:
                self._fail(group, failures)
            if phase == "lease":  # granted: these incarnations are current (a replayed old one is refused)
                self._note_restarts(validated)
        if group.state != "importing":  # a fault arrived while importing
            raise ImportFailed.of(0, ImportReason.INTERRUPTED, f"group {group.state} during import")
        try:
            group.fire("complete")
        except TransitionError as exc:  # refused (or a concurrent fault): never left importing
            if group.may("drain"):
                group.fire("drain", reason=f"complete refused: {exc}")
            raise ImportFailed.wrap(0, exc) from exc
        return group

    def _fail(self, group: Group[H, A, R, M, E], failures: dict[int, Exception]) -> NoReturn:
        """Fail the group after part failures: every part leased or imported so far is
        rolled back (its lease returned), and the first failure is raised."""
        part: Part[H, A, R, M, E]
        for rank in sorted(failures):
            part = group.parts[rank]
            with part.locked():
                if part.may("import_failed"):
                    part.fire("import_failed", reason=str(failures[rank]))
        first, cause = min(failures.items())
        reason = f"rank {first}: {cause}"
        if any(isinstance(c, ImportFailed) and c.code == "stale_incarnation" for c in failures.values()):
            group.fault("incarnation_changed", reason=reason)
        else:
            group.fault("part_failed", reason=reason)
        raise ImportFailed.wrap(first, cause) from cause  # STALE when the blocks are gone: recompute

    def _note_restarts(self, validated: ValidatedGroup) -> None:
        """A descriptor of a (source, rank) that a live group imported, from another
        incarnation that the exporter then leased, shows that exporter restarted: the
        group hears it. Called only after the leases were granted, so that a replayed
        descriptor of an older incarnation (refused as ``stale_incarnation``) harms no
        live group."""
        current = {(d.source_id, d.rank): d.incarnation for d in validated.parts}
        group: Group[H, A, R, M, E]
        for group in list(self.groups):
            if any(current.get((p.descriptor.source_id, p.rank), p.descriptor.incarnation)
                   != p.descriptor.incarnation for p in group.parts):
                try:
                    group.fault("incarnation_changed")
                except TransitionError:
                    pass  # a concurrent transition already moved the group on

    def _each_part(self, parts: Sequence[Part[H, A, R, M, E]], event: Literal["lease", "open"]) -> dict[int, Exception]:
        """Fire ``event`` on every part, in this thread. ``lease``: one batched request per
        exporter, every request sent before any answer is read (one round trip for the
        group, :mod:`kvstate.share.peers`), then each part takes its grant. ``open``:
        native calls only, then one ``mapped`` note per exporter. Returns failures by rank
        (anything raised, typed or not: the caller rolls back on every one)."""
        if event == "lease":
            return self._lease_parts(parts)
        failures: dict[int, Exception] = {}
        opened: dict[int, tuple[peers.PeerLink, list[tuple[int, int]]]] = {}
        part: Part[H, A, R, M, E]
        for part in parts:
            grant, link = part.received, part.link
            if grant is not None:
                grant.report_mapped = False
            try:
                # A fault may fail the group (and close this part) before its step starts:
                # that is the group's failure, reported by the caller, not this part's.
                with part.locked():
                    if part.may("open"):
                        part.fire("open")
                        if grant is not None and link is not None and part.lease_id is not None:
                            opened.setdefault(id(link), (link, []))[1].append((part.rank, part.lease_id))
            except Exception as exc:
                failures[part.rank] = exc
        for link, leases in opened.values():  # one notification per exporter
            try:
                link.notify(peers.mapped_payload(leases), self.config.request_timeout_s)
            except ChannelError as exc:
                failures.update((rank, exc) for rank, _ in leases)
        return failures

    def _lease_parts(self, parts: Sequence[Part[H, A, R, M, E]]) -> dict[int, Exception]:
        """Phase 1 of every part: batched per exporter address (parts of another kind, or
        reached over TCP, lease on their own)."""
        failures: dict[int, Exception] = {}
        timeout = self.config.request_timeout_s
        by_peer: dict[str, list[Part[H, A, R, M, E]]] = {}
        part: Part[H, A, R, M, E]
        for part in parts:
            if type(part) is Part and "://" not in part.descriptor.socket_path:
                by_peer.setdefault(part.descriptor.socket_path, []).append(part)
            else:
                self._fire_lease(part, None, failures)
        batches = list(by_peer.values())
        answers = self.peers.leases([(served[0].descriptor.socket_path,
                                      [lease_fields(p.descriptor, p.group.blocks) for p in served])
                                     for served in batches], timeout)
        granted: list[peers.Grant] = []
        try:
            for served, answer in zip(batches, answers):
                if isinstance(answer, peers.RankRefused):  # that rank's failure; the others hold no lease
                    failures[answer.rank] = answer.refusal
                    continue
                if isinstance(answer, Exception):
                    failures.update((p.rank, answer) for p in served)
                    continue
                granted += answer
                for part, grant in zip(served, answer):
                    self._fire_lease(part, grant, failures)
        finally:
            for grant in granted:
                if not grant.taken:  # its part never leased: the lease goes back
                    grant.give_back()
        return failures

    @staticmethod
    def _fire_lease(part: Part[H, A, R, M, E], grant: peers.Grant | None, failures: dict[int, Exception]) -> None:
        try:
            # A fault may fail the group (and close this part) before its step starts.
            with part.locked():
                if part.may("lease"):
                    if grant is None:
                        part.fire("lease")
                    else:
                        part.fire("lease", grant=grant)
        except Exception as exc:
            failures[part.rank] = exc

    def _lease_one(self, d: Descriptor, blocks: BlockRequest | None) -> peers.Grant:
        """One rank's lease over the persistent link to its exporter (a part leased on
        its own, as a rank worker's is). Private: ``d`` must be validated already."""
        (answer,) = self.peers.leases([(d.socket_path, [lease_fields(d, blocks)])], self.config.request_timeout_s)
        if isinstance(answer, peers.RankRefused):
            raise answer.refusal
        if isinstance(answer, Exception):
            raise answer
        return answer[0]

    def _connect(self, address: str, timeout: float) -> chan.Channel:
        return chan.connect(address, timeout=timeout, limits=peers.LINK_LIMITS)

    # -- fault detection ------------------------------------------------------------------

    def _watch(self, part: Part[H, A, R, M, E], ch: chan.Channel) -> None:
        """Hear when the exporter of ``part`` goes: its channel ``ch`` is watched once,
        however many parts hold leases on it. Raises, changing nothing, when the watcher
        is closed (the importer is closing)."""
        with self._owners_lock:
            first = id(ch) not in self._watched
            if first:  # a link stays watched while it is open, used or not: no watcher wake-up per import
                try:
                    self._watcher.watch(ch, self._peer_closed)
                except ChannelError as exc:
                    if not exc.closed:
                        raise
                    # this importer closes: not the exporter's doing
                    raise ImportFailed.wrap(part.rank, exc, ImportReason.INTERRUPTED) from exc
                self._watched.add(id(ch))
            self._owners.setdefault(id(ch), {})[id(part)] = part

    def _unwatch(self, ch: chan.Channel) -> None:
        with self._owners_lock:
            self._owners.pop(id(ch), None)
            self._watched.discard(id(ch))
        self._watcher.unwatch(ch)

    def _unwatch_part(self, part: Part[H, A, R, M, E], link: peers.PeerLink) -> None:
        """``part`` let go of its lease on ``link`` (the link stays watched while open)."""
        with self._owners_lock:
            owners = self._owners.get(id(link.channel))
            if owners is not None:
                owners.pop(id(part), None)

    def _peer_closed(self, ch: chan.Channel) -> None:
        self.peers.forget(ch)
        with self._owners_lock:
            owners = self._owners.pop(id(ch), {})
            self._watched.discard(id(ch))
        for part in owners.values():
            part.group.peer_closed(part)

    def _expire_loop(self) -> None:
        while not self._stopping.wait(0.05):
            self.peers.close_idle()
            live = [g for g in self.groups if g.state in ("importing", "ready", "draining", "quiescent")]
            try:
                self.renew_leases(live)
                self.expire_leases([g for g in live if g.state == "ready"])
                for group in live:  # a group that lost a lease lets go of the bank promptly
                    if group.expired_at is not None:
                        group.settle()
            except KvStateError:
                pass  # the group moved on concurrently; the next round looks again

    def renew_leases(self, groups: Iterable[Group[H, A, R, M, E]]) -> list[Group[H, A, R, M, E]]:
        """Renew every lease of every part still leased or mapped, once half its term or
        ``renew_interval_s`` has passed since its grant or last renewal (the expiry thread
        calls this every 50 ms). A renewal the exporter refuses, or cannot
        answer, is the group's ``expired`` fault, with the reason: the group drains, then
        unmaps and returns its leases. Returns the groups that faulted."""
        groups = need_items("groups", groups, Group)
        faulted: list[Group[H, A, R, M, E]] = []
        every = self.config.renew_interval_s
        group: Group[H, A, R, M, E]
        for group in groups:
            for part in list(group.parts):
                if part.channel is None or time.monotonic() - part.renewed_at < min(part.lease_s / 2, every):
                    continue
                try:
                    part.renew()
                except KvStateError as exc:
                    if group.fault("expired", reason=f"{part.label}: lease renewal failed: {exc}"):
                        faulted.append(group)
                    break
        return faulted

    def expire_leases(self, groups: Iterable[Group[H, A, R, M, E]]) -> list[Group[H, A, R, M, E]]:
        """Fire ``expired`` on every group holding a lease past its expiry; return them."""
        groups = need_items("groups", groups, Group)
        now = time.monotonic()
        expired: list[Group[H, A, R, M, E]] = []
        group: Group[H, A, R, M, E]
        for group in groups:
            late = [p.label for p in group.parts if p.lease_id is not None and p.lease_expires_at <= now]
            if late and group.fault("expired", reason=f"lease of {', '.join(late)} ran out unrenewed"):
                expired.append(group)
        return expired
