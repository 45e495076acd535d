"""Persistent control channels from an importer to its exporters, and batched leases.

Why
---

An import used to open a connection per rank part: connect, credential checks, a pidfd,
a handler thread started by the exporter, a watcher wake-up, and one lease round trip
each. Measured at tp=8 (``python -m benchmarks.import_profile``), that set-up
was most of the import's time. Now an importer keeps one :class:`PeerLink` per exporter
address, reused across imports, and asks for every rank that exporter serves in one
request whose answer carries every fd in one SCM_RIGHTS message.

What stays the same
-------------------

- Leases are still bound to the connection: when the link closes (the importer closes
  it, or its process dies), the exporter ends every lease on it. A part that ends sends
  ``release`` and waits for the answer; if that fails the link is closed, so the lease
  ends anyway.
- Credentials (SO_PEERCRED, uid) and the socket path are checked when a link connects;
  every import still validates each descriptor (socket path rule included) before any
  handle is opened.
- A batched request is all or nothing on the exporter (:meth:`Exporter._handle_batch`):
  a refusal of any rank returns every lease it granted in that request.

Threads: one request and its answer at a time per link, so a lease renewal, a release
and an import never read each other's answers. The link's frame I/O and that lock are
in C (:mod:`kvstate.share.link`), so that the importer's native renewal thread
(:mod:`kvstate.share.renewal`) shares the connection without the GIL. Requests to
several exporters are pipelined without threads (:func:`exchange`): every request is
sent, then every answer read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import attrs

from kvstate import channel as chan
from kvstate.channel.framing import close_quietly
from kvstate.share.epochs import ENTRY_BYTES, EpochView
from kvstate.share.link import NativeLink
from kvstate.share.parked import Key, Parked
from kvstate.core.errors import ArgumentInvalid, ChannelError, ImportFailed, KvStateError
from kvstate.core.reasons import ArgumentReason, ImportReason, ChannelReason

#: How many fds one message may carry on a link: every rank of the largest group.
log = logging.getLogger(__name__)

LINK_LIMITS = chan.Limits(max_fds=chan.HARD_MAX_FDS)


class PeerLink:
    """One persistent channel to one exporter address."""

    def __init__(self, address: str, channel: chan.Channel, spin_s: float = 0.0) -> None:
        self.address = address
        self.channel = channel
        #: The connection's frame I/O and its lock, held from a request's send to its
        #: answer's receipt (and for notifications), by Python and the renewal thread.
        try:
            self.native = NativeLink(channel, channel.limits, spin_s=spin_s)  # channel.close() closes it too
        except BaseException:  # no link (EMFILE duplicating the socket): no connection either
            channel.close()
            raise
        self.users = 0                 # holders: requests in flight, grants and parts leasing on it (Peers)
        #: The exporter's block epoch pages, once asked: (rank, incarnation, handle bytes) ->
        #: the page, or None where it has none (:meth:`epoch_page`).
        self.block_epochs: dict[tuple[int, bytes, bytes], EpochView | None] = {}
        self.idle_since = time.monotonic()

    def __repr__(self) -> str:
        return f"<PeerLink {self.address} users={self.users}{' closed' if self.closed else ''}>"

    @property
    def closed(self) -> bool:
        return self.channel.closed or self.native.closed

    def usable(self) -> bool:
        """Open, its peer process alive, and not hung up: an exporter that stopped (or
        restarted at the same address) is noticed here before the watcher says so."""
        return not self.closed and self.channel.peer_alive() and not self.channel.hung_up()

    def request(self, payload: bytes, timeout: float) -> chan.Message:
        """Send one request and return its answer (the caller closes the message's fds).
        A request whose answer did not come closes the link: a late answer would be read
        as the next request's, so the link can no longer be trusted (the exporter ends
        every lease on it)."""
        try:
            return self.native.request(payload, timeout)
        except ChannelError:
            self.close()
            raise

    def epoch_page(self, rank: int, lease_id: int, num_blocks: int, timeout: float) -> EpochView | None:
        """Ask for the block epoch page of the bank ``lease_id`` is on (this link holds the
        lease, so the page is that bank's). None where the exporter keeps none (``no_epochs``,
        or an exporter that does not know the request): loads from it are then checked by
        their lease alone. Anything else (no answer, another refusal, a page that does not
        check) raises ChannelError: that load vouches for nothing, and the next one asks again."""
        try:
            with self.request(chan.encode({"op": "block_epochs", "rank": rank, "lease": lease_id}), timeout) as msg:
                reply = chan.decode(msg.payload)
                if not reply.get("ok"):
                    if reply.get("code") in ("no_epochs", "bad_request"):
                        return None
                    raise ChannelError(ChannelReason.FAILED, f"block epochs refused: {reply!r:.200}")
                if reply.get("blocks") != num_blocks or reply.get("entry_bytes") != ENTRY_BYTES \
                        or len(msg.fds) != 1:
                    raise ChannelError(ChannelReason.FAILED, f"a block epoch page that does not fit rank {rank}'s "
                                       f"bank: {reply!r:.200}")
                return EpochView.open(msg.fds[0], num_blocks)
        except (OSError, ValueError) as exc:
            raise ChannelError(ChannelReason.FAILED, f"the block epoch page of rank {rank} does not map: {exc}") from exc

    def notify(self, payload: bytes, timeout: float) -> None:
        """Send a message that has no answer."""
        self.native.lock()
        try:
            self.native.send(payload, timeout=timeout)
        finally:
            self.native.unlock()

    def release(self, rank: int, lease_id: int | None, timeout: float = 1.0) -> None:
        """Return a lease and wait for the answer. An exporter that is gone, or a lease that
        already ended, is fine; if the answer does not come, the link is closed so that the
        exporter ends the lease (and every other on this link) by itself."""
        try:
            with self.request(chan.encode({"op": "release", "rank": rank, "lease": lease_id}), timeout) as msg:
                chan.decode(msg.payload)
        except ChannelError:
            self.close()  # an answer that did not parse: out of step as well

    def close(self) -> None:
        self.native.close()
        self.channel.close()
        pages, self.block_epochs = self.block_epochs, {}
        for page in pages.values():
            if page is not None:
                page.close()


@attrs.define(eq=False)
class Grant:
    """One rank's lease as the exporter granted it, with the fds that came for it. The
    fds belong to the grant until :meth:`close_fds`; a grant nobody took is given back."""

    link: PeerLink
    rank: int
    lease_id: int
    expires_in_s: float
    reply: dict[str, Any]
    fds: tuple[int, ...]
    taken: bool = False
    #: Lets go of the grant's hold on its link (:meth:`Peers.leases` holds the link for
    #: every grant, so an idle sweep never closes a link under a lease; the part that
    #: takes the grant takes the hold over).
    let_go: Callable[[PeerLink], None] | None = None
    #: Whether the part reports its mapping itself; False when its group reports every
    #: mapping of this link in one message (:func:`mapped_payload`) once its parts opened.
    report_mapped: bool = True

    def close_fds(self) -> None:
        fds, self.fds = self.fds, ()
        for fd in fds:
            close_quietly(fd)

    def give_back(self) -> None:
        """Close the fds, return the lease and let go of the link (a grant whose part
        never opened)."""
        self.close_fds()
        self.link.release(self.rank, self.lease_id)
        let_go, self.let_go = self.let_go, None
        if let_go is not None:
            let_go(self.link)


class RankRefused(Exception):
    """A batched request the exporter refused because of one rank (it names the rank); the
    other ranks of the batch were not refused themselves, and none of them is leased.
    Internal: the importer reports ``refusal`` for ``rank``."""

    def __init__(self, rank: int, refusal: ImportFailed) -> None:
        super().__init__(rank, refusal)
        self.rank = rank
        self.refusal = refusal


def _grant(link: PeerLink, reply: Any, rank: int) -> Grant:
    """A grant from the exporter's answer, checked: the exporter is a peer. Its fds are
    handed over only once every grant of the answer is checked."""
    lease: Any = reply.get("lease") if isinstance(reply, dict) else None
    expires: Any = reply.get("expires_in_s") if isinstance(reply, dict) else None
    if type(lease) is not int or type(expires) not in (int, float) or not 0 <= expires < 1e9:
        raise ImportFailed.of(rank, ImportReason.MALFORMED, f"malformed lease grant {reply!r:.200}")
    return Grant(link, rank, lease, float(expires), reply, ())


def lease_payload(items: Sequence[dict[str, Any]]) -> bytes:
    """The request for the lease fields of one rank (``op: lease``, what every exporter
    understands) or of several (``op: leases``, one answer with every fd)."""
    if len(items) == 1:
        return chan.encode({"op": "lease", **items[0]})
    return chan.encode({"op": "leases", "items": list(items)})


def grants(link: PeerLink, items: Sequence[dict[str, Any]], msg: chan.Message) -> list[Grant]:
    """The grants in the answer ``msg`` to :func:`lease_payload` of ``items``, one per item
    in order. ImportFailed (a lease refusal: ``code``) when the exporter refused (it then holds none of them): as
    :class:`RankRefused` when a batch names the rank refused; ImportFailed when the answer
    is malformed: every lease it names is returned and its fds are closed, each once
    (the message owns them until every grant is checked)."""
    try:
        reply = chan.decode(msg.payload)
        if not reply.get("ok"):
            refusal = ImportFailed.lease_refused(str(reply.get("code")), str(reply.get("detail")))
            rank = reply.get("rank")
            if len(items) > 1 and type(rank) is int and any(item["rank"] == rank for item in items):
                raise RankRefused(rank, refusal)
            raise refusal
        if len(items) == 1:
            answers: Any = [{**reply, "nfds": len(msg.fds)}]
        else:
            answers = reply.get("grants")
        ranks = [int(item["rank"]) for item in items]
        try:
            if not isinstance(answers, list) or len(answers) != len(items) or \
                    any(not isinstance(a, dict) or type(a.get("nfds")) is not int or a["nfds"] < 0 for a in answers) or \
                    sum(a["nfds"] for a in answers) != len(msg.fds):
                raise ImportFailed.of(ranks[0], ImportReason.MALFORMED,
                                      f"malformed batched lease answer {reply!r:.200}")
            out = [_grant(link, a, rank) for a, rank in zip(answers, ranks)]
        except ImportFailed:
            for a, rank in zip(answers if isinstance(answers, list) else [], ranks):
                if isinstance(a, dict) and type(a.get("lease")) is int:
                    link.release(rank, a["lease"])
            raise
    except BaseException:
        msg.close()
        raise
    at = 0
    for g, a in zip(out, answers):  # every fd now belongs to exactly one grant
        g.fds = msg.fds[at:at + a["nfds"]]
        at += a["nfds"]
    return out


def mapped_payload(leases: Sequence[tuple[int, int]]) -> bytes:
    """The notification that parts are mapped: ``(rank, lease id)`` each; one message for
    every rank of a link (``op: mapped`` with ``items``), or the single-rank form."""
    if not all(type(r) is int and type(lease) is int for r, lease in leases):
        raise ChannelError(ChannelReason.FRAME, "a mapped note names ranks and lease ids, ints only")
    # Ints only, so written directly: what chan.encode writes (its keys sorted), without
    # a general encoder's cost on every import.
    if len(leases) == 1:
        rank, lease_id = leases[0]
        return b'{"lease":%d,"op":"mapped","rank":%d}' % (lease_id, rank)
    return b'{"items":[%s],"op":"mapped"}' % b",".join(b'{"lease":%d,"rank":%d}' % (lease, r) for r, lease in leases)


def too_big(link: PeerLink, payload: bytes) -> ArgumentInvalid | None:
    """The refusal of a request larger than ``link`` carries (a block request naming too
    many blocks for its group's tp), made before anything is sent: the link stays open for
    the other groups on it."""
    cap = link.native.limits.max_payload
    if len(payload) <= cap:
        return None
    return ArgumentInvalid(ArgumentReason.INVENTORY, f"the lease request is {len(payload)} bytes, more than the "
                                                     f"{cap} a link to {link.address} carries: ask for fewer blocks")


def exchange(requests: Sequence[tuple[PeerLink, bytes]], timeout: float) -> list[chan.Message | KvStateError]:
    """Send every request, then read every answer: one round trip for several exporters,
    without threads. Each link is held from its send to its answer (locks taken in address
    order). A failure is returned in its slot; a link that failed is closed."""
    order = sorted(range(len(requests)), key=lambda i: requests[i][0].address)
    out: list[chan.Message | KvStateError | None] = [None] * len(requests)
    deadline = time.monotonic() + timeout  # one for all: exporters are waited for together
    with ExitStack() as held:
        for i in order:
            link = requests[i][0]
            if not any(requests[j][0] is link for j in order[:order.index(i)]):
                link.native.lock()
                held.callback(link.native.unlock)
        sent: list[int] = []
        for i in order:
            link, payload = requests[i]
            out[i] = too_big(link, payload)
            if out[i] is not None:
                continue
            try:
                link.native.send(payload, timeout=timeout)
                sent.append(i)
            except ChannelError as exc:
                out[i] = _last_word(link) if exc.closed else None
                if out[i] is None:
                    out[i] = exc
                link.close()
        for i in sent:
            link = requests[i][0]
            try:
                out[i] = link.native.recv(timeout=max(0.0, deadline - time.monotonic()))
            except ChannelError as exc:
                out[i] = exc
                link.close()
    return [x for x in out if x is not None]


def _last_word(link: PeerLink) -> chan.Message | None:
    """What a peer that hung up said first, if anything: an exporter over its connection
    limit refuses at accept, then closes, and that refusal is its answer."""
    try:
        return link.native.recv(timeout=0.0)
    except ChannelError:
        return None


class Peers:
    """An importer's links, one per exporter address. Idle links close after ``idle_s``.

    A link is held (``users``) by every request in flight on it and by every grant or
    part with a lease on it; only a link nobody holds is idle, and the idle sweep takes
    it out of the table under the same lock that hands links out, so a link is never
    closed under a request or a lease."""

    def __init__(self, connect: Callable[[str, float], chan.Channel], idle_s: float, spin_s: float = 0.0) -> None:
        self._connect = connect
        self.idle_s = idle_s
        self.spin_s = spin_s  # each link's answer spin (ImportConfig.answer_spin_s)
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()
        self._closing = False
        #: Parked leases (kvstate.share.parked) by exporter address and bank; each holds its link.
        self._parked: dict[tuple[str, Key], Parked] = {}

    def _take(self, address: str, timeout: float, *, fresh: bool) -> tuple[PeerLink, bool]:
        """The live link to ``address``, held, and whether it was reused; connecting (and
        checking the peer) if there is none, or if ``fresh``."""
        with self._lock:
            if self._closing:
                raise ChannelError(ChannelReason.CLOSED, "the importer is closed")
            link = self._links.get(address)
            if link is not None and not fresh and link.usable():
                link.users += 1
                return link, True
        channel = self._connect(address, timeout)
        made = PeerLink(address, channel, self.spin_s)
        with self._lock:
            old = self._links.get(address)
            if old is not None and old is not link and not fresh and old.usable():
                channel.close()  # another thread connected meanwhile: use that one
                old.users += 1
                return old, True
            self._links[address] = made
            made.users += 1
            replaced = old if old is not None and old.users == 0 else None
        if replaced is not None:
            replaced.close()  # a replaced link still held closes when its last holder lets go
        return made, False

    def lease_one(self, address: str, fields: dict[str, Any], timeout: float) -> Grant:
        """One rank's lease (its ``fields``) over the persistent link to ``address`` (a part
        leased on its own, as a rank worker's is); raises what :meth:`leases` returns."""
        (answer,) = self.leases([(address, [fields])], timeout)
        if isinstance(answer, RankRefused):
            raise answer.refusal
        if isinstance(answer, Exception):
            raise answer
        return answer[0]

    def leases(self, batches: Sequence[tuple[str, Sequence[dict[str, Any]]]],
               timeout: float) -> list[list[Grant] | Exception]:
        """Lease each batch of ``(address, lease fields of its ranks)``: every request is
        sent before any answer is read. Per batch: its grants (each holding its link until
        it is given back or its part lets go), or what failed (:class:`RankRefused`, a
        KvStateError, an OSError). A request that found a link it had reused closed by
        the exporter is sent once more on a fresh connection (the exporter ended whatever
        the closed one held); a timeout is not retried."""
        out: list[list[Grant] | Exception | None] = [None] * len(batches)
        pending = list(range(len(batches)))
        for attempt in (0, 1):
            links: dict[int, PeerLink] = {}
            reused: set[int] = set()
            try:
                for i in pending:
                    try:
                        links[i], was_reused = self._take(batches[i][0], timeout, fresh=attempt > 0)
                    except Exception as exc:
                        out[i] = exc
                        continue
                    if was_reused:
                        reused.add(i)
                order = list(links)
                answers = exchange([(links[i], lease_payload(batches[i][1])) for i in order], timeout)
                pending = []
                for i, answer in zip(order, answers):
                    if isinstance(answer, ChannelError) and answer.closed and i in reused:
                        pending.append(i)  # a stale link: once more, freshly connected
                        continue
                    try:
                        if isinstance(answer, KvStateError):
                            raise answer
                        made = grants(links[i], batches[i][1], answer)
                    except (RankRefused, KvStateError, OSError) as exc:
                        out[i] = exc
                        continue
                    for g in made:
                        self.hold(g.link)
                        g.let_go = self.let_go
                    out[i] = made
            finally:
                for link in links.values():  # the requests' holds
                    self.let_go(link)
            if not pending:
                break
        return [x if x is not None else ChannelError(ChannelReason.FAILED, "no answer") for x in out]

    def park(self, parked: Parked) -> bool:
        """File ``parked`` (it keeps its part's hold on its link); False, changing nothing,
        when its link is no longer this address's or the bank already has one parked."""
        link = parked.link
        with self._lock:
            where = (link.address, parked.key)
            if self._closing or self._links.get(link.address) is not link or where in self._parked:
                return False
            self._parked[where] = parked
            return True

    def take_parked(self, address: str, key: Key) -> Parked | None:
        """The lease parked for bank ``key`` at ``address``, out of the table, if any."""
        with self._lock:
            return self._parked.pop((address, key), None)

    def take_parked_where(self, pick: Callable[[Parked], bool]) -> list[Parked]:
        """Every parked lease ``pick`` chooses, out of the table."""
        with self._lock:
            chosen = [k for k, p in self._parked.items() if pick(p)]
            return [self._parked.pop(k) for k in chosen]

    def parked(self) -> int:
        """How many leases are parked."""
        with self._lock:
            return len(self._parked)

    def hold(self, link: PeerLink) -> None:
        with self._lock:
            link.users += 1

    def let_go(self, link: PeerLink) -> None:
        with self._lock:
            link.users -= 1
            if link.users == 0:
                link.idle_since = time.monotonic()
            close = link.users == 0 and (self._closing or self._links.get(link.address) is not link)
        if close:
            self._drop(link)

    def _drop(self, link: PeerLink) -> None:
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]
        link.close()

    def forget(self, channel: chan.Channel) -> None:
        """The peer of ``channel`` hung up: drop its link and close our end. A link a
        request holds is closed by its last holder (let_go) instead: the peer may have said
        why before it hung up (a refusal at accept), and that request reads it."""
        with self._lock:
            dead = [k for k, v in self._links.items() if v.channel is channel]
            held = any(self._links[k].users > 0 for k in dead)
            for k in dead:
                del self._links[k]
        if not held:
            channel.close()  # its link too (Channel.on_close)

    def close_idle(self, now: float | None = None, *, everything: bool = False) -> None:
        """Close links nobody has held for ``idle_s`` (every idle one while closing, or
        with ``everything``: when the caller knows its exporters are going away)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [link for link in self._links.values() if link.users == 0 and
                    (self._closing or everything or now - link.idle_since >= self.idle_s)]
            for link in idle:  # out of the table first: nobody can take it any more
                del self._links[link.address]
        for link in idle:
            link.close()

    def close(self) -> None:
        """Close every idle link now, and each busy one when its last holder lets go."""
        with self._lock:
            self._closing = True
        self.close_idle()

    def __len__(self) -> int:
        with self._lock:
            return len(self._links)
