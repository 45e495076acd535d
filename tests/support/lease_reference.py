"""The exporter's lease serving as Python did it before it moved to C (ffi/kvs_lease_answer.c),
kept as the reference the differential test holds the native handler to
(tests/native/test_lease_differential.py).

It is the former ``Exporter._handle``, ``_handle_batch``, ``_handle_mapped``,
``_end_leases`` and ``expire`` over banks driven by the Python
:class:`kvstate.core.machine.Lifecycle` of ``spec/bank.toml``, with the former lease
effects and guards, and the former ``LeaseServer._lease_blocks``: a lease naming
inventory blocks pinned them with :meth:`Inventory.lease` first (the inventory was only
Python's), then the lease was decided, and its end released them. Connections are plain ids; what the native server does with
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
from kvstate.reuse.inventory import Inventory, LeaseGrant, Stale, refused_by_inventory

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
        self.on_end: Callable[[int], None] = lambda lease_id: None

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
        self.on_end(lease_id)

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
                 fd: Callable[[RefBank], int | None], inventory: Inventory | None = None,
                 epochs: Callable[[RefBank], tuple[int, int]] | None = None) -> None:
        self.banks, self.incarnation, self.report, self.fd = banks, incarnation, report, fd
        self.epochs = epochs  # a bank's block epoch page: (fd, blocks)
        self.inventory = inventory
        self._next = 1
        self._blocks: dict[int, LeaseGrant] = {}  # lease id -> the inventory blocks it pins
        for bank in banks.values():
            bank.on_end = self._ended

    def _ended(self, lease_id: int) -> None:
        grant = self._blocks.pop(lease_id, None)
        if grant is not None and self.inventory is not None:
            self.inventory.release(grant)

    def serve(self, conn: int, payload: bytes) -> tuple[dict[str, Any] | None, tuple[int, ...]]:
        """One request's answer (None: a notification, not answered) and its fds."""
        request: dict[str, Any] = {}
        try:
            request = chan.decode(payload)
            items = request.get("items")
            blocks = request.get("blocks") is not None or (isinstance(items, list) and any(
                isinstance(i, dict) and i.get("blocks") is not None for i in items))
            if blocks and request.get("op") == "lease":
                self._check_fields(request)
            if blocks and request.get("op") in ("lease", "leases"):
                reply, fds = self._lease_blocks(conn, request)
            elif request.get("op") == "leases":
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

    @staticmethod
    def _check_fields(req: dict[str, Any]) -> None:
        for key, kind in _REQUEST_FIELDS.items():
            if key in req and type(req[key]) is not kind:
                raise ChannelError(ChannelReason.FRAME,
                                   f"request field {key!r} must be {kind.__name__}, not {type(req[key]).__name__}")

    def _lease_blocks(self, conn: int, request: dict[str, Any]) -> tuple[dict[str, Any] | None, tuple[int, ...]]:
        """Pin every item's blocks first (the first refusal answers, with its rank in a
        batch), then serve the request without them; a refusal gives the blocks back."""
        batch = request.get("op") == "leases"
        items = request.get("items") if batch else [request]
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ChannelError(ChannelReason.FRAME, "leases: items must be lease requests")
        pinned: list[LeaseGrant] = []
        stripped: list[dict[str, Any]] = []
        for item in items:
            want = item.get("blocks")
            if want is not None:
                got = self._pin_blocks(want)
                if not isinstance(got, LeaseGrant):
                    for g in pinned:
                        self._release_pin(g)
                    return ({**got, "rank": item.get("rank")} if batch else got), ()
                pinned.append(got)
            stripped.append({k: v for k, v in item.items() if k != "blocks"})
        body = {"op": "leases", "items": stripped} if batch else stripped[0]
        reply, fds = self.serve(conn, chan.encode(body))
        grants = (reply or {}).get("grants") if batch else [reply]
        if not (reply or {}).get("ok") or not isinstance(grants, list):
            for g in pinned:
                self._release_pin(g)
            return reply, fds
        at = 0
        for item, grant in zip(items, grants):
            if item.get("blocks") is not None:
                self._blocks[int(grant["lease"])] = pinned[at]
                at += 1
        return reply, fds

    def _pin_blocks(self, want: Any) -> LeaseGrant | dict[str, Any]:
        if self.inventory is None:
            return {"ok": False, "code": "no_inventory", "detail": "this exporter keeps no retained inventory"}
        try:
            result = self.inventory.lease(want["group"], want["epoch"], want["hashes"])
        except (KvStateError, KeyError, TypeError) as exc:
            if isinstance(exc, KvStateError) and not refused_by_inventory(exc):
                raise
            return {"ok": False, "code": "bad_request", "detail": f"blocks: {exc}"}
        if isinstance(result, Stale):
            return {"ok": False, "code": "stale_inventory", "detail": f"{result.reason.value}: recompute"}
        return result

    def _release_pin(self, grant: LeaseGrant) -> None:
        assert self.inventory is not None
        self.inventory.release(grant)

    def _handle(self, conn: int, req: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
        self._check_fields(req)
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
        if op == "block_epochs":
            if self.epochs is None:
                return self._refuse("no_epochs", f"no epoch page for rank {req['rank']} on this connection")
            page_fd, blocks = self.epochs(bank)
            return {"ok": True, "blocks": blocks, "entry_bytes": 8}, (page_fd,)
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
            return {"ok": True, "expires_in_s": held.expires_at - time.monotonic(), "generation": bank.generation}, ()
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
