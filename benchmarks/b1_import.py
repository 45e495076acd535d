"""B1, group import: the importer side of a tp-rank group, one bank per rank.

Every row runs a real exporter process that owns ``tp`` banks of ``bank_bytes`` and an
importer process that times, per repeat, what it must do before the group is usable:

- kvstate whole group: decode and validate every descriptor, lease, receive fds, map,
  ready (one importer holding every rank, :meth:`Importer.import_group`);
- kvstate per rank, the coordinator topology: what one rank worker does for its own part
  (decode and check its descriptor, lease, receive its fd, map), timed per rank, ranks
  0..tp-1 in turn from one worker process (its channel to the exporter stays warm, as a
  worker's does between groups); the coordinator's messages are not in it;
- the floor (:mod:`benchmarks.b1_floor`): raw SCM_RIGHTS of the same kind of
  fds plus mmap, with no checks, whole group and per rank;
- ``multiprocessing.shared_memory``: attach every segment by name (shm_open + mmap);
- torch.multiprocessing fd sharing: receive the shared tensors (fds over a unix socket,
  rebuilt and mapped), when torch is installed;
- NIXL: register the importer's destination memory, load the exporter's agent metadata
  and prepare the remote and local descriptor lists;
- NIXL that asks its peer: the same, then one notification to the exporter and its
  answer. kvstate's import asks its exporter for a lease; the row above asks nobody.

Untimed work (creating banks, tearing down after each repeat) stays outside the clock.
"""

from __future__ import annotations

import importlib
import mmap
import time
from multiprocessing.connection import Connection
from typing import Any, Protocol

from kvstate.core.descriptor import Descriptor
from kvstate.core.machine import Observer
from benchmarks.framework import Figure, Skipped
from benchmarks.procs import run_pair
from kvstate.share.importer import BlockRequest, ImportConfig, Importer, Part

LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}


# -- kvstate -------------------------------------------------------------------------


def _geometry(bank_bytes: int) -> Any:
    from kvstate.core.geometry import DType, Geometry, Layout
    block = 64 * 1024  # 1 layer x 1 head x 128 dim x 128 tokens x K,V x bf16
    return Geometry.uniform(layers=1, kv_heads=1, head_dim=128, block_tokens=128, dtype=DType.BF16,
                    layout=Layout.BLOCK_MAJOR, num_blocks=bank_bytes // block)


_DEPLOYMENT_KEY = bytes(range(32))


def import_config(park_s: float = 0.0) -> ImportConfig:
    """The importers' config in every kvstate row (and the import profile); ``park_s``:
    closed parts park their leases for the next import (kvstate.share.parked)."""
    from kvstate.core.identity import Deployment
    from kvstate.reuse.policy import ReuseSettings
    return ImportConfig(Deployment("bench", _DEPLOYMENT_KEY), reuse=ReuseSettings(enable_decode_to_prefill_reuse=True),
                        park_s=park_s)


class Pipe(Protocol):
    """The exporter's end of the pipe to its importer (a Connection, or a profiler's tap)."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...


def _kvstate_exporter(conn: Pipe, p: dict[str, Any]) -> None:
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from kvstate.share.exporter import Exporter

    from kvstate.share.export_config import ExportConfig
    from kvstate.core.identity import Deployment
    from kvstate.transport.host import HostTransport

    d = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
    ex = Exporter(ExportConfig(Deployment("bench", _DEPLOYMENT_KEY), d / "s", os.urandom(16), p["tp"]),
                  HostTransport(), name="bench")
    for r in range(p["tp"]):
        bank = ex.add_bank(r, _geometry(p["bank_bytes"]))
        bank.register()
        bank.view()[:: mmap.PAGESIZE] = b"\1" * len(range(0, bank.size, mmap.PAGESIZE))  # touch every page
        bank.advertise()
    ex.start()
    conn.send([ex.descriptor(r) for r in range(p["tp"])])
    conn.recv()
    ex.drain(30.0)
    ex.stop()
    shutil.rmtree(d, ignore_errors=True)


def _kvstate_group_importer(conn: Connection, p: dict[str, Any]) -> tuple[float, ...]:
    from kvstate.transport.host import HostTransport

    wire = conn.recv()
    t = HostTransport()
    im = Importer(import_config(p.get("park_s", 0.0)), t)
    samples = []
    try:
        for i in range(p["repeats"] + 1):
            t0 = time.perf_counter()
            group = im.import_group(wire)  # decode, validate whole, lease, receive fds, map, ready
            t1 = time.perf_counter()
            assert group.state == "ready"
            assert all(t.view(part.mapped())[0] == 1 for part in group.parts)
            group.drain()
            if i:  # the first round is a warm-up
                samples.append(t1 - t0)
    finally:
        im.close()
        conn.send("done")
    return tuple(samples)


def kvstate_group_import(params: dict[str, Any]) -> Figure:
    """kvstate's row: decode and validate every descriptor, lease, receive the fds over the
    control channel, check and map them, set access, ready (the group machine's guard)."""
    samples = run_pair(_kvstate_exporter, _kvstate_group_importer, params)
    return Figure(tuple(samples), note=f"import_group: validate + lease + SCM_RIGHTS + map of {params['tp']} banks")


def kvstate_group_import_parked(params: dict[str, Any]) -> Figure:
    """The same imports, with the previous import's leases parked (``park_s``): each import
    after the first decodes and validates every descriptor and adopts every part's lease
    and mapping, with no round trip (the warm-up round takes them)."""
    samples = run_pair(_kvstate_exporter, _kvstate_group_importer, {**params, "park_s": 60.0})
    return Figure(tuple(samples), note=f"import_group: validate + adopt {params['tp']} parked leases and mappings")


class _Worker:
    """The owner of one rank's part, as a rank worker's share is (the PartOwner protocol):
    its group passed the coordinator's validation and is importing."""

    def __init__(self, importer: Importer[Any, Any, Any, Any, Any], descriptor: Descriptor) -> None:
        self.label = f"rank{descriptor.rank}"
        self.observers: tuple[Observer, ...] = ()
        self.importer = importer
        self.blocks: BlockRequest | None = None
        self.validated: object = descriptor
        self.state = "importing"
        self.leasing = True     # validated: its part may lease
        self.releasing = True   # the bench closes its part itself once timed
        self.parts: list[Part[Any, Any, Any, Any, Any]] = []  # its own rank's part only

    def peer_closed(self, part: Part[Any, Any, Any, Any, Any]) -> None:
        pass

    def lease_lost(self, part: Part[Any, Any, Any, Any, Any], why: str) -> bool:
        return False


def import_rank(importer: Importer[Any, Any, Any, Any, Any], wire: bytes, rank: int,
                tp: int) -> Part[Any, Any, Any, Any, Any]:
    """One rank worker's import of its own part (RankWorker's check, then its open): decode
    and check the descriptor on its own, then lease, receive the fd, check, map, set access."""
    from kvstate.core.descriptor import decode_cached
    from kvstate.core.errors import GroupRejected
    from kvstate.core.validate import descriptor_problems
    from kvstate.share import attach, native_import

    importer.check_gates()  # reuse enabled, as a worker's check requires
    d = decode_cached(wire, importer.config.deployment)
    problems = descriptor_problems(d, importer.expectation())
    if problems:
        raise GroupRejected(problems)
    assert d.rank == rank and d.tp == tp, (d.rank, d.tp)
    owner = _Worker(importer, d)
    part: Part[Any, Any, Any, Any, Any] = Part(owner, d)
    owner.parts.append(part)
    part.fire("validate")
    native_import.lease_part(part)  # as RankShare leases its part
    attach.open_part(part)  # as RankShare opens it
    return part


def _kvstate_rank_importer(conn: Connection, p: dict[str, Any]) -> tuple[float, ...]:
    from kvstate.transport.host import HostTransport

    wire = conn.recv()
    t = HostTransport()
    im = Importer(import_config(), t)
    samples = []
    try:
        for i in range(p["repeats"] + 1):
            for rank in range(p["tp"]):
                t0 = time.perf_counter()
                part = import_rank(im, wire[rank], rank, p["tp"])
                t1 = time.perf_counter()
                assert part.state == "imported" and t.view(part.mapped())[0] == 1
                part.fire("close")
                if i:  # the first round is a warm-up
                    samples.append(t1 - t0)
    finally:
        im.close()
        conn.send("done")
    return tuple(samples)


def kvstate_rank_import(params: dict[str, Any]) -> Figure:
    """kvstate's per-rank row: one worker's import of its own part, per rank."""
    samples = run_pair(_kvstate_exporter, _kvstate_rank_importer, params)
    return Figure(tuple(samples), note="one part per worker: check own descriptor + lease + SCM_RIGHTS + map")


# -- multiprocessing.shared_memory -----------------------------------------------------


def _shm_exporter(conn: Connection, p: dict[str, Any]) -> None:
    from multiprocessing import shared_memory
    segments = [shared_memory.SharedMemory(create=True, size=p["bank_bytes"]) for _ in range(p["tp"])]
    try:
        for s in segments:
            assert s.buf is not None
            s.buf[:: mmap.PAGESIZE] = b"\1" * len(range(0, p["bank_bytes"], mmap.PAGESIZE))  # touch every page
        conn.send([s.name for s in segments])
        conn.recv()
    finally:
        for s in segments:
            s.close()
            s.unlink()


def _shm_importer(conn: Connection, p: dict[str, Any]) -> tuple[float, ...]:
    from multiprocessing import shared_memory
    names = conn.recv()
    samples = []
    for i in range(p["repeats"] + 1):
        t0 = time.perf_counter()
        attached = [shared_memory.SharedMemory(name=n) for n in names]
        t1 = time.perf_counter()
        assert all(a.size >= p["bank_bytes"] and a.buf is not None and a.buf[0] == 1 for a in attached)
        for a in attached:  # (both processes share the bench's resource tracker: the
            a.close()         # exporter's unlink is the one unregistration)
        if i:  # the first round is a warm-up
            samples.append(t1 - t0)
    conn.send("done")
    return tuple(samples)


def shm_attach(params: dict[str, Any]) -> Figure:
    samples = run_pair(_shm_exporter, _shm_importer, params)
    return Figure(tuple(samples), note=f"shm_open + mmap of {params['tp']} segments")


# -- torch.multiprocessing -----------------------------------------------------------


def _torch() -> Any:
    try:
        return importlib.import_module("torch.multiprocessing")
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise Skipped("torch is not installed (optional; CPU wheel: pip install torch==2.13.0)") from None


def _torch_exporter(conn: Connection, p: dict[str, Any]) -> None:
    tmp = _torch()
    import torch
    tmp.set_sharing_strategy("file_descriptor")
    tensors = [torch.ones(p["bank_bytes"], dtype=torch.uint8).share_memory_() for _ in range(p["tp"])]
    conn.send("ready")
    while conn.recv() == "go":
        conn.send(tensors)
    conn.send("bye")


def _torch_importer(conn: Connection, p: dict[str, Any]) -> tuple[float, ...]:
    tmp = _torch()
    tmp.set_sharing_strategy("file_descriptor")
    conn.recv()
    samples = []
    for i in range(p["repeats"] + 1):
        t0 = time.perf_counter()
        conn.send("go")
        tensors = conn.recv()
        t1 = time.perf_counter()
        assert len(tensors) == p["tp"] and all(int(t[0]) == 1 and t.numel() == p["bank_bytes"] for t in tensors)
        del tensors
        if i:
            samples.append(t1 - t0)
    conn.send("stop")
    conn.recv()
    return tuple(samples)


def torch_fd_sharing(params: dict[str, Any]) -> Figure:
    _torch()  # skip here, before starting processes, when torch is absent
    samples = run_pair(_torch_exporter, _torch_importer, params)
    return Figure(tuple(samples), note="request + receive shared tensors (file_descriptor strategy)")


# -- NIXL ------------------------------------------------------------------------------


def _nixl() -> Any:
    from kvstate.core.errors import BackendUnavailable
    from kvstate.transport.nixl import load_nixl
    try:
        return load_nixl()
    except BackendUnavailable as exc:
        raise Skipped(str(exc)) from None


def _nixl_config(nixl: Any, p: dict[str, Any]) -> Any:
    # The asking rows run without NIXL's progress thread: its default is a busy spin
    # (kvstate.transport.nixl.agent, PROGRESS_DELAY_US) that shares each side's one CPU with
    # the polling main thread, and a round trip then took 8 to 21 ms here. Without it, both
    # sides progress UCX in their own polls, NIXL's fastest way to answer.
    return nixl.nixl_agent_config(enable_prog_thread=not p.get("nixl_ask", False), backends=["UCX"])


def _nixl_exporter(conn: Connection, p: dict[str, Any]) -> None:
    import numpy as np
    nixl = _nixl()
    agent = nixl.nixl_agent("b1-exporter", _nixl_config(nixl, p))
    banks = [mmap.mmap(-1, p["bank_bytes"]) for _ in range(p["tp"])]
    regions = []
    for b in banks:
        arr = np.frombuffer(b, dtype=np.uint8)
        arr[:: mmap.PAGESIZE] = 1
        regions.append((int(arr.ctypes.data), p["bank_bytes"], 0))
    reg = agent.register_memory([(*r, "") for r in regions], "DRAM")
    conn.send((agent.get_agent_metadata(), regions))
    importer = agent.add_remote_agent(conn.recv()) if p.get("nixl_ask") else None
    if importer is not None:
        while not conn.poll(0):  # answer each notification with itself, polling as NIXL's users do
            for peer, messages in agent.get_new_notifs().items():
                for message in messages:
                    agent.send_notif(peer, message)
    conn.recv()
    if importer is not None:  # before the importer's agent goes: no reconnects towards it
        agent.remove_remote_agent(_text(importer))
    agent.deregister_memory(reg)
    conn.send("bye")
    conn.recv()  # the importer is gone: no reconnects towards a closed peer


def _text(name: str | bytes) -> str:
    """An agent's name as NIXL's calls take it (add_remote_agent returns bytes in some versions)."""
    return name.decode() if isinstance(name, bytes) else name


def _ask(agent: Any, peer: str, message: bytes) -> None:
    """One notification to ``peer`` and its answer, polled for (at most 10 s)."""
    agent.send_notif(peer, message)
    deadline = time.monotonic() + 10.0
    while message not in agent.get_new_notifs().get(peer, ()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"NIXL peer {peer} did not answer within 10 s")


def _nixl_importer(conn: Connection, p: dict[str, Any]) -> tuple[float, ...]:
    import numpy as np
    nixl = _nixl()
    agent = nixl.nixl_agent("b1-importer", _nixl_config(nixl, p))
    metadata, regions = conn.recv()
    if p.get("nixl_ask"):
        conn.send(agent.get_agent_metadata())  # the exporter answers through it
    local = [mmap.mmap(-1, p["bank_bytes"]) for _ in range(p["tp"])]
    local_regions = [(int(np.frombuffer(b, dtype=np.uint8).ctypes.data), p["bank_bytes"], 0) for b in local]
    samples = []
    for i in range(p["repeats"] + 1):
        t0 = time.perf_counter()
        reg = agent.register_memory([(*r, "") for r in local_regions], "DRAM")
        name = _text(agent.add_remote_agent(metadata))
        remote = agent.prep_xfer_dlist(name, regions, "DRAM")
        mine = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_regions, "DRAM")
        if p.get("nixl_ask"):
            _ask(agent, name, b"import %d" % i)  # the first message to a loaded agent connects
        t1 = time.perf_counter()
        # teardown in NIXL's order, off the clock
        agent.release_dlist_handle(mine)
        agent.release_dlist_handle(remote)
        agent.remove_remote_agent(name)
        agent.deregister_memory(reg)
        if i:
            samples.append(t1 - t0)
    conn.send("done")
    conn.recv()
    del agent
    conn.send("gone")
    return tuple(samples)


def nixl_register_and_load(params: dict[str, Any]) -> Figure:
    _nixl()
    samples = run_pair(_nixl_exporter, _nixl_importer, params, env=LOOPBACK)
    return Figure(tuple(samples), note="register destinations + add_remote_agent + prep lists (UCX, lo)")


def nixl_register_load_and_ask(params: dict[str, Any]) -> Figure:
    """The NIXL row with one round trip to the exporter, as kvstate's lease is one: a
    notification and its answer, over the connection the loaded metadata opens."""
    _nixl()
    samples = run_pair(_nixl_exporter, _nixl_importer, {**params, "nixl_ask": True}, env=LOOPBACK)
    return Figure(tuple(samples), note="the NIXL row + send_notif and its answer (UCX, lo; no progress thread)")
