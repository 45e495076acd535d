"""The transport protocols, shaped like CUDA VMM: what every backend offers, typed.

The lifecycle sides (``kvstate.share``: banks, groups, parts) and the harness are written
against :class:`MappedTransport` only, so the host backend exercises the same ownership
rules as the CUDA one. Its operations:

==================  =================================================================
create(size)        allocate a physical object of ``size`` (a multiple of granularity)
export(a, kind)     a shareable handle for ``a``: ``kind`` and ``identity`` bytes (and
                    an fd, for fd kinds), as a descriptor carries them
release(a)          release an object; refuses while pinned or mapped
receive_handle      (kind, handle bytes, received fds) -> the backend's handle, checked
                    (kind, size, fd count, fd identity); nothing is opened
import_(h, n)       open a received handle of ``n`` bytes, after checking it
reserve(n)          reserve ``n`` bytes of address space with no access
free(r)             return a reservation (cuMemAddressFree); refuses while mapped
map(r, off, a)      map object ``a`` at ``off`` inside reservation ``r``, still no access
set_access(m, x)    grant read or read-write access to a mapping
unmap(m)            unmap; refuses with Busy (PINNED) while ops or leases pin it
pin(m), unpin(m)    an explicit pin (a lease's): unmap and release refuse until unpinned
own(m, o)           claim a mapping for owner token ``o`` (a part's, a bank's): unmap and
disown(m, o)        set_access refuse with Busy (OWNED) until the owner disowns it
stats(m)            :class:`RegionStats`: pins, ops in flight, completed and failed ops
submit_gather       copy (src_off, dst_off, len) blocks between mappings and the caller
                    memory the backend takes (``E``); returns a :class:`PendingOp` that
                    pins every mapping it touches until it finishes
granularity()       the allocation and mapping granularity in bytes
device_uuid()       16 bytes naming the memory's device (a host identity for host memory)
==================  =================================================================

Handles, allocations, reservations and mappings are each backend's own types, the
protocol's type parameters ``H, A, R, M`` (``E`` is the caller memory its ops take):
callers hand them back to the backend that made them, and mypy checks that they do.
Each backend module ends with a function that mypy checks and nothing calls, assigning
the backend to the protocols it implements.

The choice for backends that cannot map. NIXL moves bytes one-sidedly: nothing is mapped
into the importer's address space, so it has no reserve, map, set_access, unmap or pins.
Rather than methods that can only refuse, it implements the narrower protocols it can
honour (:class:`Backend` for the registry, :class:`ExportingTransport` for a bank's
memory) and its own loads (``NixlTransport.load`` under a lease gate). The lifecycle
sides refuse anything that is not a :class:`MappedTransport` with
:class:`BackendUnavailable` (UNSUITABLE) before they touch it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import attrs

from kvstate.core.capabilities import Access, Capabilities
from kvstate.core.errors import BackendUnavailable, ArgumentInvalid
from kvstate.core.reasons import ArgumentReason
from kvstate.core.handles import HandleKind

#: One gather block: (source offset, destination offset, length) in bytes.
Block = tuple[int, int, int]

#: The largest size or offset one backend call takes (256 TiB): every backend refuses more
#: with ArgumentInvalid before its C layer sees it.
MAX_SIZE = 1 << 48
#: The largest owner token (:meth:`MappedTransport.own`): a C ``uint64_t``; 0 names no owner.
OWNER_MAX = (1 << 64) - 1


@attrs.frozen
class RegionStats:
    """What a backend reports about one mapping. ``quiescent`` means no pins."""

    region: int
    addr: int
    size: int
    allocation: int
    reservation: int
    access: int
    pins: int
    explicit_pins: int
    inflight: int
    completed: int
    failed: int
    bytes: int

    @property
    def quiescent(self) -> bool:
        return self.pins == 0


@attrs.frozen
class OpInfo:
    """How an op stands or ended; ``state`` is a state of ``spec/op.toml``. ``error`` is the
    native layer's reason (``KVS_E_*``), ``result`` the CUresult a CUDA op's device reported."""

    op: int
    state: str
    error: int
    bytes: int
    nblocks: int
    result: int = 0


class PendingOp(Protocol):
    """A submitted copy or gather. It pins what it touches until it finishes; wait for it,
    then reap it (or call :meth:`result`) once."""

    @property
    def id(self) -> int: ...

    def info(self) -> OpInfo: ...

    def poll(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...

    def cancel(self) -> None: ...

    def reap(self) -> OpInfo: ...

    def result(self, timeout: float) -> OpInfo: ...


class Handle(Protocol):
    """What a descriptor carries of an exported handle, and the fd sent with it (fd
    kinds), or None (FABRIC and legacy IPC handles are bytes only)."""

    @property
    def kind(self) -> HandleKind: ...

    @property
    def identity(self) -> bytes: ...

    @property
    def fd(self) -> int | None: ...


class Mapped(Protocol):
    """What the lifecycle sides read of a mapping."""

    @property
    def size(self) -> int: ...


H = TypeVar("H", bound=Handle)
A = TypeVar("A")
R = TypeVar("R")
M = TypeVar("M", bound=Mapped)
E = TypeVar("E")
_H_co = TypeVar("_H_co", covariant=True)
_E_contra = TypeVar("_E_contra", contravariant=True)
_M_contra = TypeVar("_M_contra", contravariant=True)
_B = TypeVar("_B", bound="Backend")


@runtime_checkable
class Backend(Protocol):
    """What a worker registers and publishes about a transport."""

    name: str

    @property
    def capabilities(self) -> Capabilities: ...

    def granularity(self) -> int: ...

    def device_uuid(self) -> bytes: ...


class ExportingTransport(Backend, Protocol[_H_co, A]):
    """The exporting half every backend has, NIXL included: memory a peer may reach."""

    def create(self, size: int) -> A: ...

    def export(self, allocation: A, kind: HandleKind) -> _H_co: ...

    def release(self, allocation: A) -> None: ...


@runtime_checkable
class MappedTransport(ExportingTransport[H, A], Protocol[H, A, R, M, _E_contra]):
    """Everything the lifecycle sides call. See the module docstring."""

    def receive_handle(self, kind: HandleKind, data: bytes, fds: Sequence[int]) -> H: ...

    def import_(self, handle: H, size: int) -> A: ...

    def reserve(self, size: int) -> R: ...

    def free(self, reservation: R) -> None: ...

    def map(self, reservation: R, offset: int, allocation: A) -> M: ...

    def set_access(self, mapping: M, access: Access) -> None: ...

    def unmap(self, mapping: M) -> None: ...

    def pin(self, mapping: M) -> None: ...

    def unpin(self, mapping: M) -> None: ...

    def own(self, mapping: M, owner: int) -> None: ...

    def disown(self, mapping: M, owner: int) -> None: ...

    def stats(self, mapping: M) -> RegionStats: ...

    def submit_gather(self, src: M | _E_contra, dst: M | _E_contra, blocks: Sequence[Block]) -> PendingOp: ...


@runtime_checkable
class HostView(Protocol[_M_contra]):
    """A backend whose mappings are host memory this process may read and write."""

    def view(self, mapping: _M_contra) -> memoryview: ...


def require_mapped(transport: object) -> None:
    """Refuse, before anything is touched, a transport that cannot map (NIXL)."""
    if not isinstance(transport, MappedTransport):
        name = getattr(transport, "name", type(transport).__name__)
        raise BackendUnavailable.unsuitable(str(name), "the lifecycle sides need a MappedTransport (reserve, map, "
                                            "set_access, unmap, pins, gathers); NIXL ranks load with NixlTransport.load")



class Registry:
    """The transports one worker has registered, by name. Explicit by design."""

    def __init__(self) -> None:
        self._by_name: dict[str, Backend] = {}

    def register(self, transport: _B) -> _B:
        if not isinstance(transport, Backend):
            raise TypeError(f"{transport!r} does not implement the Backend interface")
        if transport.name in self._by_name:
            raise ArgumentInvalid(ArgumentReason.STATE, f"transport {transport.name!r} is already registered")
        self._by_name[transport.name] = transport
        return transport

    def get(self, name: str) -> Backend:
        try:
            return self._by_name[name]
        except KeyError:
            raise BackendUnavailable.missing(name, "not registered in this worker's transport registry") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._by_name.values())
