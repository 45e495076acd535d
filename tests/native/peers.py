"""Peer processes of the native tests: ``python peers.py ROLE ARGS``.

Each role talks to the test on stdout (one line per step) and stdin (``go`` lines), and
to its peer over the real control channel with real memfds.
"""

from __future__ import annotations

import os
import sys
import time

from kvstate import channel
from kvstate.core.handles import HandleKind
from kvstate.core.capabilities import Access
from kvstate.transport.host import HostHandle, HostTransport

BANK = 2 << 20


def pattern(bank: int, size: int) -> bytes:
    period = bytes((bank * 7 + j) % 251 for j in range(251))
    return (period * (size // 251 + 1))[:size]


def say(line: str) -> None:
    print(line, flush=True)


def wait_go() -> None:
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("expected go")


def touch_before_access(mode: str) -> None:
    """Map a bank and touch it against its access rights; the test expects SIGSEGV."""
    t = HostTransport()
    a = t.create(BANK)
    r = t.reserve(BANK)
    m = t.map(r, 0, a)
    view = t.view(m)
    if mode == "read-only-write":
        t.set_access(m, Access.READ)
        assert view[0] == 0
    say("touching")
    if mode == "read":
        _ = view[0]
    else:
        view[0] = 1
    say("survived")


def exporter(path: str, banks: str, hold: str, fork_child: str = "no") -> None:
    """Serve ``banks`` patterned memfds to one importer, pausing after ``hold`` of them."""
    t = HostTransport()
    allocs, maps = [], []
    r = t.reserve(BANK * int(banks))
    for i in range(int(banks)):
        a = t.create(BANK)
        m = t.map(r, i * BANK, a)
        t.set_access(m, Access.READ_WRITE)
        t.view(m)[:] = pattern(i, BANK)
        allocs.append(a)
        maps.append(m)
    with channel.Server(path) as server:
        say("ready")
        ch = server.accept(timeout=20)
        for i, a in enumerate(allocs):
            if i == int(hold):
                if fork_child == "fork":
                    child = os.fork()
                    if child == 0:  # holds the socket open: only the pidfd tells the parent died
                        time.sleep(60)
                        os._exit(0)
                    say(f"child {child}")
                say(f"held {i}")
                wait_go()
            h = t.export(a, HandleKind.MEMFD)
            ch.send(channel.encode({"bank": i, "size": BANK, "identity": h.identity}), [h.fd])
        msg = ch.recv(timeout=20)
        assert channel.decode(msg.payload) == {"done": True}
        ch.close()
    for m in maps:
        t.unmap(m)
    for a in allocs:
        t.release(a)
    t.free(r)
    say("exit")


def importer(path: str) -> None:
    """Import one bank, check its pattern, report, then wait (the test kills it)."""
    t = HostTransport()
    ch = channel.connect(path, timeout=20)
    with ch.recv(timeout=20) as msg:
        body = channel.decode(msg.payload)
        a = t.import_(HostHandle(msg.fds[0], body["identity"]), body["size"])
    r = t.reserve(body["size"])
    m = t.map(r, 0, a)
    t.set_access(m, Access.READ)
    assert bytes(t.view(m)[:4096]) == pattern(body["bank"], 4096)
    say("mapped")
    time.sleep(60)


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    {"touch": touch_before_access, "exporter": exporter, "importer": importer}[role](*args)
