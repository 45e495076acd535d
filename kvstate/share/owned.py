"""Mappings a part or a bank owns: claimed with the owner's token once they are made
(:meth:`~kvstate.transport.protocol.MappedTransport.own`), so that nobody else can unmap
them or change their access while the owner still counts on them (``Busy``, ``OWNED``:
``transport.unmap(part.mapped())`` is refused, and the part closes as it would have).
Only the owner, which knows its token, gives one up, just before it unmaps it."""

from __future__ import annotations

import secrets
from typing import Any

from kvstate.transport.protocol import MappedTransport

AnyTransport = MappedTransport[Any, Any, Any, Any, Any]


def new_owner() -> int:
    """A token of one owner: nonzero, and not one another owner can guess."""
    return secrets.randbits(63) + 1


def unmap_owned(transport: AnyTransport, mapping: Any, owner: int) -> None:
    """Unmap the owner's own mapping. A refused unmap (pinned, say) leaves it owned, so a
    retry finds it as it was."""
    transport.disown(mapping, owner)
    try:
        transport.unmap(mapping)
    except BaseException:
        transport.own(mapping, owner)
        raise
