"""The decode engine's index, in its scheduler process, and the prefill side's client.

Theory of operation
-------------------

**Where the inventory lives.** A decode engine has one scheduler process (vLLM's
EngineCore) and one worker process per TP rank. The index runs in the scheduler process,
next to the :class:`~.slots.SlotTable`, which alone assigns bank blocks: lookups and block
assignment are then one process and one lock, and every rank stores a prefix block in the
same bank block. Each rank's exporter keeps its own
:class:`~kvstate.reuse.inventory.Inventory` (what a prefill worker's lease re-validates and
pins atomically, in that rank's process, under that rank's lease). The index drives those
inventories in lockstep: a block is advertised only once every rank reported it stored,
and a bank block is reused only once every rank confirmed its key removed (refused while
leased). Rank 0 as home would make the other ranks' inventories follow a peer that may die
first; the scheduler outlives its workers.

**Peers.** Decode ranks connect (``hello``) and report; prefill schedulers connect and ask
(``lookup``, ``descriptors``); see :mod:`.wire`. The index answers lookups only while every
rank is connected and advertised descriptors of one generation.

**Off the GIL.** The scheduler process is the engine's: vLLM busy-polls there holding the
GIL. So the socket is served by a native thread (:mod:`.index_mirror`) that answers
``lookup`` and ``descriptors`` from a C mirror of what :meth:`DecodeIndex._answer` reads:
the table's advertised blocks (the table tells the mirror under its own lock) and the
ranks' descriptors, epochs and generation (set here under the index's lock whenever a
rank comes, advertises or goes). Everything else (a rank's ``hello``, a question under
another compatibility key, a malformed message) is handed to Python with its connection,
and :meth:`_answer` stays the reference (a differential test holds the two equal). The
TCP listener for other nodes' prefill schedulers is still served here, in Python.

**Stores without the GIL.** A block becomes findable once every rank stored it. Each
rank's op engine sends its ``stored`` report, as the store ends, on the rank's *report
link*: a second connection to the index's socket, opened (``report_link``, answered
``linked``) only by the process that said the rank's ``hello``, and served by the native
thread, which counts each reserved block's ranks and advertises it once all have. The
report then reaches the table here, which keeps its own account (the LRU, failures,
evictions). So a prefill scheduler finds a store that ended while this process's Python
was busy; the report that waits for Python is only the table's. A rank that has no report
link (a refused or lost one, tp above 64) reports on its main link, as before.

**Evictions.** When free bank blocks run low, the least recently used blocks stop being
advertised and every rank is asked to drop their keys; a rank refuses a key a lease pins,
and the index asks again every second until every rank dropped it.

**The client** of a prefill scheduler is :mod:`.index_client`.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvstate import channel as chan
from kvstate.channel.tcp import TcpServer
from kvstate.core.reasons import ChannelReason
from kvstate.core.errors import ChannelError
from kvstate.core.identity import Deployment
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.hashing import HASH_BYTES, Compat
from kvstate.integrations.vllm.index_mirror import IndexMirror
from kvstate.integrations.vllm.slots import MIRROR_MAX_TP, Reservation, SlotTable

log = logging.getLogger(__name__)

RETRY_EVICT_S = 1.0
#: A prefill scheduler's connection closes after this long without a question (it
#: reconnects on its next one): idle connections would hold the server's handler slots.
CLIENT_IDLE_S = 30.0
#: Connections served at once (natively, and in Python each).
MAX_CONNECTIONS = 256
NOT_READY = "not every decode rank is connected with descriptors of one generation"


@attrs.define(eq=False)
class _Rank:
    rank: int
    pid: int
    epoch: int
    channel: chan.Channel
    send_lock: threading.Lock = attrs.Factory(threading.Lock)
    descriptor: bytes | None = None
    generation: int = 0


class DecodeIndex:
    """The decode engine's index (see the module docstring). ``capacity``: bank blocks
    per rank, the same on every rank."""

    def __init__(self, path: Path, compat: Compat, table: SlotTable, *, request_timeout_s: float = 2.0,
                 tcp: tuple[str, int] | None = None, deployment: Deployment | None = None) -> None:
        if tcp is not None and deployment is None:
            raise ValueError("an index served over TCP needs the deployment whose key peers prove")
        self.path = Path(path)
        #: (host, port): also answer prefill schedulers of other nodes, over the
        #: authenticated TCP channel (decode ranks are on this node: AF_UNIX only).
        self.tcp = tcp
        self.deployment = deployment
        self.compat = compat
        self.table = table
        self.tp = compat.tp
        self.request_timeout_s = request_timeout_s
        self._ranks: dict[int, _Rank] = {}
        self._lock = threading.Lock()
        self._server: chan.Server | None = None
        self._tcp_server: TcpServer | None = None
        self._stopping = threading.Event()
        self._timer: threading.Thread | None = None
        self._handoff: threading.Thread | None = None
        self._python_slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._py_lookups = 0
        self._client_idle_s = CLIENT_IDLE_S
        self.mirror = IndexMirror(chan.encode(compat.as_dict()),
                                  wire.encode("refused", reason="decode_not_ready", detail=NOT_READY),
                                  hash_bytes=HASH_BYTES, capacity=table.capacity, max_blocks=wire.MAX_BLOCKS,
                                  limits=wire.LIMITS, max_connections=MAX_CONNECTIONS,
                                  first_timeout_s=request_timeout_s, idle_s=CLIENT_IDLE_S)
        table.attach(self.mirror)

    @property
    def client_idle_s(self) -> float:
        """A prefill scheduler's connection closes after this long without a question."""
        return self._client_idle_s

    @client_idle_s.setter
    def client_idle_s(self, seconds: float) -> None:
        self.mirror.deadlines(self.request_timeout_s, seconds)
        self._client_idle_s = seconds

    @property
    def lookups(self) -> int:
        """Lookups answered while ready (natively and here)."""
        return self._py_lookups + self.mirror.lookups

    # -- life -----------------------------------------------------------------------------

    def start(self) -> None:
        chan.make_socket_dir(self.path.parent)
        self._server = chan.Server(self.path, limits=wire.LIMITS, max_connections=MAX_CONNECTIONS)
        self.mirror.serve(self._server.fileno())
        self._handoff = threading.Thread(target=self._take_handoffs, name="kvstate-index-handoff", daemon=True)
        self._handoff.start()
        if self.tcp is not None:
            assert self.deployment is not None
            self._tcp_server = TcpServer(*self.tcp, self.deployment, limits=wire.LIMITS, max_connections=MAX_CONNECTIONS,
                                         handshake_timeout=self.request_timeout_s)
            self._tcp_server.serve_in_thread(self._serve_remote, name="kvstate-index-tcp")
        self._timer = threading.Thread(target=self._retry_loop, name="kvstate-index-evict", daemon=True)
        self._timer.start()

    def close(self) -> None:
        self._stopping.set()
        if self._handoff is not None:
            self._handoff.join(2.0)
            self._handoff = None
        self.mirror.stop()  # before the server: the listening socket is the server's to close
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._tcp_server is not None:
            self._tcp_server.close()
            self._tcp_server = None
        with self._lock:
            ranks = list(self._ranks.values())
        for r in ranks:
            r.channel.close()
        if self._timer is not None:
            self._timer.join(2.0)
            self._timer = None

    def ready(self) -> bool:
        """Every rank connected and advertised, all at one generation."""
        with self._lock:
            return self._ready()

    def _ready(self) -> bool:
        ranks = [self._ranks.get(r) for r in range(self.tp)]
        if any(r is None or r.descriptor is None for r in ranks):
            return False
        return len({r.generation for r in ranks if r is not None}) == 1

    # -- what the scheduler calls -------------------------------------------------------------

    def reserve(self, hashes: Sequence[bytes]) -> list[Reservation]:
        """Bank blocks for a finished request's prefix blocks (none while not ready)."""
        if not self.ready():
            return []
        self.table.touch(self.mirror.touched())
        out = self.table.reserve(hashes)
        self._evict(self.table.choose_evictions())
        return out

    def _publish(self) -> None:
        """Tell the mirror whether, and with what, to answer (called with ``_lock`` held)."""
        if not self._ready():
            self.mirror.unready()
            return
        ranks = [self._ranks[r] for r in range(self.tp)]
        self.mirror.ready(wire.encode("descriptor_set", descriptors=[r.descriptor for r in ranks]),
                          [r.epoch for r in ranks], ranks[0].generation)

    # -- serving --------------------------------------------------------------------------------

    def _take_handoffs(self) -> None:
        """Serve, each in a thread, the connections the native thread hands over."""
        fd = self.mirror.handoff_fd()
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        while not self._stopping.is_set():
            if poll.poll(250):
                try:
                    os.read(fd, 8)
                except BlockingIOError:
                    pass
            for payload in self.mirror.reports():
                self._take_report(payload)
            for ch, payload in self.mirror.handoffs(wire.LIMITS):
                if ch is None:
                    continue
                if self._stopping.is_set() or not self._python_slots.acquire(blocking=False):
                    ch.close()
                    continue
                try:
                    threading.Thread(target=self._serve, args=(ch, payload), name=f"kvstate-index-{ch.peer.pid}",
                                     daemon=True).start()
                except RuntimeError:  # the interpreter cannot start another thread
                    self._python_slots.release()
                    ch.close()

    def _take_report(self, payload: bytes) -> None:
        """A ``stored`` report the native thread took from a rank's report link (and
        already counted for its lookups): the table's account of it."""
        try:
            self._on_stored(wire.decode(payload, "stored"))
        except ChannelError as exc:  # the thread took only what wire.decode takes: a bug
            log.error("kvstate index: a report from a rank's link is unreadable: %s", exc)
        except Exception:  # this thread serves every handoff: it must outlive a bug here
            log.exception("kvstate index: taking a rank's report failed")

    def _serve(self, ch: chan.Channel, first: bytes) -> None:
        """A connection the native thread handed over, with the request it read."""
        try:
            msg = wire.decode(first, "hello", "lookup", "descriptors")
            if msg["kind"] == "hello":
                self._serve_rank(ch, msg)
            else:
                self._serve_client(ch, msg)
        except ChannelError as exc:
            if not self._stopping.is_set():
                log.info("kvstate index: a connection ended: %s", exc)
        except Exception:
            log.exception("kvstate index: serving %r failed", ch)
        finally:
            ch.close()
            self._python_slots.release()

    def _serve_remote(self, ch: chan.Channel) -> None:
        """A peer of another node (it proved the deployment key): questions only; a decode
        rank says hello over its node's socket, never over TCP."""
        try:
            with ch.recv(timeout=self.request_timeout_s) as first:
                msg = wire.decode(first.payload, "lookup", "descriptors")
            self._serve_client(ch, msg)
        except ChannelError as exc:
            if not self._stopping.is_set():
                log.info("kvstate index: a tcp connection ended: %s", exc)
        finally:
            ch.close()

    def _refuse(self, ch: chan.Channel, reason: str, detail: str) -> None:
        try:
            ch.send(wire.encode("refused", reason=reason, detail=detail[:4000]), timeout=self.request_timeout_s)
        except ChannelError:
            pass

    def _serve_rank(self, ch: chan.Channel, hello: dict[str, Any]) -> None:
        rank, tp = hello["rank"], hello["tp"]
        theirs = Compat.from_dict(hello["compat"])
        problem = None
        if tp != self.tp or not rank < tp:
            problem = ("tp_mismatch", f"rank {rank} of tp {tp}; this decode engine has tp {self.tp}")
        elif hello["pid"] != ch.peer.pid:
            problem = ("pid", f"hello says pid {hello['pid']}, the socket says {ch.peer.pid}")
        elif theirs is None:
            problem = ("malformed", "unreadable compatibility key")
        else:
            problem = self.compat.mismatch(theirs)
        link = _Rank(rank, hello["pid"], hello["epoch"], ch)
        with self._lock:
            if problem is None and rank in self._ranks:
                problem = ("duplicate_rank", f"rank {rank} is connected (pid {self._ranks[rank].pid})")
            if problem is None:
                self._ranks[rank] = link
                self._publish()
                if rank < MIRROR_MAX_TP:  # only this process may open the rank's report link
                    self.mirror.rank(rank, link.pid)
        if problem is not None:
            log.error("kvstate index: refusing decode rank %d: %s (%s)", rank, *problem)
            self._refuse(ch, *problem)
            return
        try:
            self._send(link, wire.encode("welcome", tp=self.tp))
            while not self._stopping.is_set():
                try:
                    msg = ch.recv(timeout=0.25)
                except ChannelError as exc:
                    if exc.reason is not ChannelReason.TIMEOUT:
                        raise
                    continue
                with msg:
                    report = wire.decode(msg.payload, "advertised", "stored", "removed")
                if report["rank"] != rank:
                    raise ChannelError(ChannelReason.PROTOCOL, f"rank {rank} reported for rank {report['rank']}")
                self._on_report(link, report)
        finally:
            with self._lock:
                if self._ranks.get(rank) is link:
                    del self._ranks[rank]
                    self._publish()
                    if rank < MIRROR_MAX_TP:
                        self.mirror.rank(rank, 0)

    def _on_report(self, link: _Rank, report: dict[str, Any]) -> None:
        kind = report["kind"]
        if kind == "advertised":
            with self._lock:
                link.descriptor, link.generation = report["descriptor"], report["generation"]
                self._publish()
        elif kind == "stored":
            self._on_stored(report)
        else:
            self.table.removed(link.rank, report["keys"])

    def _on_stored(self, report: dict[str, Any]) -> None:
        """A rank's ``stored`` report, from its main link or (taken natively) its report link."""
        rank = report["rank"]
        log.debug("t=%.6f rank %d stored %d block(s), %d failed", time.monotonic(), rank, len(report["keys"]),
                  len(report["failed"]))
        again = self.table.stored(rank, report["keys"]) + self.table.store_failed(rank, report["failed"])
        if again:
            self._broadcast(wire.encode("evict", keys=again))

    def _serve_client(self, ch: chan.Channel, msg: dict[str, Any]) -> None:
        """Answer a prefill scheduler until it closes, or stays silent ``client_idle_s`` (its
        client reconnects on its next question): an idle connection holds a handler slot."""
        while True:
            ch.send(self._answer(msg), timeout=self.request_timeout_s)
            quiet_until = time.monotonic() + self._client_idle_s
            while True:
                if self._stopping.is_set() or time.monotonic() > quiet_until:
                    return
                try:
                    nxt = ch.recv(timeout=0.25)
                except ChannelError as exc:
                    if exc.reason is not ChannelReason.TIMEOUT:
                        raise
                    continue
                break
            with nxt:
                msg = wire.decode(nxt.payload, "lookup", "descriptors")

    def _answer(self, msg: dict[str, Any]) -> bytes:
        theirs = Compat.from_dict(msg["compat"])
        if theirs is None:
            return wire.encode("refused", reason="malformed", detail="unreadable compatibility key")
        problem = self.compat.mismatch(theirs)
        if problem is not None:
            return wire.encode("refused", reason=problem[0], detail=problem[1])
        with self._lock:
            ready = self._ready()
            ranks = [self._ranks[r] for r in range(self.tp)] if ready else []
        if not ready:
            return wire.encode("refused", reason="decode_not_ready", detail=NOT_READY)
        if msg["kind"] == "descriptors":
            return wire.encode("descriptor_set", descriptors=[r.descriptor for r in ranks])
        self._py_lookups += 1
        held = self.table.lookup(wire.split_hashes(msg["hashes"], HASH_BYTES))
        return wire.encode("found", blocks=len(held), slots=[h.slot for h in held], keys=[h.key for h in held],
                           epochs=[r.epoch for r in ranks], generation=ranks[0].generation)

    # -- to the ranks ---------------------------------------------------------------------------

    def _send(self, link: _Rank, payload: bytes) -> None:
        try:
            with link.send_lock:
                link.channel.send(payload, timeout=self.request_timeout_s)
        except ChannelError as exc:
            log.warning("kvstate index: rank %d cannot be told (%s): closing its connection", link.rank, exc)
            link.channel.close()

    def _broadcast(self, payload: bytes) -> None:
        with self._lock:
            ranks = list(self._ranks.values())
        for link in ranks:
            self._send(link, payload)

    def _evict(self, keys: list[int]) -> None:
        """Tell every rank to remove ``keys``, in messages of at most wire.MAX_BLOCKS."""
        for at in range(0, len(keys), wire.MAX_BLOCKS):
            self._broadcast(wire.encode("evict", keys=keys[at:at + wire.MAX_BLOCKS]))

    def _retry_loop(self) -> None:
        while not self._stopping.wait(RETRY_EVICT_S):
            self.table.touch(self.mirror.touched())
            self._evict(self.table.evicting())
