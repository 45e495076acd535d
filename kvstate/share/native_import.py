"""The native import: phase 1 and phase 2 of a one-exporter group import on the host
backend in one C call (``kvs_import`` in ``ffi/kvs_import.c``).

Why
---

A group import's phase 1 in Python (the lease request encoded, the answer decoded, each
grant checked, the exporter's report compared, each fd examined, each lease handed to the
renewal thread, each part's ``lease`` row fired) cost more than the attach it admits
(``python -m benchmarks.import_profile``). So when every part of a group is served by one
exporter over a persistent link, one call sends the request, reads the answer and its fds,
fires every part's ``lease`` row of the generated part table (the report and fd checks,
the renewal registration) and, only when every part passed, the ``open`` rows
(:mod:`kvstate.share.attach`'s ``kvs_attach``). The GIL is released throughout.

A rank worker's own part (:class:`~kvstate.share.rank_share.RankShare`) must wait for its
coordinator's ``open`` after its lease, so it takes phase 1 alone (``kvs_import_lease``,
:func:`lease_part`): the part ends ``leased``, holding its received fd as a grant, as the
reference's ``lease`` leaves it, and the native attach opens it later.

What stays the same
-------------------

- Two phases: no part opens before every rank of the group holds a checked lease. A group
  of several exporters keeps the pipelined Python phase 1 (:meth:`Importer._lease_parts`)
  and the per-batch native attach.
- One verdict: C accepts only answers it can take whole, a subset of what the Python
  reference accepts. Anything else (a refusal, an answer it does not read, a mismatched
  report, a bad fd, a failed registration) comes back untouched, nothing registered, and
  the reference path decides it from the same answer and fds, with its own typed errors,
  returning the leases. A failed attach is undone in C, the reference then takes the
  leases as it would have, and the group fails with the attach's error, as before.
- The Python machines are the reference and the observers' view: they are fed the
  outcome afterwards, in one bulk step per group (:meth:`Lifecycle.adopt_all`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

from kvstate import channel as chan
from kvstate.core.descriptor import Descriptor
from kvstate.core.errors import ChannelError, KvStateError, TransitionError
from kvstate.core.remembered import ByIdentity
from kvstate.core.handles import FD_IDENTITY_BYTES, HandleKind
from kvstate.share import attach, peers
from kvstate.share.link import _ns, link_error
from kvstate.share.part import Part, lease_fields
from kvstate.transport import libkvs
from kvstate.transport.host import HostHandle, HostTransport
from kvstate.transport.machines import native_table
from kvstate.transport.native import Native

AnyPart = Part[Any, Any, Any, Any, Any]

#: Fires the reference path's ``lease`` of one part with its grant (Importer._fire_lease).
FireLease = Callable[[AnyPart, "peers.Grant | None", dict[int, Exception]], None]


def eligible(parts: Sequence[AnyPart], transport: object, *, whole: bool = True) -> bool:
    """The native import serves parts that are all plain memfd parts on the host backend,
    reached over one exporter's unix socket; both phases at once only when they are the
    whole group (``whole``)."""
    if not parts or not isinstance(transport, HostTransport) or not attach.usable(transport):
        return False
    address = parts[0].descriptor.socket_path
    return "://" not in address and (not whole or len(parts) == len(parts[0].group.parts)) and all(
        type(p) is Part and p.descriptor.socket_path == address and p.descriptor.handle_kind is HandleKind.MEMFD
        and len(p.descriptor.handle) == FD_IDENTITY_BYTES for p in parts)


@functools.cache
def _lease_guards() -> tuple[tuple[int, Callable[..., bool]], ...]:
    """(bit, guard function) of every guard the part table's ``lease`` rows name."""
    table, bound = native_table("part"), Part.bindings()
    names = dict.fromkeys(g for row in table.spec.rows("lease", "validated") for g in (*row.guards, *row.unless))
    return tuple((table.mask((g,), "guard"), bound[("guard", g)]) for g in names)


#: Each descriptor's ``kvs_import_part``: the report's fields and the fd's identity.
_templates: ByIdentity[bytes] = ByIdentity(1024)
#: Each group's lease request, when it pins no blocks.
_requests: ByIdentity[bytes] = ByIdentity(256)


def _template(nat: Native, d: Descriptor) -> bytes:
    def make(d: Descriptor) -> bytes:
        one = nat.ffi.new("kvs_import_part[]", 1)
        c = one[0]
        c.attach.size = d.size
        c.attach.dev = int.from_bytes(d.handle[:8], "little")
        c.attach.ino = int.from_bytes(d.handle[8:], "little")
        c.rank, c.generation, c.num_blocks = d.rank, d.generation, d.geometry.num_blocks
        c.incarnation = d.incarnation.hex().encode()
        c.geometry = d.geometry.fingerprint().hex().encode()
        c.device_uuid = d.device_uuid.hex().encode()
        return bytes(nat.ffi.buffer(one, nat.ffi.sizeof("kvs_import_part")))
    return _templates.one(d, make)


def _request(parts: Sequence[AnyPart]) -> bytes:
    """The lease request of ``parts`` (one exporter's batch)."""
    if any(p.group.blocks is not None for p in parts):  # pinned blocks: a request of its own
        return peers.lease_payload([lease_fields(p.descriptor, p.group.blocks) for p in parts])
    return _requests.get([p.descriptor for p in parts],
                         lambda descriptors: peers.lease_payload([lease_fields(d, None) for d in descriptors]))


def _array(nat: Native, parts: Sequence[AnyPart], state: int, keys: Sequence[int]) -> libkvs.ImportPartArray:
    """The native call's ``kvs_import_part[]``: each part's template, then what this import
    adds (the part's state, the guard bits of its ``lease`` rows, its renewal key)."""
    arr = nat.ffi.from_buffer("kvs_import_part[]", bytearray(b"".join(_template(nat, p.descriptor) for p in parts)),
                              require_writable=True)
    guards = _lease_guards()
    for i, part in enumerate(parts):
        c = arr[i]
        c.attach.state = state
        c.lease_holds = sum(bit for bit, fn in guards if fn(part))
        c.renew_key = keys[i]
    return arr


def lease_and_open(parts: Sequence[AnyPart], fire_lease: FireLease) -> dict[int, Exception] | None:
    """Both phases of ``parts`` (every part of a group, :func:`eligible`) in one native
    call. Returns the failures by rank (the caller fails the group, whose rollback returns
    every lease), or None when the reference path must run instead (a part a fault moved
    on, or a reused link the exporter had closed: the reference reconnects)."""
    return _native(parts, fire_lease, opening=True)


def lease(parts: Sequence[AnyPart], fire_lease: FireLease) -> dict[int, Exception] | None:
    """Phase 1 only of ``parts`` (:func:`eligible` with ``whole=False``) in one native call
    (``kvs_import_lease``): each part ends ``leased``, holding its received fd for its open.
    Returns as :func:`lease_and_open`."""
    return _native(parts, fire_lease, opening=False)


def lease_part(part: Part[Any, Any, Any, Any, Any]) -> None:
    """Phase 1 of one part on its own (a rank worker's share, whose open waits for its
    coordinator): natively where :func:`eligible`, else ``part.fire("lease")``. Raises what
    that fire raises for the same failure."""
    if eligible([part], part.transport, whole=False):
        failures = lease([part], part.group.importer._fire_lease)
        if failures is not None:
            if part.rank in failures:
                raise failures[part.rank]
            if part.state != "leased":  # a fault moved the part on first: as fire would say
                raise TransitionError.illegal(part.table.name, part.state, "lease")
            return
    part.fire("lease")


def _native(parts: Sequence[AnyPart], fire_lease: FireLease, *, opening: bool) -> dict[int, Exception] | None:
    """:func:`lease_and_open` (``opening``) or :func:`lease`: one path, two C entries."""
    importer = parts[0].group.importer
    transport = importer.transport
    assert isinstance(transport, HostTransport)
    nat, table = transport.native, native_table("part")
    timeout = importer.config.request_timeout_s
    with Part.locked_all(parts), ExitStack() as held:  # a fault waits until the outcome is adopted
        if not all(p.state == "validated" and p.may("lease") for p in parts):
            return None
        try:
            link, reused = importer.peers._take(parts[0].descriptor.socket_path, timeout, fresh=False)
        except Exception as exc:  # as the reference reports a batch it could not send
            return {p.rank: exc for p in parts}
        held.callback(importer.peers.let_go, link)  # the request's hold; each lease takes its own
        payload = _request(parts)
        oversized = peers.too_big(link, payload)
        if oversized is not None:
            return {p.rank: oversized for p in parts}
        try:
            for part in parts:
                importer._watch(part, link.channel)
        except Exception as exc:  # the importer is closing: nothing was asked
            for part in parts:
                importer._unwatch_part(part, link)
            return {p.rank: exc for p in parts}
        renewal = importer.renewal
        reserved = renewal.reserve(parts, link.native) if renewal is not None else None
        keys = reserved[1] if reserved is not None else [0] * len(parts)
        arr = _array(nat, parts, table.states.index("validated"), keys)
        frame = nat.ffi.new("kvs_frame *")
        buf = nat.ffi.new("uint8_t[]", link.native.limits.max_payload)
        frame.buf, frame.cap = buf, link.native.limits.max_payload
        failed = nat.ffi.new("int32_t *")
        renewed_at = time.monotonic()
        renewer = reserved[0] if reserved is not None else nat.ffi.NULL
        if opening:
            rc = _call(nat.lib, link.native.ptr, payload, frame, _ns(timeout), arr, len(parts), renewer,
                       int(renewed_at * 1e9), transport.granularity(), nat.lib.KVS_ACCESS_READ, failed)
        else:
            rc = _call_lease(nat.lib, link.native.ptr, payload, frame, _ns(timeout), arr, len(parts), renewer,
                             int(renewed_at * 1e9), failed)
        if renewal is not None and reserved is not None:
            renewal.settle(keys, registered=rc == nat.lib.KVS_OK)
        if rc == nat.lib.KVS_OK:
            adopt = _adopt if opening else _adopt_leases
            return adopt(parts, link, arr, keys if reserved is not None else None, renewed_at, timeout)
        for part in parts:  # the reference path watches each part it leases itself
            importer._unwatch_part(part, link)
        if rc < 0 and rc != nat.lib.KVS_E_INVAL:  # the request failed; kvs_link_request closed the link
            error = link_error(rc, err=frame.err, frame=frame, pid=link.native.pid, timeout=timeout,
                               limits=link.native.limits, size=len(payload),
                               sending=rc in (nat.lib.KVS_E_LINK_CAP, nat.lib.KVS_E_LINK_TOOBIG,
                                              nat.lib.KVS_E_LINK_SHORT_SEND))
            link.close()
            if error.closed and reused:
                return None  # a stale link: the reference path asks once more, freshly connected
            return {p.rank: error for p in parts}
        if rc not in (nat.lib.KVS_IMPORT_DEFER, nat.lib.KVS_IMPORT_ATTACH):  # a malformed call: nothing was sent
            refused = nat.error(rc, "kvs_import", f"a batch of {len(parts)} part(s)")
            return {p.rank: refused for p in parts}
        msg = chan.Message(bytes(nat.ffi.buffer(buf, frame.len)), tuple(frame.fds[i] for i in range(frame.nfds)))
        failures = _reference(parts, link, msg, fire_lease)
        if rc == nat.lib.KVS_IMPORT_ATTACH:  # C passed phase 1 and undid a failed attach
            for i, part in enumerate(parts):
                if arr[i].attach.left:  # a rollback the native layer refused: the part keeps what is left
                    attach._keep(part, arr[i].attach)
            if not 0 <= failed[0] < len(parts):  # the attach refused its own arguments: the group fails
                refused = nat.error(rc, "kvs_attach", f"a batch of {len(parts)} part(s)")
                return {**failures, **{p.rank: refused for p in parts}}
            bad = parts[failed[0]]
            c = arr[failed[0]].attach
            item = attach.Item(c.fd, bad.descriptor.handle, bad.descriptor.size, "leased", frozenset(), bad.label)
            failures[bad.rank] = attach.error(item, c, transport)
        return failures


def _call(lib: libkvs.Lib, link: libkvs.LinkPtr, payload: bytes, frame: libkvs.FramePtr, timeout_ns: int,
          arr: libkvs.ImportPartArray, n: int, renewer: libkvs.RenewerPtr, renewed_at_ns: int, align: int, access: int,
          failed: libkvs.Int32Ptr) -> int:
    """The one native call (its own function so profiles can name it)."""
    return lib.kvs_import(link, payload, len(payload), frame, timeout_ns, arr, n, renewer, renewed_at_ns, align,
                          access, failed)


def _call_lease(lib: libkvs.Lib, link: libkvs.LinkPtr, payload: bytes, frame: libkvs.FramePtr, timeout_ns: int,
                arr: libkvs.ImportPartArray, n: int, renewer: libkvs.RenewerPtr, renewed_at_ns: int,
                failed: libkvs.Int32Ptr) -> int:
    """The one native call of phase 1 alone."""
    return lib.kvs_import_lease(link, payload, len(payload), frame, timeout_ns, arr, n, renewer, renewed_at_ns, failed)


def _reference(parts: Sequence[AnyPart], link: peers.PeerLink, msg: chan.Message,
               fire_lease: FireLease) -> dict[int, Exception]:
    """Phase 1 of ``parts`` by the Python reference, from the answer the native call read:
    the grants checked (:func:`peers.grants`), then each part's ``lease`` fired with its
    grant; a grant no part took goes back."""
    importer = parts[0].group.importer
    failures: dict[int, Exception] = {}
    items = [lease_fields(p.descriptor, p.group.blocks) for p in parts]
    try:
        made = peers.grants(link, items, msg)
    except peers.RankRefused as exc:  # that rank's failure; the others hold no lease
        return {exc.rank: exc.refusal}
    except (KvStateError, OSError) as exc:
        return {p.rank: exc for p in parts}
    for g in made:  # each grant holds the link until its part takes the hold over
        importer.peers.hold(g.link)
        g.let_go = importer.peers.let_go
    try:
        for part, grant in zip(parts, made):
            fire_lease(part, grant, failures)
    finally:
        for grant in made:
            if not grant.taken:
                grant.give_back()
    return failures


def _adopt(parts: Sequence[AnyPart], link: peers.PeerLink, arr: libkvs.ImportPartArray, keys: list[int] | None,
           renewed_at: float, timeout: float) -> dict[int, Exception]:
    """Every part leased and opened natively: record what each holds, feed the reference
    machines in one step, and tell the exporter the parts are mapped (one message)."""
    importer = parts[0].group.importer
    for i, part in enumerate(parts):
        c = arr[i]
        importer.peers.hold(link)  # each lease holds the link until it is returned
        part._took_natively(link, c.lease, c.expires_ns / 1e9, keys[i] if keys is not None else None, renewed_at,
                            *attach._objects(c.attach, part.descriptor.size))
    try:
        Part.adopt_all(parts, (("lease", "leased"), ("open", "imported")))
    except KvStateError as exc:  # diverged (nothing committed): undo here, as no row of theirs will
        for part in parts:
            part._unmap()
            part._return_lease()
        return {p.rank: exc for p in parts}
    try:
        link.notify(peers.mapped_payload([(p.rank, int(arr[i].lease)) for i, p in enumerate(parts)]), timeout)
    except ChannelError as exc:
        return {p.rank: exc for p in parts}
    return {}


def _adopt_leases(parts: Sequence[AnyPart], link: peers.PeerLink, arr: libkvs.ImportPartArray,
                  keys: list[int] | None, renewed_at: float, timeout: float) -> dict[int, Exception]:
    """Every part leased natively: each takes a grant holding its received fd (as
    :meth:`Part._lease` takes the reference's), and the reference machines are fed."""
    importer = parts[0].group.importer
    for i, part in enumerate(parts):
        c = arr[i]
        importer.peers.hold(link)  # each lease holds the link until it is returned
        grant = peers.Grant(link, part.rank, int(c.lease), c.expires_ns / 1e9, {}, (int(c.attach.fd),), taken=True)
        part._leased_natively(grant, HostHandle(grant.fds[0], part.descriptor.handle),
                              keys[i] if keys is not None else None, renewed_at)
    try:
        Part.adopt_all(parts, (("lease", "leased"),))
    except KvStateError as exc:  # diverged (nothing committed): undo here, as no row of theirs will
        for part in parts:
            part._return_lease()
        return {p.rank: exc for p in parts}
    return {}
