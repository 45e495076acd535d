"""The native import (ffi/kvs_import.c, kvstate/share/native_import.py): one C call leases,
checks and attaches a one-exporter group on the host backend.

Against a scripted exporter (a real unix socket, real sealed memfds sent by SCM_RIGHTS),
every answer is imported twice, by the native call and by the Python reference (phase 1
in Python, then the native attach), and both must agree:

- differential: the same verdict (error type, reason, code) on every bad answer class:
  a refusal naming a rank, malformed grants, each field of the exporter's report wrong,
  a wrong or unsealed fd, a memfd of the wrong size (found by the attach, after phase 1);
- rollback: after a failure nothing is mapped or held (native objects, fds), no lease is
  left with the renewal thread, and every lease the exporter granted was released;
- two phases: a rank that fails phase 1 means no part opened (the verdict is phase 1's,
  at tp=3 with the last rank bad, not an open refused part way);
- success: the group is ready, each lease is renewed by the native thread, and draining
  returns every lease.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvstate import channel as chan
from kvstate.core.descriptor import encode
from kvstate.core.errors import ChannelError, KvStateError
from kvstate.core.handles import HandleKind
from kvstate.core.reasons import ChannelReason
from kvstate.share import native_import
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostTransport

from support.descriptors import DEPLOYMENT, DEVICE, GEOMETRY, GRANULARITY, INCARNATION, descriptor
from support.reuse import REUSE_ON
from support.waiting import wait_until

pytestmark = pytest.mark.native

SIZE = GEOMETRY.bank_size(GRANULARITY)
Reply = Callable[[list[dict[str, Any]], list[int]], tuple[Any, list[int]]]


class FakeExporter:
    """Answers the first lease request with what ``reply`` makes of the true grants and
    the memfds; then grants renewals and releases, and records every request."""

    def __init__(self, reply: Reply, fds: list[int]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvs-nimp-"))
        self.dir.chmod(0o700)
        self.path = str(self.dir / "fake.sock")
        self.server = chan.Server(self.path)
        self.reply, self.fds = reply, fds
        self.requests: list[dict[str, Any]] = []
        self.granted: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            with self.server.accept(timeout=10.0) as ch:
                while not self.stop.is_set():
                    try:
                        with ch.recv(timeout=0.05) as msg:
                            req = chan.decode(msg.payload)
                    except ChannelError as exc:
                        if exc.reason is ChannelReason.TIMEOUT:
                            continue
                        return
                    self.requests.append(req)
                    if req["op"] in ("lease", "leases"):
                        items = req["items"] if req["op"] == "leases" else [req]
                        grants = [self._grant(item, 100 + i) for i, item in enumerate(items)]
                        answer, fds = self.reply(grants, self.fds)
                        if isinstance(answer, dict) and answer.get("ok"):
                            self.granted += [g["lease"] for g in grants]
                        ch.send(answer if isinstance(answer, bytes) else chan.encode(answer), fds)
                    elif req["op"] == "renew":
                        ch.send(chan.encode({"ok": True, "expires_in_s": 5}))
                    elif req["op"] == "release":
                        ch.send(chan.encode({"ok": True}))
        except KvStateError:
            pass

    @staticmethod
    def _grant(item: dict[str, Any], lease: int) -> dict[str, Any]:
        return {"bank": {"rank": item["rank"], "generation": 3, "incarnation": INCARNATION.hex(),
                         "geometry": GEOMETRY.fingerprint().hex(), "num_blocks": GEOMETRY.num_blocks,
                         "device_uuid": DEVICE.hex(), "size": SIZE},
                "expires_in_s": 5.0, "lease": lease, "ok": True}

    def released(self) -> list[int]:
        return sorted(r["lease"] for r in self.requests if r["op"] == "release")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.server.close()


def batched(grants: list[dict[str, Any]], fds: list[int]) -> tuple[Any, list[int]]:
    """The answer a real exporter gives: the single form at tp=1, else every grant."""
    if len(grants) == 1:
        return grants[0], fds
    return {"grants": [{**g, "nfds": 1} for g in grants], "ok": True}, fds


def report(field: str, value: Any) -> Reply:
    def make(grants: list[dict[str, Any]], fds: list[int]) -> tuple[Any, list[int]]:
        grants[-1]["bank"][field] = value
        return batched(grants, fds)
    return make


def swap_fd(fd_of: Callable[[], int]) -> Reply:
    def make(grants: list[dict[str, Any]], fds: list[int]) -> tuple[Any, list[int]]:
        return batched(grants, fds[:-1] + [fd_of()])
    return make


def no_report(fd_of: Callable[[], int] | None = None) -> Reply:
    def make(grants: list[dict[str, Any]], fds: list[int]) -> tuple[Any, list[int]]:
        for g in grants:
            g["bank"] = None
        return batched(grants, fds if fd_of is None else fds[:-1] + [fd_of()])
    return make


def memfd(size: int, sealed: bool) -> int:
    fd = os.memfd_create("kvs-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


@pytest.fixture
def extra_fds() -> Iterator[list[int]]:
    made: list[int] = []
    yield made
    for fd in made:
        os.close(fd)


def cases(extra: list[int]) -> dict[str, Reply]:
    def fd(size: int, sealed: bool) -> Callable[[], int]:
        def make() -> int:
            extra.append(memfd(size, sealed))
            return extra[-1]
        return make
    return {
        "good": batched,
        "good_unreported": no_report(),
        "refused_rank": lambda g, f: ({"ok": False, "code": "stale_generation", "detail": "no", "rank": len(g) - 1},
                                      []),
        "refused": lambda g, f: ({"ok": False, "code": "draining", "detail": "no"}, []),
        "nfds_lie": lambda g, f: (({"grants": [{**x, "nfds": 1 if i else 2} for i, x in enumerate(g)], "ok": True},
                                   f) if len(g) > 1 else (g[0], f + f)),  # tp=1: two fds for one grant
        "expires_negative": lambda g, f: batched([{**x, "expires_in_s": -1} for x in g], f),
        "not_json": lambda g, f: (b"not json", f),
        "report_rank": report("rank", 7),
        "report_generation": report("generation", 4),
        "report_incarnation": report("incarnation", (b"J" * 16).hex()),
        "report_geometry": report("geometry", "00" * 16),
        "report_num_blocks": report("num_blocks", 17),
        "report_device_uuid": report("device_uuid", (b"E" * 16).hex()),
        "report_size": report("size", SIZE + 4096),
        "report_not_object": lambda g, f: batched([{**x, "bank": [1]} for x in g], f),
        "fd_other_file": swap_fd(fd(SIZE, True)),
        "fd_unsealed": swap_fd(fd(SIZE, False)),
        "fd_wrong_size": batched,  # the last bank is larger than its descriptor says: phase 1 passes, the attach refuses
    }


def verdict(exc: BaseException | None) -> tuple[Any, ...] | None:
    if exc is None:
        return None
    assert isinstance(exc, KvStateError), f"untyped {exc!r}"
    # `call` (of the cause the group's error wraps) names the step that refused a received
    # fd: phase 1's receive_handle, or the attach's kvs_attach / kvs_import_fd
    cause = getattr(exc, "cause", None)
    return (type(exc), getattr(exc, "reason", None), getattr(exc, "code", None), getattr(exc, "defect", None),
            getattr(exc, "rank", None), None if cause is None else verdict(cause),
            getattr(exc, "call", None), getattr(exc, "native_code", None))


def held(t: HostTransport) -> tuple[int, int, int]:
    s = t.native.stats()
    return s.allocations, s.reservations, s.regions


@contextmanager
def importer_under_test(monkeypatch: pytest.MonkeyPatch, native: bool,
                        entry: str) -> Iterator[tuple[Importer[Any, Any, Any, Any, Any], HostTransport, list[int]]]:
    """An importer, its transport, and the calls of the native ``entry`` (``_call`` or
    ``_call_lease``), counted; or, unless ``native``, with the native path refused so that
    the Python reference serves every part."""
    calls: list[int] = []
    real = getattr(native_import, entry)
    with monkeypatch.context() as m:
        if native:
            m.setattr(native_import, entry, lambda *a: calls.append(1) or real(*a))
        else:
            m.setattr(native_import, "eligible", lambda *a, **k: False)
        t = HostTransport(granularity=GRANULARITY)
        yield Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, request_timeout_s=2.0, renew_interval_s=0.05), t), \
            t, calls


def mapped_notes(fake: FakeExporter) -> list[dict[str, Any]]:
    """The ``mapped`` notes the fake exporter read, once it read one (a notification has no
    answer to wait for)."""
    wait_until(lambda: any(r["op"] == "mapped" for r in fake.requests), 5.0)
    return [r for r in fake.requests if r["op"] == "mapped"]


def run(reply: Reply, tp: int, native: bool, monkeypatch: pytest.MonkeyPatch, last_size: int = SIZE) -> dict[str, Any]:
    """One import of a tp-part group against a fake exporter answering with ``reply``
    (the last rank's memfd ``last_size`` bytes)."""
    exporting = HostTransport(granularity=GRANULARITY)
    allocations = [exporting.create(SIZE if r < tp - 1 else last_size) for r in range(tp)]
    handles = [exporting.export(a, HandleKind.MEMFD) for a in allocations]
    fake = FakeExporter(reply, [h.fd for h in handles])
    with importer_under_test(monkeypatch, native, "_call") as (im, t, calls):
        before = held(t)
        out: dict[str, Any] = {"calls": calls}
        try:
            wire = [encode(descriptor(rank=r, tp=tp, socket_path=fake.path, handle=handles[r].identity), DEPLOYMENT)
                    for r in range(tp)]
            try:
                group = im.import_group(wire, incarnations=None)
            except KvStateError as exc:
                out["error"] = exc
                group = im.groups[-1]
            out["state"] = group.state
            renewal = im.renewal
            assert renewal is not None
            out["renewed"] = [renewal.state(k) for k in range(1, renewal._next + 1)]
            if group.state == "ready":
                out["mapped"] = mapped_notes(fake)
                group.drain(5.0)
            out["unmapped"] = all(p.mapping is None and p.allocation is None and p.reservation is None
                                  and p.received is None for p in group.parts)
            out["held"] = held(t) == before
            out["renewed_after"] = [renewal.state(k) for k in range(1, renewal._next + 1)]
        finally:
            im.close()
            fake.close()
            for a in allocations:
                exporting.release(a)
        out["granted"], out["released"] = sorted(fake.granted), fake.released()
        return out


CASES = list(cases([]))


@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_the_native_import_and_the_reference_agree(case: str, tp: int, extra_fds: list[int],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    reply = cases(extra_fds)[case]
    last = SIZE + GRANULARITY if case == "fd_wrong_size" else SIZE
    native = run(reply, tp, True, monkeypatch, last)
    reference = run(reply, tp, False, monkeypatch, last)
    assert native["calls"] == [1], "the native path served the group"
    assert verdict(native.get("error")) == verdict(reference.get("error")), (native.get("error"),
                                                                             reference.get("error"))
    assert native["state"] == reference["state"]
    for out in (native, reference):
        assert out["unmapped"] and out["held"], "a failed or drained group keeps nothing"
        assert all(s is None for s in out["renewed_after"]), "no lease is left with the renewal thread"
        assert out["released"] == out["granted"], "every lease granted went back"
    if case.startswith("good"):
        assert native["state"] == "ready"
        assert len(native["mapped"]) == 1 and native["mapped"] == reference["mapped"], "one mapped note"
        assert all(s is not None for s in native["renewed"]), "each lease was registered for renewal"
    else:
        assert native["state"] == "failed"


def test_adopt_all_checks_every_path_before_it_commits_any() -> None:
    """Lifecycle.adopt_all, how the native import feeds a group's Part machines: every
    object's path must be rows its table declares, else nothing is committed."""
    from kvstate.core.errors import ArgumentInvalid, TransitionError
    from kvstate.core.machine import Lifecycle
    from kvstate.share.part import Part

    seen: list[Any] = []
    parts: list[Any] = []
    for r in range(2):
        p: Any = Part.__new__(Part)  # the machine alone (adopt runs no effect)
        Lifecycle.__init__(p, label=f"g/part[{r}]", observers=[seen.append])
        parts.append(p)
    parts[1].adopt("validate", "validated")
    seen.clear()
    steps = (("lease", "leased"), ("open", "imported"))
    with pytest.raises(TransitionError):
        Part.adopt_all(parts, steps)  # part 0 is still `received`: lease is not declared there
    assert [p.state for p in parts] == ["received", "validated"] and not seen
    parts[0].adopt("validate", "validated")
    seen.clear()
    Part.adopt_all(parts, steps)
    assert [p.state for p in parts] == ["imported", "imported"]
    assert [(c.label, c.event, c.source, c.dest) for c in seen] == [
        (f"g/part[{r}]", e, s, d) for r in range(2) for e, s, d in
        (("lease", "validated", "leased"), ("open", "leased", "imported"))]
    for _ in range(2):  # the second verdict is the remembered path's: the same
        with pytest.raises(TransitionError, match="'open' is not declared in state 'closed'"):
            Part.adopt_all(parts, (("close", "closed"), ("open", "imported")))  # diverges at its second step
    assert [p.state for p in parts] == ["imported", "imported"]
    with pytest.raises(ArgumentInvalid):
        Part.adopt_all(parts, [("close",)])
    with pytest.raises(ArgumentInvalid):
        Part.adopt_all([object()], steps)


def test_a_group_s_lease_request_is_remembered_only_while_it_pins_no_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native import remembers a group's encoded lease request by its descriptors, and
    each part's C fields by its descriptor. A request naming pinned blocks is made afresh
    (the epochs and hashes are the caller's), and the one without them comes back after it.
    Each import's parts report their own ranks' leases."""
    from kvstate.share.importer import BlockRequest

    tp = 2
    exporting = HostTransport(granularity=GRANULARITY)
    allocations = [exporting.create(SIZE) for _ in range(tp)]
    handles = [exporting.export(a, HandleKind.MEMFD) for a in allocations]
    fake = FakeExporter(batched, [h.fd for h in handles])
    try:
        with importer_under_test(monkeypatch, True, "_call") as (im, t, calls):
            try:
                wire = [encode(descriptor(rank=r, tp=tp, socket_path=fake.path, handle=handles[r].identity),
                               DEPLOYMENT) for r in range(tp)]
                pins = [None, BlockRequest("prefix", (4, 5), (11, 13)), None, BlockRequest("prefix", (6, 6), (12,))]
                for blocks in pins:
                    group = im.import_group(wire, incarnations=None, blocks=blocks)
                    assert group.state == "ready"
                    assert [p.lease_id for p in group.parts] == [100, 101]
                    group.drain(5.0)
            finally:
                im.close()
            assert calls == [1] * len(pins), "the native path served every import"
    finally:
        fake.close()
        for a in allocations:
            exporting.release(a)
    asked = [r for r in fake.requests if r["op"] == "leases"]
    assert [[item["blocks"] for item in r["items"]] for r in asked] == [
        [None if b is None else {"group": b.group, "epoch": b.epoch(rank), "hashes": list(b.hashes)}
         for rank in range(tp)] for b in pins]
    assert [[item["rank"] for item in r["items"]] for r in asked] == [[0, 1]] * len(pins)


# -- phase 1 alone: a rank worker's own part (kvs_import_lease) ----------------------------


class Share:
    """The owner of one rank's part, as a rank worker's share is (the PartOwner protocol):
    its group passed the coordinator's validation and is importing."""

    def __init__(self, importer: Importer[Any, Any, Any, Any, Any], descriptor: Any) -> None:
        self.label, self.observers = "share", ()
        self.importer, self.blocks, self.validated = importer, None, descriptor
        self.state, self.leasing, self.releasing = "checking", True, False
        self.parts: list[Any] = []


def run_rank(reply: Reply, native: bool, monkeypatch: pytest.MonkeyPatch, size: int = SIZE) -> dict[str, Any]:
    """One rank's part leased on its own, then opened (RankShare's two steps), against a
    fake exporter answering with ``reply``; the part is closed at the end, as the share's
    rollback or unmap closes it."""
    from kvstate.share import attach
    from kvstate.share.part import Part

    exporting = HostTransport(granularity=GRANULARITY)
    allocation = exporting.create(size)
    handle = exporting.export(allocation, HandleKind.MEMFD)
    fake = FakeExporter(reply, [handle.fd])
    with importer_under_test(monkeypatch, native, "_call_lease") as (im, t, calls):
        before = held(t)
        out: dict[str, Any] = {"calls": calls}
        try:
            d = descriptor(rank=0, tp=1, socket_path=fake.path, handle=handle.identity)
            share = Share(im, d)
            part: Part[Any, Any, Any, Any, Any] = Part(share, d)
            share.parts.append(part)
            part.fire("validate")
            try:
                native_import.lease_part(part)
                out["leased"] = part.state
                out["renewed"] = [im.renewal.state(part.renewal_key)] if im.renewal and part.renewal_key else []
                share.state, share.leasing = "importing", False  # the coordinator said open
                attach.open_part(part)
            except KvStateError as exc:
                out["error"] = exc
                if part.may("import_failed"):  # as RankShare._import_part undoes a failed open
                    part.fire("import_failed")
            out["state"] = part.state
            if part.state == "imported":
                assert t.view(part.mapped())[0] == 0
                out["mapped"] = mapped_notes(fake)
            share.releasing = True
            if part.may("close"):
                part.fire("close")
            out["unmapped"] = part.mapping is None and part.allocation is None and part.received is None
            out["held"] = held(t) == before
            renewal = im.renewal
            assert renewal is not None
            out["renewed_after"] = [renewal.state(k) for k in range(1, renewal._next + 1)]
        finally:
            im.close()
            fake.close()
            exporting.release(allocation)
        out["granted"], out["released"] = sorted(fake.granted), fake.released()
        return out


@pytest.mark.parametrize("case", CASES)
def test_a_ranks_own_lease_natively_and_by_the_reference_agree(case: str, extra_fds: list[int],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase 1 alone in C (a rank worker's part, whose open waits for its coordinator) and
    by the Python reference give the same verdict on every answer, keep nothing after, and
    a good lease holds its fd, registered for renewal, until the open."""
    reply = cases(extra_fds)[case]
    size = SIZE + GRANULARITY if case == "fd_wrong_size" else SIZE
    native = run_rank(reply, True, monkeypatch, size)
    reference = run_rank(reply, False, monkeypatch, size)
    assert native["calls"] == [1], "the native path leased the part"
    assert verdict(native.get("error")) == verdict(reference.get("error")), (native.get("error"),
                                                                             reference.get("error"))
    assert native["state"] == reference["state"]
    assert native.get("leased") == reference.get("leased")
    for out in (native, reference):
        assert out["unmapped"] and out["held"], "a failed or closed part keeps nothing"
        assert all(s is None for s in out["renewed_after"]), "no lease is left with the renewal thread"
        assert out["released"] == out["granted"], "every lease granted went back"
    if case.startswith("good"):
        assert native["state"] == "imported" and native["leased"] == "leased"
        assert len(native["mapped"]) == 1 and native["mapped"] == reference["mapped"], "one mapped note"
        assert native["renewed"] and native["renewed"][0] is not None, "the lease was registered for renewal"
    elif case == "fd_wrong_size":
        assert native["leased"] == "leased" and native["state"] == "failed", "phase 1 passed, the open failed"
    else:
        assert native["state"] == "failed" and "leased" not in native, "phase 1 failed"
