"""The NIXL agent of an engine process, shared by every rank of the connector in it.

kvstate keeps one NIXL agent per process (:class:`~kvstate.transport.nixl.transport.NixlTransport`
refuses a second), and one engine process may hold a decode rank and a prefill rank
(``kv_both``), or several ranks (in-process tests). So the connector's ranks take this
process's agent from here instead of making their own. It lives as long as the process:
each rank releases what it registered (banks when drained, staging buffers after each
load, remote views with their parts), and the agent's sockets end with the process.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstate.transport.nixl.transport import NixlTransport

_lock = threading.Lock()
_agent: NixlTransport | None = None


def process_agent() -> NixlTransport:
    """This process's agent, made on first use (BackendUnavailable without NIXL)."""
    global _agent
    with _lock:
        if _agent is None:
            from kvstate.transport.nixl.transport import NixlTransport

            _agent = NixlTransport()
        return _agent
