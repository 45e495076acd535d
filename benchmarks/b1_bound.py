"""B1's architecture bound: the floor plus only what kvstate's design cannot drop.

The floor (:mod:`benchmarks.b1_floor`) is the least any fd-passing import does.
kvstate must also, by its design (``DESIGN.md``), run on every import:

- the validation rules over every descriptor, in the pure core
  (:func:`~kvstate.core.validate.validate_group`; per rank
  :func:`~kvstate.core.validate.descriptor_problems`), before anything is opened;
- the spec's machines, in Python: the importer's group (``begin_import``, ``complete``)
  and every part (``validate``, ``lease``, ``open``); the exporter's bank
  (``grant_lease`` before its fds leave, ``lease_mapped`` and ``release_lease`` after);
- the fd identity and seal checks (``fstat``, ``F_GET_SEALS``) before a map.

This row runs exactly that around the floor's own request, ``SCM_RIGHTS`` receipt and
``mmap``: the machines are B3's bookkeeping-only bindings of the real tables
(:mod:`~benchmarks.b3_lifecycle`), the descriptors are a real exporter's and
the rules are kvstate's. Left out, so the bound stays a lower bound: the lease protocol's
codec and glue, the VMM-style reserve and ``set_access`` (two more syscalls per part), the
watcher, the "mapped" note and every other piece of kvstate's own code. No import that
keeps the design can be faster than this row: it says how much of the distance to a peer
is kvstate's code, and how much its design.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import socket
import tempfile
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.b1_floor import Step, _memfd, recv_fds, timed_maps
from benchmarks.b1_import import _DEPLOYMENT_KEY, _geometry, import_config
from benchmarks.b3_lifecycle import BenchBank, BenchGroup, BenchPart
from benchmarks.framework import Figure
from benchmarks.procs import run_pair

#: The seals every host bank's fd carries (checked by the host transport before a map).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _bound_exporter(conn: Connection, p: dict[str, Any]) -> None:
    from kvstate.core.identity import Deployment
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.transport.host import HostTransport, fd_identity_of

    tp = p["tp"]
    d = Path(tempfile.mkdtemp(prefix="kvs-bound-"))
    # A real exporter for real descriptors (its socket is what validation checks); its
    # banks are never touched. The fds served are the floor's sealed memfds.
    ex = Exporter(ExportConfig(Deployment("bench", _DEPLOYMENT_KEY), d / "x", os.urandom(16), tp),
                  HostTransport(), name="bound")
    for r in range(tp):
        ex.add_bank(r, _geometry(p["bank_bytes"])).register()
        ex.banks[r].advertise()
    ex.start()
    fds = [_memfd(p["bank_bytes"]) for _ in range(tp)]
    for fd in fds:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    banks = [BenchBank() for _ in range(tp)]
    for bank in banks:
        bank.fire("register")
        bank.fire("advertise")
    path = d / "s"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        srv.bind(str(path))
        srv.listen(1)
        conn.send((str(path), [ex.descriptor(r) for r in range(tp)], [fd_identity_of(fd) for fd in fds]))
        peer, _ = srv.accept()
        with peer:
            while True:
                req = peer.recv(16)
                if not req or req == b"q":
                    break
                ranks = range(tp) if req == b"g" else (int(req),)
                for r in ranks:  # the grant is recorded before the fds leave
                    banks[r].fire("grant_lease")
                socket.send_fds(peer, [b"g"], [fds[r] for r in ranks])
                for r in ranks:  # after the answer: off the importer's clock, as in kvstate
                    banks[r].fire("lease_mapped")
                    banks[r].fire("release_lease")
    finally:
        srv.close()
        path.unlink(missing_ok=True)
        for fd in fds:
            os.close(fd)
        ex.drain(5.0)
        ex.stop()
        shutil.rmtree(d, ignore_errors=True)
        conn.send("bye")


def _checked_maps(fds: list[int], identities: list[bytes], size: int) -> list[mmap.mmap]:
    """The host transport's fd checks before a map (the file the descriptor names, its
    seals), then the floor's map; every fd is closed."""
    from kvstate.transport.host import fd_identity_of

    try:
        for fd, identity in zip(fds, identities, strict=True):
            if fd_identity_of(fd) != identity or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                raise AssertionError(f"fd {fd} fails the checks")
        return [mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


def _group_bound(sock: socket.socket, wire: list[bytes], identities: list[bytes], im: Any,
                 size: int) -> list[mmap.mmap]:
    from kvstate.core.descriptor import decode_group
    from kvstate.core.errors import GroupRejected
    from kvstate.core.validate import validate_group

    descriptors, problems = decode_group(wire, im.config.deployment)
    if problems:
        raise GroupRejected(problems)
    validate_group(descriptors, im.expectation())
    group = BenchGroup(len(wire), counted=False)
    group.fire("begin_import")
    for part in group.parts:
        part.fire("validate")
    sock.send(b"g")
    fds = recv_fds(sock, len(wire))
    for part in group.parts:
        part.fire("lease")
    maps = _checked_maps(fds, identities, size)
    for part in group.parts:
        part.fire("open")
    group.fire("complete")
    return maps


def _rank_bound(sock: socket.socket, wire: bytes, identity: bytes, rank: int, im: Any,
                size: int, worker: BenchGroup) -> list[mmap.mmap]:
    from kvstate.core.descriptor import decode_cached
    from kvstate.core.errors import DescriptorRejected, GroupRejected
    from kvstate.core.reasons import RejectReason
    from kvstate.core.validate import descriptor_problems

    d = decode_cached(wire, im.config.deployment)
    problems = descriptor_problems(d, im.expectation())
    if problems or d.rank != rank:
        raise GroupRejected(problems or [DescriptorRejected(RejectReason.MISSING_RANK, f"not rank {rank}", d.rank)])
    part = BenchPart(worker, rank, observed=False)
    part.fire("validate")
    sock.send(str(rank).encode())
    fds = recv_fds(sock, 1)
    part.fire("lease")
    maps = _checked_maps(fds, [identity], size)
    part.fire("open")
    return maps


def _bound_importer(conn: Connection, p: dict[str, Any]) -> tuple[float, ...]:
    from kvstate.share.importer import Importer
    from kvstate.transport.host import HostTransport

    path, wire, identities = conn.recv()
    im = Importer(import_config(), HostTransport())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    size = p["bank_bytes"]
    worker = BenchGroup(1, counted=False)  # a rank worker's group: checked by the coordinator, importing
    worker.fire("begin_import")
    steps: list[Step]
    if p["bound"] == "rank":
        steps = [(partial(_rank_bound, sock, wire[r], identities[r], r, im, size, worker), 1) for r in range(p["tp"])]
    else:
        steps = [(partial(_group_bound, sock, wire, identities, im, size), p["tp"])]
    try:
        return timed_maps(p["repeats"], steps)
    finally:
        sock.send(b"q")
        sock.close()
        im.close()
        conn.recv()


def bound_group(params: dict[str, Any]) -> Figure:
    samples = run_pair(_bound_exporter, _bound_importer, {**params, "bound": "group"})
    return Figure(tuple(samples), note=f"the floor + validation, fd checks and the spec's machines "
                  f"({3 * params['tp'] + 2} importer, {3 * params['tp']} exporter transitions); no kvstate glue")


def bound_rank(params: dict[str, Any]) -> Figure:
    samples = run_pair(_bound_exporter, _bound_importer, {**params, "bound": "rank"})
    return Figure(tuple(samples), note="per rank: the floor + its rules, fd checks, 3 part and 3 bank transitions")
