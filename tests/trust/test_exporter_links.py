"""The importer's persistent links to exporters (kvstate.share.peers) against exporters
that are slow, silent or wrong: answers are read in step with their requests, a link is
never closed under a request or a lease, timeouts bound an import, and a malformed answer
returns every lease it names and closes each received fd exactly once."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from kvstate import channel as chan
from kvstate.harness import leaks
from kvstate.core.descriptor import encode
from kvstate.core.errors import ImportFailed, KvStateError
from kvstate.core.reasons import ImportReason
from kvstate.core.handles import HandleKind
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostTransport

from support.descriptors import DEPLOYMENT, GRANULARITY, descriptor
from support.reuse import REUSE_ON

Answer = Callable[[chan.Channel, dict[str, Any], int], None]  # channel, request, connection number


class FakeExporter:
    """A same-uid server speaking the lease protocol, with ``answer`` deciding each reply;
    it records every request and how many connections it accepted."""

    def __init__(self, answer: Answer) -> None:
        where = Path(tempfile.mkdtemp(prefix="kvs-links-"))
        where.chmod(0o700)
        self.path = str(where / "fake.sock")
        self.server = chan.Server(self.path, limits=chan.Limits(max_fds=chan.HARD_MAX_FDS))
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.closed_by_importer = 0
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept)
        self._accepting.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                ch = self.server.accept(timeout=0.05)
            except ChannelError as exc:
                if exc.reason is not ChannelReason.TIMEOUT:
                    raise
                continue
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(ch, self.connections))
            t.start()
            self.threads.append(t)

    def _serve(self, ch: chan.Channel, n: int) -> None:
        with ch:
            while not self.stop.is_set():
                try:
                    with ch.recv(timeout=0.05) as msg:
                        req = chan.decode(msg.payload)
                except KvStateError as exc:
                    if isinstance(exc, ChannelError) and exc.reason is ChannelReason.TIMEOUT:
                        continue
                    self.closed_by_importer += 1
                    return
                self.requests.append(req)
                try:
                    self.answer(ch, req, n)
                except KvStateError:  # the importer closed its end before the answer
                    self.closed_by_importer += 1
                    return

    def ops(self) -> list[str]:
        return [str(r["op"]) for r in self.requests]

    def close(self) -> None:
        self.stop.set()
        self._accepting.join(5)
        for t in self.threads:
            t.join(5)
        self.server.close()


@contextmanager
def memfd() -> Iterator[Any]:
    """A real sealed memfd of the descriptor's size, as an exporter would send."""
    exporting = HostTransport(granularity=GRANULARITY)
    allocation = exporting.create(descriptor().size)
    try:
        yield exporting.export(allocation, HandleKind.MEMFD)
    finally:
        exporting.release(allocation)


def wire(fake: FakeExporter, handle: Any, rank: int = 0, tp: int = 1) -> bytes:
    return encode(descriptor(rank=rank, tp=tp, socket_path=fake.path, handle=handle.identity), DEPLOYMENT)


def importer(**config: Any) -> Importer:
    return Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, **config), HostTransport(granularity=GRANULARITY))


def memfds() -> set[int]:
    """This process's open memfds (the links' sockets stay open by design)."""
    return {fd for fd, target in leaks.snapshot().fds.items() if target.startswith("/memfd:")}


def ok(ch: chan.Channel, **fields: Any) -> None:
    ch.send(chan.encode({"ok": True, **fields}))


def test_a_malformed_grant_in_a_batch_returns_every_lease_and_closes_each_fd_once() -> None:
    """Rank 1's grant is malformed: both leases go back, and the two fds that came are
    closed once each. (They were closed twice: once by the grant, once by the message,
    after a release round trip in which another thread could reuse the number.)"""
    victims: list[int] = []
    with memfd() as handle:
        def answer(ch: chan.Channel, req: dict[str, Any], n: int) -> None:
            if req["op"] == "leases":
                good = {"ok": True, "lease": 1, "expires_in_s": 5.0, "nfds": 1}
                bad = {"ok": True, "lease": 2, "expires_in_s": "soon", "nfds": 1}
                ch.send(chan.encode({"ok": True, "grants": [good, bad]}), [handle.fd, handle.fd])
            else:
                victims.append(os.open("/dev/null", os.O_RDONLY))  # takes the lowest free number
                ok(ch)
        fake = FakeExporter(answer)
        im = importer(request_timeout_s=2.0)
        before = memfds()
        try:
            with pytest.raises(ImportFailed, match="malformed lease grant") as info:
                im.import_group([wire(fake, handle, r, 2) for r in range(2)], incarnations=None)
            assert info.value.reason is ImportReason.MALFORMED
            for fd in victims:
                os.fstat(fd)  # still open: nobody else's fd was closed
            assert sorted(r["lease"] for r in fake.requests if r["op"] == "release") == [1, 2]
            assert memfds() == before  # none of the two received is left open
        finally:
            for fd in victims:
                os.close(fd)
            im.close()
            fake.close()


def test_a_slow_answer_within_the_timeout_is_not_cut_by_the_idle_sweep() -> None:
    """The link's idle time starts when its last holder lets go, and a request in flight
    holds it: an answer 0.6 s late, under a 0.1 s idle limit, still arrives."""
    with memfd() as handle:
        def answer(ch: chan.Channel, req: dict[str, Any], n: int) -> None:
            if req["op"] == "lease":
                time.sleep(0.6)
                ch.send(chan.encode({"ok": True, "lease": 7, "expires_in_s": 30.0}), [handle.fd])
            elif req["op"] != "mapped":
                ok(ch, expires_in_s=30.0)
        fake = FakeExporter(answer)
        im = importer(request_timeout_s=3.0, link_idle_s=0.1)
        try:
            group = im.import_group([wire(fake, handle)], incarnations=None)
            assert group.state == "ready"
            assert not group.parts[0].link.closed  # held by the part's lease, however idle
            group.drain()
            assert fake.connections == 1
        finally:
            im.close()
            fake.close()


def test_a_renewal_answered_late_closes_the_link() -> None:
    """A renewal that timed out leaves its answer on the way: the link closes (ending its
    leases) instead of reading that answer as the next request's. The next import
    connects afresh and is granted."""
    with memfd() as handle:
        leases = iter(range(1, 100))

        def answer(ch: chan.Channel, req: dict[str, Any], n: int) -> None:
            if req["op"] == "lease":
                ch.send(chan.encode({"ok": True, "lease": next(leases), "expires_in_s": 2.0}), [handle.fd])
            elif req["op"] == "renew":
                if n == 1:
                    time.sleep(0.8)  # past the importer's 0.3 s
                ok(ch, expires_in_s=2.0)
            elif req["op"] == "release":
                ok(ch, released=req["lease"])
        fake = FakeExporter(answer)
        im = importer(request_timeout_s=0.3, renew_interval_s=0.2, link_idle_s=30.0)
        try:
            late = im.import_group([wire(fake, handle)], incarnations=None)
            deadline = time.monotonic() + 10
            while late.state == "ready" and time.monotonic() < deadline:
                time.sleep(0.02)
            assert late.state != "ready"  # its renewal failed: the group let go
            deadline = time.monotonic() + 10
            while fake.closed_by_importer < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert fake.closed_by_importer == 1
            group = im.import_group([wire(fake, handle)], incarnations=None)
            assert group.state == "ready" and fake.connections == 2
            group.drain()
        finally:
            im.close()
            fake.close()


def test_silent_exporters_cost_one_timeout_and_one_connection_each() -> None:
    """Three exporters that never answer: the import fails after one request timeout in
    all (the answers are awaited together), with no second attempt (a retry is only for a
    reused link the exporter had closed)."""
    with memfd() as handle:
        fakes = [FakeExporter(lambda ch, req, n: None) for _ in range(3)]
        im = importer(request_timeout_s=1.0)
        try:
            started = time.monotonic()
            with pytest.raises(ImportFailed):
                im.import_group([wire(f, handle, r, 3) for r, f in enumerate(fakes)], incarnations=None)
            took = time.monotonic() - started
            assert [(f.connections, f.ops()) for f in fakes] == [(1, ["lease"])] * 3
            assert took < 2.5, took  # was 6 s: a full timeout per exporter, then a retry of each
        finally:
            im.close()
            for f in fakes:
                f.close()
