"""A group's parts adopting parked leases (:mod:`kvstate.share.parked`): phase 1 of an
import without a round trip, for every part whose bank has a lease parked on its link.

:func:`parked`, called by ``Importer._lease_parts``, takes each part's parked lease out of
the table and checks it: the link is polled once per import, however many parts it
serves; the lease must fit the descriptor and still be renewed, for a bank no newer than
the descriptor. A lease that fails a check is dropped (unmapped, returned). When every
part of the group adopts, both phases are done here and the part machines are fed the
``lease`` and ``open`` rows in one step, as after the native import; otherwise each part
that adopts fires its ``lease`` row with the parked lease as its grant, and the others
lease the ordinary way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstate.core.errors import TransitionError
from kvstate.share.parked import Parked, key_of
from kvstate.share.part import Part

if TYPE_CHECKING:
    from kvstate.share.importer import Importer

log = logging.getLogger(__name__)

AnyPart = Part[Any, Any, Any, Any, Any]


def parked(importer: Importer[Any, Any, Any, Any, Any], parts: Sequence[AnyPart],
           failures: dict[int, Exception]) -> list[AnyPart]:
    """The parts of ``parts`` that adopted a parked lease (see the module docstring);
    failures by rank go to ``failures``."""
    found: list[tuple[AnyPart, Parked]] = []
    usable: dict[int, bool] = {}  # a link is polled once, however many parts it serves
    for part in parts:
        d = part.descriptor
        if type(part) is not Part or part.group.blocks is not None:
            continue
        lease = importer.peers.take_parked(d.socket_path, key_of(d))
        if lease is None:
            continue
        link = lease.link
        if id(link) not in usable:
            usable[id(link)] = link.usable()
        if usable[id(link)] and lease.fits(d) and lease.renewing(d.generation):
            found.append((part, lease))
        else:
            importer._drop_parked(lease)
    if found and len(found) == len(parts) == len(parts[0].group.parts):
        return _whole(importer, found, failures)
    adopted: list[AnyPart] = []
    for part, lease in found:
        importer._fire_lease(part, lease, failures)
        if part.lease_id == lease.lease_id and part.link is lease.link and part.state == "leased":
            adopted.append(part)
        elif part.mapping is not lease.mapping:  # not taken (a fault, or refused)
            importer._drop_parked(lease)
    return adopted


def _whole(importer: Importer[Any, Any, Any, Any, Any], found: Sequence[tuple[AnyPart, Parked]],
           failures: dict[int, Exception]) -> list[AnyPart]:
    """Every part of the group adopts: the ``lease`` rows' effects here, the ``open`` rows'
    (nothing: the mappings came along), then :meth:`Lifecycle.adopt_all` feeds the
    machines both rows at once. Their guards hold by construction: the group is importing,
    and every part leases before any is fed ``open``. Anything that fails undoes every
    part (unmapped, returned) and every part fails with it."""
    parts = [part for part, _ in found]
    group = parts[0].group
    taken: list[tuple[AnyPart, Parked]] = []
    try:
        with Part.locked_all(parts):
            if not group.leasing or not all(p.may("lease") for p in parts):
                raise TransitionError.illegal(Part.table.name, parts[0].state, "lease")
            for part, lease in found:
                part._adopt(lease)
                taken.append((part, lease))
            Part.adopt_all(parts, (("lease", "leased"), ("open", "imported")))
            for part in parts:
                part._adopted = False
    except Exception as exc:
        for part, lease in found:
            try:
                if (part, lease) in taken:
                    part._adopted = False
                    part._unmap()
                    part._return_lease()
                else:
                    importer._drop_parked(lease)
            except Exception as undo_failed:  # the others are still undone; the group fails anyway
                log.warning("%s: undoing an adoption failed too (%s)", part.label, undo_failed)
        failures.update((p.rank, exc) for p in parts)
        return []
    return parts
