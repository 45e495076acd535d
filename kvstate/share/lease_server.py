"""The exporter's lease server: the Python face of ``ffi/kvs_lease.c``.

Importers are served natively, by one thread per exporter that never takes the GIL
(``ffi/kvs_lease_thread.c``), so an exporter whose Python is stuck in a long C call still
grants, renews and ends leases. That thread serves importers on other nodes too: it
accepts on the exporter's TCP socket, runs the deployment key's handshake of
:mod:`kvstate.channel.tcp` and cuts the stream into frames (``ffi/kvs_lease_tcp.c``). The
lease rules have one home, ``kvs_lease_handle``: the thread calls it for every frame, and
:meth:`LeaseServer.handle` exposes it to tests.
Each bank's state has one home too, the native instance of the bank table inside the
server; :class:`kvstate.share.bank.Bank` reads it and fires its own (non-lease)
events through :meth:`LeaseServer.fire`, with its Python effects called back, so they are
serialised with the thread.

Python observes: every committed transition is queued natively; :meth:`LeaseServer.pump`
(called after each Python fire, and by this module's thread whenever the queue's eventfd
is readable) turns them into :class:`kvstate.core.machine.StateChange` for the bank's
observers, in order. Python also serves what the native handler passes on: the
``status`` request.

A lease naming inventory blocks is served natively too: the server keeps a mirror of the
exporter's inventory (groups, epochs, blocks; ``ffi/kvs_inventory.c``) that the Python
:class:`kvstate.reuse.inventory.Inventory` updates as blocks are stored, removed, evicted
and cleared (:class:`InventoryMirror`, off the request path). The thread re-validates and
pins the named blocks with the grant, and unpins them when the lease ends; the inventory
never removes a block a native lease pins, and counts those leases in ``busy``.

Memory nobody counts across processes (legacy CUDA IPC, ``UNCOUNTED_KINDS``): the driver
frees it at the exporter's release whoever still has it open, so the bank keeps a *hold*
for every importer that may have it open: a pin on its mapping, taken with the lease and
dropped only on evidence that the importer closed it: its ``release`` request (an
importer closes its handle before returning the lease), its connection closing from its
side (it let go, or its process exited), or, once this exporter stopped serving and so
closed the connection itself, the importer's process having exited (a pidfd kept with
the hold). A lease that expires ends as a lease, but its hold stays, so the pins keep the
bank out of ``quiescent`` and its memory is never freed under an importer that still has
it open.
The lease server keeps those holds (``kvs_hold`` in ``ffi/kvs_lease.h``).
"""

from __future__ import annotations

import json
import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvstate import channel as chan
from kvstate.channel.tcp import KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES, MAX_HANDSHAKES, TcpServer
from kvstate.core.errors import ChannelError, KvStateError, NativeError, TransitionError
from kvstate.core.identity import Purpose
from kvstate.core.machine import StateChange
from kvstate.core.reasons import ChannelReason
from kvstate.reuse.inventory import Inventory
from kvstate.transport import native
from kvstate.transport.machines import native_table

if TYPE_CHECKING:
    from kvstate.share.bank import Bank
    from kvstate.share.exporter import Exporter

log = logging.getLogger(__name__)

_REPLY_CAP = chan.HARD_MAX_PAYLOAD
_MAX_FDS = chan.HARD_MAX_FDS


@attrs.frozen
class Peer:
    pid: int


class Connection:
    """An importer connection the native server holds, as a lease names it. Closing it
    closes this side: its leases end (``peer_died``), and its holds wait for its process."""

    def __init__(self, server: LeaseServer, conn: int, pid: int) -> None:
        self.server, self.id, self.peer = server, conn, Peer(pid)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Connection) and other.server is self.server and other.id == self.id

    def __hash__(self) -> int:
        return hash((id(self.server), self.id))

    def __repr__(self) -> str:
        return f"<lease connection {self.id} of pid {self.peer.pid}>"

    def close(self) -> None:
        self.server.close_connection(self.id, importer_closed=False)


@attrs.frozen
class NativeLease:
    """A read-only snapshot of one lease of the native table."""

    id: int
    channel: Connection
    expires_at: float  # time.monotonic()
    expired: bool
    blocks: int = 0  # inventory blocks it pins


@attrs.frozen
class HoldView:
    """A read-only snapshot of one hold (an importer that may have the bank open)."""

    id: int
    conn: int
    conn_open: bool
    has_pidfd: bool


class LeaseServer:
    """One exporter's native lease server (see the module docstring)."""

    def __init__(self, exporter: Exporter[Any, Any, Any, Any, Any], limits: chan.Limits) -> None:
        nat = native.default()
        # Untyped: kvstate.transport.libkvs types the memory and op calls, not these.
        ffi: Any = nat.ffi
        lib: Any = nat.lib
        self.ffi, self.lib = ffi, lib
        self.table = native_table("bank")
        self.exporter = exporter
        self.limits = limits
        cfg = exporter.config
        out = ffi.new("kvs_lease_server **")
        rc = lib.kvs_lease_server_new(int(cfg.lease_timeout_s * 1e9), cfg.max_leases, os.getuid(),
                                           limits.max_payload, limits.max_fds, cfg.max_connections, out)
        if rc != lib.KVS_OK:
            raise nat.error(rc, "kvs_lease_server_new", "the exporter's lease server")
        self._s = out[0]
        self._why = {lib.KVS_LWHY_CLOSED: "the importer's connection closed",
                     lib.KVS_LWHY_EXITED: "the importer's process exited",
                     lib.KVS_LWHY_STOPPED: "this exporter closed the connection",
                     lib.KVS_LWHY_EXPIRED: f"not renewed within {cfg.lease_timeout_s} s"}
        self._lease_events = {self.table.events.index(e) for e in ("peer_died", "release_lease")}
        self._pump_lock = threading.RLock()
        self._pending_reason: dict[int, str | None] = {}  # rank -> reason of a Python fire
        self._stop_r = self._stop_w = -1  # a pipe while serving: stop() wakes the thread
        self._thread: threading.Thread | None = None
        # Freed with the exporter (its thread, if still running, is stopped first).
        self._free = weakref.finalize(exporter, lib.kvs_lease_server_free, self._s)

    # -- banks ----------------------------------------------------------------------------

    def add_bank(self, rank: int, uncounted: bool) -> None:
        self._check(self.lib.kvs_lease_bank_add(self._s, rank, int(uncounted)), "kvs_lease_bank_add", f"rank {rank}")

    def block_epochs(self, rank: int, fd: int | None, num_blocks: int) -> None:
        """The epoch page a ``block_epochs`` request of a lease holder on ``rank`` receives."""
        self._check(self.lib.kvs_lease_bank_epochs(self._s, rank, -1 if fd is None else fd, num_blocks),
                    "kvs_lease_bank_epochs", f"rank {rank}")

    def publish(self, bank: Bank[Any, Any, Any, Any, Any], report: dict[str, Any], fd: int | None) -> None:
        """What a grant of ``bank``'s current generation says and sends (at advertise)."""
        text = json.dumps(report, sort_keys=True, separators=(",", ":")).encode()
        region = int(getattr(bank.mapping, "region", 0) or 0)
        self._check(self.lib.kvs_lease_bank_publish(
            self._s, bank.rank, bank.generation, self.exporter.incarnation.value.hex().encode(),
            bank.descriptor_expires_ns, -1 if fd is None else fd, region, text), "kvs_lease_bank_publish",
            bank.label)

    def descriptor(self, rank: int, expires_ns: int) -> None:
        self._check(self.lib.kvs_lease_bank_descriptor(self._s, rank, expires_ns), "kvs_lease_bank_descriptor",
                    f"rank {rank}")

    def uncounted(self, rank: int, value: bool) -> None:
        """Whether grants of ``rank``'s bank take a hold (memory nobody counts)."""
        self._check(self.lib.kvs_lease_bank_uncounted(self._s, rank, int(value)), "kvs_lease_bank_uncounted",
                    f"rank {rank}")

    def state(self, rank: int) -> str:
        s = self.lib.kvs_lease_bank_state(self._s, rank)
        if s < 0:
            self._check(s, "kvs_lease_bank_state", f"rank {rank}")
        return str(self.table.states[s])

    def bank_event(self, bank: Bank[Any, Any, Any, Any, Any], event: str, kwargs: dict[str, Any],
             effects: dict[str, Callable[..., Any]], quiescent: bool) -> str:
        """Fire ``event`` on ``bank``'s native instance with Python's ``effects`` called back
        (each may return an undo); raises what :meth:`Lifecycle.fire` raises."""
        name, t, ffi = self.table.spec.name, self.table, self.ffi
        source = self.state(bank.rank)
        undos: list[Callable[[], None] | None] = []
        failed: list[tuple[str, BaseException]] = []

        def fx(_: Any, effect: int, undo: int) -> int:
            step = t.effects[effect]
            if undo:
                back = undos.pop() if undos else None
                try:
                    if back is not None:
                        back()
                except Exception as exc:  # keep the original error; report the second
                    if failed:
                        failed[0][1].add_note(f"rollback of {step} also failed: {exc!r}")
                    return -1
                return 0
            try:
                undos.append(effects[step](bank, **kwargs))
            except BaseException as exc:
                failed.append((step, exc))
                return -1
            return 0

        callback = ffi.callback("int32_t(void *, int32_t, int32_t)", fx)
        out = ffi.new("kvs_fire_result *")
        holds = 1 << t.guards.index("native_quiescent") if quiescent else 0
        self._pending_reason[bank.rank] = kwargs.get("reason") if isinstance(kwargs.get("reason"), str) else None
        rc = self.lib.kvs_lease_fire(self._s, bank.rank, t._event_ids[event], holds, callback, ffi.NULL, out)
        lib = self.lib
        if rc == lib.KVS_OK:
            return str(t.states[out.dest])
        if rc == lib.KVS_E_ILLEGAL:
            raise TransitionError.illegal(name, source, event)
        if rc == lib.KVS_E_GUARD:
            refused = tuple(t.guards[g] if g >= 0 else f"not {t.guards[-1 - g]}"
                            for g in (out.refused[i] for i in range(out.nrefused)))
            raise TransitionError.guard(name, source, event, refused)
        if rc == lib.KVS_E_REENTRANT or (rc == lib.KVS_E_EFFECT and out.error == lib.KVS_E_REENTRANT):
            raise TransitionError.reentrant(name, source, event)
        if rc == lib.KVS_E_EFFECT and failed:
            step, exc = failed[0]
            if isinstance(exc, KvStateError) or not isinstance(exc, Exception):
                raise exc
            raise NativeError.effect(name, source, event, f"effect {step}", exc) from exc
        raise native.default().error(rc, "kvs_lease_fire", f"{bank.label} event {event!r}")

    def leases(self, rank: int) -> dict[int, NativeLease]:
        cap = self.exporter.config.max_leases
        buf = self.ffi.new("kvs_lease_info[]", cap)
        n = self.lib.kvs_lease_leases(self._s, rank, buf, cap)
        now = time.monotonic()
        return {buf[i].id: NativeLease(buf[i].id, Connection(self, buf[i].conn, buf[i].pid),
                                       now + buf[i].expires_in_ns / 1e9, bool(buf[i].expired), buf[i].nblocks)
                for i in range(max(0, min(n, cap)))}

    def holds(self, rank: int) -> dict[int, HoldView]:
        n = self.lib.kvs_lease_holds(self._s, rank, self.ffi.NULL, 0)
        if n <= 0:
            return {}
        buf = self.ffi.new("kvs_hold_info[]", n)
        n = min(n, self.lib.kvs_lease_holds(self._s, rank, buf, n))
        return {buf[i].id: HoldView(buf[i].id, buf[i].conn, bool(buf[i].conn_open), bool(buf[i].has_pidfd))
                for i in range(max(0, n))}

    def drop_exited_holds(self, rank: int) -> int:
        return int(self.lib.kvs_lease_drop_exited_holds(self._s, rank))

    def expire(self, ahead_s: float = 0.0) -> int:
        """One expiry round now (the thread runs them at each expiry on its own): leases
        that run out within ``ahead_s`` expire (a test looks ahead)."""
        return int(self.lib.kvs_lease_expire(self._s, int(ahead_s * 1e9)))

    # -- serving --------------------------------------------------------------------------

    def start(self, listen_fd: int | None, tcp: TcpServer | None = None) -> None:
        """Serve the listening socket ``listen_fd`` natively (None: nothing is served), and
        ``tcp``'s too (importers on other nodes: the thread runs the key handshake of
        :mod:`kvstate.channel.tcp` itself), and start the thread that delivers transitions
        and serves what the handler passes on."""
        if listen_fd is None:
            return
        if tcp is not None:
            key, person = tcp.deployment.key, Purpose.CHANNEL_AUTH.value
            self._check(self.lib.kvs_lease_listen_tcp(
                self._s, tcp.fileno(), key, len(key), person, len(person), MAX_HANDSHAKES,
                int(tcp.handshake_timeout * 1e9), KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES),
                "kvs_lease_listen_tcp", "the lease thread's tcp socket")
        self._check(self.lib.kvs_lease_serve(self._s, listen_fd), "kvs_lease_serve", "the lease thread")
        try:
            self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
            self._thread = threading.Thread(target=self._run, name="kvstate-lease-observer", daemon=True)
            self._thread.start()
        except BaseException:  # nothing of this start stays, so it can be tried again
            self._thread = None
            for fd in (self._stop_r, self._stop_w):
                if fd >= 0:
                    os.close(fd)
            self._stop_r = self._stop_w = -1
            self.lib.kvs_lease_stop(self._s)
            raise

    def stop(self) -> None:
        """Stop serving: the native thread is joined and its connections closed (their holds
        wait for their processes); queued transitions are delivered."""
        if self._thread is not None:  # first: the native stop closes the fds it waits on
            os.write(self._stop_w, b"x")
            self._thread.join(5.0)
            self._thread = None
            os.close(self._stop_r)
            os.close(self._stop_w)
            self._stop_r = self._stop_w = -1
        self.lib.kvs_lease_stop(self._s)
        self.pump()

    def handshakes(self) -> int:
        """TCP peers not yet authenticated (each holds a socket, never a served slot)."""
        return int(self.lib.kvs_lease_handshakes(self._s))

    def connections(self) -> int:
        return int(self.lib.kvs_lease_connections(self._s))

    def lease_requests(self) -> int:
        """``lease`` and ``leases`` requests handled so far (a batch counts once)."""
        return int(self.lib.kvs_lease_lease_requests(self._s))

    def close_connection(self, conn: int, *, importer_closed: bool) -> None:
        self.lib.kvs_lease_conn_close(self._s, conn, int(importer_closed))
        self.pump()

    def open_connection(self, pid: int) -> int:
        """A connection served from Python: its requests go through :meth:`handle`."""
        out = self.ffi.new("uint64_t *")
        self._check(self.lib.kvs_lease_conn_open(self._s, pid, out), "kvs_lease_conn_open", "a tcp connection")
        return int(out[0])

    def handle(self, conn: int, payload: bytes) -> tuple[bytes | None, tuple[int, ...]]:
        """The answer to one request of ``conn`` (None: none is sent) and its fds."""
        ffi, lib = self.ffi, self.lib
        reply, rlen = ffi.new("char[]", _REPLY_CAP), ffi.new("uint32_t *")
        fds, nfds, answer = ffi.new("int32_t[]", _MAX_FDS), ffi.new("int32_t *"), ffi.new("int32_t *")
        rc = lib.kvs_lease_handle(self._s, conn, payload, len(payload), reply, _REPLY_CAP, rlen, fds, _MAX_FDS,
                                  nfds, answer)
        self.pump()
        if rc == lib.KVS_LEASE_PYTHON:
            return self._serve_in_python(conn, payload)
        if rc != lib.KVS_OK:
            raise native.default().error(rc, "kvs_lease_handle", f"connection {conn}")
        if not answer[0]:
            return None, ()
        return bytes(ffi.buffer(reply, rlen[0])), tuple(fds[i] for i in range(nfds[0]))

    def _serve_in_python(self, conn: int, payload: bytes) -> tuple[bytes | None, tuple[int, ...]]:
        """The one request the native handler passes on: status."""
        from kvstate.share import status

        try:
            request = chan.decode(payload)
            if request == status.REQUEST:
                reply = status.exporter_status(self.exporter, asking=1, max_bytes=self.limits.max_payload)
                return chan.encode(reply), ()
            raise ChannelError(ChannelReason.FRAME, "only status is served in Python")
        except KvStateError as exc:
            return chan.encode({"ok": False, "code": exc.reason.value, "detail": str(exc)}), ()

    # -- the inventory mirror ---------------------------------------------------------------

    def attach(self, inventory: Inventory) -> None:
        """Serve leases naming ``inventory``'s blocks natively (see the module docstring)."""
        self._check(self.lib.kvs_lease_inv_on(self._s), "kvs_lease_inv_on", "the inventory mirror")
        inventory.attach(InventoryMirror(self))

    # -- observing ------------------------------------------------------------------------

    def pump(self) -> None:
        """Deliver every queued transition to its bank's observers, in order."""
        ev = self.ffi.new("kvs_lease_event *")
        t = self.table
        with self._pump_lock:  # reentrant: an observer may fire, and a fire pumps
            while self.lib.kvs_lease_next_event(self._s, ev) == 1:
                if ev.dropped:
                    log.warning("lease server: %d transition(s) were not observed (the queue was full)", ev.dropped)
                bank = self.exporter.banks.get(ev.rank)
                if ev.lease:
                    why = self._why.get(ev.why)
                    reason = f"lease {ev.lease}: {why}" if why else None
                else:
                    reason = self._pending_reason.pop(ev.rank, None)
                if bank is not None:
                    bank.record(StateChange(t.spec.name, bank.label, t.events[ev.event], t.states[ev.source],
                                            t.states[ev.dest], ev.t_ns, reason))

    def _run(self) -> None:
        events_fd = self.lib.kvs_lease_events_fd(self._s)
        requests_fd = self.lib.kvs_lease_requests_fd(self._s)
        conn, buf, blen = self.ffi.new("uint64_t *"), self.ffi.new("char[]", _REPLY_CAP), self.ffi.new("uint32_t *")
        poller = select.poll()
        for fd in (events_fd, requests_fd, self._stop_r):
            poller.register(fd, select.POLLIN)
        while True:
            try:
                ready = [fd for fd, _ in poller.poll(500)]  # a lost wake-up costs half a second
            except OSError as exc:  # ENOMEM for a moment: poll again
                log.warning("lease server: poll failed (%s); polling again", exc.strerror or exc)
                continue
            if self._stop_r in ready:
                return
            for fd in ready:
                try:
                    os.read(fd, 8)
                except OSError:  # EAGAIN (raced), or a failed read: what is queued is read below anyway
                    pass
            try:
                self.pump()
                while self.lib.kvs_lease_next_request(self._s, conn, buf, _REPLY_CAP, blen) == 1:
                    reply, fds = self._serve_in_python(int(conn[0]), bytes(self.ffi.buffer(buf, blen[0])))
                    if reply is not None:
                        self.lib.kvs_lease_answer(self._s, conn[0], reply, len(reply), list(fds), len(fds))
                    self.pump()
            except Exception:  # the thread must outlive one bad request or observer
                log.exception("lease server: serving a request passed to Python failed")

    def _check(self, rc: int, call: str, what: str) -> None:
        if rc != self.lib.KVS_OK:
            raise native.default().error(rc, call, what)


class InventoryMirror:
    """The native server's copy of an inventory (a :class:`kvstate.reuse.inventory.Mirror`).
    It holds the server weakly: an inventory may outlive its exporter, and then there is
    nothing left to pin (every call answers as for a mirror with no leases)."""

    def __init__(self, server: LeaseServer) -> None:
        self._server = weakref.ref(server)

    def _call(self, call: str, group: str, *args: Any) -> int:
        s = self._server()
        if s is None:
            return 0
        name = group.encode()
        rc = int(getattr(s.lib, call)(s._s, name, len(name), *args))
        if rc < 0 and rc != s.lib.KVS_E_BUSY:
            s._check(rc, call, f"inventory group {group!r:.60}")
        return rc

    def _hashes(self, hashes: Sequence[int]) -> tuple[Any, int]:
        s = self._server()
        assert s is not None
        return s.ffi.new("uint64_t[]", list(hashes)), len(hashes)

    def epoch(self, group: str, epoch: int) -> bool:
        return self._call("kvs_lease_inv_epoch", group, epoch) == 0

    def stored(self, group: str, hashes: Sequence[int]) -> None:
        if self._server() is not None:
            self._call("kvs_lease_inv_add", group, *self._hashes(hashes))

    def removed(self, group: str, hashes: Sequence[int]) -> bool:
        if self._server() is None:
            return True
        return self._call("kvs_lease_inv_remove", group, *self._hashes(hashes)) == 0

    def leases(self, group: str, block_hash: int) -> int:
        return max(0, self._call("kvs_lease_inv_leases", group, block_hash))
