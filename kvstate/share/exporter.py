"""The exporter: a decode worker's banks, driven by ``spec/bank.toml``.

Theory of operation
-------------------

One :class:`Exporter` per process. It has an incarnation (random, new per process, so a
restart makes every old descriptor stale), a control-channel server in a private socket
directory, and one :class:`Bank` per rank it owns (usually one).

A bank starts ``allocated``: the memory exists and the engine owns it. ``register``
reserves address space, maps, sets access and exports the handle; if any step fails,
the earlier steps are undone in reverse and the bank stays ``allocated`` with its owner
unchanged (INV-REGISTER-ATOMIC). ``advertise`` bumps the generation and signs a
descriptor. Importers then ask for leases over the channel; a lease is granted only
when the request names the current incarnation and generation, and it is bound to the
requesting connection: when the importer closes it or dies, its leases end
(``peer_died``). Importers renew their leases while they map the bank (``renew``); a
lease that outlives ``lease_timeout_s`` unrenewed drains its bank (``lease_expired``) but
is *kept*, because its importer may still map the bank: the bank is released only after
that importer returns the lease (after unmapping) or its connection closes
(INV-NO-RELEASE-MAPPED). The descriptor's TTL running out withdraws it
(``descriptor_expired``); :meth:`Bank.advertise` publishes a new generation at any time
before or after, so a long-running decode worker stays reusable.

``drain`` refuses new leases; the bank becomes ``quiescent`` only when it has no lease,
no store left to collect, and the native layer reports zero pins on its mapping, and
only a quiescent bank is released (INV-RELEASE-QUIESCENT).

The engine fills a bank in one of two ways (:mod:`kvstate.share.store`): ``Bank.store``
copies pages of its own KV tensors into bank blocks on the op engine, or ``Bank.tensors``
(``Exporter.allocate``) hands it tensors over the bank's memory to use as its KV cache,
zero copy; the bank then refuses release while any of those tensors is alive.

Leases are served natively, where each bank's state lives (:mod:`kvstate.share.lease_server`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from typing import Any, Generic

from kvstate import channel as chan
from kvstate.channel.tcp import TcpServer
from kvstate.core.errors import ArgumentInvalid, ChannelError, ConfigInvalid, TimedOut, TransitionError
from kvstate.core.args import need, need_callables, need_choice, need_int, need_seconds
from kvstate.core.reasons import ArgumentReason, TimeoutReason, ChannelReason
from kvstate.core.geometry import Geometry
from kvstate.core.identity import Incarnation, host_boot_id
from kvstate.reuse.inventory import Inventory
from kvstate.core.machine import Observer
from kvstate.transport.protocol import A, E, H, M, MappedTransport, R, require_mapped
from kvstate.share.bank import DESCRIBED, Bank
from kvstate.share.export_config import ExportConfig, socket_path
from kvstate.share.lease_server import LeaseServer
from kvstate.share.transfer import stop_dispatcher_if_idle

class Exporter(Generic[H, A, R, M, E]):
    """A decode worker's exporting side: banks, the control server, lease bookkeeping."""

    def __init__(self, config: ExportConfig, transport: MappedTransport[H, A, R, M, E], *,
                 name: str | None = None, inventory: Inventory | None = None,
                 observers: Iterable[Observer] = ()) -> None:
        """``name`` names the control socket ``<socket_dir>/<name>.sock``; by default it is
        unique to this exporter (pid and incarnation), so exporters may share a socket
        directory. A name another live exporter serves is refused by :meth:`start`."""
        if not isinstance(config, ExportConfig):
            raise ConfigInvalid.of("config", f"must be an ExportConfig, not {type(config).__name__}")
        if inventory is not None:
            need("inventory", inventory, Inventory)
        observers = need_callables("observers", observers)
        require_mapped(transport)
        self.config = config
        self.transport = transport
        self._inventory: Inventory | None = None
        self._incarnation = Incarnation.new()
        self.boot_id = host_boot_id()
        self.node = os.uname().nodename
        if name is None:
            name = f"exporter-{os.getpid()}-{self.incarnation.value.hex()[:8]}"
        self.socket_path = socket_path(config, name)  # ConfigInvalid unless it can be bound and described
        # Across nodes leases travel over TCP (kvstate.channel.tcp); descriptors name the
        # address importers lease from, so it is bound before any bank is advertised.
        self._tcp = TcpServer(*config.tcp_listen, config.deployment, max_connections=config.max_connections,
                              handshake_timeout=config.request_timeout_s) if config.tcp_listen else None
        self.lease_address = self._tcp.address if self._tcp is not None else str(self.socket_path)
        self.banks: dict[int, Bank[H, A, R, M, E]] = {}
        self._observers = tuple(observers)
        # A batched lease answers with every bank's fd in one message (kvstate.share.peers).
        self.limits = chan.Limits(max_fds=min(chan.HARD_MAX_FDS, max(chan.DEFAULT_MAX_FDS, config.tp)))
        #: Leases are served natively; every bank's state lives there (kvstate.share.lease_server).
        self.lease_server = LeaseServer(self, self.limits)
        self.inventory = inventory
        self._server: chan.Server | None = None
        self._expiry: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def inventory(self) -> Inventory | None:
        """The retained inventory (advisory); a lease naming blocks pins them atomically,
        on the native lease server (it keeps a mirror the inventory updates)."""
        return self._inventory

    @inventory.setter
    def inventory(self, value: Inventory | None) -> None:
        if value is self._inventory:
            return
        if value is None or self._inventory is not None:
            raise ConfigInvalid.of("inventory", "is set once, to an Inventory")
        self.lease_server.attach(need("inventory", value, Inventory))
        self._inventory = value

    @property
    def incarnation(self) -> Incarnation:
        return self._incarnation

    @incarnation.setter
    def incarnation(self, value: Incarnation) -> None:  # a restart, in tests: grants check it
        self._incarnation = need("incarnation", value, Incarnation)
        for bank in self.banks.values():
            if bank.handle is not None:
                self.lease_server.publish(bank, bank.lease_report(), bank.handle.fd)

    # -- banks --------------------------------------------------------------------------

    def add_bank(self, rank: int, geometry: Geometry) -> Bank[H, A, R, M, E]:
        need_int("rank", rank, 0, self.config.tp - 1)
        need("geometry", geometry, Geometry)
        if rank in self.banks:
            raise ArgumentInvalid.of("rank", ArgumentReason.STATE, f"rank {rank} already has a bank in this exporter")
        bank: Bank[H, A, R, M, E] = Bank(self, rank, geometry, observers=self._observers)
        self.banks[rank] = bank
        return bank

    def replace_bank(self, rank: int) -> Bank[H, A, R, M, E]:
        """A new bank for ``rank`` once its bank is released (a drain that ended): same
        geometry, fresh memory, not registered yet; its generation continues the old one's,
        so its first advertise names a generation no descriptor of the old bank had."""
        need_int("rank", rank, 0, self.config.tp - 1)
        old = self.banks.get(rank)
        if old is None or old.state != "released":
            raise ArgumentInvalid.of("rank", ArgumentReason.STATE, f"rank {rank}'s bank is "
                                     f"{'missing' if old is None else old.state}: only a released bank is replaced")
        del self.banks[rank]
        try:
            bank = self.add_bank(rank, old.geometry)
        except BaseException:
            self.banks[rank] = old
            raise
        bank.generation = old.generation
        return bank

    def allocate(self, rank: int, geometry: Geometry,
                 framework: str = "torch") -> tuple[Bank[H, A, R, M, E], dict[str, Any]]:
        """Zero copy: a registered bank for ``rank`` and one tensor per region over its
        memory (:meth:`Bank.tensors`), for the engine to use as its KV cache. Advertise
        the bank once the engine has filled blocks worth reusing."""
        need_choice("framework", framework, ("torch", "numpy"))
        bank: Bank[H, A, R, M, E] = self.add_bank(rank, geometry)
        bank.register()
        try:
            return bank, bank.tensors(framework)
        except BaseException:
            bank.fire("drain")
            bank.fire("quiesce")
            bank.fire("release")
            del self.banks[rank]
            raise

    def descriptor(self, rank: int) -> bytes:
        need_int("rank", rank, 0, self.config.tp - 1)
        if rank not in self.banks:
            raise ArgumentInvalid.of("rank", ArgumentReason.STATE, f"no bank of rank {rank} in this exporter")
        bank = self.banks[rank]
        d = bank.descriptor
        if d is None or bank.state not in DESCRIBED:
            raise ArgumentInvalid.of("rank", ArgumentReason.STATE, f"the bank of rank {rank} is {bank.state}: "
                                     f"it has no descriptor to give (one is given from advertise until quiescent)")
        return d

    # -- serving ------------------------------------------------------------------------

    def start(self) -> None:
        """Listen for importers and serve their leases (natively, see
        kvstate.share.lease_server), and withdraw descriptors past their TTL. Once: a
        stopped exporter is not started again (make a new one)."""
        if self._stopping.is_set() or self._server is not None:
            raise ArgumentInvalid.of("exporter", ArgumentReason.STATE,
                                     "started already, or stopped: an exporter serves once; make a new one")
        chan.make_socket_dir(self.config.socket_dir)
        # Bound by the channel's Server (owner mark, sweeps of dead servers); served natively.
        self._server = chan.Server(self.socket_path, max_connections=self.config.max_connections, limits=self.limits)
        try:
            self.lease_server.start(self._server.fileno(), self._tcp)
            self._expiry = threading.Thread(target=self._expire_loop, name="kvstate-descriptor-expiry", daemon=True)
            self._expiry.start()
        except BaseException as exc:  # a start that fails leaves nothing, so it can be tried again
            server = self._server
            self._server = self._expiry = None
            self.lease_server.stop()
            server.close()
            if isinstance(exc, (OSError, RuntimeError)):  # no thread
                raise ChannelError(ChannelReason.FAILED, f"cannot start serving: {exc}") from None
            raise

    def stop(self) -> None:
        """Stop serving (idempotent): the lease server closes every importer's connection,
        which ends their leases at once (loads in flight fail). For a graceful end,
        :meth:`drain` first: it refuses renewals, so importers unmap and return their leases."""
        self._stopping.set()
        server, expiry = self._server, self._expiry
        self._server = self._expiry = None
        self.lease_server.stop()
        if server is not None:
            server.close()
        if self._tcp is not None:
            self._tcp.close()
        if expiry is not None:
            expiry.join(2.0)
        stop_dispatcher_if_idle()

    def connections(self) -> int:
        """Importer connections being served now (a lease holds one for its lifetime)."""
        return self.lease_server.connections()

    def _expire_loop(self) -> None:
        while not self._stopping.wait(0.05):
            self.expire()

    def expire(self) -> None:
        """One round of expiry: a lease past its time without renewal drains its bank (kept
        until returned or disconnected; the lease thread does this on its own at each
        expiry); a descriptor past its TTL is withdrawn. Both are observed events with a reason."""
        self.lease_server.expire()
        self.lease_server.pump()
        now_ns = time.time_ns()
        bank: Bank[H, A, R, M, E]
        for bank in list(self.banks.values()):
            with bank.locked():
                if bank.descriptor is not None and now_ns >= bank.descriptor_expires_ns \
                        and bank.may("descriptor_expired"):
                    bank.fire("descriptor_expired", reason=f"generation {bank.generation}: TTL of "
                              f"{self.config.descriptor_ttl_s} s ran out")

    # -- draining -----------------------------------------------------------------------

    def drain(self, timeout: float) -> float:
        """Drain every bank, wait for native quiescence, release. Returns seconds to quiescent."""
        timeout = need_seconds("timeout", timeout)
        start = time.monotonic()
        deadline = start + timeout
        bank: Bank[H, A, R, M, E]
        for bank in self.banks.values():
            if bank.may("drain"):
                bank.fire("drain")
        waited = 0.0
        for bank in self.banks.values():
            if bank.is_terminal:
                continue
            if bank.state == "allocated":
                bank.fire("release")
                continue
            while bank.state == "draining":
                try:
                    bank.fire("quiesce")
                except TransitionError:
                    # holds this side's close left end only once their process exited
                    self.lease_server.drop_exited_holds(bank.rank)
                    if time.monotonic() >= deadline:
                        raise TimedOut(TimeoutReason.DRAIN,
                                       f"{bank.label}: {len(bank.leases)} lease(s), {len(bank.holds)} hold(s), "
                                       f"{bank.pins()} pin(s) after {timeout} s; nothing released") from None
                    time.sleep(0.005)
            waited = time.monotonic() - start
            bank.fire("release")
        return waited
