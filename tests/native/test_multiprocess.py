"""Real exporter and importer processes: memfds over SCM_RIGHTS, and SIGKILL at each side.

What the importer reads through its mappings is what the exporter wrote (the native half
of the load-bytes invariant, whose checker reads through a ready group).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstate import channel
from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from support.errors import raises
from kvstate.core.handles import HandleKind
from kvstate.core.capabilities import Access
from kvstate.transport.host import HostAllocation, HostHandle, HostMapping, HostTransport
from native.helpers import expect_line, peer, reap
from native.peers import BANK, pattern


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return channel.make_socket_dir(tmp_path / "s") / "exporter.sock"


@pytest.fixture
def t() -> HostTransport:
    return HostTransport()


class Importer:
    """The test process as an importer: banks land side by side in one reservation."""

    def __init__(self, t: HostTransport, banks: int) -> None:
        self.t = t
        self.res = t.reserve(banks * BANK)
        self.allocs: list[HostAllocation] = []
        self.maps: list[HostMapping] = []

    def take(self, ch: channel.Channel) -> int:
        with ch.recv(timeout=20) as msg:
            body = channel.decode(msg.payload)
            alloc = self.t.import_(HostHandle(msg.fds[0], body["identity"]), body["size"])
        m = self.t.map(self.res, len(self.maps) * BANK, alloc)
        self.t.set_access(m, Access.READ)
        self.allocs.append(alloc)
        self.maps.append(m)
        return int(body["bank"])

    def check(self, index: int, bank: int) -> None:
        assert bytes(self.t.view(self.maps[index])) == pattern(bank, BANK), "imported bytes differ from the exporter's"

    def close(self) -> None:
        for m in self.maps:
            self.t.unmap(m)
        for a in self.allocs:
            self.t.release(a)
        self.t.free(self.res)


@pytest.fixture
def importer(t: HostTransport) -> Iterator[Importer]:
    imp = Importer(t, 2)
    yield imp
    imp.close()


def test_two_process_export_import_map_and_pattern(sock: Path, importer: Importer) -> None:
    proc = peer("exporter", str(sock), "2", "99")
    try:
        expect_line(proc, "ready")
        with channel.connect(sock, timeout=20) as ch:
            assert ch.peer.pid == proc.pid
            assert [importer.take(ch), importer.take(ch)] == [0, 1]
            importer.check(0, 0)
            importer.check(1, 1)
            ch.send(channel.encode({"done": True}))
            expect_line(proc, "exit")
    finally:
        assert reap(proc) == 0


@pytest.mark.parametrize("fork_child", ["no", "fork"])
def test_exporter_killed_mid_import(sock: Path, importer: Importer, fork_child: str) -> None:
    """The exporter dies after one of two banks: the importer sees EOF, or, when a child of
    the exporter still holds the socket open, pidfd readiness; its mapping stays readable."""
    proc = peer("exporter", str(sock), "2", "1", fork_child)
    child = 0
    try:
        expect_line(proc, "ready")
        with channel.connect(sock, timeout=20) as ch:
            assert importer.take(ch) == 0
            if fork_child == "fork":
                child = int(expect_line(proc, "child").split()[1])
            expect_line(proc, "held 1")
            proc.send_signal(signal.SIGKILL)
            assert reap(proc) == -signal.SIGKILL
            with raises(ChannelError, ChannelReason.PEER_DIED if fork_child == "fork" else ChannelReason.CLOSED):
                ch.recv(timeout=20)
            assert not ch.peer_alive()
        importer.check(0, 0)  # the exporter is gone; its memory is still readable here
    finally:
        if proc.poll() is None:
            proc.kill()
        reap(proc)
        if child:
            os.kill(child, signal.SIGKILL)


def test_importer_killed_ends_its_lease(sock: Path, t: HostTransport) -> None:
    """The importer dies holding a mapping: the watcher reports the hang-up, the lease (an
    explicit pin) ends, and the exporter may release its bank."""
    alloc = t.create(BANK)
    res = t.reserve(BANK)
    m = t.map(res, 0, alloc)
    t.set_access(m, Access.READ_WRITE)
    t.view(m)[:] = pattern(0, BANK)
    ended = threading.Event()

    def end_lease(ch: channel.Channel) -> None:
        t.unpin(m)
        ch.close()
        ended.set()

    proc = peer("importer", str(sock))
    try:
        with channel.Server(sock) as server, channel.Watcher() as watcher:
            ch = server.accept(timeout=20)
            assert ch.peer.pid == proc.pid
            t.pin(m)  # the lease
            watcher.watch(ch, end_lease)
            h = t.export(alloc, HandleKind.MEMFD)
            ch.send(channel.encode({"bank": 0, "size": BANK, "identity": h.identity}), [h.fd])
            expect_line(proc, "mapped")
            assert t.stats(m).pins == 1
            proc.send_signal(signal.SIGKILL)
            assert ended.wait(20), "the watcher did not report the dead importer"
            assert t.stats(m).pins == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        reap(proc)
    t.unmap(m)
    t.release(alloc)
    t.free(res)
