"""The transport interface every backend implements, shaped like CUDA VMM.

The lifecycle code (banks, groups, parts) is written against this interface only, so the
host backend exercises the same ownership rules as the CUDA one:

==============  =====================================================================
create(size)    allocate a physical object of ``size`` (a multiple of granularity)
export(a)       a shareable handle for ``a`` (an fd, or handle bytes)
import_(h, n)   open a received handle of ``n`` bytes, after checking it
reserve(n)      reserve ``n`` bytes of address space with no access
map(r, off, a)  map object ``a`` at ``off`` inside reservation ``r``, still no access
set_access(m)   grant read or read-write access to a mapping
unmap(m)        unmap; refuses with a typed error while native ops pin the mapping
release(a)      release an object; refuses while pinned or mapped
granularity()   the allocation and mapping granularity in bytes
device_uuid()   16 bytes naming the memory's device (a host identity for host memory)
==============  =====================================================================

Beyond the protocol, the lifecycle code uses these on every backend it drives (host,
cuda): ``free(r)`` (return a reservation), ``stats(m)`` (a mapping's pins, as
:class:`kvstate.transport.native.RegionStats`), ``receive_handle(kind, bytes, fds)`` (the backend's
handle for a descriptor's handle bytes and the fds received with it, checked, nothing
opened) and ``submit_gather(m, dst, blocks)`` (a :class:`PendingOp`).

Handles, allocations, reservations and mappings are backend objects; callers treat
them as opaque and hand them back to the backend that made them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import attrs

from kvstate.core.errors import BackendUnavailable, KvStateError
from kvstate.core.capabilities import Access, Capabilities
from kvstate.core.handles import HandleKind


@runtime_checkable
class Transport(Protocol):
    """A backend. See the module docstring for the meaning of each operation."""

    name: str

    @property
    def capabilities(self) -> Capabilities: ...

    def granularity(self) -> int: ...

    def device_uuid(self) -> bytes: ...

    def create(self, size: int) -> Any: ...

    def export(self, allocation: Any, kind: HandleKind) -> Any: ...

    def import_(self, handle: Any, size: int) -> Any: ...

    def reserve(self, size: int) -> Any: ...

    def map(self, reservation: Any, offset: int, allocation: Any) -> Any: ...

    def set_access(self, mapping: Any, access: Access) -> None: ...

    def unmap(self, mapping: Any) -> None: ...

    def release(self, allocation: Any) -> None: ...


class OpResult(Protocol):
    """What a finished op reports; the lifecycle code reads only its byte count."""

    @property
    def bytes(self) -> int: ...


class PendingOp(Protocol):
    """A submitted copy or gather (:class:`kvstate.transport.native.Op` on the host backend,
    ``CudaOp`` on the cuda backend). It pins what it touches until it finishes."""

    def result(self, timeout: float) -> OpResult: ...

    def cancel(self) -> None: ...


class DuplicateTransport(KvStateError):
    """A transport of that name is already registered."""


class Registry:
    """The transports one worker has registered, by name. Explicit by design."""

    def __init__(self) -> None:
        self._by_name: dict[str, Transport] = {}

    def register(self, transport: Transport) -> Transport:
        if not isinstance(transport, Transport):
            raise TypeError(f"{transport!r} does not implement the Transport interface")
        if transport.name in self._by_name:
            raise DuplicateTransport(f"transport {transport.name!r} is already registered")
        self._by_name[transport.name] = transport
        return transport

    def get(self, name: str) -> Transport:
        try:
            return self._by_name[name]
        except KeyError:
            raise BackendUnavailable(name, "not registered in this worker's transport registry") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Transport]:
        return iter(self._by_name.values())
