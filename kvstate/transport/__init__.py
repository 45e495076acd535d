"""Transports: explicit registration of backends that share one VMM-shaped interface.

Nothing registers itself at import. A worker builds a :class:`Registry`, registers the
backends it means to use, and publishes their capabilities. The protocols they implement
are in :mod:`kvstate.transport.protocol`. Importing this package
imports no backend module: ``kvstate.transport.host`` (cffi), ``.cuda`` (cuda-python) and
``.nixl`` are imported by the caller, and a missing optional dependency surfaces as
:class:`kvstate.core.errors.BackendUnavailable` only when that backend is asked for.
"""

from kvstate.core.capabilities import Access, Capabilities, MemoryKind, Scope
from kvstate.transport.protocol import (
    Backend,
    ExportingTransport,
    HostView,
    MappedTransport,
    PendingOp,
    Registry,
    RegionStats,
)

__all__ = ["Access", "Backend", "Capabilities", "ExportingTransport", "HostView", "MappedTransport",
           "MemoryKind", "PendingOp", "Registry", "RegionStats", "Scope"]
