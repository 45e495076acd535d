"""Lease renewal without the GIL: the importer's native renewal thread (``ffi/kvs_renew.c``).

Why
---

An importer keeps a lease only while it renews it. Engines hold the GIL for long
stretches, and a renewal that waits for Python waits for them: with a 1 s lease, an
importer that held its GIL for 3 s lost its leases (the exporter expired them and the
bank drained) although it lived the whole time. So renewal runs in C: one thread per
importer owns, for every lease on a persistent link, (link, rank, lease id, term,
renewed_at), and renews each once ``min(term / 2, renew_interval_s)`` has passed, with
exactly the frame Python sent (``{"lease":N,"op":"renew","rank":R}``) on the link's
own mutex (:mod:`kvstate.share.link`).

What Python keeps
-----------------

The group machine. A refused or failed renewal is queued by the thread and signalled on
an eventfd (:meth:`Renewal.fileno`); the importer's expiry thread takes the outcomes
(:meth:`Renewal.take`) and faults the part's owner (``expired`` for a group) with the
reason Python's own renewal would have given (:func:`failure`). Parts register at their
grant and unregister when their lease is returned; the expiry they see
(:meth:`Renewal.state`) is the one the thread last heard from the exporter.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs

from kvstate import channel as chan
from kvstate.core.args import need_items
from kvstate.core.errors import ChannelError, ImportFailed, KvStateError
from kvstate.core.reasons import ChannelReason, ImportReason
from kvstate.share.parked import Parked
from kvstate.share.peers import Grant, PeerLink, Peers
from kvstate.share.import_config import ImportConfig
from kvstate.share.link import NativeLink, link_error
from kvstate.transport import libkvs
from kvstate.transport.protocol import A, E, H, M, R

if TYPE_CHECKING:
    from kvstate.share.importer import Group
    from kvstate.share.part import Part

log = logging.getLogger(__name__)

P = TypeVar("P")

#: Outcomes taken per call (the C queue holds more; the eventfd stays readable).
_TAKE = 64


@attrs.frozen
class RenewState:
    """One registered lease as the renewal thread last left it (``time.monotonic`` seconds)."""

    renewed_at: float
    expires_at: float
    renewals: int
    failed: bool
    generation: int = -1  # the bank's, as the last renewal said (-1: not said yet)


def failure(code: int, reply: bytes, err: int, *, pid: int = 0, timeout: float = 0.0) -> KvStateError:
    """The error Python's renewal would have raised for one outcome of the thread: the
    exporter's refusal (ImportFailed REFUSED, with its code), a malformed answer, or the
    link's ChannelError."""
    _, lib = libkvs.load()
    if code != lib.KVS_RENEW_REFUSED:
        return link_error(code, err=err, pid=pid, timeout=timeout)
    try:
        answer = chan.decode(reply)
    except ChannelError as exc:
        return exc
    if not answer.get("ok"):
        return ImportFailed.lease_refused(str(answer.get("code")), str(answer.get("detail")))
    return ImportFailed.lease_refused("malformed", f"malformed renewal {answer!r:.200}")


class Renewal(Generic[P]):
    """One native renewal thread and the parts (``P``) it renews, by registration key."""

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        ffi, lib = libkvs.load()
        self._ffi, self._lib = ffi, lib
        self.timeout_s = timeout_s
        ptr = lib.kvs_renewer_start(int(interval_s * 1e9), int(timeout_s * 1e9))
        if ptr == ffi.NULL:
            raise ChannelError(ChannelReason.FAILED, f"cannot start the lease renewal thread: errno {ffi.errno}")
        self._ptr: libkvs.RenewerPtr | None = ptr
        self._fd = lib.kvs_renewer_fd(ptr)
        self._lock = threading.Lock()  # keeps every call off a stopped thread
        self._idle = threading.Condition(self._lock)
        self._users = 0  # native imports registering leases right now (close waits for them)
        self._parts: dict[int, tuple[P, int]] = {}  # key -> (part, peer pid)
        self._next = 0
        self._state = ffi.new("kvs_renew_state *")  # state()'s answer, filled under the lock

    def fileno(self) -> int:
        """An eventfd, readable while outcomes wait to be taken."""
        return self._fd

    def add(self, part: P, link: NativeLink, rank: int, lease_id: int, term_s: float, renewed_at: float) -> int | None:
        """Renew ``lease_id`` of ``rank`` on ``link`` from now on; the key to remove it,
        or None when the thread is stopped (the importer is closing)."""
        with self._lock:
            if self._ptr is None:
                return None
            self._next += 1
            key = self._next
            rc = self._lib.kvs_renewer_add(self._ptr, link.ptr, key, rank, lease_id, max(1, int(term_s * 1e9)),
                                           int(renewed_at * 1e9))
            if rc:
                raise ChannelError(ChannelReason.FAILED, f"cannot register lease {lease_id} for renewal (code {rc})")
            self._parts[key] = (part, link.pid)
            return key

    def reserve(self, parts: Sequence[P], link: NativeLink) -> tuple[libkvs.RenewerPtr, list[int]] | None:
        """Keys for ``parts``' leases on ``link``, for a native import that registers them
        itself (``kvs_import``): the thread's pointer and the keys, or None when the
        thread is stopped. The thread stays up until :meth:`settle` (close waits)."""
        with self._lock:
            if self._ptr is None:
                return None
            keys = list(range(self._next + 1, self._next + 1 + len(parts)))
            self._next += len(parts)
            for key, part in zip(keys, parts):
                self._parts[key] = (part, link.pid)
            self._users += 1
            return self._ptr, keys

    def settle(self, keys: Sequence[int], *, registered: bool) -> None:
        """End a :meth:`reserve`: the keys stay (the native call registered them) or go."""
        with self._lock:
            self._users -= 1
            if not registered:
                for key in keys:
                    self._parts.pop(key, None)
            self._idle.notify_all()

    def retarget(self, key: int, part: P) -> None:
        """Whom an outcome of ``key`` is for from now on (a parked lease, or its adopter)."""
        with self._lock:
            entry = self._parts.get(key)
            if entry is not None:
                self._parts[key] = (part, entry[1])

    def remove(self, key: int) -> None:
        with self._lock:
            self._parts.pop(key, None)
            if self._ptr is not None:
                self._lib.kvs_renewer_remove(self._ptr, key)

    def state(self, key: int) -> RenewState | None:
        with self._lock:
            if self._ptr is None:
                return None
            out = self._state
            if self._lib.kvs_renewer_state(self._ptr, key, out):
                return None
            return RenewState(out.renewed_at_ns / 1e9, out.expires_at_ns / 1e9, out.renewals, bool(out.failed),
                              out.generation)

    def take(self) -> list[tuple[P, KvStateError]]:
        """The parts whose renewal failed since the last call, with what failed."""
        with self._lock:
            if self._ptr is None:
                return []
            out = self._ffi.new("kvs_renew_outcome[]", _TAKE)
            n = self._lib.kvs_renewer_take(self._ptr, out, _TAKE)
            lost: list[tuple[P, Any]] = []
            for i in range(n):
                o = out[i]
                entry = self._parts.get(o.key)
                if entry is not None:
                    lost.append((entry[0], (o.code, bytes(self._ffi.buffer(o.reply, o.len)), o.err, entry[1])))
        return [(part, failure(code, reply, err, pid=pid, timeout=self.timeout_s))
                for part, (code, reply, err, pid) in lost]

    def close(self) -> None:
        """Stop the thread (idempotent): no lease is renewed after this."""
        with self._lock:
            ptr, self._ptr = self._ptr, None
            self._parts.clear()
            while self._users:  # a native import still registering on it
                self._idle.wait()
        if ptr is not None:
            self._lib.kvs_renewer_stop(ptr)


class LeaseKeeping(Generic[H, A, R, M, E]):
    """The half of :class:`~kvstate.share.importer.Importer` that keeps its leases: it
    hears exporters go (a watcher on every link), takes the renewal thread's outcomes, and
    expires what ran out. Its expiry thread wakes on the renewal eventfd, or every 50 ms."""

    config: ImportConfig
    groups: list[Group[H, A, R, M, E]]
    peers: Peers
    renewal: Renewal[Part[H, A, R, M, E]] | None
    _watcher: chan.Watcher
    _owners: dict[int, dict[int, Part[H, A, R, M, E]]]  # parts by the id of the channel their lease is on
    _watched: set[int]  # ids of the channels the watcher watches
    _owners_lock: threading.Lock
    _stopping: threading.Event

    # -- fault detection ------------------------------------------------------------------

    def _watch(self, part: Part[H, A, R, M, E], ch: chan.Channel) -> None:
        """Hear when the exporter of ``part`` goes: its channel ``ch`` is watched once,
        however many parts hold leases on it. Raises, changing nothing, when the watcher
        is closed (the importer is closing)."""
        with self._owners_lock:
            first = id(ch) not in self._watched
            if first:  # a link stays watched while it is open, used or not: no watcher wake-up per import
                try:
                    self._watcher.watch(ch, self._peer_closed)
                except ChannelError as exc:
                    if not exc.closed:
                        raise
                    # this importer closes: not the exporter's doing
                    raise ImportFailed.wrap(part.rank, exc, ImportReason.INTERRUPTED) from exc
                self._watched.add(id(ch))
            self._owners.setdefault(id(ch), {})[id(part)] = part

    def _unwatch(self, ch: chan.Channel) -> None:
        with self._owners_lock:
            self._owners.pop(id(ch), None)
            self._watched.discard(id(ch))
        self._watcher.unwatch(ch)

    def _unwatch_part(self, part: Part[H, A, R, M, E], link: PeerLink) -> None:
        """``part`` let go of its lease on ``link`` (the link stays watched while open)."""
        with self._owners_lock:
            owners = self._owners.get(id(link.channel))
            if owners is not None:
                owners.pop(id(part), None)

    def _peer_closed(self, ch: chan.Channel) -> None:
        for parked in self.peers.take_parked_where(lambda p: p.link.channel is ch):
            self._drop_parked(parked, release=False)  # the exporter ended the lease
        self.peers.forget(ch)
        with self._owners_lock:
            owners = self._owners.pop(id(ch), {})
            self._watched.discard(id(ch))
        for part in owners.values():
            part.group.peer_closed(part)

    # -- parked leases (kvstate.share.parked) ------------------------------------------------

    def _drop_parked(self, parked: Parked, *, release: bool = True) -> None:
        """Unmap a parked lease's mapping, then return the lease (``release``) and let go of
        its link. A mapping that does not unmap keeps its lease: the link's close ends it."""
        try:
            parked.unmap()
        except Exception as exc:
            log.warning("%s: a parked lease of rank %d does not unmap (%s); its lease stays until the link "
                        "closes", parked.link.address, parked.rank, exc)
        else:
            if release and not parked.link.closed:
                parked.link.release(parked.rank, parked.lease_id)
        self.peers.let_go(parked.link)

    def _sweep_parked(self) -> None:
        """Drop the leases parked for ``park_s`` or more, and those no longer live."""
        due = time.monotonic() - self.config.park_s
        for parked in self.peers.take_parked_where(lambda p: p.parked_at <= due or not p.live()):
            self._drop_parked(parked)

    # -- renewal and expiry ---------------------------------------------------------------

    def _renew_natively(self, part: Part[H, A, R, M, E], grant: Grant) -> int | None:
        """Hand ``part``'s fresh lease to the renewal thread: its key, or None when
        renewal stays with Python (``ImportConfig.native_renewal`` off, or closing)."""
        if self.renewal is None:
            return None
        return self.renewal.add(part, grant.link.native, grant.rank, grant.lease_id, grant.expires_in_s,
                                time.monotonic())

    def _expire_loop(self) -> None:
        renewal = self.renewal
        outcomes = select.poll()
        if renewal is not None:  # an outcome of the renewal thread wakes this at once
            outcomes.register(renewal.fileno(), select.POLLIN)
        while not self._stopping.is_set():
            if renewal is None:
                self._stopping.wait(0.05)
            else:
                try:
                    outcomes.poll(50)
                except OSError:  # ENOMEM: wait the round out instead
                    self._stopping.wait(0.05)
            if self._stopping.is_set():
                break
            self._sweep_parked()
            self.peers.close_idle()
            live = [g for g in self.groups if g.state in ("importing", "ready", "draining", "quiescent")]
            try:
                self.renew_leases(live)
                self.expire_leases([g for g in live if g.state == "ready"])
                for group in live:  # a group that lost a lease lets go of the bank promptly
                    if group.expired_at is not None:
                        group.settle()
            except KvStateError:
                pass  # the group moved on concurrently; the next round looks again

    def renew_leases(self, groups: Iterable[Group[H, A, R, M, E]]) -> list[Group[H, A, R, M, E]]:
        """Fault the owner of every part whose renewal failed: the renewal thread's
        outcomes for parts on links (every owner hears, among ``groups`` or not), and, for
        parts that renew in Python, a renewal sent here once half its term or
        ``renew_interval_s`` has passed since its grant or last renewal (the expiry thread
        calls this every 50 ms). A renewal the exporter refuses, or cannot answer, is the
        group's ``expired`` fault, with the reason: the group drains, then unmaps and
        returns its leases. Returns the groups of ``groups`` that faulted."""
        from kvstate.share.importer import Group  # it imports this module
        groups = need_items("groups", groups, Group)
        faulted: list[Group[H, A, R, M, E]] = []
        for part, exc in self.renewal.take() if self.renewal is not None else []:
            if isinstance(part, Parked):  # nobody reads its mapping: it goes, if still filed
                for parked in self.peers.take_parked_where(lambda p: p is part):
                    self._drop_parked(parked)  # returned too: a refusal of that is harmless
                continue  # an adopter that took it meanwhile saw the failure (Part._adopt)
            owner = part.group
            if owner.lease_lost(part, f"{part.label}: lease renewal failed: {exc}") and \
                    any(owner is g for g in groups) and not any(owner is g for g in faulted):
                faulted.append(owner)  # type: ignore[arg-type]  # it is one of ``groups``
        every = self.config.renew_interval_s
        group: Group[H, A, R, M, E]
        for group in groups:
            for part in list(group.parts):
                if part.channel is None or part.renewal_key is not None or \
                        time.monotonic() - part.renewed_at < min(part.lease_s / 2, every):
                    continue
                try:
                    part.renew()
                except KvStateError as exc:
                    if group.fault("expired", reason=f"{part.label}: lease renewal failed: {exc}") and \
                            group not in faulted:
                        faulted.append(group)
                    break
        return faulted

    def expire_leases(self, groups: Iterable[Group[H, A, R, M, E]]) -> list[Group[H, A, R, M, E]]:
        """Fire ``expired`` on every group holding a lease past its expiry; return them."""
        from kvstate.share.importer import Group  # it imports this module
        groups = need_items("groups", groups, Group)
        now = time.monotonic()
        expired: list[Group[H, A, R, M, E]] = []
        group: Group[H, A, R, M, E]
        for group in groups:
            late = [p.label for p in group.parts if p.lease_id is not None and p.lease_expires_at <= now]
            if late and group.fault("expired", reason=f"lease of {', '.join(late)} ran out unrenewed"):
                expired.append(group)
        return expired
