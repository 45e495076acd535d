"""Commands a NIXL peer process runs (see tests/support/peers.py); one agent per peer.

Banks are filled with a pattern that depends on (seed, block, byte), so a loaded block
is checked against what the exporter wrote without shipping the bytes back.
"""

from __future__ import annotations

import mmap
import time
from typing import Any

import numpy as np

from kvstate.core.errors import KvStateError
from kvstate.core.handles import HandleKind
from kvstate.transport import Registry
from kvstate.transport.nixl import LeaseGate, NixlTransport
from kvstate.transport.nixl.handle import decode
from support.reuse import REUSE_ON

State = dict[str, Any]


def pattern(seed: int, block_ids: np.ndarray, block_bytes: int) -> np.ndarray:
    """The bytes of blocks ``block_ids`` of a bank filled with ``seed``: one row per block."""
    col = np.arange(block_bytes, dtype=np.uint64)
    rows = (block_ids.astype(np.uint64)[:, None] * np.uint64(2654435761) + col * np.uint64(40503)
            + np.uint64(seed * 977))
    return (rows % np.uint64(251)).astype(np.uint8)


def start(state: State, device_memory: bool = False) -> str:
    state["t"] = NixlTransport(device_memory=device_memory)
    return str(state["t"].agent_name)


def second_agent(state: State) -> str:
    NixlTransport()  # must refuse: one agent per process
    return "created"


def unsupported(state: State) -> list[str]:
    """NIXL is a Backend and an ExportingTransport, not a MappedTransport: it has no VMM
    methods, the lifecycle sides refuse it before touching it, and it exports only NIXL."""
    from pathlib import Path

    from kvstate.core.identity import Deployment
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.share.importer import ImportConfig, Importer
    from kvstate.transport import Backend, MappedTransport

    t: NixlTransport = state["t"]
    Registry().register(t)  # it is a Backend: the explicit registry accepts it
    found = [f"backend:{isinstance(t, Backend)}", f"mapped:{isinstance(t, MappedTransport)}"]
    found += [f"{name}:{'present' if hasattr(t, name) else 'absent'}" for name in ("reserve", "map", "set_access", "unmap")]
    deployment = Deployment("nixl-test", bytes(32))
    for name, call in [("exporter", lambda: Exporter(ExportConfig(deployment, Path("/nonexistent"), bytes(16), 1), t)),
                       ("importer", lambda: Importer(ImportConfig(deployment, reuse=REUSE_ON), t)),
                       ("export_memfd", lambda: t.export(t.create(4096), HandleKind.MEMFD))]:
        try:
            call()
            found.append(f"{name}:accepted")
        except Exception as exc:
            found.append(f"{name}:{type(exc).__name__}")
    return found


def export_bank(state: State, blocks: int, block_bytes: int, seed: int, generation: int,
                owned_by_test: bool = False) -> bytes:
    """Create (or, with ``owned_by_test``, mmap and register) a bank, fill it, export it."""
    t: NixlTransport = state["t"]
    size = blocks * block_bytes
    if owned_by_test:
        buf = mmap.mmap(-1, size)
        arr = np.frombuffer(buf, dtype=np.uint8)
        state["buf"] = buf
        alloc = t.register(int(arr.ctypes.data), size)
    else:
        alloc = t.create(size)
        arr = np.frombuffer(alloc.view(), dtype=np.uint8)
    arr.reshape(blocks, block_bytes)[:] = pattern(seed, np.arange(blocks), block_bytes)
    del arr
    state["bank"] = alloc
    return t.export(alloc, generation=generation)


def fill_bank(state: State, seed: int, blocks: int, block_bytes: int) -> None:
    """Overwrite the bank's memory (also after deregistration: the owner reuses it)."""
    buf = state["buf"] if "buf" in state else state["bank"].view()
    np.frombuffer(buf, dtype=np.uint8).reshape(blocks, block_bytes)[:] = pattern(seed, np.arange(blocks), block_bytes)


def release_bank(state: State) -> None:
    state["t"].release(state.pop("bank"))


def unmap_bank(state: State) -> None:
    """The owner frees the memory it had registered (after deregistering it)."""
    state.pop("buf").close()


def import_bank(state: State, handle: bytes, size: int, generation: int, lease_s: float = 60.0) -> dict[str, Any]:
    t: NixlTransport = state["t"]
    requested = time.monotonic_ns()
    remote = t.import_(handle, size, generation=generation)
    state.setdefault("remotes", {})[generation] = remote
    state["lease"] = LeaseGate(remote.agent_name, requested_at_ns=requested, duration_s=lease_s)
    if "dst" not in state:
        state["dst"] = t.create(size)
    return {"agent": remote.agent_name, "generation": remote.generation, "size": remote.size}


def load(state: State, blocks: list[int], block_bytes: int, seed: int | None, generation: int,
         timeout: float = 20.0) -> dict[str, Any]:
    """Load ``blocks`` into dst blocks 0..n-1; report whether they equal the seed's pattern."""
    t: NixlTransport = state["t"]
    dst = state["dst"]
    view = np.frombuffer(dst.view(), dtype=np.uint8)
    view[:] = 0xEE  # a sentinel no pattern byte equals (pattern bytes are < 251)
    t.load(state["remotes"][generation], dst, blocks, block_bytes=block_bytes, lease=state["lease"], timeout=timeout)
    got = view[:len(blocks) * block_bytes].reshape(len(blocks), block_bytes)
    return {"matches": None if seed is None else bool(np.array_equal(got, pattern(seed, np.array(blocks), block_bytes))),
            "untouched": bool((view == 0xEE).all())}


def dst_untouched(state: State) -> bool:
    return bool((np.frombuffer(state["dst"].view(), dtype=np.uint8) == 0xEE).all())


def end_lease(state: State, why: str) -> None:
    state["lease"].end(why)


def short_lease(state: State, agent: str, seconds: float) -> None:
    state["lease"] = LeaseGate(agent, requested_at_ns=time.monotonic_ns(), duration_s=seconds)


def close_remote(state: State, generation: int) -> None:
    state["t"].close_remote(state["remotes"][generation])


def close(state: State) -> None:
    state["t"].close()


def decode_only(state: State, handle: bytes, generation: int) -> str:
    return decode(handle, generation=generation).agent_name



def register_vram(state: State) -> list[str]:
    """Register host memory as VRAM: what a machine with no GPU says to the device path."""
    from kvstate.core.capabilities import MemoryKind
    t: NixlTransport = state["t"]
    host = t.create(4096)
    kinds = ",".join(sorted(k.value for k in t.capabilities.memory_kinds))
    try:
        t.register(host.addr, 4096, MemoryKind.DEVICE, 0)
    except Exception as exc:
        return [kinds, type(exc).__name__]
    return [kinds, "registered"]


def freeze(state: State) -> None:
    """Stop this process (SIGSTOP): a hung exporter, as an importer sees it."""
    import os
    import signal
    os.kill(os.getpid(), signal.SIGSTOP)


def import_renamed(state: State, handle: bytes, size: int, generation: int, name: str) -> None:
    """Import a well-formed record whose agent name is not the one inside its metadata."""
    import attrs
    forged = attrs.evolve(decode(handle), agent_name=name).encode()
    state["t"].import_(forged, size, generation=generation)


def load_in_background(state: State, blocks: list[int], block_bytes: int, generation: int,
                       timeout: float = 20.0) -> None:
    """Start a load on a thread (its outcome: ``load_outcome``), e.g. against a stopped exporter."""
    import threading

    def run() -> None:
        try:
            state["t"].load(state["remotes"][generation], state["dst"], blocks, block_bytes=block_bytes,
                            lease=state["lease"], timeout=timeout)
            state["outcome"] = "done"
        except Exception as exc:
            state["outcome"] = type(exc).__name__

    state["loader"] = threading.Thread(target=run)
    state["loader"].start()
    deadline = time.monotonic() + 10
    while state["dst"].pins == 0 and "outcome" not in state and time.monotonic() < deadline:
        time.sleep(0.001)  # until the load holds its pin (or ended)


def load_outcome(state: State) -> str:
    state["loader"].join(30)
    return str(state.pop("outcome", "running"))


def release_target(state: State) -> str:
    """Release the load target; the error's class name when refused (the target stays)."""
    try:
        state["t"].release(state["dst"])
    except KvStateError as exc:
        return f"{type(exc).__name__}: {exc.reason.value}"
    del state["dst"]
    if "dst_mem" in state:  # deregistered: the owner may free its memory now
        state.pop("dst_mem").close()
    return "released"


def make_target(state: State, kind: str, size: int) -> None:
    """A new load target: ``created`` by the transport, or ``registered`` caller memory
    (an mmap this process owns, as an engine's host KV would be)."""
    t: NixlTransport = state["t"]
    if kind == "created":
        state["dst"] = t.create(size)
        return
    mem = mmap.mmap(-1, size)
    addr = np.frombuffer(mem, dtype=np.uint8).ctypes.data
    state["dst"], state["dst_mem"] = t.register(addr, size), mem


def target_pins(state: State) -> int:
    return int(state["dst"].pins)


# -- an exporter process with several banks, through NIXL (the exporter's own path) ------

BANKS_DEPLOYMENT_KEY = bytes(range(32))


def export_banks(state: State, banks: int, blocks: int, block_bytes: int, seed: int) -> list[bytes]:
    """One Exporter (handle kind nixl, leases over TCP) with ``banks`` banks in this
    process, bank r filled with ``seed + r``; their descriptors."""
    import os
    import tempfile
    from pathlib import Path

    from kvstate.core.geometry import DType, Geometry, Layout
    from kvstate.core.identity import Deployment
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.transport.host import HostTransport
    from kvstate.transport.nixl.exporting import NixlExportingHost

    t = NixlExportingHost(HostTransport(granularity=64 * 1024), state["t"])
    d = Path(tempfile.mkdtemp(prefix="kvs-nx-"))
    os.chmod(d, 0o700)
    config = ExportConfig(Deployment("nixl-banks", BANKS_DEPLOYMENT_KEY), d / "s", os.urandom(16), banks,
                          handle_kind=HandleKind.NIXL, tcp_listen=("127.0.0.1", 0))
    ex = Exporter(config, t, name="banks")
    g = Geometry.uniform(layers=1, kv_heads=1, head_dim=block_bytes // 4, block_tokens=1, dtype=DType.BF16,
                         layout=Layout.LAYER_MAJOR, num_blocks=blocks)
    assert g.block_bytes == block_bytes
    for r in range(banks):
        bank = ex.add_bank(r, g)
        bank.register()
        view = np.frombuffer(bank.view(), dtype=np.uint8)
        view[:blocks * block_bytes].reshape(blocks, block_bytes)[:] = pattern(seed + r, np.arange(blocks), block_bytes)
        del view
        bank.advertise()
    ex.start()
    state["exporter"] = ex
    return [ex.descriptor(r) for r in range(banks)]


def readvertise(state: State, rank: int) -> bytes:
    """A new generation of bank ``rank``: its new descriptor."""
    ex = state["exporter"]
    ex.banks[rank].advertise()
    return bytes(ex.descriptor(rank))


def import_descriptor(state: State, descriptor: bytes) -> dict[str, Any]:
    """Import the bank a descriptor names through NIXL (the record checked against the
    descriptor's generation), as RemotePart does; kept by rank."""
    from kvstate.core.descriptor import decode as decode_descriptor
    from kvstate.core.identity import Deployment

    d = decode_descriptor(descriptor, Deployment("nixl-banks", BANKS_DEPLOYMENT_KEY))
    remote = state["t"].import_(d.handle, d.size, generation=d.generation)
    state.setdefault("views", {})[d.rank] = remote
    return {"rank": d.rank, "generation": d.generation, "record_generation": decode(d.handle).generation}


def import_again(state: State, descriptor: bytes) -> bool:
    """A second part of this process imports the same bank at the same generation: True
    when it got the view the first import made."""
    from kvstate.core.descriptor import decode as decode_descriptor
    from kvstate.core.identity import Deployment

    d = decode_descriptor(descriptor, Deployment("nixl-banks", BANKS_DEPLOYMENT_KEY))
    remote = state["t"].import_(d.handle, d.size, generation=d.generation)
    return remote is state["views"][d.rank]


def close_view(state: State, rank: int) -> str | None:
    """One user closes rank ``rank``'s view; what the view says then (None: still open)."""
    remote = state["views"][rank]
    state["t"].close_remote(remote, "closed by one part")
    closed: str | None = remote.closed
    return closed


def load_rank(state: State, rank: int, blocks: list[int], block_bytes: int, seed: int) -> bool:
    """Load blocks of rank ``rank``'s bank and compare them with ``seed + rank``'s pattern."""
    t: NixlTransport = state["t"]
    remote = state["views"][rank]
    if "dst" not in state:
        state["dst"] = t.create(remote.size)
    gate = LeaseGate(remote.agent_name, requested_at_ns=time.monotonic_ns(), duration_s=60.0)
    t.load(remote, state["dst"], blocks, block_bytes=block_bytes, lease=gate, timeout=20.0)
    got = np.frombuffer(state["dst"].view(), dtype=np.uint8)[:len(blocks) * block_bytes].reshape(len(blocks),
                                                                                                  block_bytes)
    return bool(np.array_equal(got, pattern(seed + rank, np.array(blocks), block_bytes)))


def stop_exporter(state: State) -> None:
    ex = state.pop("exporter")
    ex.stop()
    ex.drain(10.0)
