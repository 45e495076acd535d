"""The exporter's lease serving as Python did it before it moved to C (ffi/kvs_lease.c),
kept as the reference the differential test holds the native handler to
(tests/native/test_lease_differential.py).

It is the former ``Exporter._handle``, ``_handle_batch``, ``_handle_mapped``,
``_end_leases`` and ``expire`` over banks driven by the Python
:class:`kvstate.core.machine.Lifecycle` of ``spec/bank.toml``, with the former lease
effects and guards. Connections are plain ids; what the native server does with
sockets (framing, peer credentials, pidfds) is not part of this reference. Holds are
left out: the differential banks export memfds, which are counted (no hold is kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from kvstate import channel as chan
from kvstate.core.errors import ChannelError, KvStateError, TransitionError
from kvstate.core.machine import Lifecycle, effect, guard
from kvstate.core.reasons import ChannelReason
from kvstate.core.spec import load_machine

_REQUEST_FIELDS: dict[str, type] = {"op": str, "rank": int, "lease": int, "generation": int, "incarnation": str}


@attrs.define
class RefLease:
    id: int
    conn: int
    expires_at: float
    expired: bool = False


class RefBank(Lifecycle):
    """A bank with the former Python lease effects; the other effects do nothing."""

    table = load_machine("bank")

    def __init__(self, rank: int, max_leases: int, lease_timeout_s: float) -> None:
        super().__init__(label=f"ref bank[{rank}]")
        self.rank, self.max_leases, self.lease_timeout_s = rank, max_leases, lease_timeout_s
        self.generation = 0
        self.descriptor_ok = False
        self.leases: dict[int, RefLease] = {}

    @guard("accepting_leases")
    def _accepting(self, **kw: Any) -> bool:
        return len(self.leases) < self.max_leases and self.descriptor_ok

    @guard("lease_live")
    def _lease_live(self, *, lease_id: int, **kw: Any) -> bool:
        lease = self.leases.get(lease_id)
        return lease is not None and not lease.expired

    @guard("last_lease")
    def _last_lease(self, *, lease_id: int, **kw: Any) -> bool:
        return set(self.leases) == {lease_id}

    @guard("native_quiescent")
    def _quiescent(self, **kw: Any) -> bool:
        return not self.leases

    @effect("native_register")
    def _register(self, **kw: Any) -> None:
        pass

    @effect("publish_descriptor")
    def _publish(self, **kw: Any) -> None:
        self.generation += 1
        self.descriptor_ok = True

    @effect("grant_lease")
    def _grant(self, *, lease_id: int, conn: int, **kw: Any) -> Callable[[], None]:
        self.leases[lease_id] = RefLease(lease_id, conn, time.monotonic() + self.lease_timeout_s)

        def undo() -> None:
            self.leases.pop(lease_id, None)
        return undo

    @effect("expire_lease")
    def _expire(self, *, lease_id: int, **kw: Any) -> None:
        self.leases[lease_id].expired = True

    @effect("renew_lease")
    def _renew(self, *, lease_id: int, **kw: Any) -> None:
        self.leases[lease_id].expires_at = time.monotonic() + self.lease_timeout_s

    @effect("withdraw_descriptor")
    def _withdraw(self, **kw: Any) -> None:
        self.descriptor_ok = False

    @effect("end_lease")
    def _end(self, *, lease_id: int, **kw: Any) -> None:
        self.leases.pop(lease_id)

    @effect("submit_store")
    def _submit_store(self, **kw: Any) -> None:
        pass

    @effect("collect_store")
    def _collect_store(self, **kw: Any) -> None:
        pass

    @effect("native_release")
    def _release(self, **kw: Any) -> None:
        pass


class RefServer:
    """The former request handling of one exporter, over :class:`RefBank` s."""

    def __init__(self, banks: dict[int, RefBank], incarnation: str, report: Callable[[RefBank], dict[str, Any]],
                 fd: Callable[[RefBank], int | None]) -> None:
        self.banks, self.incarnation, self.report, self.fd = banks, incarnation, report, fd
        self._next = 1

    def serve(self, conn: int, payload: bytes) -> tuple[dict[str, Any] | None, tuple[int, ...]]:
        """One request's answer (None: a notification, not answered) and its fds."""
        request: dict[str, Any] = {}
        try:
            request = chan.decode(payload)
            if request.get("op") == "leases":
                reply, fds = self._handle_batch(conn, request)
            elif request.get("op") == "mapped" and "items" in request:
                reply, fds = self._handle_mapped(conn, request)
            else:
                reply, fds = self._handle(conn, request)
        except KvStateError as exc:
            reply, fds = {"ok": False, "code": exc.reason.value, "detail": str(exc)}, ()
        if request.get("op") == "mapped":
            return None, ()
        return reply, fds

    @staticmethod
    def _refuse(code: str, detail: str) -> tuple[dict[str, Any], tuple[int, ...]]:
        return {"ok": False, "code": code, "detail": detail}, ()

    def _handle(self, conn: int, req: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
        for key, kind in _REQUEST_FIELDS.items():
            if key in req and type(req[key]) is not kind:
                raise ChannelError(ChannelReason.FRAME,
                                   f"request field {key!r} must be {kind.__name__}, not {type(req[key]).__name__}")
        op = req.get("op")
        bank = self.banks.get(req.get("rank", -1))
        if bank is None:
            return self._refuse("unknown_rank", f"no bank for rank {req.get('rank')!r}")
        if op == "lease":
            if req.get("incarnation") != self.incarnation:
                return self._refuse("stale_incarnation", "this exporter restarted since that descriptor")
            if req.get("generation") != bank.generation:
                return self._refuse("stale_generation", f"current generation is {bank.generation}")
            lease_id = self._next
            self._next += 1
            try:
                bank.fire("grant_lease", lease_id=lease_id, conn=conn)
            except TransitionError as exc:
                return self._refuse("not_leasing", str(exc))
            fd = self.fd(bank)
            return {"ok": True, "lease": lease_id, "expires_in_s": bank.leases[lease_id].expires_at - time.monotonic(),
                    "bank": self.report(bank)}, (() if fd is None else (fd,))
        held = bank.leases.get(req.get("lease", -1))
        if held is None or held.conn != conn:
            return self._refuse("unknown_lease", f"no live lease {req.get('lease')!r} on this connection")
        if op == "mapped":
            bank.fire("lease_mapped")
            return {"ok": True}, ()
        if op == "release":
            bank.fire("release_lease", lease_id=held.id)
            return {"ok": True}, ()
        if op == "renew":
            try:
                bank.fire("renew_lease", lease_id=held.id)
            except TransitionError as exc:
                return self._refuse("not_renewing", f"{'expired' if held.expired else bank.state}: {exc}")
            return {"ok": True, "expires_in_s": held.expires_at - time.monotonic()}, ()
        return self._refuse("bad_request", f"unknown op {op!r}")

    def _handle_batch(self, conn: int, req: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
        items = req.get("items")
        if set(req) != {"op", "items"} or not isinstance(items, list) or not items or \
                len(items) > len(self.banks) or not all(isinstance(i, dict) and "op" not in i for i in items):
            raise ChannelError(ChannelReason.FRAME, "leases: items must be lease requests")
        ranks = [i.get("rank") for i in items]
        if any(type(r) is not int for r in ranks) or len(set(ranks)) != len(ranks):
            raise ChannelError(ChannelReason.FRAME, "leases: every item names a different int rank")
        granted: list[tuple[int, int]] = []
        answers: list[dict[str, Any]] = []
        fds: list[int] = []
        try:
            for item in items:
                reply, got = self._handle(conn, {**item, "op": "lease"})
                if not reply.get("ok"):
                    self._return_granted(conn, granted)
                    return {**reply, "rank": item["rank"]}, ()
                granted.append((item["rank"], reply["lease"]))
                answers.append({**reply, "nfds": len(got)})
                fds.extend(got)
        except BaseException:
            self._return_granted(conn, granted)
            raise
        return {"ok": True, "grants": answers}, tuple(fds)

    def _handle_mapped(self, conn: int, req: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
        items = req.get("items")
        if set(req) != {"op", "items"} or not isinstance(items, list) or len(items) > len(self.banks) or \
                not all(isinstance(i, dict) and set(i) == {"rank", "lease"} for i in items):
            raise ChannelError(ChannelReason.FRAME, "mapped: items must be objects of rank and lease")
        for item in items:
            self._handle(conn, {"op": "mapped", **item})
        return {"ok": True}, ()

    def _return_granted(self, conn: int, granted: list[tuple[int, int]]) -> None:
        for rank, lease_id in granted:
            self._handle(conn, {"op": "release", "rank": rank, "lease": lease_id})

    def hang_up(self, conn: int) -> None:
        """The importer on ``conn`` closed its end: its leases end (peer_died)."""
        for bank in self.banks.values():
            for lease in [x for x in list(bank.leases.values()) if x.conn == conn]:
                try:
                    bank.fire("peer_died", lease_id=lease.id)
                except TransitionError:
                    pass

    def expire(self, ahead_s: float) -> None:
        """Every live lease that runs out within ``ahead_s`` expires (lease_expired)."""
        now = time.monotonic() + ahead_s
        for bank in self.banks.values():
            for lease in [x for x in list(bank.leases.values()) if not x.expired and x.expires_at <= now]:
                try:
                    bank.fire("lease_expired", lease_id=lease.id)
                except TransitionError:
                    pass
