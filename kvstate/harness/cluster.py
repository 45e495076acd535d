"""Real exporter and importer worker processes, for the demo and the multi-process tests.

The parent starts a decode engine of ``tp`` exporter processes (one bank each, filled
with a deterministic KV pattern) and a prefill engine of ``tp`` importer processes. Each
importer process validates and imports the whole rank group (it becomes ready only when
every part is imported and compatible) and loads the prefix of its own rank. Parent and
children speak JSON over pipes (``send_bytes``; nothing is pickled after start-up).

Any process can be SIGKILLed at a named phase to show how the survivors recover.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kvstate.core.errors import KvStateError
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.identity import Deployment
from kvstate.harness.leaks import snapshot

PHASES = ("advertised", "importing", "ready", "loading", "draining")

# What each timing measures. The phases are measured inside the worker processes, from
# the moment kvstate's work starts (never process spawn, Python imports or engine start),
# and the slowest rank is reported; only the total is the parent's wall clock.
TIMING_ADVERTISE = "advertise: register, fill, sign, serve (slowest exporter)"
TIMING_IMPORT = "import: validate, lease, map, ready (slowest importer)"
TIMING_LOAD = "load: submit to last op done (slowest importer)"
TIMING_DRAIN = "drain: to quiescent (slowest process)"
TIMING_TOTAL = "total: parent's wall clock, with process spawn"
ROLES = ("exporter", "importer")


@attrs.frozen
class ClusterSpec:
    tp: int = 4
    layers: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    block_tokens: int = 16
    num_blocks: int = 256
    prefix_blocks: int = 64
    granularity: int = 2 << 20
    lease_timeout_s: float = 5.0
    timeout_s: float = 20.0
    seed: int = 7

    def geometry(self) -> Geometry:
        return Geometry.uniform(layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                        block_tokens=self.block_tokens, dtype=DType.BF16, layout=Layout.BLOCK_MAJOR,
                        num_blocks=self.num_blocks)

    def prefix(self) -> list[int]:
        """The prefix's block ids in the decode worker's bank: scattered, as after reuse."""
        step = 7 if self.num_blocks % 7 else 5
        return [(self.seed + i * step) % self.num_blocks for i in range(self.prefix_blocks)]


def kv_pattern(rank: int, block: int, nbytes: int, seed: int) -> bytes:
    """Deterministic bytes of one block of one rank, distinct per (seed, rank, block)."""
    return random.Random(f"kvstate:{seed}:{rank}:{block}").randbytes(nbytes)


INVENTORY_GROUP = "demo-prefix"


def block_hash(spec: ClusterSpec, block: int) -> int:
    """The 64-bit hash a decode engine would publish for one block of the prefix."""
    return int.from_bytes(hashlib.blake2b(f"{spec.seed}:{block}".encode(), digest_size=8).digest(), "little")


def expected_checksum(spec: ClusterSpec, rank: int) -> str:
    g = spec.geometry()
    h = hashlib.blake2b(digest_size=16)
    for b in spec.prefix():
        h.update(kv_pattern(rank, b, g.block_bytes, spec.seed))
    return h.hexdigest()


def resources() -> dict[str, int]:
    """Open fds and memfd mappings of this process (read by :mod:`kvstate.harness.leaks`)."""
    return snapshot().counts()


# -- worker processes ---------------------------------------------------------------------


def _send(conn: multiprocessing.connection.Connection, **msg: Any) -> None:
    conn.send_bytes(json.dumps(msg).encode())


def _recv(conn: multiprocessing.connection.Connection, timeout: float) -> dict[str, Any]:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    msg: dict[str, Any] = json.loads(conn.recv_bytes(1 << 20))
    return msg


def exporter_main(conn: multiprocessing.connection.Connection, spec_json: str, key_hex: str,
                  socket_dir: str, rank: int, source_hex: str) -> None:
    from kvstate.share.exporter import Exporter, ExportConfig
    from kvstate.reuse.inventory import Inventory
    from kvstate.transport.host import HostTransport

    spec = ClusterSpec(**json.loads(spec_json))
    baseline = resources()
    t = HostTransport(granularity=spec.granularity)
    config = ExportConfig(Deployment("kvstate-demo", bytes.fromhex(key_hex)), Path(socket_dir),
                          bytes.fromhex(source_hex), spec.tp, lease_timeout_s=spec.lease_timeout_s)
    inventory = Inventory(budget_blocks=spec.num_blocks)
    ex = Exporter(config, t, name=f"decode-rank{rank}", inventory=inventory)
    g = spec.geometry()
    started = time.monotonic()  # process spawn and imports are behind us: kvstate's work starts
    bank = ex.add_bank(rank, g)
    states = [bank.state]
    bank.observe(lambda c: states.append(c.dest))
    bank.register()
    view = bank.view()
    for b in range(g.num_blocks):
        view[b * g.block_bytes:(b + 1) * g.block_bytes] = kv_pattern(rank, b, g.block_bytes, spec.seed)
    bank.advertise()
    inventory.store(INVENTORY_GROUP, [block_hash(spec, b) for b in spec.prefix()])
    ex.start()
    _send(conn, descriptor=ex.descriptor(rank).hex(), epoch=inventory.epoch(INVENTORY_GROUP), pid=os.getpid(),
          advertise_s=time.monotonic() - started)
    while True:
        cmd = _recv(conn, 3600)
        if cmd["cmd"] == "drain":
            try:
                waited = ex.drain(spec.lease_timeout_s + spec.timeout_s)
                _send(conn, quiescent_s=waited, states=states)
            except KvStateError as exc:
                _send(conn, error=str(exc), states=states)
        elif cmd["cmd"] == "exit":
            ex.stop()
            del view
            _send(conn, leaks=_leaks(baseline))
            return


def _leaks(baseline: dict[str, int]) -> dict[str, int]:
    now = resources()
    return {k: now[k] - baseline[k] for k in now}


def importer_main(conn: multiprocessing.connection.Connection, spec_json: str, key_hex: str, rank: int) -> None:
    from kvstate.share.importer import BlockRequest, ImportConfig, Importer
    from kvstate.core.machine import StateChange
    from kvstate.transport.host import HostTransport

    spec = ClusterSpec(**json.loads(spec_json))
    baseline = resources()
    t = HostTransport(granularity=spec.granularity)
    states: list[str] = []

    def on_change(change: StateChange) -> None:
        if change.machine == "group":
            states.append(change.dest)

    im = Importer(ImportConfig(Deployment("kvstate-demo", bytes.fromhex(key_hex))), t, observers=[on_change])

    def state() -> str | None:
        return im.groups[-1].state if im.groups else None

    loader: threading.Thread | None = None

    while True:
        cmd = _recv(conn, 3600)
        try:
            if cmd["cmd"] == "import":
                blocks = BlockRequest(INVENTORY_GROUP, cmd["epoch"], tuple(block_hash(spec, b) for b in spec.prefix()))
                started = time.monotonic()
                im.import_group([bytes.fromhex(w) for w in cmd["wire"]], blocks=blocks)
                _send(conn, state=state(), import_s=time.monotonic() - started)
            elif cmd["cmd"] == "load":
                group = im.groups[-1]

                def load(group: Any = group, blocks: list[int] = cmd["blocks"]) -> None:
                    dst = bytearray(len(blocks) * group.parts[rank].descriptor.geometry.block_bytes)
                    try:
                        result = group.load_prefix(blocks, {rank: dst}, timeout=spec.timeout_s)
                        _send(conn, checksum=hashlib.blake2b(dst, digest_size=16).hexdigest(),
                              seconds=result.seconds, bytes=result.bytes, state=state())
                    except KvStateError as exc:
                        _send(conn, error=f"{type(exc).__name__}: {exc}", state=state())

                if cmd.get("stall"):
                    # The load stays in flight (its ops queued and pinning the parts) until
                    # the next command, a drain, lets the engine run again.
                    t.native.pause(True)
                    loader = threading.Thread(target=load)
                    loader.start()
                    while not group.loads:
                        time.sleep(0.001)
                    _send(conn, loading=True)
                else:
                    load()
            elif cmd["cmd"] == "drain":
                t.native.pause(False)
                last = im.groups[-1] if im.groups else None
                waited = 0.0 if last is None or last.is_terminal else last.drain(timeout=spec.timeout_s)
                if loader is not None:
                    loader.join(spec.timeout_s)  # its reply goes out before the drain's
                _send(conn, quiescent_s=waited, state=state(), states=["advertised", *states])
            elif cmd["cmd"] == "exit":
                im.close()
                _send(conn, leaks=_leaks(baseline))
                return
        except KvStateError as exc:
            _send(conn, error=f"{type(exc).__name__}: {exc}", state=state())


# -- the orchestrator ----------------------------------------------------------------------


@attrs.define
class Worker:
    role: str
    rank: int
    process: Any
    conn: multiprocessing.connection.Connection
    killed: bool = False

    def ask(self, timeout: float, **cmd: Any) -> dict[str, Any]:
        _send(self.conn, **cmd)
        return _recv(self.conn, timeout)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(5)
        self.killed = True


class Cluster:
    """A decode engine and a prefill engine of real processes. Use as a context manager."""

    def __init__(self, spec: ClusterSpec, *, log: Callable[[str], None] = lambda s: None) -> None:
        self.spec = spec
        self.log = log
        self.key = os.urandom(32)
        d = Path(tempfile.mkdtemp(prefix="kvstate-demo-"))
        d.chmod(0o700)
        self.socket_dir = d / "sockets"
        self.source = os.urandom(16)
        self.exporters: list[Worker] = []
        self.inventory_epoch = 0
        self.advertise_s: list[float] = []
        self.importers: list[Worker] = []
        self._ctx = multiprocessing.get_context("spawn")

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.exporters + self.importers:
            if w.process.is_alive():
                w.process.kill()
            w.process.join(5)

    def _start(self, role: str, rank: int, target: Any, *args: Any) -> Worker:
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=target, args=(child, *args), name=f"{role}-{rank}", daemon=True)
        p.start()
        child.close()
        return Worker(role, rank, p, parent)

    def start_decode(self) -> list[bytes]:
        spec_json = json.dumps(attrs.asdict(self.spec))
        self.exporters = [self._start("exporter", r, exporter_main, spec_json, self.key.hex(),
                                      str(self.socket_dir), r, self.source.hex()) for r in range(self.spec.tp)]
        replies = [_recv(w.conn, self.spec.timeout_s) for w in self.exporters]
        self.inventory_epoch = int(replies[0]["epoch"])
        self.advertise_s = [float(r["advertise_s"]) for r in replies]
        return [bytes.fromhex(r["descriptor"]) for r in replies]

    def start_prefill(self) -> None:
        spec_json = json.dumps(attrs.asdict(self.spec))
        self.importers = [self._start("importer", r, importer_main, spec_json, self.key.hex(), r)
                          for r in range(self.spec.tp)]

    def broadcast(self, workers: list[Worker], timeout: float | None = None, **cmd: Any) -> list[dict[str, Any]]:
        live = [w for w in workers if not w.killed]
        for w in live:
            _send(w.conn, **cmd)
        return [_recv(w.conn, timeout or self.spec.timeout_s) for w in live]


# -- one scenario, end to end ---------------------------------------------------------------


def run_scenario(spec: ClusterSpec, kill: tuple[str, str] | None = None, *,
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Decode-to-prefill reuse across real processes, optionally SIGKILLing one process
    (``(role, phase)``; the highest rank of that role) at that phase. Returns a report."""
    if kill is not None and (kill[0] not in ROLES or kill[1] not in PHASES):
        raise ValueError(f"kill must be ROLE:PHASE with ROLE in {ROLES} and PHASE in {PHASES}")
    timings: dict[str, float] = {}
    report: dict[str, Any] = {"tp": spec.tp, "kill": ":".join(kill) if kill else None}
    t0 = time.monotonic()
    with Cluster(spec, log=log) as c:
        def maybe_kill(phase: str) -> None:
            if kill and kill[1] == phase:
                victim = (c.exporters if kill[0] == "exporter" else c.importers)[-1]
                victim.kill()
                log(f"  SIGKILL {victim.role} rank {victim.rank} (pid {victim.process.pid}) while {phase}")

        wire = c.start_decode()
        timings[TIMING_ADVERTISE] = max(c.advertise_s, default=0.0)
        log(f"decode engine: {spec.tp} exporter processes registered, filled and advertised their banks; "
            f"retained inventory: {len(spec.prefix())} block hashes, epoch {c.inventory_epoch}")
        c.start_prefill()
        maybe_kill("advertised")

        live = [w for w in c.importers if not w.killed]
        for w in live:
            _send(w.conn, cmd="import", wire=[d.hex() for d in wire], epoch=c.inventory_epoch)
        maybe_kill("importing")
        imports = [_recv(w.conn, spec.timeout_s) for w in live if not w.killed]
        timings[TIMING_IMPORT] = max((r.get("import_s", 0.0) for r in imports), default=0.0)
        report["import_states"] = [r.get("state") for r in imports]
        report["import_errors"] = sorted({r["error"] for r in imports if "error" in r})
        log(f"prefill engine: group import -> {', '.join(str(s) for s in report['import_states'])}")
        maybe_kill("ready")

        ready = [w for w in c.importers if not w.killed]
        loads: list[dict[str, Any]] = []
        drains_early = False
        if all(s == "ready" for s in report["import_states"]):
            stall = bool(kill and kill[1] == "loading")
            for w in ready:
                _send(w.conn, cmd="load", blocks=spec.prefix(), stall=stall)
            if stall:
                for w in ready:
                    _recv(w.conn, spec.timeout_s)  # "loading": the ops are queued and pinning
                maybe_kill("loading")
                for w in [w for w in ready if not w.killed]:  # the drain lets the stalled load finish
                    _send(w.conn, cmd="drain")
                drains_early = True
            loads = [_recv(w.conn, spec.timeout_s) for w in ready if not w.killed]
            timings[TIMING_LOAD] = max((r.get("seconds", 0.0) for r in loads), default=0.0)
        report["verified"] = [
            (w.rank, r.get("checksum") == expected_checksum(spec, w.rank))
            for w, r in zip([w for w in ready if not w.killed], loads) if "checksum" in r]
        report["load_bytes"] = sum(r.get("bytes", 0) for r in loads)
        if loads:
            log(f"prefix load: {len(spec.prefix())} blocks x {spec.tp} ranks, "
                f"{report['load_bytes'] / 2**20:.1f} MiB, checksums "
                + ("verified" if report["verified"] and all(ok for _, ok in report["verified"]) else "NOT verified"))

        survivors = [w for w in c.importers if not w.killed]
        if not drains_early:
            for w in survivors:
                _send(w.conn, cmd="drain")
        maybe_kill("draining")
        drains = [_recv(w.conn, spec.timeout_s) for w in survivors if not w.killed]
        report["importer_final"] = [r.get("state") for r in drains]
        report["importer_states"] = drains[0].get("states", []) if drains else []
        exp = c.broadcast(c.exporters, timeout=spec.lease_timeout_s + spec.timeout_s + 5, cmd="drain")
        timings[TIMING_DRAIN] = max((r.get("quiescent_s", 0.0) for r in [*drains, *exp]), default=0.0)
        report["exporter_quiescent_s"] = max((r.get("quiescent_s", 0.0) for r in exp), default=0.0)
        report["exporter_states"] = exp[0].get("states", []) if exp else []
        report["exporter_errors"] = [r["error"] for r in exp if "error" in r]
        log(f"drain: importers {', '.join(map(str, report['importer_final']))}; exporters quiescent in "
            f"{report['exporter_quiescent_s'] * 1e3:.1f} ms and released")
        leaks = c.broadcast(c.exporters + c.importers, cmd="exit")
        report["leaks"] = [r["leaks"] for r in leaks]
    timings[TIMING_TOTAL] = time.monotonic() - t0
    report["timings_s"] = timings
    report["ok"] = _judge(report, kill)
    report["outcome"] = _outcome(report)
    return report


def _outcome(report: dict[str, Any]) -> str:
    """What a user should take from the run, in words."""
    loaded = sum(ok for _, ok in report["verified"])
    if not report["ok"]:
        return "FAILED"
    if loaded == report["tp"]:
        return ("OK: reuse verified, nothing partial, nothing leaked" if report["kill"] is None else
                f"OK: all {loaded} ranks loaded and verified before the kill; survivors drained, nothing leaked")
    # A group's KV is usable only when every rank loaded it: a partial load is thrown away.
    return (f"failed cleanly, prefix recomputed: {loaded}/{report['tp']} ranks loaded, so none uses the load; "
            "nothing partial was used, nothing leaked")


def _judge(report: dict[str, Any], kill: tuple[str, str] | None) -> bool:
    """The safety verdict: no partial readiness, verified bytes, quiescence, no leaks."""
    clean = not report["exporter_errors"] and all(v == 0 for leak in report["leaks"] for v in leak.values())
    every_load_ok = all(ok for _, ok in report["verified"])
    drained = all(s in ("closed", "failed", "rejected") for s in report["importer_final"])
    if kill is None:
        return clean and drained and every_load_ok and len(report["verified"]) == report["tp"]
    return clean and drained and every_load_ok
