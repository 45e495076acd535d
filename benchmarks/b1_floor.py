"""B1's floor: raw SCM_RIGHTS of the same kind of fds plus mmap, with no checks.

The exporter process owns ``tp`` sealed memfds of ``bank_bytes`` (every page touched) and
serves them on one AF_UNIX SOCK_SEQPACKET connection, which the importer opens before the
clock starts. Per repeat the importer asks for the fds, receives them and maps each one
readable (PROT_READ, MAP_SHARED): the least any fd-passing import can do, with no
descriptor, no lease, no identity or seal check and no address reservation.

- whole group: one request, every fd in one message, tp mmaps;
- per rank: one request per rank, one fd each, one mmap (timed per rank).

The answer is waited for as kvstate's importer waits (:func:`recv_fds`): polled for
``ImportConfig.answer_spin_s``, or until something else ran on the CPU, before the thread
sleeps. So the ratios to the floor measure what kvstate adds, not a different way of
waiting.
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.framework import Figure
from benchmarks.procs import run_pair
from kvstate.share.import_config import ANSWER_SPIN_S


def _memfd(size: int) -> int:
    fd = os.memfd_create("kvs-floor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as m:
        m[:: mmap.PAGESIZE] = b"\1" * len(range(0, size, mmap.PAGESIZE))  # touch every page
    return fd


def _floor_exporter(conn: Connection, p: dict[str, Any]) -> None:
    fds = [_memfd(p["bank_bytes"]) for _ in range(p["tp"])]
    d = Path(tempfile.mkdtemp(prefix="kvs-floor-"))
    path = d / "s"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        srv.bind(str(path))
        srv.listen(1)
        conn.send(str(path))
        peer, _ = srv.accept()
        with peer:
            while True:
                req = peer.recv(16)
                if not req or req == b"q":
                    break
                if req == b"g":
                    socket.send_fds(peer, [b"g"], fds)
                else:
                    socket.send_fds(peer, [b"r"], [fds[int(req)]])
    finally:
        srv.close()
        path.unlink(missing_ok=True)
        d.rmdir()
        for fd in fds:
            os.close(fd)
        conn.send("bye")


#: Two polls further apart than this: something else ran on the CPU (kvs_link.c's SPIN_GAP_NS).
SPIN_GAP_S = 20e-6


def recv_fds(sock: socket.socket, n: int) -> list[int]:
    """The fds of the next message, waited for as kvstate's importer waits for an answer:
    polled for its default ``answer_spin_s`` unless something else ran on the CPU, then
    asleep."""
    last = time.perf_counter()
    until = last + ANSWER_SPIN_S
    while True:
        now = time.perf_counter()
        if now >= until or now - last > SPIN_GAP_S:
            break
        last = now
        try:
            return socket.recv_fds(sock, 16, n, socket.MSG_DONTWAIT)[1]
        except BlockingIOError:
            pass
    return socket.recv_fds(sock, 16, n)[1]


def _receive_and_map(sock: socket.socket, request: bytes, n: int, size: int) -> list[mmap.mmap]:
    sock.send(request)
    fds = recv_fds(sock, n)
    try:
        return [mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


#: One timed step: it maps ``n`` banks and returns the maps.
Step = tuple[Callable[[], list[mmap.mmap]], int]


def timed_maps(repeats: int, steps: list[Step]) -> tuple[float, ...]:
    """Seconds of each step of ``repeats`` rounds, after one warm-up round. Off the clock,
    each step's maps are checked (``n`` of them, every bank's first byte the 1 its exporter
    wrote) and closed."""
    samples = []
    for i in range(repeats + 1):
        for step, n in steps:
            t0 = time.perf_counter()
            maps = step()
            t1 = time.perf_counter()
            assert len(maps) == n and all(m[0] == 1 for m in maps)
            for m in maps:
                m.close()
            if i:  # the first round is a warm-up
                samples.append(t1 - t0)
    return tuple(samples)


def _floor_importer(conn: Connection, p: dict[str, Any]) -> tuple[float, ...]:
    path = conn.recv()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    batches = [(str(r).encode(), 1) for r in range(p["tp"])] if p["floor"] == "rank" else [(b"g", p["tp"])]
    try:
        return timed_maps(p["repeats"], [(partial(_receive_and_map, sock, request, n, p["bank_bytes"]), n)
                                         for request, n in batches])
    finally:
        sock.send(b"q")
        sock.close()
        conn.recv()


def floor_group(params: dict[str, Any]) -> Figure:
    samples = run_pair(_floor_exporter, _floor_importer, {**params, "floor": "group"})
    return Figure(tuple(samples), note=f"one request, {params['tp']} fds in one SCM_RIGHTS message, "
                  f"{params['tp']} mmaps; no checks")


def floor_rank(params: dict[str, Any]) -> Figure:
    samples = run_pair(_floor_exporter, _floor_importer, {**params, "floor": "rank"})
    return Figure(tuple(samples), note="per rank: one request, one fd, one mmap; no checks")
