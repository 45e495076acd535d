"""``kvstate gpucheck``: the cuda backend on a real device, in one run, with real processes.

It checks, printing one JSON summary on stdout (progress on stderr):

1. the driver and device: version, whether the batched copy is used, granularity, the
   FABRIC trial;
2. VMM (POSIX fd) import between two processes: a tp=1 group through its whole
   lifecycle, the real Exporter in a child process and the Importer here, the prefix
   load checked bit for bit; the import timed over ``--rounds`` rounds;
3. legacy IPC import between two processes, the same way, with the lifetime rule: the
   exporter's lease expires while this process still has the memory open, and its drain
   must refuse (no release) until this side closed;
4. a gather (blocks of a mapped bank into device memory) and a scatter (device memory
   into blocks of a bank), checked bit for bit;
5. a kill during a copy: a child imports the exporter's bank, loads, keeps copies of it
   queued on the device and is SIGKILLed while some are unfinished (it says how many just
   before); the exporter must still drain to quiescent and release;
6. figures: group import time, and the bandwidth of a gather and of one contiguous op
   against a plain ``cudaMemcpy`` of the same bytes (``kvs_cuda_memcpy``);
7. its own wall time, each check's and the whole run's: the run passes only within
   ``--budget-s`` (five minutes by default), so every run checks that claim.

It needs a CUDA driver and device; the same run goes through the CPU shim driver with
``KVSTATE_LIBCUDA=tests/cudashim/_build/libcudashim.so`` (a test does, to exercise its
control flow; the shim's figures mean nothing). Exit status: 0 every check passed, 1 a
check failed, 2 not run (no driver or device). Under five minutes on a GPU at the
defaults.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstate.core.capabilities import Access
from kvstate.core.errors import BackendUnavailable, KvStateError, ArgumentInvalid, ReuseRefused
from kvstate.core.reasons import ArgumentReason, BackendReason, DecisionReason
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment

if TYPE_CHECKING:
    from kvstate.transport.native import Op

DEPLOYMENT = Deployment("kvstate-gpu-check", bytes(range(32)))
#: A Llama-8B-like rank: 32 layers, 8 KV heads of 128, 16-token blocks, bf16.
GEOMETRY = Geometry.uniform(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype=DType.BF16,
                            layout=Layout.LAYER_MAJOR, num_blocks=64)
TIMEOUT_S = 60.0
#: The whole run, discovery to summary, must take less than this (``--budget-s``).
BUDGET_S = 300.0
#: Slows the shim's copies in the killed child so that the kill lands during one; the
#: real driver never reads it.
SHIM_DELAY_ENV = "KVSTATE_CUDASHIM_DELAY_US"


def pattern(nbytes: int, salt: int = 0) -> bytes:
    unit = bytes((salt * 11 + i) % 251 for i in range(251))
    return (unit * (nbytes // len(unit) + 1))[:nbytes]


def _say(msg: str) -> None:
    print(f"gpucheck: {msg}", file=sys.stderr, flush=True)


def _wait(conn: Connection, what: str) -> Any:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"no {what} from the other process within {TIMEOUT_S} s")
    return conn.recv()


def _free_buffer(t: Any, buf: Any) -> None:
    """Give ``buf`` back after a check. An op that timed out may still pin it (free_buffer
    is Busy while the device has it), so wait for the pin to go, up to TIMEOUT_S; if it
    never does, the buffer is left to the process's exit rather than raising here, which
    would hide the check's own failure."""
    from kvstate.core.errors import Busy

    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            t.free_buffer(buf)
            return
        except Busy as exc:
            if time.monotonic() >= deadline:
                _say(f"a device buffer stays pinned after {TIMEOUT_S} s ({exc}); left to the process's exit")
                return
            time.sleep(0.01)


def _socket_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvs-gpucheck-"))
    os.chmod(d, 0o700)
    return d / "sock"


def _expected(blocks: Sequence[int]) -> bytes:
    data = pattern(GEOMETRY.nbytes, 2)
    return b"".join(data[o:o + n] for b in blocks for o, n in GEOMETRY.block_extents(b))


# -- the exporter, in a child process ---------------------------------------------------------


def _exporter(device: bytes, kind_value: str, socket_dir: str, lease_timeout_s: float, conn: Connection) -> None:
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.transport.cuda import CudaTransport

    kind = HandleKind(kind_value)
    t = CudaTransport(device, kind=kind, legacy_ipc=kind is HandleKind.CUDA_IPC)
    ex = Exporter(ExportConfig(DEPLOYMENT, Path(socket_dir), os.urandom(16), 1, handle_kind=kind,
                               lease_timeout_s=lease_timeout_s), t)
    bank = ex.add_bank(0, GEOMETRY)
    bank.register()
    t.write(bank.mapped(), pattern(GEOMETRY.nbytes, 2))
    bank.advertise()
    ex.start()
    conn.send(ex.descriptor(0))
    while True:  # commands from the importer's side
        cmd = _wait(conn, "command")
        if cmd == "try_drain":  # must refuse while the importer has the memory open
            try:
                # Short: the importer lets go on its own once a renewal is refused (<= half
                # a lease later); what is checked is that release waits for that.
                ex.drain(0.05)
                conn.send({"refused": False, "bank_state": bank.state})
            except KvStateError as exc:
                conn.send({"refused": True, "why": str(exc), "bank_state": bank.state, "holds": len(bank.holds)})
        elif cmd == "drain":
            waited = ex.drain(TIMEOUT_S)
            ex.stop()
            t.close()
            conn.send({"bank_state": bank.state, "drain_s": waited})
            return


def gpu_admission(t: Any, device: bytes) -> Any:
    """The deployment profile admission a GPU import needs (kvstate.reuse.gates): this
    worker publishes its CUDA transport and is admitted under gpu-single-node."""
    from kvstate.core.capabilities import FabricTrial
    from kvstate.reuse.profile import (PROTOCOL_VERSION, DeploymentProfile, PublishedCapabilities,
                                       TransportCapabilities, admit)

    caps = PublishedCapabilities(device_uuids=(device,), handle_kinds=t.capabilities.handle_kinds,
                                 fabric_trial=FabricTrial.NOT_RUN,
                                 transports=(TransportCapabilities(t.name, t.capabilities),),
                                 geometry_fingerprint=GEOMETRY.fingerprint(), protocol_version=PROTOCOL_VERSION)
    admission = admit(DeploymentProfile.GPU_SINGLE_NODE, caps)
    if not admission.admitted:
        raise ReuseRefused(DecisionReason.GPU_PROFILE_NOT_ADMITTED,
                           f"this GPU worker is not admitted under gpu-single-node: {admission}")
    return admission


def gpu_import_config(t: Any, device: bytes) -> Any:
    """An importer config that may import GPU memory: reuse and GPU reuse enabled (both
    off by default) under this worker's admission (kvstate.reuse.gates)."""
    from kvstate.reuse.policy import ReuseSettings
    from kvstate.share.importer import ImportConfig

    reuse = ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True)
    return ImportConfig(DEPLOYMENT, reuse=reuse, admission=gpu_admission(t, device))


def _spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Connection]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def _reap(proc: Any, wait: bool = True) -> int | None:
    """The child's exit status: waited for if it was told to finish (``wait``), else killed."""
    proc.join(TIMEOUT_S if wait else 0.1)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    code: int | None = proc.exitcode
    return code


# -- 2 and 3: import between two processes ------------------------------------------------------


def two_process_import(device: bytes, kind: HandleKind, rounds: int) -> dict[str, Any]:
    """A tp=1 group exported by a child process and imported here ``rounds`` times; the
    first load is checked bit for bit. For legacy IPC, more than a lease term later (this
    side renews its lease) and while this side still has the memory open, the child's drain
    must refuse: it may release only once this side closed."""
    from kvstate.share.importer import Importer
    from kvstate.transport.cuda import CudaTransport

    legacy = kind is HandleKind.CUDA_IPC
    t = CudaTransport(device, kind=kind, legacy_ipc=legacy)
    proc, conn = _spawn(_exporter, device, kind.value, str(_socket_dir()), 1.0 if legacy else 30.0)
    importer = Importer(gpu_import_config(t, device), t)
    blocks = list(range(0, GEOMETRY.num_blocks, 3))
    want = _expected(blocks)
    times: list[float] = []
    out: dict[str, Any] = {"kind": kind.value}
    dst = t.alloc_buffer(len(want))
    told = False
    try:
        wire = _wait(conn, "descriptor")
        for i in range(rounds):
            start = time.perf_counter()
            group = importer.import_group([wire])
            times.append(time.perf_counter() - start)
            if i == 0:
                result = group.load_prefix(blocks, [dst], timeout=TIMEOUT_S)
                out["load_ok"] = result.bytes == len(want) and t.read(dst, len(want)) == want
            if legacy and i == rounds - 1:
                time.sleep(1.5)  # past the exporter's lease term; renewed, and the memory stays open
                conn.send("try_drain")
                out["exporter_refused_while_open"] = _wait(conn, "drain attempt")
            group.drain(TIMEOUT_S)
        conn.send("drain")
        told = True
        out["exporter"] = _wait(conn, "drain report")
    finally:
        for g in importer.groups:
            if not g.is_terminal:
                g.drain(TIMEOUT_S)  # a check that failed midway still lets go of what it mapped
        _free_buffer(t, dst)
        importer.close()
        out["exporter_exit"] = _reap(proc, told)
        t.close()
    times.sort()
    out.update(rounds=rounds, import_p50_ms=statistics.median(times) * 1e3, import_min_ms=times[0] * 1e3)
    out["ok"] = bool(out.get("load_ok") and out["exporter"].get("bank_state") == "released"
                     and out["exporter_exit"] == 0
                     and (not legacy or out["exporter_refused_while_open"].get("refused")))
    return out


# -- 4 and 6: gather, scatter, bandwidth --------------------------------------------------------


def _median(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gather_scatter(device: bytes, mib: int, block_kib: int, repeats: int) -> dict[str, Any]:
    """Every other block of a mapped bank gathered into device memory, and scattered back
    into another bank's every other block, both checked bit for bit; then the gather and
    one contiguous op timed against cudaMemcpy of the same bytes."""
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device)
    g = t.granularity()
    size = max(g, (mib << 20) // g * g)
    block = block_kib << 10
    n = size // block // 2
    moved = n * block
    bank = t.map(t.reserve(size), 0, t.create(size))
    back = t.map(t.reserve(size), 0, t.create(size))
    t.set_access(bank, Access.READ_WRITE)
    t.set_access(back, Access.READ_WRITE)
    src = pattern(size, 4)
    t.write(bank, src)
    t.write(back, bytes(size))
    dst = t.alloc_buffer(moved)
    gather_blocks = [(2 * i * block, i * block, block) for i in range(n)]
    scatter_blocks = [(i * block, 2 * i * block, block) for i in range(n)]
    out: dict[str, Any] = {"bytes": moved, "blocks": n, "block_bytes": block}
    try:
        t.submit_gather(bank, dst, gather_blocks).result(TIMEOUT_S)
        out["gather_ok"] = t.read(dst, moved) == b"".join(src[s:s + ln] for s, _, ln in gather_blocks)
        t.submit_gather(dst, back, scatter_blocks).result(TIMEOUT_S)
        got = t.read(back, size)
        want = bytearray(size)
        for s, d, ln in gather_blocks:
            want[s:s + ln] = src[s:s + ln]
        out["scatter_ok"] = got == bytes(want)

        def gather() -> None:
            t.submit_gather(bank, dst, gather_blocks).result(TIMEOUT_S)

        def op_copy() -> None:
            t.submit_copy(bank, dst, moved).result(TIMEOUT_S)

        def memcpy() -> None:
            t.memcpy(dst, bank, moved)

        gather_s, op_s, memcpy_s = _median(gather, repeats), _median(op_copy, repeats), _median(memcpy, repeats)
        out.update(gather_GBps=moved / gather_s / 1e9, op_copy_GBps=moved / op_s / 1e9,
                   memcpy_GBps=moved / memcpy_s / 1e9, gather_vs_memcpy=memcpy_s / gather_s,
                   op_copy_vs_memcpy=memcpy_s / op_s)
    finally:
        _free_buffer(t, dst)
        for m in (bank, back):
            t.unmap(m)
            t.free(m.reservation)
            t.release(m.allocation)
        t.close()
    out["ok"] = bool(out.get("gather_ok") and out.get("scatter_ok"))
    return out


# -- 5: a kill during a copy ------------------------------------------------------------------


#: Whole-bank copies the killed child keeps queued, so that the device is busy with its
#: ops when the kill lands (a GPU copies the bank far faster than Python submits one op).
IN_FLIGHT = 16


def _loader(device: bytes, wire: bytes, delay_us: int, conn: Connection) -> None:
    os.environ[SHIM_DELAY_ENV] = str(delay_us)  # before the driver loads
    from kvstate.share.importer import Importer
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device)
    importer = Importer(gpu_import_config(t, device), t)
    group = importer.import_group([wire])
    dst = t.alloc_buffer(GEOMETRY.nbytes)
    group.load_prefix([0], [dst], timeout=TIMEOUT_S)  # the data path, once (one block: the shim's delay)
    src = group.parts[0].mapped()
    conn.send("loading")
    ops: deque[Op] = deque()
    while True:  # until killed: copies of the imported bank queued on the device
        while len(ops) < IN_FLIGHT:
            ops.append(t.submit_copy(src, dst, GEOMETRY.nbytes))
        if conn.poll():  # the parent kills right after this answer: how many the device still has
            conn.recv()
            conn.send(sum(not op.poll() for op in ops))
        if ops[0].wait(0.002):
            ops.popleft().result(0)


def kill_during_copy(device: bytes, delay_us: int) -> dict[str, Any]:
    """The exporter here; a child imports, loads once, then keeps copies of the imported
    bank queued on the device, and is SIGKILLed right after it reported how many are still
    unfinished (so the kill lands during a copy). The exporter must see the death, drain
    to quiescent and release; the device must still work afterwards."""
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.transport.cuda import CudaTransport

    t = CudaTransport(device)
    ex = Exporter(ExportConfig(DEPLOYMENT, _socket_dir(), os.urandom(16), 1, handle_kind=HandleKind.POSIX_FD), t)
    bank = ex.add_bank(0, GEOMETRY)
    bank.register()
    t.write(bank.mapped(), pattern(GEOMETRY.nbytes, 2))
    bank.advertise()
    ex.start()
    proc, conn = _spawn(_loader, device, ex.descriptor(0), delay_us)
    out: dict[str, Any] = {}
    try:
        out["child_loading"] = _wait(conn, "loading report") == "loading"
        time.sleep(0.2)  # copies in flight
        conn.send("report")
        out["child_ops_unfinished_at_kill"] = _wait(conn, "in-flight report")
        os.kill(proc.pid, signal.SIGKILL)
        out["child_exit"] = _reap(proc)
        out["exporter_drain_s"] = ex.drain(TIMEOUT_S)
        out["bank_state"] = bank.state
    finally:
        ex.stop()
    buf = t.alloc_buffer(1 << 16)  # the device still works
    t.write(buf, pattern(1 << 16, 5))
    out["device_usable"] = t.read(buf, 1 << 16) == pattern(1 << 16, 5)
    t.free_buffer(buf)
    t.close()
    out["ok"] = bool(out["child_loading"] and out["child_ops_unfinished_at_kill"] > 0
                     and out["child_exit"] == -signal.SIGKILL and out["bank_state"] == "released"
                     and out["device_usable"])
    return out


# -- the run -----------------------------------------------------------------------------------


def run(device: bytes | None, *, rounds: int, repeats: int, mib: int, block_kib: int,
        kill_delay_us: int, budget_s: float = BUDGET_S) -> dict[str, Any]:
    from kvstate.transport.cuda import CudaTransport, devices, driver_info, rules

    started = time.perf_counter()
    drv = driver_info()
    seen = devices()
    if not seen:
        raise BackendUnavailable.missing("cuda", "the driver sees no CUDA device")
    dev = device or seen[0].uuid
    info = next((d for d in seen if d.uuid == dev), None)
    t = CudaTransport(dev, fabric=True)
    report: dict[str, Any] = {
        "library": drv.library, "driver_version": drv.version, "batched_copy": drv.batch,
        "device": rules.format_uuid(dev), "device_name": info.name if info else "?",
        "visible_devices": [rules.format_uuid(d.uuid) for d in seen],
        "granularity": t.granularity(), "min_granularity": t.min_granularity,
        "fabric_trial": t.fabric_trial.value, "fabric_why": t.fabric_decision.why,
    }
    t.close()
    checks: dict[str, Any] = {}
    plan: list[tuple[str, str, Callable[[], dict[str, Any]]]] = [
        ("vmm_two_process", "VMM (POSIX fd) import between two processes",
         lambda: two_process_import(dev, HandleKind.POSIX_FD, rounds)),
        ("legacy_ipc_two_process", "legacy IPC import between two processes, and its lifetime",
         lambda: two_process_import(dev, HandleKind.CUDA_IPC, max(1, rounds // 5))),
        ("gather_scatter", "gather and scatter, bit for bit, and bandwidth",
         lambda: gather_scatter(dev, mib, block_kib, repeats)),
        ("kill_during_copy", "a kill during a copy", lambda: kill_during_copy(dev, kill_delay_us)),
    ]
    for key, what, check in plan:
        _say(what)
        begun = time.perf_counter()
        try:
            checks[key] = check()
        except (KvStateError, OSError, TimeoutError, EOFError) as exc:  # reported; the other checks still run
            checks[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        checks[key]["elapsed_s"] = time.perf_counter() - begun
    report["checks"] = checks
    gs, vmm, ipc = checks["gather_scatter"], checks["vmm_two_process"], checks["legacy_ipc_two_process"]
    report["figures"] = {
        "vmm_import_p50_ms": vmm.get("import_p50_ms"), "legacy_ipc_import_p50_ms": ipc.get("import_p50_ms"),
        "gather_GBps": gs.get("gather_GBps"), "op_copy_GBps": gs.get("op_copy_GBps"),
        "memcpy_GBps": gs.get("memcpy_GBps"), "gather_vs_memcpy": gs.get("gather_vs_memcpy"),
        "op_copy_vs_memcpy": gs.get("op_copy_vs_memcpy"),
    }
    elapsed = time.perf_counter() - started
    report.update(elapsed_s=elapsed, budget_s=budget_s, within_budget=elapsed < budget_s)
    report["ok"] = all(c["ok"] for c in checks.values()) and report["within_budget"]
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="device UUID (GPU-xxxxxxxx-...); default: the first visible device")
    p.add_argument("--rounds", type=int, default=50, help="group import rounds to time (legacy IPC: a fifth)")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per bandwidth figure")
    p.add_argument("--mib", type=int, default=512, help="bank size for the gather, scatter and bandwidth")
    p.add_argument("--block-kib", type=int, default=256, help="block size of the gather and scatter")
    p.add_argument("--kill-delay-us", type=int, default=0,
                   help="slow each copy of the killed child by this much (the CPU shim only)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the run fails when it takes longer than this")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstate gpucheck", description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    from kvstate.transport.cuda.rules import parse_uuid

    try:
        if min(args.rounds, args.repeats, args.mib, args.block_kib) < 1 or args.kill_delay_us < 0 \
                or not args.budget_s > 0:
            raise ArgumentInvalid(ArgumentReason.RANGE, "--rounds, --repeats, --mib and --block-kib must be at least 1, "
                                  "--budget-s positive and --kill-delay-us not negative")
        report = run(parse_uuid(args.device) if args.device else None, rounds=args.rounds, repeats=args.repeats,
                     mib=args.mib, block_kib=args.block_kib, kill_delay_us=args.kill_delay_us,
                     budget_s=args.budget_s)
    except (KvStateError, OSError, TimeoutError) as exc:
        if isinstance(exc, BackendUnavailable) and exc.reason is BackendReason.MISSING:  # not here: not run
            print(json.dumps({"ok": False, "not_run": exc.detail}))
            print(f"GPU CHECK NOT RUN: {exc}", file=sys.stderr)
            return 2
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        print(f"GPU CHECK FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
