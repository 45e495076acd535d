"""Mappings a part or a bank owns: claimed with the owner's token once they are made
(:meth:`~kvstate.transport.protocol.MappedTransport.own`), so that nobody else can unmap
them or change their access while the owner still counts on them (``Busy``, ``OWNED``:
``transport.unmap(part.mapped())`` is refused, and the part closes as it would have).
Only the owner, which knows its token, gives one up, just before it unmaps it."""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

from kvstate.transport.protocol import MappedTransport

AnyTransport = MappedTransport[Any, Any, Any, Any, Any]


#: Tokens drawn ahead, 64 per read of the system's random source: a group import makes
#: one owner per part, and a read per token was a system call each.
_pool: list[int] = []
_pool_lock = threading.Lock()


def _forked() -> None:
    """A child draws its own tokens, under a lock no parent's thread holds."""
    global _pool_lock
    _pool_lock = threading.Lock()
    _pool.clear()


os.register_at_fork(after_in_child=_forked)


def new_owner() -> int:
    """A token of one owner: nonzero, and not one another owner can guess."""
    with _pool_lock:
        if not _pool:
            drawn = secrets.token_bytes(8 * 64)
            _pool.extend((int.from_bytes(drawn[i:i + 8], "little") >> 1) + 1 for i in range(0, len(drawn), 8))
        return _pool.pop()


def unmap_owned(transport: AnyTransport, mapping: Any, owner: int) -> None:
    """Unmap the owner's own mapping. A refused unmap (pinned, say) leaves it owned, so a
    retry finds it as it was."""
    transport.disown(mapping, owner)
    try:
        transport.unmap(mapping)
    except BaseException:
        transport.own(mapping, owner)
        raise


def let_go(transport: AnyTransport, holder: Any, owner: int) -> None:
    """Unmap ``holder``'s own ``mapping``, free its ``reservation``, release its
    ``allocation`` (an imported part's objects, or a parked lease's): each attribute set
    to None only once its object is gone, so a failure here can be retried."""
    if holder.mapping is not None:
        unmap_owned(transport, holder.mapping, owner)
        holder.mapping = None
    if holder.reservation is not None:
        transport.free(holder.reservation)
        holder.reservation = None
    if holder.allocation is not None:
        transport.release(holder.allocation)
        holder.allocation = None
