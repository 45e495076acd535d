"""Parked leases: a closed part's lease and mapping, kept on its link for the next import
of the same bank (docs/proposals/lease-per-link.md, item 1; ``ImportConfig.park_s``,
off by default).

Why
---

A serving stack imports from the same decode workers again and again. Each import takes
a lease, which is one round trip to the exporter, and maps every rank's bank. A part that
closes while its lease still holds can instead leave both on its link, and the next
import of the same bank adopts them: no request, no fd and no mapping. Across imports
the lease stays what it was. The exporter sees one lease, renewed by the importer's
renewal thread, and a drain ends it as it ends any other: the renewal is refused, and
the parked mapping is unmapped and the lease returned.

What is parked, and when
------------------------

A part parks only when its group closes after use (``unmap_parts``). A rollback returns
every lease, as the group table says. It parks only if its group named no inventory
blocks (``BlockRequest``): a lease that names blocks pins them, and the pins must end
with the import. Its lease must be renewed natively and not about to run out, and its
link must be usable. Each link keeps at
most one parked lease per bank, keyed by (rank, incarnation, handle bytes): the handle
names the memory itself. A second part closing on the same bank closes as before.

Who may adopt it
----------------

A part whose descriptor names that rank, incarnation and handle adopts the parked lease
(:meth:`Parked.fits`). It must also pass the rest of a grant's report check
(:func:`kvstate.share.part._check_report`), except the generation. The descriptor's
generation may be newer than the one the lease was granted for: a re-advertise of the
same memory keeps the lease. It may not be older than the bank's as the last renewal
answer said it (:meth:`Parked.renewing`): such a descriptor takes the ordinary path, where
the exporter refuses it as stale. A re-advertise less than one renewal interval old is
not known yet, so a descriptor it superseded may still adopt in that window. The
descriptor was validated whole before this, as every descriptor is. The adopting part takes the lease, the renewal registration, the mapping
and the mapping's owner token, all in its ``lease`` row, so a rollback of its group
unmaps and returns them as it would its own.

When it ends
------------

A parked lease is dropped (unmapped, then returned) when:

- it was parked for ``park_s`` seconds (the importer's expiry thread sweeps);
- its renewal failed;
- its link's exporter hung up (then it is unmapped only: the exporter ended the lease);
- the importer closes.

A parked mapping is never read. Only an adopting part reads it, after the checks above,
and with T21's check on its loads.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import attrs

from kvstate.core.descriptor import Descriptor
from kvstate.share.owned import let_go

if TYPE_CHECKING:
    from kvstate.share.peers import PeerLink
    from kvstate.share.renewal import Renewal

log = logging.getLogger(__name__)

#: A lease with less than this (or a quarter of its term) left is not parked or adopted:
#: it could run out before its next renewal is heard.
MARGIN_S = 0.25

Key = tuple[int, bytes, bytes]


def key_of(d: Descriptor) -> Key:
    """What a parked lease is filed under: the bank's rank, incarnation and memory."""
    return d.rank, d.incarnation, d.handle


@attrs.define(eq=False)
class Parked:
    """One parked lease and its mapping (see the module docstring)."""

    key: Key
    link: PeerLink
    lease_id: int
    lease_s: float
    renewal_key: int
    renewal: Renewal[Any]
    generation: int     # of the descriptor the lease was granted for
    descriptor: Descriptor  # the one the lease was granted for (decoded descriptors are remembered)
    report: dict[str, Any]  # what the lease's grant checked, for an adopter's own check
    transport: Any
    allocation: Any
    reservation: Any
    mapping: Any
    owner: int          # the token the mapping is owned with (kvstate.share.owned)
    parked_at: float = attrs.field(factory=time.monotonic)

    @property
    def rank(self) -> int:
        return self.key[0]

    def renewing(self, generation: int | None = None) -> bool:
        """The renewal thread last heard a lease with time left, and no failure since; and,
        given a descriptor's ``generation``, of a bank no newer than it (a renewal's answer
        says the bank's)."""
        state = self.renewal.state(self.renewal_key)
        return state is not None and not state.failed \
            and (generation is None or state.generation <= generation) \
            and state.expires_at - time.monotonic() > min(MARGIN_S, self.lease_s / 4)

    def live(self) -> bool:
        """:meth:`renewing`, on a usable link."""
        return self.renewing() and self.link.usable()

    def fits(self, d: Descriptor) -> bool:
        """Whether the part of ``d`` may adopt this lease: the same bank memory, a
        generation no older than the lease's, and the report's other fields as the
        descriptor says (:meth:`renewing` then compares it with the bank's generation)."""
        if d is self.descriptor:  # the same decoded descriptor again (kvstate.core.remembered)
            return True
        return key_of(d) == self.key and d.generation >= self.generation and self.report == self.report_of(d)

    @classmethod
    def report_of(cls, d: Descriptor) -> dict[str, Any]:
        """What :meth:`fits` compares: the fields of a grant's report but the generation."""
        return {"rank": d.rank, "incarnation": d.incarnation.hex(), "geometry": d.geometry.fingerprint().hex(),
                "num_blocks": d.geometry.num_blocks, "device_uuid": d.device_uuid.hex(), "size": d.size}

    def unmap(self) -> None:
        """Unmap, free, release, each forgotten once gone (the renewal goes first: nothing
        renews a lease whose mapping is gone)."""
        self.renewal.remove(self.renewal_key)
        let_go(self.transport, self, self.owner)
