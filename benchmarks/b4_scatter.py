"""B4, paged scatter: bank blocks into an engine's paged KV cache at the engine's block ids.

Workload: ``n_blocks`` random blocks of ``block_bytes`` in all, spread evenly over
``regions`` layer regions (vLLM's CPU layout: per layer ``[num_blocks, heads, block_size,
2 * head_dim]`` bf16, one 64 KiB page per block and layer at full size), scattered from
random bank blocks into random destination pages (block 0 never used, ids unordered).

Rows, each moving the same bytes:

- kvstate ``Group.load``: an imported (memfd, mapped read-only) bank into the paged
  destination, timed from the call to ``handle.wait`` returning (validation, planning,
  submit and copy); the destination is checked once;
- kvstate first layer usable: the same load, timed to ``wait_region`` of the first region;
- kvstate ``Bank.store`` of the same pages from engine tensors into bank blocks;
- torch ``index_copy_`` and ``index_put_`` per layer (they gather into a dense temporary
  first: ``src[bank_ids]``), when torch is installed;
- numpy fancy assignment per layer, ``dst[dst_ids] = src[bank_ids]``;
- NIXL READ of the blocks from an exporter process's registered bank into registered
  destination memory (UCX's same-node transports);
- one contiguous memcpy of the same number of bytes: the limit, and the reference.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.b1_import import _nixl
from benchmarks.framework import Figure, Skipped, timed
from benchmarks.procs import run_pair

HEADS, BLOCK_SIZE = 8, 16


def _shape(p: dict[str, Any], num_blocks: int) -> tuple[int, int, int, int]:
    """A page of block_bytes: [heads, block_size, 2 * head_dim] bf16."""
    per_token = p["block_bytes"] // (HEADS * BLOCK_SIZE * 2)
    return num_blocks, HEADS, BLOCK_SIZE, per_token


def _ids(p: dict[str, Any]) -> tuple[list[int], list[int]]:
    import numpy as np
    rng = np.random.default_rng(p["seed"])
    per_region = p["n_blocks"] // p["regions"]
    bank = rng.choice(p["bank_blocks"], size=per_region, replace=False)
    dst = rng.choice(np.arange(1, p["dst_blocks"]), size=per_region, replace=False)
    return [int(b) for b in bank], [int(d) for d in dst]


def _fill_bank(views: dict[str, Any]) -> None:
    """Page b of region i holds the value (b * 7 + i) % 65521 everywhere: checkable by index."""
    import numpy as np
    for i, v in enumerate(views.values()):
        v[:] = ((np.arange(v.shape[0], dtype=np.uint32) * 7 + i) % 65521).astype(np.uint16)[:, None, None, None]


def _check(dst: dict[str, Any], bank_ids: list[int], dst_ids: list[int]) -> None:
    for i, t in enumerate(dst.values()):
        for b, d in ((bank_ids[0], dst_ids[0]), (bank_ids[-1], dst_ids[-1])):
            got = t[d].reshape(-1)
            want = (b * 7 + i) % 65521
            if int(got[0]) != want or int(got[-1]) != want:
                raise RuntimeError("scattered pages differ from the bank's: the row would time a wrong copy")


class _Pair:
    """An exporter with one bank in vLLM's CPU layout and an importer of it, in-process."""

    def __init__(self, p: dict[str, Any]) -> None:
        from kvstate.core import layouts
        from kvstate.core.identity import Deployment
        from kvstate.share.exporter import Exporter
        from kvstate.share.export_config import ExportConfig
        from kvstate.share.importer import ImportConfig, Importer
        from kvstate.reuse.policy import ReuseSettings
        from kvstate.transport.host import HostTransport

        _, heads, bs, per_token = _shape(p, p["bank_blocks"])
        self.geometry = layouts.vllm_cpu(p["regions"], num_blocks=p["bank_blocks"], num_kv_heads=heads,
                                         block_size=bs, head_dim=per_token // 2)
        self._dir = d = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
        d.chmod(0o700)
        deployment = Deployment("bench", bytes(range(32)))
        self.exporter = Exporter(ExportConfig(deployment, d / "s", os.urandom(16), 1), HostTransport())
        self.bank = self.exporter.add_bank(0, self.geometry)
        self.bank.register()
        views = self.bank.tensors("numpy")
        _fill_bank(views)
        del views
        self.bank.advertise()
        self.exporter.start()
        self.importer = Importer(ImportConfig(deployment, reuse=ReuseSettings(enable_decode_to_prefill_reuse=True)), HostTransport())
        self.group = self.importer.import_group([self.exporter.descriptor(0)])

    def close(self) -> None:
        self.group.drain(30.0)
        self.importer.close()
        self.exporter.stop()
        self.exporter.drain(30.0)
        shutil.rmtree(self._dir, ignore_errors=True)


def _pages(p: dict[str, Any], names: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    """Destination (or source) pages per region: torch bf16 when torch is here, else numpy uint16."""
    shape = _shape(p, p["dst_blocks"])
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        import numpy as np
        return {n: np.zeros(shape, dtype=np.uint16) for n in names}, "numpy uint16 pages"
    return {n: torch.zeros(shape, dtype=torch.bfloat16) for n in names}, "torch bf16 pages"


def kvstate_load(p: dict[str, Any]) -> Figure:
    pair = _Pair(p)
    try:
        bank_ids, dst_ids = _ids(p)
        dst, kind = _pages(p, pair.geometry.names)

        def load() -> None:
            h = pair.group.load(bank_ids, dst, dst_ids)
            if not h.wait(60.0) or not h.result() or h.failed_blocks():
                raise RuntimeError(f"load did not complete: {h.result()}")
            h.close()

        samples = timed(load, p["repeats"])
        _check({n: _bits(t) for n, t in dst.items()}, bank_ids, dst_ids)
    finally:
        pair.close()
    return Figure(samples, p["n_blocks"] * p["block_bytes"], f"Group.load, {p['regions']} ops, {kind}")


def kvstate_first_layer(p: dict[str, Any]) -> Figure:
    pair = _Pair(p)
    try:
        bank_ids, dst_ids = _ids(p)
        dst, kind = _pages(p, pair.geometry.names)
        first = pair.geometry.names[0]
        samples = []
        for i in range(p["repeats"] + 1):
            t0 = time.perf_counter()
            h = pair.group.load(bank_ids, dst, dst_ids)
            if not h.wait_region(first, 60.0):
                raise RuntimeError("first region did not load")
            t1 = time.perf_counter()
            h.wait(60.0)
            h.close()
            if i:
                samples.append(t1 - t0)
    finally:
        pair.close()
    return Figure(tuple(samples), 0, f"Group.load to wait_region({first!r}); 1/{p['regions']} of the bytes")


def kvstate_store(p: dict[str, Any]) -> Figure:
    pair = _Pair(p)
    try:
        bank_ids, src_ids = _ids(p)
        src, kind = _pages(p, pair.geometry.names)

        def store() -> None:
            h = pair.bank.store(src, src_ids, bank_ids)
            if not h.wait(60.0) or h.failed_blocks():
                raise RuntimeError(f"store did not complete: {h.result()}")
            h.close()

        samples = timed(store, p["repeats"])
    finally:
        pair.close()
    return Figure(samples, p["n_blocks"] * p["block_bytes"], f"Bank.store from {kind}, {p['regions']} ops")


def _bits(t: Any) -> Any:
    """A tensor's elements as 16-bit integers, for the check."""
    import numpy as np
    if isinstance(t, np.ndarray):
        return t
    import torch
    return t.view(torch.int16).numpy().view(np.uint16)


def _torch_pages(p: dict[str, Any]) -> tuple[Any, list[Any], list[Any], Any, Any]:
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise Skipped("torch is not installed (optional; CPU wheel: pip install torch==2.13.0)") from None
    bank_ids, dst_ids = _ids(p)
    src = [torch.full(_shape(p, p["bank_blocks"]), float(i), dtype=torch.bfloat16) for i in range(p["regions"])]
    dst = [torch.zeros(_shape(p, p["dst_blocks"]), dtype=torch.bfloat16) for _ in range(p["regions"])]
    return torch, src, dst, torch.tensor(bank_ids), torch.tensor(dst_ids)


def torch_index_copy(p: dict[str, Any]) -> Figure:
    torch, src, dst, b, d = _torch_pages(p)

    def run() -> None:
        for s, t in zip(src, dst):
            t.index_copy_(0, d, s.index_select(0, b))

    samples = timed(run, p["repeats"])
    return Figure(samples, p["n_blocks"] * p["block_bytes"],
                  f"dst.index_copy_(0, dst_ids, src.index_select(0, bank_ids)) per layer, {torch.get_num_threads()} threads")


def torch_index_put(p: dict[str, Any]) -> Figure:
    torch, src, dst, b, d = _torch_pages(p)

    def run() -> None:
        for s, t in zip(src, dst):
            t.index_put_((d,), s[b])

    samples = timed(run, p["repeats"])
    return Figure(samples, p["n_blocks"] * p["block_bytes"],
                  f"dst.index_put_((dst_ids,), src[bank_ids]) per layer, {torch.get_num_threads()} threads")


def numpy_fancy(p: dict[str, Any]) -> Figure:
    import numpy as np
    bank_ids, dst_ids = _ids(p)
    b, d = np.array(bank_ids), np.array(dst_ids)
    src = [np.full(_shape(p, p["bank_blocks"]), i, dtype=np.uint16) for i in range(p["regions"])]
    dst = [np.zeros(_shape(p, p["dst_blocks"]), dtype=np.uint16) for _ in range(p["regions"])]

    def run() -> None:
        for s, t in zip(src, dst):
            t[d] = s[b]

    samples = timed(run, p["repeats"])
    return Figure(samples, p["n_blocks"] * p["block_bytes"], "dst[dst_ids] = src[bank_ids] per layer")


def memcpy(p: dict[str, Any]) -> Figure:
    import numpy as np
    n = p["n_blocks"] * p["block_bytes"]
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty(n, dtype=np.uint8)
    samples = timed(lambda: np.copyto(dst, src), p["repeats"])
    return Figure(samples, n, "np.copyto of the same bytes, contiguous, one thread")


# -- NIXL ------------------------------------------------------------------------------------


def _nixl_exporter(conn: Connection, p: dict[str, Any]) -> None:
    import numpy as np
    from kvstate.transport.nixl import NixlTransport
    _nixl()
    t = NixlTransport()
    regions, nb, bb = p["regions"], p["bank_blocks"], p["block_bytes"]
    bank = t.create(regions * nb * bb)
    rows = np.frombuffer(bank.view(), dtype=np.uint16).reshape(regions, nb, bb // 2)
    for i in range(regions):
        rows[i] = ((np.arange(nb, dtype=np.uint32) * 7 + i) % 65521).astype(np.uint16)[:, None]
    del rows
    conn.send(t.export(bank, generation=1))
    conn.recv()
    t.close()


def _nixl_importer(conn: Connection, p: dict[str, Any]) -> tuple[float, ...]:
    import numpy as np
    from kvstate.transport.nixl import LeaseGate, NixlTransport
    t = NixlTransport()
    regions, nb, nd, bb = p["regions"], p["bank_blocks"], p["dst_blocks"], p["block_bytes"]
    handle = conn.recv()
    requested = time.monotonic_ns()
    remote = t.import_(handle, regions * nb * bb, generation=1)
    lease = LeaseGate(remote.agent_name, requested_at_ns=requested, duration_s=3600)
    dst = t.create(regions * nd * bb)
    bank_ids, dst_ids = _ids(p)
    src_blocks = np.array([r * nb + b for r in range(regions) for b in bank_ids], dtype=np.int64)
    dst_blocks = np.array([r * nd + d for r in range(regions) for d in dst_ids], dtype=np.int64)
    samples = timed(lambda: t.load(remote, dst, src_blocks, dst_blocks, block_bytes=bb, lease=lease), p["repeats"])
    view = np.frombuffer(dst.view(), dtype=np.uint16).reshape(regions, nd, bb // 2)
    _check({str(i): view[i] for i in range(regions)}, bank_ids, dst_ids)
    del view
    t.close()
    conn.send("done")
    return samples


def nixl_read(p: dict[str, Any]) -> Figure:
    _nixl()
    env = {"NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}
    samples = run_pair(_nixl_exporter, _nixl_importer, p, env=env)
    return Figure(tuple(samples), p["n_blocks"] * p["block_bytes"],
                  "NixlTransport.load: READ into registered pages; UCX same-node defaults")
