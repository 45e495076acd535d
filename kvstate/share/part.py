"""One rank part on the importer side, driven by ``spec/part.toml``: what it asks of its
owner (:class:`PartOwner`), its lease and its mapping.

Phase 1 (``lease``) takes the lease over the exporter's persistent link and checks the
exporter's report and the received handle; phase 2 (``open``) imports, reserves, maps and
sets read access. From its grant until its lease is returned, a part on a link is renewed
by the importer's native renewal thread (:mod:`kvstate.share.renewal`); a part on a channel
of its own (NIXL's) renews in Python (:meth:`Part.renew`).
"""

from __future__ import annotations

import threading
import time
import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Generic, Protocol

import attrs

from kvstate import channel as chan
from kvstate.core.descriptor import Descriptor
from kvstate.core.errors import ArgumentInvalid, ChannelError, ImportFailed, TransferFailed
from kvstate.core.reasons import ArgumentReason, ImportReason, TransferFailReason
from kvstate.reuse.inventory import MAX_GROUP_NAME, block_hashes, group_name
from kvstate.core.machine import Lifecycle, Observer, effect, guard
from kvstate.core.spec import load_machine
from kvstate.core.capabilities import Access
from kvstate.transport.protocol import A, E, H, M, R
from kvstate.share import peers
from kvstate.share.epochs import EpochView
from kvstate.share.owned import let_go, new_owner
from kvstate.share.parked import Parked, key_of

if TYPE_CHECKING:
    from kvstate.share.importer import Importer

log = logging.getLogger(__name__)


def _epochs(value: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not value or \
            not all(type(e) is int and e >= 0 for e in value):
        raise ArgumentInvalid(ArgumentReason.INVENTORY,
                              f"epochs must be a non-empty sequence of non-negative ints (one per rank), "
                              f"not {value!r:.80}")
    return tuple(value)


#: The most block hashes one BlockRequest names: a rank's lease request names them all
#: (up to 20 digits and a comma each) and must fit the link's frame
#: (chan.DEFAULT_MAX_PAYLOAD, 64 KiB) beside its other fields at their largest, a group
#: name of MAX_GROUP_NAME included. 3,100 blocks: 49,600 tokens at 16-token blocks.
#: (Ranks one exporter serves are leased in one frame: that batch may still be larger.)
MAX_REQUEST_HASHES = (chan.DEFAULT_MAX_PAYLOAD + 1 - len(chan.encode({
    "op": "lease", "rank": 2**32 - 1, "generation": 2**64 - 1, "incarnation": "0" * 32,
    "blocks": {"group": "g" * MAX_GROUP_NAME, "epoch": 2**64 - 1, "hashes": []}}))) // len(f"{2**64 - 1},")


def _request_hashes(value: Any) -> tuple[int, ...]:
    hashes = block_hashes(value)
    if len(hashes) > MAX_REQUEST_HASHES:
        raise ArgumentInvalid(ArgumentReason.BLOCK_HASH, f"{len(hashes)} block hashes: a lease request names at "
                              f"most {MAX_REQUEST_HASHES} (it must fit one {chan.DEFAULT_MAX_PAYLOAD}-byte frame)")
    return hashes


@attrs.frozen
class BlockRequest:
    """Inventory blocks every rank's lease must pin, as the decode workers advertised them.

    Each rank's bank keeps its own inventory, so each rank has its own epoch: ``epochs[r]``
    is the epoch rank ``r``'s bank advertised for ``group`` (one entry per rank). At most
    :data:`MAX_REQUEST_HASHES` hashes, and a group name an inventory takes
    (:func:`~kvstate.reuse.inventory.group_name`): a lease request must fit one frame."""

    group: str = attrs.field(converter=group_name)
    epochs: tuple[int, ...] = attrs.field(converter=_epochs)
    hashes: tuple[int, ...] = attrs.field(converter=_request_hashes)  # the exporter's rules, checked here first

    def epoch(self, rank: int) -> int:
        """The epoch rank ``rank``'s lease names."""
        if not 0 <= rank < len(self.epochs):
            raise ArgumentInvalid(ArgumentReason.INVENTORY,
                                  f"no epoch for rank {rank}: the request names {len(self.epochs)} rank(s)")
        return self.epochs[rank]


class PartOwner(Protocol[H, A, R, M, E]):
    """What a :class:`Part` needs of the object it belongs to: an importer-side
    :class:`Group` (every rank in one process), or one worker's share of a coordinated group
    (:class:`kvstate.share.rank_share.RankShare`, its own rank only)."""

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

    def lease_lost(self, part: Part[H, A, R, M, E], why: str) -> bool:
        """The renewal of ``part``'s lease was refused or failed (``why``); True when the
        owner faulted on it."""



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
        #: Set while the importer's renewal thread renews the lease (kvstate.share.renewal):
        #: then it, not this object, knows when the lease was renewed and when it ends.
        self.renewal_key: int | None = None
        self._renewed_at = 0.0            # time.monotonic() of the grant or last renewal
        self._expires_at = 0.0            # time.monotonic()
        self.received: peers.Grant | None = None  # phase 1's grant, with the handle's fds
        self.handle: H | None = None      # checked, not opened (phase 1)
        self.allocation: A | None = None
        self.reservation: R | None = None
        self.mapping: M | None = None
        self._owner = new_owner()         # the token the part owns its mapping with
        self._adopted = False             # phase 1 adopted a parked lease and its mapping (kvstate.share.parked)

    def pins(self) -> int:
        return 0 if self.mapping is None else self.transport.stats(self.mapping).pins

    def lease_intact(self) -> bool:
        """Whether the lease still holds for the exporter: the channel it is on is open at
        both ends. A hang-up ends the lease there (``peer_died``), and the blocks it pinned
        may be written again. Asked after a load's copies ended: the exporter saw the
        hang-up only after this side shut the channel or after its own side closed, both of
        which this poll sees, so a load that read rewritten blocks is never called intact."""
        ch = self.channel
        return ch is not None and not ch.hung_up()

    def _voucher(self, sources: Sequence[int]) -> Callable[[], bool]:
        """For a load of bank blocks ``sources`` about to be submitted: what it asks once its
        copies completed, whether it may use them. The lease must still hold
        (:meth:`lease_intact`), and where the exporter keeps block epochs, no store may
        have written those blocks since now (:class:`kvstate.share.epochs.EpochView`)."""
        try:
            page = self._epoch_page()
            if page is None or not sources:
                return self.lease_intact
            before = page.read(sources)
        except (ChannelError, ValueError) as exc:  # no page this time, or its link closed meanwhile
            log.warning("%s: the load cannot be checked against its block epochs (%s): it fails", self.label, exc)
            return lambda: False
        return lambda: self.lease_intact() and page.vouches(sources, before)

    def _epoch_page(self) -> EpochView | None:
        """The block epoch page of this part's bank, asked once per link and bank (None: the
        exporter keeps none). ChannelError when it could not be had this time."""
        link, lease_id, d = self.link, self.lease_id, self.descriptor
        if link is None or lease_id is None:
            return None  # a part on a channel of its own (NIXL's) reads across nodes
        key = key_of(d)
        if key not in link.block_epochs:
            link.block_epochs[key] = link.epoch_page(d.rank, lease_id, d.geometry.num_blocks,
                                                     self.group.importer.config.request_timeout_s)
        return link.block_epochs[key]

    def _renewed(self) -> tuple[float, float] | None:
        renewal, key = self.group.importer.renewal, self.renewal_key
        state = renewal.state(key) if renewal is not None and key is not None else None
        return None if state is None else (state.renewed_at, state.expires_at)

    @property
    def renewed_at(self) -> float:
        """``time.monotonic()`` of the grant or the last renewal."""
        native = self._renewed()
        return self._renewed_at if native is None else native[0]

    @renewed_at.setter
    def renewed_at(self, value: float) -> None:
        self._renewed_at = value

    @property
    def lease_expires_at(self) -> float:
        """``time.monotonic()`` of the lease's end, as the exporter last said it."""
        native = self._renewed()
        return self._expires_at if native is None else native[1]

    @lease_expires_at.setter
    def lease_expires_at(self, value: float) -> None:
        self._expires_at = value

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
    def _lease(self, *, grant: peers.Grant | Parked | None = None, **kw: Any) -> Callable[[], None]:
        """Phase 1: lease (unless the group's batched request already did: ``grant``),
        receive the handle, check the exporter's report. Opens nothing. A ``grant`` that
        is a parked lease is adopted instead (:meth:`_adopt`)."""
        if isinstance(grant, Parked):
            self._adopt(grant)

            def let_go() -> None:
                self._adopted = False
                self._unmap()
                self._return_lease()
            return let_go
        d, t = self.descriptor, self.transport
        importer = self.group.importer
        with ExitStack() as undo:
            if grant is None:
                grant = importer.peers.lease_one(d.socket_path, lease_fields(d, self.group.blocks),
                                                 importer.config.request_timeout_s)
            grant.taken = True
            # Refused below: give the lease back now, not when the exporter sees a close.
            undo.callback(grant.give_back)
            _check_report(grant.reply, d)
            handle = t.receive_handle(d.handle_kind, d.handle, grant.fds)
            importer._watch(self, grant.link.channel)  # raises if the importer is closing
            key = importer._renew_natively(self, grant)
            undo.pop_all()
        self.renewal_key = key
        # The part takes the grant over: its fds, its lease and its hold on the link.
        self.link, self.channel, self.lease_id = grant.link, grant.link.channel, grant.lease_id
        self.received, self.handle = grant, handle
        grant.let_go = None
        self.lease_s = grant.expires_in_s
        self.renewed_at = time.monotonic()
        self.lease_expires_at = self.renewed_at + grant.expires_in_s
        return self._return_lease

    def _adopt(self, parked: Parked) -> None:
        """Phase 1 from a parked lease (the importer checked it fits this descriptor): the
        lease, its renewal, and the mapping with its owner token, all taken here, so that a
        rollback unmaps and returns them as this part's own. Raises, taking nothing, when
        its renewal failed before the part took it over, or the importer is closing."""
        parked.renewal.retarget(parked.renewal_key, self)  # a failure from now on is this part's
        try:
            # A failure before it was taken over went to the parked lease, not to this part.
            if not parked.renewing(self.descriptor.generation):
                raise ImportFailed.lease_refused("not_renewing", f"{self.label}: the parked lease's renewal failed")
            self.group.importer._watch(self, parked.link.channel)
        except BaseException:
            parked.renewal.retarget(parked.renewal_key, parked)
            raise
        self.renewal_key = parked.renewal_key
        self.link, self.channel, self.lease_id = parked.link, parked.link.channel, parked.lease_id
        self.lease_s = parked.lease_s
        self.allocation, self.reservation, self.mapping = parked.allocation, parked.reservation, parked.mapping
        self._owner = parked.owner
        self._adopted = True

    def _park(self) -> bool:
        """At close: leave the lease and the mapping on the link for the next import of
        this bank (kvstate.share.parked); False, changing nothing, where they may not stay."""
        importer, link, key, lease_id = self.group.importer, self.link, self.renewal_key, self.lease_id
        renewal = importer.renewal
        if importer.config.park_s <= 0 or not getattr(self.group, "parking", False) or self.group.blocks is not None \
                or importer._stopping.is_set() \
                or link is None or key is None or lease_id is None or renewal is None or self.mapping is None \
                or self.allocation is None or self.reservation is None:
            return False
        d = self.descriptor
        parked = Parked(key_of(d), link, lease_id, self.lease_s, key, renewal, d.generation, d, Parked.report_of(d),
                        self.transport, self.allocation, self.reservation, self.mapping, self._owner)
        # Before it is filed: an outcome from now on is the parked lease's.
        renewal.retarget(key, parked)  # type: ignore[arg-type]
        if not parked.live() or not importer.peers.park(parked):
            renewal.retarget(key, self)
            return False
        importer._unwatch_part(self, link)
        self.link = self.channel = None
        self.lease_id = self.renewal_key = None
        self.allocation = self.reservation = self.mapping = None
        self._owner = new_owner()
        return True

    def _took_natively(self, link: peers.PeerLink, lease_id: int, term_s: float, key: int | None, renewed_at: float,
                      allocation: A | None, reservation: R | None, mapping: M | None) -> None:
        """What the native import (:mod:`kvstate.share.native_import`) made for this part,
        recorded as :meth:`_lease` and :meth:`_import` record theirs: the lease on ``link``
        (renewed natively under ``key``), and the mapping. The received fd is closed."""
        self.renewal_key = key
        self.link, self.channel, self.lease_id = link, link.channel, lease_id
        self.received = self.handle = None
        self.lease_s = term_s
        self.renewed_at = renewed_at
        self.lease_expires_at = renewed_at + term_s
        self.allocation, self.reservation, self.mapping = allocation, reservation, mapping
        self._own()

    def _leased_natively(self, grant: peers.Grant, handle: H, key: int | None, renewed_at: float) -> None:
        """What the native phase 1 (:func:`kvstate.share.native_import.lease`) made for
        this part, recorded as :meth:`_lease` records it: the grant with its received fd,
        the checked handle, the lease (renewed natively under ``key``)."""
        self.renewal_key = key
        self.link, self.channel, self.lease_id = grant.link, grant.link.channel, grant.lease_id
        self.received, self.handle = grant, handle
        self.lease_s = grant.expires_in_s
        self.renewed_at = renewed_at
        self.lease_expires_at = renewed_at + grant.expires_in_s

    def _own(self) -> None:
        """Claim the part's mapping (kvstate.share.owned): only the part unmaps it."""
        if self.mapping is not None:
            self.transport.own(self.mapping, self._owner)

    @effect("native_import")
    def _import(self, **kw: Any) -> None:
        """Phase 2: open the handle leased in phase 1, reserve, map, set access (an adopted
        parked lease came with its mapping: nothing to do)."""
        if self._adopted:
            self._adopted = False
            return
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
            self._own()
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
        self._adopted = False
        try:
            self._unmap()  # what a failed open could not undo (as a rule, there is nothing)
        except Exception as exc:
            log.warning("%s: still cannot undo a failed open (%s); the part keeps what is left", self.label, exc)
        self._return_lease()

    @effect("unmap_close")
    def _unmap_close(self, **kw: Any) -> None:
        """Unmap and release first (pins were checked by the guard), then return the lease;
        or park both for the next import (:meth:`_park`). The transport calls straight into
        C: row -> this effect -> transport -> C."""
        if self._park():
            return
        self._unmap()
        self._return_lease()

    def _unmap(self) -> None:
        """Unmap, free, release: each object forgotten only once it is gone (retryable)."""
        let_go(self.transport, self, self._owner)

    def _return_lease(self) -> None:
        """Close the received handle, tell the exporter, and let go of the channel: a
        persistent link stays open for later imports (it closes if the release is not
        answered, which ends the lease too); a part's own channel closes."""
        grant, self.received, self.handle = self.received, None, None
        if grant is not None:
            grant.close_fds()
        key, self.renewal_key = self.renewal_key, None
        if key is not None and self.group.importer.renewal is not None:
            self.group.importer.renewal.remove(key)  # before the release: no renewal after it
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

