"""B2, prefix load: ``n_blocks`` random blocks of ``block_bytes`` from a bank into a buffer.

Rows: kvstate's op engine (the lead's row), a numpy gather, NIXL READs (UCX over
loopback TCP, and UCX's same-node defaults), and a contiguous memcpy of the same number
of bytes, the physical limit here and the reference. Every row moves the same bytes,
and the gather and NIXL rows check them once against what the bank holds.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.b1_import import LOOPBACK, _nixl
from benchmarks.framework import Figure, Skipped, timed
from benchmarks.procs import run_pair


def _fill(bank: Any, block_bytes: int) -> None:
    """Block i holds the byte i % 251, so any block is checkable by its index alone."""
    import numpy as np
    rows = bank.reshape(-1, block_bytes)
    rows[:] = (np.arange(rows.shape[0]) % 251).astype(np.uint8)[:, None]


def _blocks(p: dict[str, Any]) -> Any:
    import numpy as np
    rng = np.random.default_rng(p["seed"])
    return rng.choice(p["bank_blocks"], size=p["n_blocks"], replace=False).astype(np.int64)


def _check(dst: Any, idx: Any, block_bytes: int) -> None:
    import numpy as np
    rows = dst.reshape(-1, block_bytes)[: len(idx)]
    if not (np.array_equal(rows[:, 0], idx % 251) and np.array_equal(rows[:, -1], idx % 251)):
        raise RuntimeError("loaded bytes differ from the bank's: the row would be measuring a wrong copy")


def kvstate_op_gather(p: dict[str, Any]) -> Figure:
    """kvstate's row: the op engine gathers the blocks out of an *imported* bank (exported
    as a memfd, imported, mapped read-only) into the local buffer."""
    import numpy as np

    from kvstate.core.handles import HandleKind
    from kvstate.core.capabilities import Access
    from kvstate.transport.host import HostHandle, HostTransport

    bb = p["block_bytes"]
    t = HostTransport()
    size = -(-p["bank_blocks"] * bb // t.granularity()) * t.granularity()
    own = t.create(size)
    res_w = t.reserve(size)
    map_w = t.map(res_w, 0, own)
    t.set_access(map_w, Access.READ_WRITE)
    _fill(np.frombuffer(t.view(map_w), dtype=np.uint8)[: p["bank_blocks"] * bb], bb)
    exported = t.export(own, HandleKind.MEMFD)
    imported = t.import_(HostHandle(exported.fd, exported.identity), size)
    res_r = t.reserve(size)
    bank = t.map(res_r, 0, imported)
    t.set_access(bank, Access.READ)
    dst = np.empty(p["n_blocks"] * bb, dtype=np.uint8)
    idx = _blocks(p)
    blocks = np.stack([idx * bb, np.arange(len(idx)) * bb, np.full(len(idx), bb)], axis=1).astype(np.uint64)
    native = t.native
    try:
        samples = timed(lambda: native.submit_gather(bank.region, dst, blocks).result(60.0), p["repeats"])
        _check(dst, idx, bb)
    finally:
        for m, r in ((bank, res_r), (map_w, res_w)):
            t.unmap(m)
            t.free(r)
        t.release(imported)
        t.release(own)
    return Figure(samples, p["n_blocks"] * bb, f"op engine gather, {native.stats().workers} workers")


def numpy_gather(p: dict[str, Any]) -> Figure:
    import numpy as np
    bb = p["block_bytes"]
    bank = np.empty(p["bank_blocks"] * bb, dtype=np.uint8)
    _fill(bank, bb)
    dst = np.empty(p["n_blocks"] * bb, dtype=np.uint8)
    idx = _blocks(p)
    src2, dst2 = bank.reshape(-1, bb), dst.reshape(-1, bb)
    samples = timed(lambda: np.take(src2, idx, axis=0, out=dst2), p["repeats"])
    _check(dst, idx, bb)
    return Figure(samples, p["n_blocks"] * bb, "np.take(bank, blocks, axis=0, out=dst)")


def memcpy(p: dict[str, Any]) -> Figure:
    import numpy as np
    bb = p["block_bytes"]
    n = p["n_blocks"] * bb
    bank = np.empty(p["bank_blocks"] * bb, dtype=np.uint8)
    _fill(bank, bb)
    dst = np.empty(n, dtype=np.uint8)
    samples = timed(lambda: np.copyto(dst, bank[:n]), p["repeats"])
    return Figure(samples, n, "one contiguous copy of the same bytes")


def _nixl_exporter(conn: Connection, p: dict[str, Any]) -> None:
    import numpy as np
    from kvstate.transport.nixl import NixlTransport
    _nixl()
    t = NixlTransport()
    bank = t.create(p["bank_blocks"] * p["block_bytes"])
    _fill(np.frombuffer(bank.view(), dtype=np.uint8), p["block_bytes"])
    conn.send(t.export(bank, generation=1))
    conn.recv()
    t.close()


def _nixl_importer(conn: Connection, p: dict[str, Any]) -> tuple[float, ...]:
    import numpy as np
    from kvstate.transport.nixl import LeaseGate, NixlTransport
    t = NixlTransport()
    handle = conn.recv()
    requested = time.monotonic_ns()
    remote = t.import_(handle, p["bank_blocks"] * p["block_bytes"], generation=1)
    lease = LeaseGate(remote.agent_name, requested_at_ns=requested, duration_s=3600)
    dst = t.create(p["n_blocks"] * p["block_bytes"])
    view = np.frombuffer(dst.view(), dtype=np.uint8)
    view[:] = 0xFF
    idx = _blocks(p)
    samples = timed(lambda: t.load(remote, dst, idx, block_bytes=p["block_bytes"], lease=lease), p["repeats"])
    _check(view, idx, p["block_bytes"])
    del view
    t.close()  # before the exporter goes: no reconnects to a closed peer
    conn.send("done")
    return samples


def nixl_read_loopback(p: dict[str, Any]) -> Figure:
    _nixl()
    samples = run_pair(_nixl_exporter, _nixl_importer, p, env=LOOPBACK)
    return Figure(tuple(samples), p["n_blocks"] * p["block_bytes"], "kvstate.transport.nixl.transport load; UCX_TLS=tcp, lo")


def nixl_read_same_node(p: dict[str, Any]) -> Figure:
    _nixl()
    env = {"NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}
    samples = run_pair(_nixl_exporter, _nixl_importer, p, env=env)
    return Figure(tuple(samples), p["n_blocks"] * p["block_bytes"], "same, UCX's default transports (shared memory)")
