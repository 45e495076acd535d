"""One rank's bank: its memory, registration and descriptor, driven by ``spec/bank.toml``.
:mod:`kvstate.share.exporter` holds the banks of a decode worker and serves them; its
theory of operation says how a bank lives (register, advertise, leases, drain, release)."""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic

from kvstate.core.descriptor import Descriptor, encode
from kvstate.core.errors import ArgumentInvalid, BackendUnavailable, Busy, KvStateError, NativeError, TransitionError
from kvstate.core.args import FD_MAX, need_choice, need_text
from kvstate.core.reasons import ArgumentReason, BusyReason
from kvstate.core.geometry import Geometry
from kvstate.core.handles import UNCOUNTED_KINDS, HandleKind
from kvstate.core.identity import FabricDomain, FabricKind
from kvstate.core.machine import Lifecycle, Observer, effect, guard
from kvstate.core.spec import load_machine
from kvstate.core.capabilities import Access
from kvstate.transport.protocol import A, E, H, HostView, M, R
from kvstate.share import store
from kvstate.share.epochs import new_page
from kvstate.share.lease_server import HoldView, NativeLease
from kvstate.share.owned import new_owner, unmap_owned
from kvstate.transport.nixl import handle as nixl_handle
from kvstate.share.plan import Plan
from kvstate.share.transfer import TransferHandle

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvstate.share.exporter import Exporter

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
        #: Each block's store count, for importers' loads to check (kvstate.share.epochs).
        self.block_epochs = new_page(geometry.num_blocks, self.label)
        try:
            self.allocation: A = self.transport.create(self.size)
        except BaseException:
            self.block_epochs.close()
            raise
        self.owner = "engine"
        self.reservation: R | None = None
        self.mapping: M | None = None
        self._owner = new_owner()  # the token the bank owns its mapping with (kvstate.share.owned)
        self.handle: H | None = None
        self._generation = 0
        self.descriptor: bytes | None = None
        self.descriptor_expires_ns = 0
        self.inventory_epoch = 0
        #: The bank's state, its leases and holds live in the exporter's native lease server.
        self._native = exporter.lease_server
        self._uncounted = exporter.config.handle_kind in UNCOUNTED_KINDS
        self._native.add_bank(rank, self._uncounted)
        self._native.block_epochs(rank, self.block_epochs.fd, geometry.num_blocks)
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
                                       and type(report[0]) is int and 0 <= report[0] <= FD_MAX
                                       and isinstance(report[1], bytes) and isinstance(report[2], bytes)):
            raise ArgumentInvalid(ArgumentReason.TYPE, f"report must be (socket fd 0..{FD_MAX}, ok bytes, failed bytes), "
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
            step = "own"
            t.own(self.mapping, self._owner)
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
            unmap_owned(self.transport, self.mapping, self._owner)
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
        # Odd before the first op can write; Busy (storing) while another store writes a block.
        # The op engine makes them even as the last op ends, before the store's report goes out.
        plan.epochs = epochs = self.block_epochs.begin(plan.blocks, self.label)
        try:
            handle = plan.submit(self.transport)
        except BaseException:
            self.block_epochs.end(epochs.blocks, epochs.odd)
            raise
        self.stores.add(handle)
        try:
            handle._activate(self._store_finished)
        except BaseException:  # not watched: nothing of it is in flight (_activate)
            self.stores.discard(handle)
            self.block_epochs.end(epochs.blocks, epochs.odd)
            raise

    def _store_finished(self, handle: TransferHandle) -> None:
        try:
            self.fire("stored", handle=handle)
        except TransitionError as exc:  # cannot happen while the table keeps `stored` where stores run
            log.error("%s: a finished store was not collected: %s", self.label, exc)
            self._end_epochs(handle)
            self.stores.discard(handle)

    @effect("collect_store")
    def _collect_store(self, *, handle: object = None, **kw: Any) -> None:
        self._end_epochs(handle)
        self.stores.discard(handle)

    def _end_epochs(self, handle: object) -> None:
        """Every op of a store of this bank reaped: its blocks' epochs even, where the op
        engine has not made them so already (a transport without native reports)."""
        if handle in self.stores and isinstance(handle, TransferHandle) and handle.epochs is not None:
            self.block_epochs.end(handle.epochs.blocks, handle.epochs.odd)

    @effect("native_release")
    def _release(self, **kw: Any) -> None:
        if self.views_alive():
            raise Busy(BusyReason.VIEWS, f"{self.label}: {len(self._views)} set(s) of tensors from Bank.tensors() are "
                       "still alive; drop them (the engine's KV cache) before releasing the bank")
        # The transport calls straight into C: row -> this effect -> transport -> C.
        t = self.transport
        self._unregister()  # step by step: a failed step leaves the rest for a retry
        t.release(self.allocation)
        self._native.block_epochs(self.rank, None, 0)  # before its fd closes
        self.block_epochs.close()
        self.owner = "released"
