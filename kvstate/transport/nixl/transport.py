"""The NIXL transport: cross-node prefix loads through NIXL's UCX backend.

Theory of operation
-------------------

Each process has exactly one NIXL agent, owned by its :class:`NixlTransport`. NIXL moves
bytes one-sidedly: the exporter registers a bank's memory, the importer loads the
exporter's agent metadata and READs blocks into its own registered buffer. Nothing is
mapped into the importer's address space, so this transport has no ``reserve``, ``map``,
``set_access`` or ``unmap``: it implements the narrower protocols
(:class:`~kvstate.transport.protocol.Backend`,
:class:`~kvstate.transport.protocol.ExportingTransport`; see that module for the choice),
the lifecycle sides refuse it with ``BackendUnavailable`` (UNSUITABLE), and a NIXL rank part is used
through :meth:`NixlTransport.load` instead.

Exporter side: :meth:`create` (or :meth:`register` for memory another backend owns)
registers a bank for DRAM (VRAM for device memory), :meth:`export` returns the handle
bytes of :mod:`kvstate.transport.nixl.handle` (agent name, the bank's partial agent
metadata with connection info, the region list, the generation), which travel inside
kvstate's authenticated descriptor. :meth:`release` deregisters.

Importer side: :meth:`import_` decodes and checks the handle bytes *before* NIXL sees
them (INV-REJECT-BEFORE-OPEN), refuses a generation older than one already seen from
that agent (INV-STALE-REJECTED), loads the metadata and prepares the remote block list.
:meth:`load` is one prefix load: a NIXL READ of a list of remote blocks into local
blocks, polled to completion under a timeout.

Why leases, not NIXL, govern lifetime: NIXL's deregistration does not revoke a peer's
access. A peer that still holds the metadata can READ a deregistered region, and it
then reads whatever the owner has put there since; once the owner unmaps the memory,
such a READ crashes the *owner* (tests/test_nixl_transport.py shows both on the real
library). So every load passes a :class:`LeaseGate` first, and an exporter may
deregister or reuse a bank only after every lease on it has ended (the bank machine's
``native_quiescent`` guard, INV-RELEASE-QUIESCENT).

Teardown follows NIXL's order: release the transfer (done after every load), then the
prepared descriptor lists, then invalidate the remote metadata, then deregister.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvstate.core.errors import (
    ArgumentInvalid, BackendUnavailable, Busy, KvStateError, ImportFailed, TransferFailed, TimedOut, NativeError,
)
from kvstate.core.reasons import ArgumentReason, BackendReason, BusyReason, NativeReason
from kvstate.core.handles import HandleKind
from kvstate.core.capabilities import Capabilities, MemoryKind, Scope
from kvstate.transport.nixl.agent import BACKEND, host_uuid, load_nixl, make_agent, nixl_call, numpy_api
from kvstate.transport.nixl.handle import NixlHandle, HandleDefect, RemoteRegion, decode

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from kvstate.transport.protocol import Backend, ExportingTransport

DEFAULT_TIMEOUT_S = 30.0
#: The longest wait between two asks whether a transfer completed.
MAX_POLL_NAP_S = 0.001

_MEM_TYPE = {MemoryKind.HOST: "DRAM", MemoryKind.DEVICE: "VRAM"}


# -- leases --------------------------------------------------------------------------


class LeaseGate:
    """The importer's side of a kvstate lease on one bank: the gate every load passes.

    The deadline is computed from the moment the importer *asked* for the lease, which
    is before the exporter granted it, so the importer's view always ends no later than
    the exporter's, whatever the clocks of the two nodes say.
    """

    def __init__(self, bank: str, *, requested_at_ns: int, duration_s: float,
                 renewed: Callable[[], int | None] | None = None) -> None:
        """``renewed``: the deadline (monotonic ns) of the lease's latest renewal, counted
        from when it was asked too, for a lease renewed without Python (the importer's
        renewal thread); consulted once the gate's own deadline has passed."""
        if duration_s <= 0:
            raise ValueError(f"lease duration must be positive, not {duration_s}")
        self.bank = bank
        self.deadline_ns = requested_at_ns + int(duration_s * 1e9)
        self._renewed = renewed
        self._ended: str | None = None

    def _past(self) -> bool:
        now = time.monotonic_ns()
        if now >= self.deadline_ns and self._renewed is not None:
            self.deadline_ns = max(self.deadline_ns, self._renewed() or 0)
        return now >= self.deadline_ns

    @property
    def live(self) -> bool:
        return self._ended is None and not self._past()

    def end(self, why: str = "returned") -> None:
        """End the lease (returned, revoked by the exporter, peer died). Idempotent."""
        if self._ended is None:
            self._ended = why

    def check(self) -> None:
        if self._ended is not None:
            raise TransferFailed.lease_ended(self.bank, self._ended)
        if self._past():
            raise TransferFailed.lease_ended(self.bank, "expired")


# -- objects the transport hands out -------------------------------------------------


@attrs.define(eq=False)
class NixlAllocation:
    """Memory registered with this process's agent: an exported bank or a load target."""

    addr: int
    size: int
    memory: MemoryKind
    device_id: int
    reg: Any  # nixlRegDList
    owned: mmap.mmap | None  # the mapping kvstate created, or None for registered memory
    local_dlists: dict[int, Any] = attrs.field(factory=dict)  # block bytes -> prepped dlist
    released: bool = False
    #: Loads in flight into it (the one pin rule): release refuses while any is. A load
    #: whose unfinished transfer could not be released keeps its pin for good, since NIXL
    #: may still write here.
    pins: int = 0

    def view(self) -> memoryview:
        """The bytes of a host allocation kvstate created (tests, benchmarks, fill)."""
        if self.owned is None:
            raise BackendUnavailable(BackendReason.UNSUPPORTED,
                                     "only memory created by NixlTransport.create has a Python view")
        return memoryview(self.owned)


@attrs.define(eq=False)
class NixlRemote:
    """An imported remote bank: its loaded metadata and prepared remote block lists."""

    handle: NixlHandle
    agent_name: str
    remote_dlists: dict[int, Any] = attrs.field(factory=dict)  # block bytes -> prepped dlist
    closed: str | None = None
    #: Parts of this process that imported this bank at this generation (several groups
    #: may lease one bank at once): the view goes when the last one closes it.
    users: int = 1

    @property
    def size(self) -> int:
        return self.handle.size

    @property
    def generation(self) -> int:
        return self.handle.generation


# -- the agent --------------------------------------------------------------------------

# -- the transport -------------------------------------------------------------------

_process_agent_lock = threading.Lock()
_process_agent: tuple[int, str] | None = None  # (pid, agent name) of this process's agent


class NixlTransport:
    """The ``nixl`` transport. One per process, for the life of the process (a closed
    transport is not replaced); see the module docstring."""

    name = "nixl"

    def __init__(self, agent_name: str | None = None, *, device_memory: bool = False,
                 num_threads: int = 0) -> None:
        global _process_agent
        nixl = load_nixl()
        self._np = numpy_api()
        agent_name = agent_name or f"kvstate-{os.getpid()}-{secrets.token_hex(4)}"
        with _process_agent_lock:
            if _process_agent is not None and _process_agent[0] == os.getpid():
                raise NativeError(NativeReason.NIXL, f"this process already has a NIXL agent ({_process_agent[1]!r}); "
                                  "kvstate uses one agent per process")
            self._agent = nixl_call("create agent", make_agent, nixl, agent_name, num_threads)
            _process_agent = (os.getpid(), agent_name)
        if BACKEND not in self._agent.backends:
            raise BackendUnavailable.missing("nixl",
                                             f"NIXL's {BACKEND} plugin is missing; found {self._agent.get_plugin_list()}")
        self.agent_name = agent_name
        mem_types = set(self._agent.get_backend_mem_types(BACKEND))
        kinds = {MemoryKind.HOST}
        if device_memory and mem_types & {"VRAM", "VRAM_SEG"}:
            kinds.add(MemoryKind.DEVICE)
        self._capabilities = Capabilities(
            handle_kinds=frozenset({HandleKind.NIXL}),
            memory_kinds=frozenset(kinds),
            scopes=frozenset({Scope.SAME_NODE, Scope.CROSS_NODE}),
        )
        self._allocations: list[NixlAllocation] = []
        self._pins = threading.Lock()  # NixlAllocation.pins and release decide under it
        self._views = threading.RLock()  # imports and closes of views (ranks' threads share the agent)
        self._remotes: dict[tuple[str, int], NixlRemote] = {}     # one view per bank (NixlHandle.bank)
        self._latest_generation: dict[tuple[str, int], int] = {}
        self._closed = False

    # -- the Backend and ExportingTransport protocols -----------------------------------

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def granularity(self) -> int:
        return mmap.PAGESIZE

    def device_uuid(self) -> bytes:
        return host_uuid()

    def create(self, size: int) -> NixlAllocation:
        """Allocate ``size`` bytes of host memory and register it for DRAM."""
        if size <= 0 or size % self.granularity():
            raise ValueError(f"size {size} is not a positive multiple of {self.granularity()}")
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = self._np.frombuffer(buf, dtype=self._np.uint8).ctypes.data
        try:
            return self._register(int(addr), size, MemoryKind.HOST, 0, owned=buf)
        except BaseException:
            buf.close()
            raise

    def register(self, addr: int, size: int, memory: MemoryKind = MemoryKind.HOST,
                 device_id: int = 0) -> NixlAllocation:
        """Register memory another backend owns (a host bank, or VRAM where a GPU exists)."""
        if memory not in self._capabilities.memory_kinds:
            raise BackendUnavailable.missing("nixl", f"{memory.value} memory is not enabled for this agent "
                                             "(pass device_memory=True where a GPU exists)")
        if addr <= 0 or size <= 0:
            raise ValueError(f"bad region ({addr:#x}, {size})")
        return self._register(addr, size, memory, device_id, owned=None)

    def _register(self, addr: int, size: int, memory: MemoryKind, device_id: int,
                  owned: mmap.mmap | None) -> NixlAllocation:
        self._check_open()
        reg = nixl_call("register_memory", self._agent.register_memory,
                    [(addr, size, device_id, "")], _MEM_TYPE[memory], backends=[BACKEND])
        allocation = NixlAllocation(addr, size, memory, device_id, reg, owned)
        self._allocations.append(allocation)
        return allocation

    def export(self, allocation: NixlAllocation, kind: HandleKind = HandleKind.NIXL, *,
               generation: int = 0) -> bytes:
        """Handle bytes for ``allocation`` at ``generation`` (kvstate.transport.nixl.handle)."""
        if kind is not HandleKind.NIXL:
            raise ArgumentInvalid.of("kind", ArgumentReason.RANGE, f"the nixl transport exports only "
                                     f"{HandleKind.NIXL.value!r} handles, not {kind.value!r}")
        self._check_live(allocation)
        metadata = nixl_call("get_partial_agent_metadata", self._agent.get_partial_agent_metadata,
                         allocation.reg, inc_conn_info=True, backends=[BACKEND])
        handle = NixlHandle(agent_name=self.agent_name, metadata=bytes(metadata),
                            regions=(RemoteRegion(allocation.addr, allocation.size, allocation.device_id),),
                            generation=generation, memory=allocation.memory)
        return handle.encode()

    def import_(self, handle: bytes | NixlHandle, size: int, *, generation: int | None = None) -> NixlRemote:
        """Check handle bytes, then load the remote agent's metadata.

        ``generation`` is the descriptor's; a record from an older generation, or older
        than one this process already imported from the same agent, is
        :class:`ImportFailed` (HANDLE, defect STALE_GENERATION). A newer generation retires the older view first;
        the same generation again shares the view (one more user; :meth:`close_remote`).
        """
        with self._views:
            return self._import(handle, size, generation)

    def _import(self, handle: bytes | NixlHandle, size: int, generation: int | None) -> NixlRemote:
        self._check_open()
        h = handle if isinstance(handle, NixlHandle) else decode(handle, generation=generation)
        if isinstance(handle, NixlHandle) and generation is not None and h.generation != generation:
            h = decode(h.encode(), generation=generation)  # same checks, same errors
        if h.size != size:
            raise ImportFailed.nixl_handle(HandleDefect.REGIONS,
                                           f"handle covers {h.size} bytes; the descriptor says {size}")
        if h.agent_name == self.agent_name:
            raise ImportFailed.nixl_handle(HandleDefect.AGENT_NAME, "the handle names this process's own agent")
        bank = h.bank
        where = f"{h.agent_name} bank at {bank[1]:#x}"
        latest = self._latest_generation.get(bank)
        if latest is not None and h.generation < latest:
            raise ImportFailed.nixl_handle(HandleDefect.STALE_GENERATION,
                                           f"{where}: generation {h.generation}, but {latest} was already imported")
        previous = self._remotes.get(bank)
        if previous is not None:
            if previous.generation == h.generation:  # another part of this process reads it too
                previous.users += 1
                return previous
            self._retire(previous, why=f"superseded by generation {h.generation}")
        # Loading partial metadata again for a known agent adds this bank's registration.
        loaded = nixl_call("add_remote_agent", self._agent.add_remote_agent, h.metadata)
        loaded_name = loaded.decode("ascii", "replace") if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != h.agent_name:
            if self._agent_views(loaded_name) == 0:  # never drop another view's metadata
                nixl_call("remove_remote_agent", self._agent.remove_remote_agent, loaded_name)
            raise ImportFailed.nixl_handle(HandleDefect.AGENT_NAME,
                                           f"metadata is for agent {loaded_name!r}, the handle names {h.agent_name!r}")
        remote = NixlRemote(handle=h, agent_name=loaded_name)
        self._remotes[bank] = remote
        self._latest_generation[bank] = h.generation
        return remote

    def _agent_views(self, agent_name: str) -> int:
        return sum(1 for a, _ in self._remotes if a == agent_name)

    def release(self, allocation: NixlAllocation) -> None:
        """Release local prepared lists, then deregister (and unmap what create mapped).

        The caller must know no lease on it is live: NIXL would not stop a peer's READ.
        """
        with self._pins:
            self._check_live(allocation)
            if allocation.pins:
                raise Busy.native(BusyReason.PINNED, "release", 0, f"{allocation.pins} load(s) in flight into the "
                                  f"allocation at {allocation.addr:#x}; NIXL would let them write after deregistration")
            allocation.released = True  # no load starts on it from here
        try:
            for size in list(allocation.local_dlists):  # each forgotten once it is gone: a retry resumes
                nixl_call("release_dlist_handle", self._agent.release_dlist_handle, allocation.local_dlists[size])
                del allocation.local_dlists[size]
            nixl_call("deregister_memory", self._agent.deregister_memory, allocation.reg, backends=[BACKEND])
        except BaseException:
            with self._pins:
                allocation.released = False  # still registered: release may be tried again
            raise
        self._allocations.remove(allocation)
        if allocation.owned is not None:
            try:
                allocation.owned.close()
            except BufferError:  # a caller still holds a view: unmapped when it is dropped
                pass
            allocation.owned = None

    # -- loads ------------------------------------------------------------------------

    def load(self, remote: NixlRemote, dst: NixlAllocation, src_blocks: Sequence[int] | npt.NDArray[Any],
             dst_blocks: Sequence[int] | npt.NDArray[Any] | None = None, *, block_bytes: int,
             lease: LeaseGate, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """One prefix load: READ remote blocks ``src_blocks`` into local ``dst_blocks``.

        Blocks are ``block_bytes`` each, numbered from the start of the bank and of
        ``dst``; ``dst_blocks`` defaults to 0..n-1. The lease is checked before anything
        is posted. Raises :class:`TransferFailed` (LEASE_ENDED), :class:`ImportFailed`
        (HANDLE, defect STALE_GENERATION) for a retired view, :class:`TimedOut` (NIXL) or
        :class:`NativeError` (NIXL).
        """
        lease.check()
        if remote.closed is not None:
            raise ImportFailed.nixl_handle(HandleDefect.STALE_GENERATION,
                                           f"{remote.agent_name} view is closed: {remote.closed}")
        self._check_live(dst)
        np = self._np
        src = np.asarray(src_blocks, dtype=np.int64)
        dst_idx = np.arange(len(src), dtype=np.int64) if dst_blocks is None else np.asarray(dst_blocks, dtype=np.int64)
        if src.ndim != 1 or dst_idx.shape != src.shape or len(src) == 0:
            raise ValueError("src_blocks and dst_blocks must be equal-length, non-empty 1-d block lists")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, not {block_bytes}")
        n_src, n_dst = remote.size // block_bytes, dst.size // block_bytes
        if src.min() < 0 or src.max() >= n_src or dst_idx.min() < 0 or dst_idx.max() >= n_dst:
            raise ValueError(f"block index out of range (remote has {n_src}, local has {n_dst} blocks)")
        with self._pins:
            self._check_live(dst)  # again: a release may have begun since the check above
            dst.pins += 1
        unpin = True
        try:
            local_list = self._local_dlist(dst, block_bytes)
            remote_list = self._remote_dlist(remote, block_bytes)
            xfer = nixl_call("make_prepped_xfer", self._agent.make_prepped_xfer, "READ",
                         local_list, dst_idx.astype(np.int32), remote_list, src.astype(np.int32))
            try:
                self._wait(xfer, timeout)
            except BaseException as exc:
                if not isinstance(exc, NativeError):
                    # Not known to be over (timed out, interrupted): releasing it does not stop
                    # the bytes. Over TCP, UCX delivered a timed-out READ's late reply into its
                    # target after the release; once the target was unmapped, the importer died
                    # in ucp_get_rep_handler (issue 30). So the target stays pinned for good.
                    unpin = False
                    exc.add_note("the READ may still land: its target stays pinned")
                try:  # releasing an unfinished transfer asks NIXL to cancel it
                    nixl_call("release_xfer_handle", self._agent.release_xfer_handle, xfer)
                except NativeError as release_exc:  # nixl_call raises only the NIXL reason
                    unpin = False  # NIXL may still write into dst: it stays pinned for good
                    exc.add_note(f"releasing the transfer also failed: {release_exc}; its target stays pinned")
                raise
            nixl_call("release_xfer_handle", self._agent.release_xfer_handle, xfer)
        finally:
            if unpin:
                self._unpin(dst)

    def _unpin(self, allocation: NixlAllocation) -> None:
        with self._pins:
            allocation.pins -= 1

    def _wait(self, xfer: Any, timeout: float) -> None:
        state = nixl_call("transfer", self._agent.transfer, xfer)
        deadline = time.monotonic() + timeout
        nap = 0.0
        while state == "PROC":
            if time.monotonic() >= deadline:
                raise TimedOut.nixl("transfer", f"not complete after {timeout} s")
            # NIXL's progress thread moves the bytes; this only asks. A spin here took a
            # core (and the GIL, call after call) from the engine this runs in, so it
            # backs off to at most MAX_POLL_NAP_S between asks.
            time.sleep(nap)
            nap = min(MAX_POLL_NAP_S, nap * 2 or 0.00005)
            state = nixl_call("check_xfer_state", self._agent.check_xfer_state, xfer)
        if state != "DONE":
            raise NativeError.nixl("transfer", f"state {state}")

    def _blocks(self, base: int, size: int, block_bytes: int, device_id: int) -> npt.NDArray[Any]:
        np = self._np
        n = size // block_bytes
        descs = np.empty((n, 3), dtype=np.uint64)
        descs[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
        descs[:, 1] = block_bytes
        descs[:, 2] = device_id
        result: npt.NDArray[Any] = descs
        return result

    def _local_dlist(self, dst: NixlAllocation, block_bytes: int) -> Any:
        if block_bytes not in dst.local_dlists:
            descs = self._blocks(dst.addr, dst.size, block_bytes, dst.device_id)
            dst.local_dlists[block_bytes] = nixl_call("prep_xfer_dlist", self._agent.prep_xfer_dlist,
                                                  "NIXL_INIT_AGENT", descs, _MEM_TYPE[dst.memory], backends=[BACKEND])
        return dst.local_dlists[block_bytes]

    def _remote_dlist(self, remote: NixlRemote, block_bytes: int) -> Any:
        if block_bytes not in remote.remote_dlists:
            np = self._np
            parts = [self._blocks(r.addr, r.length, block_bytes, r.device_id) for r in remote.handle.regions]
            descs = np.concatenate(parts) if len(parts) > 1 else parts[0]
            remote.remote_dlists[block_bytes] = nixl_call(
                "prep_xfer_dlist", self._agent.prep_xfer_dlist, remote.agent_name, descs,
                _MEM_TYPE[remote.handle.memory], backends=[BACKEND])
        return remote.remote_dlists[block_bytes]

    # -- teardown ---------------------------------------------------------------------

    def close_remote(self, remote: NixlRemote, why: str = "closed") -> None:
        """One user of the view is done with it; the last one releases the remote's
        prepared lists, then invalidates its metadata. Idempotent once retired."""
        with self._views:
            if remote.closed is not None:
                return
            remote.users -= 1
            if remote.users <= 0:
                self._retire(remote, why)

    def _retire(self, remote: NixlRemote, why: str) -> None:
        """Retire the view for every user (the last one closed it, or a newer generation
        of the bank supersedes it: its READs then fail as stale)."""
        if remote.closed is not None:
            return
        for dlist in remote.remote_dlists.values():
            nixl_call("release_dlist_handle", self._agent.release_dlist_handle, dlist)
        remote.remote_dlists.clear()
        remote.closed = why
        if self._remotes.get(remote.handle.bank) is remote:
            del self._remotes[remote.handle.bank]
        if self._agent_views(remote.agent_name) == 0:  # the agent's metadata serves no other view
            nixl_call("remove_remote_agent", self._agent.remove_remote_agent, remote.agent_name)

    def close(self) -> None:
        """Tear everything down in NIXL's order. Transfers are already released after
        each load; then every prepared list, then remote metadata, then deregistration."""
        if self._closed:
            return
        for allocation in self._allocations:
            for dlist in allocation.local_dlists.values():
                nixl_call("release_dlist_handle", self._agent.release_dlist_handle, dlist)
            allocation.local_dlists.clear()
        for remote in list(self._remotes.values()):
            self._retire(remote, "closed")
        failed: list[KvStateError] = []
        for allocation in list(self._allocations):
            try:
                self.release(allocation)
            except KvStateError as exc:  # pinned for good, or NIXL refused: the others still go
                failed.append(exc)
        self._closed = True
        if failed:
            raise failed[0]

    def _check_open(self) -> None:
        if self._closed:
            raise NativeError(NativeReason.NIXL, f"NIXL transport {self.agent_name!r} is closed")

    def _check_live(self, allocation: NixlAllocation) -> None:
        self._check_open()
        if allocation.released or allocation not in self._allocations:
            raise NativeError(NativeReason.NIXL,
                              f"allocation at {allocation.addr:#x} is not registered with {self.agent_name!r}")


def _conformance(t: NixlTransport) -> None:
    """Checked by mypy, never called: the protocols NIXL can honour (it cannot map)."""
    backend: Backend = t
    exporting: ExportingTransport[bytes, NixlAllocation] = t
    del backend, exporting
