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

import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Generic

from kvstate import channel as chan
from kvstate.channel.tcp import TcpServer
from kvstate.core.descriptor import Descriptor, encode
from kvstate.core.errors import (
    ArgumentInvalid, BackendUnavailable, Busy, ChannelError, ConfigInvalid, KvStateError, NativeError, TimedOut,
    TransitionError,
)
from kvstate.core.args import need, need_callables, need_choice, need_int, need_seconds, need_text
from kvstate.core.reasons import ArgumentReason, BusyReason, TimeoutReason, ChannelReason
from kvstate.core.geometry import Geometry
from kvstate.core.handles import UNCOUNTED_KINDS, HandleKind
from kvstate.core.identity import FabricDomain, FabricKind, Incarnation, host_boot_id
from kvstate.reuse.inventory import Inventory
from kvstate.core.machine import Lifecycle, Observer, effect, guard
from kvstate.core.spec import load_machine
from kvstate.core.capabilities import Access
from kvstate.transport.protocol import A, E, H, HostView, M, MappedTransport, R, require_mapped
from kvstate.share import store
from kvstate.share.export_config import ExportConfig
from kvstate.share.lease_server import HoldView, LeaseServer, NativeLease
from kvstate.transport.nixl import handle as nixl_handle
from kvstate.share.plan import Plan
from kvstate.share.transfer import TransferHandle, stop_dispatcher_if_idle

log = logging.getLogger(__name__)

#: The bank states whose descriptor is given out: from advertise until quiescent (a
#: draining bank's is still true, and its leases are refused by the bank itself).
DESCRIBED = frozenset({"advertised", "importing", "ready", "draining"})


def _stamped(kind: HandleKind, identity: bytes, generation: int) -> bytes:
    """The handle bytes a descriptor of ``generation`` carries: a NIXL record names its
    generation itself (registered once, stamped at each advertise), so an importer's check
    of the record against the descriptor can find a stale one."""
    return nixl_handle.at_generation(identity, generation) if kind is HandleKind.NIXL else identity


class Bank(Lifecycle, Generic[H, A, R, M, E]):
    """One rank's bank (spec/bank.toml; see the module docstring). ``H, A, R, M, E``: the types
    of :class:`kvstate.transport.protocol.MappedTransport`."""

    table = load_machine("bank")
    #: The lease rows' guards and effects: the lease server's, in C (ffi/kvs_lease.c).
    native = frozenset({"accepting_leases", "last_lease", "lease_live", "grant_lease", "renew_lease",
                        "expire_lease", "end_lease"})

    def __init__(self, exporter: Exporter[H, A, R, M, E], rank: int, geometry: Geometry, *,
                 observers: Iterable[Observer] = ()) -> None:
        super().__init__(label=f"bank[rank {rank}]", observers=observers)
        self.exporter = exporter
        self.transport = exporter.transport
        self.rank = rank
        self.geometry = geometry
        self.size = geometry.bank_size(self.transport.granularity())
        self.allocation: A = self.transport.create(self.size)
        self.owner = "engine"
        self.reservation: R | None = None
        self.mapping: M | None = None
        self.handle: H | None = None
        self._generation = 0
        self.descriptor: bytes | None = None
        self.descriptor_expires_ns = 0
        self.inventory_epoch = 0
        #: The bank's state, its leases and holds live in the exporter's native lease server.
        self._native = exporter.lease_server
        self._uncounted = exporter.config.handle_kind in UNCOUNTED_KINDS
        self._native.add_bank(rank, self._uncounted)
        self.stores: set[TransferHandle] = set()
        self._views: list[weakref.ref[Any]] = []  # buffers under the engine's tensors (Bank.tensors)
        self._report: dict[str, Any] | None = None  # lease_report() of this generation and incarnation

    # -- the state, in the native lease server (kvstate.share.lease_server) -----------

    @property
    def state(self) -> str:
        return self._native.state(self.rank)

    @property
    def is_terminal(self) -> bool:
        return self.state in self.table.terminal

    def may(self, event: str) -> bool:  # Lifecycle.may, of the native state
        return isinstance(event, str) and (event, self.state) in type(self)._kv_compiled.declared

    @property
    def uncounted(self) -> bool:  # grants take a hold (UNCOUNTED_KINDS)
        return self._uncounted

    @uncounted.setter
    def uncounted(self, value: bool) -> None:  # tests plant a bug with it
        self._uncounted = value
        self._native.uncounted(self.rank, value)

    @property
    def generation(self) -> int:
        return self._generation

    @generation.setter
    def generation(self, value: int) -> None:  # grants check it: set by advertise (and tests)
        self._generation = value
        if self.handle is not None and self.descriptor is not None:
            self._native.publish(self, self.lease_report(), self.handle.fd)

    @property
    def leases(self) -> dict[int, NativeLease]:  # a snapshot: lease id -> lease
        return self._native.leases(self.rank)

    @property
    def holds(self) -> dict[int, HoldView]:  # a snapshot: lease id -> hold (UNCOUNTED_KINDS), each a pin
        return self._native.holds(self.rank)

    def fire(self, event: str, **kwargs: Any) -> str:
        """Lifecycle.fire on the bank's native instance; lease events are the lease server's."""
        spec = self.table
        if not isinstance(event, str):
            raise TransitionError.illegal(spec.name, self.state, f"{event!r:.40}")
        if kwargs.get("reason") is not None:
            need_text("reason", kwargs["reason"], allow_empty=True)
        with self.locked():
            source = self.state
            if self._kv_firing:
                raise TransitionError.reentrant(spec.name, source, event)
            if (event, source) not in type(self)._kv_compiled.declared:
                raise TransitionError.illegal(spec.name, source, event)
            quiescent = event == "quiesce" and self._quiescent()
            self._kv_firing = True
            try:
                return self._native.bank_event(self, event, kwargs, type(self)._kv_compiled.effects, quiescent)
            finally:
                self._kv_firing = False
                self._native.pump()

    # -- what the engine uses -------------------------------------------------------

    def register(self) -> None:
        """Export the bank (``register``). A failure records ``register_failed`` too, and NativeError
        (REGISTRATION) propagates with the bank ``allocated``, the engine's (INV-REGISTER-ATOMIC)."""
        with self.locked():
            try:
                self.fire("register")
            except KvStateError:  # NativeError (REGISTRATION), or NativeError (EFFECT): rolled back either way
                if self.may("register_failed"):  # not for a register its state refused (twice)
                    self.fire("register_failed")
                raise

    def advertise(self) -> None:
        """Publish a signed descriptor with a new generation (``advertise``)."""
        self.fire("advertise")

    def view(self) -> memoryview:
        """The exporter's own read-write view of the bank (after registration), where the
        transport's memory is host memory (:class:`kvstate.transport.protocol.HostView`)."""
        t = self.transport
        if not isinstance(t, HostView):
            raise BackendUnavailable.unsuitable(t.name, "a bank view needs host memory")
        return t.view(self.mapped())

    def lease_report(self) -> dict[str, Any]:
        """What a grant says of this bank, for the importer's checks (built once per generation)."""
        report, incarnation = self._report, self.exporter.incarnation.value.hex()
        if report is None or report["generation"] != self.generation or report["incarnation"] != incarnation:
            report = self._report = {
                "rank": self.rank, "generation": self.generation, "incarnation": incarnation,
                "geometry": self.geometry.fingerprint().hex(), "num_blocks": self.geometry.num_blocks,
                "device_uuid": self.transport.device_uuid().hex(), "size": self.size}
        return report

    def pins(self) -> int:
        return 0 if self.mapping is None else self.transport.stats(self.mapping).pins

    def mapped(self) -> M:
        """The exporter's own mapping of the bank (KvStateError before registration)."""
        if self.mapping is None:
            raise ArgumentInvalid(ArgumentReason.STATE, f"{self.label} is not registered")
        return self.mapping

    def exported(self) -> H:
        """The handle registration exported (KvStateError before registration)."""
        if self.handle is None:
            raise ArgumentInvalid(ArgumentReason.STATE, f"{self.label} is not registered")
        return self.handle

    def store(self, src_tensors: Any, src_block_ids: Any, bank_block_ids: Any, *,
              report: tuple[int, bytes, bytes] | None = None) -> TransferHandle:
        """Copy pages ``src_block_ids`` of the engine's tensors (region name -> tensor) into
        bank blocks ``bank_block_ids``, every region, on the op engine. Returns at once;
        the handle says when the blocks hold the pages (``wait``, ``done``, a callback,
        an fd) and which failed. ``report`` (socket fd, ok message, failed message): the op
        engine itself sends one of them as the last op ends, armed before any op can end
        (``handle.report_status`` says whether it went out). Refused (ArgumentInvalid (a
        load/store reason), nothing submitted) when any argument is wrong; TransitionError
        (ILLEGAL) unless the bank is registered and not draining."""
        if not self.may("store"):
            raise TransitionError.illegal(self.table.name, self.state, "store")
        if report is not None and not (isinstance(report, tuple) and len(report) == 3
                                       and type(report[0]) is int and report[0] >= 0
                                       and isinstance(report[1], bytes) and isinstance(report[2], bytes)):
            raise ArgumentInvalid(ArgumentReason.TYPE, f"report must be (socket fd, ok bytes, failed bytes), "
                                                       f"not {report!r:.60}")
        plan = store.plan(self, src_tensors, src_block_ids, bank_block_ids)
        plan.report = report
        try:
            self.fire("store", plan=plan)
        finally:
            plan.release()
        assert plan.handle is not None
        return plan.handle

    def tensors(self, framework: str = "torch") -> dict[str, Any]:
        """Zero copy: one tensor (``"torch"``) or array (``"numpy"``) per region over the
        bank's own memory, for the engine to use as its KV cache. The bank is not
        released while any of them, or anything viewing them, is alive."""
        need_choice("framework", framework, ("torch", "numpy"))
        if self.mapping is None or self.state in ("draining", "quiescent", "released"):
            raise ArgumentInvalid.transfer(ArgumentReason.STATE, self.label, f"the bank is {self.state}; views need a "
                                           "registered bank that is not draining")
        memory = self.view()
        out = store.views(self, framework, memory)
        # Every tensor or array over it keeps the exporting object (not the memoryview) alive.
        self._views.append(weakref.ref(memory.obj))
        return out

    def views_alive(self) -> int:
        """How many ``tensors()`` results still have a live tensor (after a collection)."""
        if any(w() is not None for w in self._views):
            gc.collect()  # views caught in reference cycles
        self._views = [w for w in self._views if w() is not None]
        return len(self._views)

    # -- guards -----------------------------------------------------------------------

    @guard("native_quiescent")  # what Python knows of it; the lease server adds "no lease left"
    def _quiescent(self, **kw: Any) -> bool:
        return not self.stores and self.pins() == 0

    # -- effects ----------------------------------------------------------------------

    @effect("native_register")
    def _register(self, **kw: Any) -> Callable[[], None]:
        """Reserve, map, set access, export. Each object is recorded on the bank as it is
        made, so that when undoing a failed step fails too (the driver refuses an unmap),
        what is left stays known: a later register or release undoes it. The failure
        reported is always the step's own, as NativeError (REGISTRATION)."""
        t = self.transport
        step = "undo an earlier failed registration"
        try:
            self._unregister()  # nothing to do unless an earlier attempt left objects behind
            step = "reserve"
            self.reservation = t.reserve(self.size)
            step = "map"
            self.mapping = t.map(self.reservation, 0, self.allocation)
            step = "set_access"
            t.set_access(self.mapping, Access.READ_WRITE)
            step = "export"
            handle = t.export(self.allocation, self.exporter.config.handle_kind)
        except Exception as exc:  # typed or not, every step so far is undone, as far as it can be
            try:
                self._unregister()
            except Exception as undo_failed:
                log.warning("%s: undoing a failed registration failed too (%s); the bank keeps what is "
                            "left, for a later register or release", self.label, undo_failed)
            raise NativeError.registration(step, exc) from exc
        self.handle, self.owner = handle, "kvstate"
        return self._unregister

    def _unregister(self) -> None:
        """Undo registration: unmap, free the reservation; the engine owns the memory again.
        Each object is forgotten only once it is gone, so a failure here can be retried."""
        if self.mapping is not None:
            self.transport.unmap(self.mapping)
            self.mapping = None
        if self.reservation is not None:
            self.transport.free(self.reservation)
            self.reservation = None
        self.handle = None
        self.owner = "engine"

    @effect("publish_descriptor")
    def _publish(self, **kw: Any) -> Callable[[], None]:
        handle = self.exported()
        before = (self.generation, self.descriptor, self.descriptor_expires_ns, self.inventory_epoch)
        ex = self.exporter
        self.generation += 1
        self.inventory_epoch += 1
        self.descriptor_expires_ns = time.time_ns() + int(ex.config.descriptor_ttl_s * 1e9)
        desc = Descriptor(
            deployment_id=ex.config.deployment.id, source_id=ex.config.source_id,
            fabric=FabricDomain(FabricKind.NETWORK if handle.kind is HandleKind.NIXL else FabricKind.NODE,
                                ex.node), host_boot_id=ex.boot_id,
            device_uuid=self.transport.device_uuid(), incarnation=ex.incarnation.value, pid=os.getpid(),
            rank=self.rank, tp=ex.config.tp, geometry=self.geometry, handle_kind=handle.kind,
            handle=_stamped(handle.kind, handle.identity, self.generation), size=self.size, granularity=self.transport.granularity(),
            generation=self.generation, expires_at_ns=self.descriptor_expires_ns,
            socket_path=ex.lease_address, inventory_epoch=self.inventory_epoch,
        )
        self.descriptor = encode(desc, ex.config.deployment)
        self._native.publish(self, self.lease_report(), handle.fd)  # what grants of this generation say

        def undo() -> None:
            self.generation, self.descriptor, self.descriptor_expires_ns, self.inventory_epoch = before
            self._native.publish(self, self.lease_report(), handle.fd)
        return undo

    @effect("withdraw_descriptor")
    def _withdraw(self, **kw: Any) -> Callable[[], None]:
        before = (self.descriptor, self.descriptor_expires_ns)
        self.descriptor, self.descriptor_expires_ns = None, 0
        self._native.descriptor(self.rank, 0)

        def undo() -> None:
            self.descriptor, self.descriptor_expires_ns = before
            self._native.descriptor(self.rank, before[1])
        return undo

    @effect("submit_store")
    def _submit_store(self, *, plan: object = None, **kw: Any) -> None:
        if not isinstance(plan, Plan) or plan.kind != "store":
            raise ArgumentInvalid.transfer(ArgumentReason.PLAN, "fire('store')", "needs the plan Bank.store builds")
        handle = plan.submit(self.transport)
        self.stores.add(handle)
        try:
            handle._activate(self._store_finished)
        except BaseException:  # not watched: nothing of it is in flight (_activate)
            self.stores.discard(handle)
            raise

    def _store_finished(self, handle: TransferHandle) -> None:
        try:
            self.fire("stored", handle=handle)
        except TransitionError as exc:  # cannot happen while the table keeps `stored` where stores run
            log.error("%s: a finished store was not collected: %s", self.label, exc)
            self.stores.discard(handle)

    @effect("collect_store")
    def _collect_store(self, *, handle: object = None, **kw: Any) -> None:
        self.stores.discard(handle)

    @effect("native_release")
    def _release(self, **kw: Any) -> None:
        if self.views_alive():
            raise Busy(BusyReason.VIEWS, f"{self.label}: {len(self._views)} set(s) of tensors from Bank.tensors() are "
                       "still alive; drop them (the engine's KV cache) before releasing the bank")
        # The transport calls straight into C: row -> this effect -> transport -> C.
        t = self.transport
        self._unregister()  # step by step: a failed step leaves the rest for a retry
        t.release(self.allocation)
        self.owner = "released"


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
        if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
            raise ConfigInvalid.of("name", f"must be a file name (no '/', no NUL), not {name!r:.40}")
        self.socket_path = Path(config.socket_dir) / f"{name}.sock"
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
        """Stop serving (idempotent). Live leases stay until drained or their peers go."""
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
