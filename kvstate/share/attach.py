"""The native attach: phase 2 of a group import on the host backend, one C call per
exporter batch (``kvs_attach`` in ``ffi/kvs_attach.c``).

Phase 1 (leases, the exporter's reports, the received fds) is unchanged and complete
before this runs: every rank of the group holds a checked lease. Then, for each exporter
(link), one call fires every part's ``open`` row of the generated part table in C: the
fd checks (identity, memfd, size, seals), the duplicate, reserve, map and ``set_access``,
with the GIL released. If one part fails, C closes every part of the batch it opened
(the table's ``close`` row, its ``unmap_close`` effect), so nothing of the batch stays;
the caller then fails the group, which returns the leases as before.

The Python :class:`~kvstate.share.part.Part` machine stays the reference and the
observers' view: it is fed each committed ``open`` afterwards (:meth:`Lifecycle.adopt`),
deciding nothing. Other transports (CUDA, NIXL) and parts of other kinds keep the Python
path (:meth:`Part._import`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import attrs

from kvstate.core.errors import ImportFailed, KvStateError, NativeError, TransitionError
from kvstate.core.handles import FD_IDENTITY_BYTES, HandleKind
from kvstate.core.reasons import ImportDefect, NativeReason
from kvstate.share import peers
from kvstate.share.part import Part
from kvstate.transport import libkvs
from kvstate.transport.host import HostAllocation, HostHandle, HostMapping, HostReservation, HostTransport
from kvstate.transport.machines import native_table


#: The C step that failed -> the call a refusal names (as the Python path's errors do).
_CALLS = {"IDENTITY": "kvs_attach", "IMPORT": "kvs_import_fd", "RESERVE": "kvs_reserve",
          "MAP": "kvs_map", "ACCESS": "kvs_set_access"}


def usable(transport: object) -> bool:
    """The native attach serves the host backend itself (a wrapper, such as a test's fault
    injector, keeps the Python path it wraps)."""
    return type(transport) is HostTransport


def attachable(part: Part[Any, Any, Any, Any, Any]) -> bool:
    """A plain part on a link, holding a received memfd from phase 1."""
    h = part.handle
    return type(part) is Part and part.link is not None and part.received is not None \
        and isinstance(h, HostHandle) and h.kind is HandleKind.MEMFD and len(h.identity) == FD_IDENTITY_BYTES


@functools.cache
def _guards(state: str) -> tuple[tuple[int, Callable[..., bool]], ...]:
    """(bit, guard function) of every guard the part table's ``open`` rows in ``state``
    name, as C numbers them: the only ones C reads for this call (the rollback's
    ``close`` guards are the batch's own)."""
    table, bound = native_table("part"), Part.bindings()
    names = dict.fromkeys(g for row in table.spec.rows("open", state) for g in (*row.guards, *row.unless))
    return tuple((table.mask((g,), "guard"), bound[("guard", g)]) for g in names)


def _holds(part: Part[Any, Any, Any, Any, Any]) -> int:
    """The guard bits of ``part`` that hold now, evaluated by Python's own guard functions."""
    return sum(bit for bit, fn in _guards(part.state) if fn(part))


@attrs.frozen
class Item:
    """One part of a native batch, as C takes it: the received fd (borrowed), the
    identity its descriptor names, its size, its state in the part table and the guards
    that hold."""

    fd: int
    identity: bytes
    size: int
    state: str
    holds: frozenset[str]
    label: str = "part"


def _call(lib: libkvs.Lib, arr: libkvs.AttachPartArray, n: int, align: int, access: int,
          failed: libkvs.Int32Ptr) -> int:
    """The one native call (its own function so profiles can name it)."""
    return lib.kvs_attach(arr, n, align, access, failed)


def _fill(c: libkvs.AttachPart, fd: int, identity: bytes, size: int, state: int, holds: int) -> None:
    c.fd, c.state, c.holds, c.size = fd, state, holds, size
    c.dev = int.from_bytes(identity[:8], "little")
    c.ino = int.from_bytes(identity[8:], "little")


def run(items: Sequence[Item], transport: HostTransport) -> tuple[libkvs.AttachPartArray, int, int]:
    """The one native call for ``items``: (the C array with what each made, the return
    code, the index of the part that failed or -1)."""
    nat = transport.native
    table = native_table("part")
    arr = nat.ffi.new("kvs_attach_part[]", len(items))
    for i, item in enumerate(items):
        _fill(arr[i], item.fd, item.identity, item.size, table.states.index(item.state), table.mask(item.holds, "guard"))
    failed = nat.ffi.new("int32_t *")
    rc = _call(nat.lib, arr, len(items), transport.granularity(), nat.lib.KVS_ACCESS_READ, failed)
    return arr, rc, failed[0]


def error(item: Item, c: libkvs.AttachPart, transport: HostTransport) -> KvStateError:
    """The typed error of the part that failed: what the Python path raises for the same
    defect (the differential test holds them to it)."""
    lib, table = transport.native.lib, native_table("part")
    step = {lib.KVS_ATTACH_ROW: "ROW", lib.KVS_ATTACH_IDENTITY: "IDENTITY", lib.KVS_ATTACH_IMPORT: "IMPORT",
            lib.KVS_ATTACH_RESERVE: "RESERVE", lib.KVS_ATTACH_MAP: "MAP",
            lib.KVS_ATTACH_ACCESS: "ACCESS"}.get(c.step, "?")
    if step == "ROW":
        if c.code == lib.KVS_E_GUARD:
            refused = tuple(table.guards[g] for g in (c.refused[k] for k in range(c.nrefused)) if g >= 0)
            return TransitionError.guard(table.spec.name, item.state, "open", refused)
        return TransitionError.illegal(table.spec.name, item.state, "open")
    call = _CALLS.get(step, "kvs_attach")
    what = f"{item.label}: fd {item.fd}, size {item.size}"
    if c.code == lib.KVS_E_IDENTITY:
        return ImportFailed.handle(ImportDefect.FD_IDENTITY, f"{what}: the fd is not the file its descriptor names",
                                   call=call, code=c.code)
    if c.code == lib.KVS_E_SYS and step == "IDENTITY":
        return ImportFailed.handle(ImportDefect.FD, f"{what}: the fd cannot be examined (errno {c.err})",
                                   call=call, code=c.code)
    if c.code == lib.KVS_E_SYS:
        return NativeError.native(call, c.code, f"{what}: {transport.native.strerror(c.code)} (errno {c.err})",
                                  NativeReason.OS, errno=c.err)
    return transport.native.error(c.code, call, what)


def attach(parts: Sequence[Part[Any, Any, Any, Any, Any]], transport: HostTransport) -> dict[int, Exception]:
    """Open every part of one exporter batch natively; failures by rank (every other part
    of the batch then still ``leased``, with nothing opened). Parts a fault already moved
    on are left alone, as the Python path leaves them."""
    nat, table = transport.native, native_table("part")
    with ExitStack() as held:
        for part in parts:  # a fault closing a part waits until its outcome is adopted
            held.enter_context(part.locked())
        batch = [p for p in parts if p.may("open")]
        if not batch:
            return {}
        arr = nat.ffi.new("kvs_attach_part[]", len(batch))
        for i, part in enumerate(batch):
            handle = part.handle
            assert isinstance(handle, HostHandle)
            _fill(arr[i], handle.fd, handle.identity, part.descriptor.size, table.states.index(part.state),
                  _holds(part))
        failed = nat.ffi.new("int32_t *")
        rc = _call(nat.lib, arr, len(batch), transport.granularity(), nat.lib.KVS_ACCESS_READ, failed)
        if rc == nat.lib.KVS_OK:
            return _adopt(batch, arr)
        for i, part in enumerate(batch):
            if arr[i].left:  # a rollback the native layer refused: the part keeps what is left
                _keep(part, arr[i])
        if not 0 <= failed[0] < len(batch):
            raise nat.error(rc, "kvs_attach", f"a batch of {len(batch)} part(s)")
        bad = batch[failed[0]]
        assert isinstance(bad.handle, HostHandle)
        item = Item(bad.handle.fd, bad.handle.identity, bad.descriptor.size, bad.state, frozenset(), bad.label)
        return {bad.rank: error(item, arr[failed[0]], transport)}


def open_natively(parts: Sequence[Part[Any, Any, Any, Any, Any]], transport: object) -> tuple[
        dict[int, Exception], list[Part[Any, Any, Any, Any, Any]], list[Part[Any, Any, Any, Any, Any]]]:
    """Phase 2 of ``parts`` natively where it serves them, one call per exporter link.
    Returns the failures by rank, the parts opened here, and the parts left for the
    Python path (none once a batch failed: the group fails, and its rollback returns
    every lease)."""
    if not isinstance(transport, HostTransport) or not usable(transport):
        return {}, [], list(parts)
    by_link: dict[int, list[Part[Any, Any, Any, Any, Any]]] = {}
    rest: list[Part[Any, Any, Any, Any, Any]] = []
    for part in parts:
        if attachable(part):
            by_link.setdefault(id(part.link), []).append(part)
        else:
            rest.append(part)
    failures: dict[int, Exception] = {}
    opened: list[Part[Any, Any, Any, Any, Any]] = []
    for batch in by_link.values():
        failures.update(attach(batch, transport))
        if failures:
            return failures, opened, []
        opened += [p for p in batch if p.state == "imported"]
    return failures, opened, rest


def open_part(part: Part[Any, Any, Any, Any, Any]) -> None:
    """Phase 2 of one part on its own (a rank worker's share): one native call where it
    serves the part, then the ``mapped`` note its exporter waits for; else the Python
    path, ``part.fire("open")``. Raises what that fire raises for the same failure."""
    transport = part.transport
    if not (isinstance(transport, HostTransport) and usable(transport) and attachable(part)):
        part.fire("open")
        return
    grant, link = part.received, part.link
    failures = attach([part], transport)
    if part.rank in failures:
        raise failures[part.rank]
    if part.state != "imported":  # a fault moved the part on first: as fire would say
        raise TransitionError.illegal(part.table.name, part.state, "open")
    if grant is not None and link is not None and grant.report_mapped:
        link.notify(peers.mapped_payload([(part.rank, grant.lease_id)]),
                    part.group.importer.config.request_timeout_s)


def _objects(c: libkvs.AttachPart, size: int) -> tuple[HostAllocation | None, HostReservation | None,
                                                       HostMapping | None]:
    alloc = HostAllocation(c.allocation, size, imported=True) if c.allocation else None
    resv = HostReservation(c.reservation, c.addr, size) if c.reservation else None
    mapping = HostMapping(c.region, c.addr, size, alloc, resv) if c.region and alloc and resv else None
    return alloc, resv, mapping


def _keep(part: Part[Any, Any, Any, Any, Any], c: libkvs.AttachPart) -> None:
    part.allocation, part.reservation, part.mapping = _objects(c, part.descriptor.size)
    part._own()


def _adopt(batch: Sequence[Part[Any, Any, Any, Any, Any]], arr: libkvs.AttachPartArray) -> dict[int, Exception]:
    """Every part opened natively: record its objects, close the received fd (the
    transport holds its duplicate) and feed the reference machine."""
    failures: dict[int, Exception] = {}
    part: Part[Any, Any, Any, Any, Any]
    for i, part in enumerate(batch):
        _keep(part, arr[i])
        grant: peers.Grant | None = part.received
        if grant is not None:
            grant.close_fds()
        part.received = part.handle = None
        try:
            part.adopt("open", "imported")
        except TransitionError as exc:  # diverged: the group fails; return_lease unmaps what it holds
            failures[part.rank] = exc
    return failures
