"""The cross-node backend: NIXL READs of a peer's registered bank, gated by kvstate leases.

Importing this package loads no NIXL module; constructing a :class:`NixlTransport` does
(``BackendUnavailable`` where NIXL is not installed).
"""

from kvstate.transport.nixl.agent import load_nixl
from kvstate.transport.nixl.transport import LeaseGate, NixlTransport

__all__ = ["LeaseGate", "NixlTransport", "load_nixl"]
