"""The GPU check of the cuda backend: one run, real processes, printed figures.

Run it with ``python benchmarks/gpu_check.py`` (or ``python -m kvstate.harness.gpucheck``) on a
machine with a CUDA GPU and the ``cuda`` extra installed. In one run it:

1. reports the device (by UUID), the allocation granularity and the FABRIC trial;
2. two processes: one creates, maps, writes a pattern and exports a POSIX fd; the other
   receives it by SCM_RIGHTS, imports, reserves, maps, sets read access and verifies the
   pattern byte for byte; the same for legacy cuIpc (and its own-process open refused);
3. a tp=1 group through its whole lifecycle over the cuda backend, with the real
   Exporter (in a child process) and Importer: import, load a prefix into device memory
   and verify it, drain to quiescent and close, then the exporter drains and releases;
   the import is timed over many rounds (goal: p50 under 2 ms);
4. device-to-device gather out of a mapped bank against one contiguous cuMemcpy of the
   same bytes, run side by side (goal: gather at 80 % or more of contiguous bandwidth).

Without a GPU (or cuda-python, or a driver) it prints why and exits with status 2: it
never reports success it did not measure. Status 1 means a functional check failed;
goals are reported as MET or MISSED (``--strict`` makes a missed goal status 1).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvstate.core.errors import BackendUnavailable, KvStateError
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment
from kvstate.core.capabilities import Access

DEPLOYMENT = Deployment("kvstate-gpu-check", bytes(range(32)))
#: A Llama-8B-like rank: 32 layers, 8 KV heads of 128, 16-token blocks, bf16.
def _llama8b(layout: Layout) -> Geometry:
    return Geometry.uniform(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype=DType.BF16,
                            layout=layout, num_blocks=128)


GEOMETRY = _llama8b(Layout.LAYER_MAJOR)
IMPORT_GOAL_S = 2e-3
GATHER_GOAL = 0.80
TIMEOUT_S = 60.0


def pattern(nbytes: int, salt: int = 0) -> bytes:
    unit = bytes((salt * 11 + i) % 251 for i in range(251))
    return (unit * (nbytes // len(unit) + 1))[:nbytes]


def _wait(conn: Connection, what: str) -> Any:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"no {what} from the other process within {TIMEOUT_S} s")
    return conn.recv()


# -- 2. two processes: export, import, map, set_access, verify ------------------------------


def _vmm_exporter(device: bytes, sock: socket.socket, conn: Connection, size: int) -> None:
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device)
    a = t.create(size)
    r = t.reserve(size)
    m = t.map(r, 0, a)
    t.set_access(m, Access.READ_WRITE)
    t.write(m, pattern(size, 1))
    h = t.export(a, HandleKind.POSIX_FD)
    assert h.fd is not None
    socket.send_fds(sock, [h.identity], [h.fd])
    _wait(conn, "'done'")
    t.unmap(m)
    t.free(r)
    t.release(a)
    t.close()
    conn.send("released")


def two_process_vmm(device: bytes) -> dict[str, Any]:
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device)
    size = 4 * t.granularity()
    ctx = mp.get_context("spawn")
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_vmm_exporter, args=(device, child_sock, child_conn, size), daemon=True)
    child.start()
    try:
        parent_sock.settimeout(TIMEOUT_S)
        data, fds, _, _ = socket.recv_fds(parent_sock, 64, 1)
        try:
            start = time.perf_counter()
            h = t.receive_handle(HandleKind.POSIX_FD, data, fds)
            a = t.import_(h, size)
            r = t.reserve(size)
            m = t.map(r, 0, a)
            t.set_access(m, Access.READ)
            import_s = time.perf_counter() - start
        finally:
            for fd in fds:
                os.close(fd)
        same = t.read(m, size) == pattern(size, 1)
        t.unmap(m)
        t.free(r)
        t.release(a)
        parent_conn.send("done")
        released = _wait(parent_conn, "release report") == "released"
    finally:
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
        parent_sock.close()
        child_sock.close()
    t.close()
    return {"bytes": size, "pattern_ok": same, "import_map_s": import_s, "exporter_released": released,
            "exporter_exit": child.exitcode}


def _legacy_importer(device: bytes, conn: Connection, size: int) -> None:
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device, kind=HandleKind.CUDA_IPC, legacy_ipc=True)
    data = _wait(conn, "legacy handle")
    a = t.import_(t.receive_handle(HandleKind.CUDA_IPC, data, []), size)
    r = t.reserve(size)
    m = t.map(r, 0, a)
    t.set_access(m, Access.READ)
    same = t.read(m, size) == pattern(size, 3)
    t.unmap(m)
    t.free(r)
    t.release(a)  # cuIpcCloseMemHandle, before the exporter may free
    t.close()
    conn.send(same)


def two_process_legacy_ipc(device: bytes) -> dict[str, Any]:
    """Legacy cuIpc, on request: the exporter (this process) keeps its cuMemAlloc memory
    until the importer closed the handle; its own open of the handle is refused."""
    from kvstate.core.errors import LegacyIpcRefused
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device, kind=HandleKind.CUDA_IPC, legacy_ipc=True)
    size = t.granularity()
    a = t.create(size)
    r = t.reserve(size)
    m = t.map(r, 0, a)
    t.set_access(m, Access.READ_WRITE)
    t.write(m, pattern(size, 3))
    h = t.export(a, HandleKind.CUDA_IPC)
    try:
        t.import_(h, size)
        own_open_refused = False
    except LegacyIpcRefused:
        own_open_refused = True
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_legacy_importer, args=(device, child_conn, size), daemon=True)
    child.start()
    try:
        parent_conn.send(h.identity)
        same = bool(_wait(parent_conn, "legacy import report"))
    finally:
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
    t.unmap(m)
    t.free(r)
    t.release(a)  # cuMemFree only now: the importer closed its handle and exited
    t.close()
    return {"handle_bytes": len(h.identity), "pattern_ok": same, "own_open_refused": own_open_refused,
            "importer_exit": child.exitcode}


# -- 3. a tp=1 group through its whole lifecycle ----------------------------------------


def _lifecycle_exporter(device: bytes, socket_dir: str, conn: Connection) -> None:
    from kvstate.share.exporter import ExportConfig, Exporter
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device)
    ex = Exporter(ExportConfig(DEPLOYMENT, Path(socket_dir), os.urandom(16), 1,
                               handle_kind=HandleKind.POSIX_FD), t)
    bank = ex.add_bank(0, GEOMETRY)
    bank.register()
    t.write(bank.mapped(), pattern(GEOMETRY.nbytes, 2))
    bank.advertise()
    ex.start()
    conn.send(ex.descriptor(0))
    _wait(conn, "'drain'")
    waited = ex.drain(10.0)
    ex.stop()
    conn.send({"bank_state": bank.state, "drain_s": waited})
    t.close()


def lifecycle_tp1(device: bytes, rounds: int) -> dict[str, Any]:
    from kvstate.share.importer import ImportConfig, Importer
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device)
    d = Path(tempfile.mkdtemp(prefix="kvs-gpucheck-"))
    os.chmod(d, 0o700)
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_lifecycle_exporter, args=(device, str(d / "sock"), child_conn), daemon=True)
    child.start()
    importer = Importer(ImportConfig(DEPLOYMENT), t)
    blocks = list(range(0, GEOMETRY.num_blocks, 3))
    want = pattern(GEOMETRY.nbytes, 2)
    expected = b"".join(want[o:o + n] for b in blocks for o, n in GEOMETRY.block_extents(b))
    times: list[float] = []
    quiescent: list[float] = []
    loaded_ok = False
    states: set[str] = set()
    try:
        wire = _wait(parent_conn, "descriptor")
        dst = t.alloc_buffer(len(expected))
        for i in range(rounds):
            start = time.perf_counter()
            group = importer.import_group([wire])
            times.append(time.perf_counter() - start)
            if i == 0:
                result = group.load_prefix(blocks, [dst], timeout=TIMEOUT_S)
                loaded_ok = result.bytes == len(expected) and t.read(dst, len(expected)) == expected
            quiescent.append(group.drain(TIMEOUT_S))
            states.add(group.state)
        t.free_buffer(dst)
        parent_conn.send("drain")
        exporter = _wait(parent_conn, "drain report")
    finally:
        importer.close()
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
    t.close()
    times.sort()
    return {"rounds": rounds, "import_p50_s": statistics.median(times), "import_min_s": times[0],
            "import_p90_s": times[int(0.9 * (len(times) - 1))], "load_ok": loaded_ok,
            "group_states": sorted(states), "group_quiescent_max_s": max(quiescent),
            "exporter": exporter, "exporter_exit": child.exitcode}


# -- 4. gather against contiguous ------------------------------------------------------------


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gather_vs_contiguous(device: bytes, repeats: int) -> list[dict[str, Any]]:
    """For each layout, gather every other block (no two adjacent: nothing coalesces)
    out of a mapped bank into device memory, timed from submit to completion as the
    engine sees it; against one contiguous copy of the same bytes, in the same run."""
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device)
    out = []
    for layout in (Layout.LAYER_MAJOR, Layout.BLOCK_MAJOR):
        g = _llama8b(layout)
        size = g.bank_size(t.granularity())
        a = t.create(size)
        r = t.reserve(size)
        m = t.map(r, 0, a)
        t.set_access(m, Access.READ_WRITE)
        blocks, pos = [], 0
        for b in range(0, g.num_blocks, 2):
            for off, n in g.block_extents(b):
                blocks.append((off, pos, n))
                pos += n
        dst = t.alloc_buffer(pos)

        def gather() -> None:
            t.submit_gather(m, dst, blocks).result(TIMEOUT_S)

        def contiguous() -> None:
            t.submit_copy(m, dst, pos).result(TIMEOUT_S)

        g_s = _median_time(gather, repeats)
        c_s = _median_time(contiguous, repeats)
        out.append({"layout": layout.value, "bytes": pos, "extents": len(blocks),
                    "gather_GBps": pos / g_s / 1e9, "contiguous_GBps": pos / c_s / 1e9, "ratio": c_s / g_s})
        t.free_buffer(dst)
        t.unmap(m)
        t.free(r)
        t.release(a)
    t.close()
    return out


# -- the run -----------------------------------------------------------------------------------


def run(device: bytes | None, rounds: int, repeats: int) -> dict[str, Any]:
    from kvstate.transport.cuda import rules as cuda_rules
    from kvstate.transport.cuda import CudaTransport, visible_devices

    devices = visible_devices()
    if not devices:
        raise BackendUnavailable("cuda", "no visible CUDA device")
    dev = device or devices[0]
    t = CudaTransport(dev, fabric=True)
    err, version = t.driver.cuDriverGetVersion()
    err, name = t.driver.cuDeviceGetName(128, t.device)
    report: dict[str, Any] = {
        "device": cuda_rules.format_uuid(dev), "device_name": name.split(b"\0")[0].decode(),
        "driver_version": int(version), "visible_devices": [cuda_rules.format_uuid(u) for u in devices],
        "granularity_recommended": t.granularity(), "granularity_minimum": int(t.min_granularity),
        "fabric_trial": t.fabric_trial.value, "fabric_why": t.fabric_decision.why,
    }
    t.close()
    report["vmm_two_process"] = two_process_vmm(dev)
    report["legacy_ipc_two_process"] = two_process_legacy_ipc(dev)
    report["lifecycle_tp1"] = lifecycle_tp1(dev, rounds)
    report["gather"] = gather_vs_contiguous(dev, repeats)
    lc, vmm, ipc = report["lifecycle_tp1"], report["vmm_two_process"], report["legacy_ipc_two_process"]
    report["functional_ok"] = bool(
        ipc["pattern_ok"] and ipc["own_open_refused"] and ipc["handle_bytes"] == 64 and ipc["importer_exit"] == 0
        and
        vmm["pattern_ok"] and vmm["exporter_released"] and vmm["exporter_exit"] == 0 and lc["load_ok"]
        and lc["group_states"] == ["closed"] and lc["exporter"]["bank_state"] == "released"
        and lc["exporter_exit"] == 0)
    report["goals"] = {
        "import_tp1_p50_under_2ms": lc["import_p50_s"] < IMPORT_GOAL_S,
        "gather_at_least_80pct_contiguous": {g["layout"]: g["ratio"] >= GATHER_GOAL for g in report["gather"]},
    }
    return report


def _print(report: dict[str, Any]) -> None:
    vmm, lc = report["vmm_two_process"], report["lifecycle_tp1"]
    print(f"device            {report['device']} ({report['device_name']}), driver {report['driver_version']}")
    print(f"granularity       recommended {report['granularity_recommended']} B, "
          f"minimum {report['granularity_minimum']} B")
    print(f"FABRIC trial      {report['fabric_trial']}: {report['fabric_why']}")
    print(f"two processes     {vmm['bytes']} B pattern {'OK' if vmm['pattern_ok'] else 'MISMATCH'}; "
          f"import+reserve+map+set_access {vmm['import_map_s'] * 1e3:.3f} ms")
    ipc = report["legacy_ipc_two_process"]
    print(f"legacy cuIpc      {ipc['handle_bytes']} B handle, pattern {'OK' if ipc['pattern_ok'] else 'MISMATCH'}, "
          f"own-process open {'refused' if ipc['own_open_refused'] else 'NOT REFUSED'}")
    print(f"tp=1 lifecycle    load {'OK' if lc['load_ok'] else 'MISMATCH'}; states {lc['group_states']}; "
          f"exporter bank {lc['exporter']['bank_state']}")
    print(f"group import      p50 {lc['import_p50_s'] * 1e3:.3f} ms, min {lc['import_min_s'] * 1e3:.3f} ms, "
          f"p90 {lc['import_p90_s'] * 1e3:.3f} ms over {lc['rounds']} rounds "
          f"(goal < {IMPORT_GOAL_S * 1e3:.0f} ms: {'MET' if report['goals']['import_tp1_p50_under_2ms'] else 'MISSED'})")
    for g in report["gather"]:
        met = "MET" if g["ratio"] >= GATHER_GOAL else "MISSED"
        print(f"gather {g['layout']:<11} {g['bytes'] / 2**20:.0f} MiB in {g['extents']} extents: "
              f"{g['gather_GBps']:.1f} GB/s vs contiguous {g['contiguous_GBps']:.1f} GB/s = "
              f"{g['ratio'] * 100:.1f} % (goal >= {GATHER_GOAL * 100:.0f} %: {met})")
    print(f"functional        {'OK' if report['functional_ok'] else 'FAILED'}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--device", help="device UUID (GPU-xxxxxxxx-...); default: the first visible device")
    p.add_argument("--rounds", type=int, default=50, help="group import rounds to time")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per gather figure")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="a missed goal is a failure (status 1)")
    args = p.parse_args(argv)
    from kvstate.transport.cuda.rules import parse_uuid

    try:
        report = run(parse_uuid(args.device) if args.device else None, args.rounds, args.repeats)
    except BackendUnavailable as exc:
        print(f"GPU CHECK NOT RUN: {exc}", file=sys.stderr)
        return 2
    except (KvStateError, OSError, TimeoutError) as exc:
        print(f"GPU CHECK FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    goals = report["goals"]
    all_goals = goals["import_tp1_p50_under_2ms"] and all(goals["gather_at_least_80pct_contiguous"].values())
    if not report["functional_ok"]:
        return 1
    return 1 if args.strict and not all_goals else 0


if __name__ == "__main__":
    sys.exit(main())
