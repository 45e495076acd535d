"""One request on a native request link (kvstate.share.link) under the syscall shim.

Run as ``python link_case.py [early]`` with LD_PRELOAD=shim and KVS_SYSFAIL set: a forked peer
(forked before the shim is armed, so none of its calls count) answers the request after
a pause, attaching one fd; this process arms the shim, sends the request, disarms, and
prints one JSON line: the outcome (``ok`` with the answer and its fd count, or the
ChannelError's reason), whether the link is closed, whether the rule fired, and its open
fds before the link and after (the answer's fd closed): a refused request closes the
link and leaves no fd behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import select
import struct
import sys
import time

from kvstate import channel as chan
from kvstate.core.errors import ChannelError
from kvstate.share.link import NativeLink


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def peer(sock: socket.socket, early: bool) -> None:
    """Answer after the request (the request waits: poll and a retried recvmsg come into
    play), or, ``early``, before it (the first recvmsg finds the answer queued)."""
    sock.setblocking(True)
    if not early:
        time.sleep(0.2)
        sock.recv(1 << 16)
    payload = b'{"ok":true}'
    frame = struct.pack("<4sIH2x", b"KVS\x01", len(payload), 1) + payload
    r, w = os.pipe()
    socket.send_fds(sock, [frame], [r])
    time.sleep(5.0)  # keep the connection open until the parent is done


def main() -> None:
    early = sys.argv[1:] == ["early"]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = os.fork()
    if child == 0:
        a.close()
        peer(b, early)
        os._exit(0)
    b.close()
    if early:
        select.select([a], [], [], 30.0)  # queued before the shim is armed
    ch = chan.Channel(a)
    before = open_fds()  # the link's own duplicates come after: a closed link leaves none
    link = NativeLink(ch, chan.Limits())
    lib = ctypes.CDLL(None)
    lib.kvs_sys_arm(1)
    try:
        with link.request(b'{"op":"renew"}', 5.0) as msg:
            out: dict[str, object] = {"outcome": "ok", "payload": msg.payload.decode(), "nfds": len(msg.fds)}
    except ChannelError as exc:
        out = {"outcome": "refused", "reason": exc.reason.value, "error": str(exc)}
    lib.kvs_sys_arm(0)
    out.update(closed=link.closed, fired=lib.kvs_sys_fired(), fds_before=before, fds_after=open_fds())
    print(json.dumps(out), flush=True)
    link.close()
    ch.close()
    os.kill(child, 9)
    os.waitpid(child, 0)


if __name__ == "__main__":
    main()
