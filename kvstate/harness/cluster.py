"""Real processes on both sides, for the demo and the multi-process tests.

The decode engine is ``tp`` exporter processes (one bank each, filled with a deterministic
KV pattern, with its own retained inventory). The prefill engine is one coordinator
process (the scheduler side: :class:`~kvstate.share.coordinator.Coordinator`) and ``tp``
worker processes (:class:`~kvstate.share.rank_worker.RankWorker`, see
:mod:`kvstate.harness.prefill_procs`): each worker leases, checks, imports and maps only
its own rank's part, so the group takes tp leases in all, and loads its own rank's prefix
once the coordinator declared the group ready. Parent and children speak JSON over pipes
(nothing is pickled after start-up); processes are forked from a preloaded forkserver,
so starting one costs milliseconds, and import the same kvstate as the parent whatever
the current folder (:mod:`kvstate.harness.children`). A process that dies unasked ends
the run with :class:`~kvstate.harness.children.ChildDied`: its name, exit status and
last stderr lines.

Any process can be SIGKILLed at a named phase (:data:`PHASES`) to show how the survivors
recover: workers are held at their check or open so the phase is open when the kill lands.
Timings exclude process start: they start once every process is up and connected.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kvstate.core.errors import KvStateError, NativeError
from kvstate.core.reasons import NativeReason
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment
from kvstate.harness import children
from kvstate.harness.leaks import shm_held, snapshot

PHASES = ("advertised", "checking", "importing", "ready", "loading", "draining")
ROLES = ("exporter", "worker", "coordinator")


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
    phase_timeout_s: float = 5.0     # the coordinator's deadline per phase
    silence_s: float = 2.0           # a worker hearing nothing from its coordinator this long cleans up alone
    seed: int = 7
    plant: str | None = None         # "module:Class": a planted RankShare for the workers (self-tests)
    nixl: bool = False               # banks exported through NIXL, leased over TCP: every part remote

    def geometry(self) -> Geometry:
        return Geometry.uniform(layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                block_tokens=self.block_tokens, dtype=DType.BF16, layout=Layout.BLOCK_MAJOR,
                                num_blocks=self.num_blocks)

    def prefix(self) -> list[int]:
        """The prefix's block ids in the decode worker's bank: scattered, as after reuse."""
        step = 7 if self.num_blocks % 7 else 5
        return [(self.seed + i * step) % self.num_blocks for i in range(self.prefix_blocks)]


#: UCX confined to TCP over the loopback device: the cross-node path on one machine.
LOOPBACK_UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}


def use_loopback_ucx() -> None:
    """Before this process creates its NIXL agent (UCX reads the environment then)."""
    for k, v in LOOPBACK_UCX.items():
        os.environ.setdefault(k, v)


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


def leaks_since(baseline: dict[str, int], grace_s: float = 2.0) -> dict[str, int]:
    """What this process holds beyond ``baseline`` (0 each when nothing leaked), after up
    to ``grace_s`` for daemon threads of stopped servers to close their channels."""
    deadline = time.monotonic() + grace_s
    while True:
        now = resources()
        extra = {k: now[k] - baseline[k] for k in now}
        if all(v <= 0 for v in extra.values()) or time.monotonic() >= deadline:
            return extra
        gc.collect()  # objects in reference cycles (NIXL views, channels) close their fds when collected
        time.sleep(0.01)


# -- pipes ---------------------------------------------------------------------------------


def send(conn: multiprocessing.connection.Connection, **msg: Any) -> None:
    conn.send_bytes(json.dumps(msg).encode())


def recv(conn: multiprocessing.connection.Connection, timeout: float) -> dict[str, Any]:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    msg: dict[str, Any] = json.loads(conn.recv_bytes(1 << 20))
    return msg


_send, _recv = send, recv  # the soak's names


# -- decode side ---------------------------------------------------------------------------


def exporter_main(conn: multiprocessing.connection.Connection, spec_json: str, key_hex: str,
                  socket_dir: str, rank: int, source_hex: str) -> None:
    from kvstate.reuse.inventory import Inventory
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.transport.host import HostTransport

    spec = ClusterSpec(**json.loads(spec_json))
    baseline = resources()
    host = HostTransport(granularity=spec.granularity)
    t: Any = host
    nixl: Any = None
    extra: dict[str, Any] = {}
    if spec.nixl:  # this bank is another node's to the workers: NIXL handle, leases over TCP
        from kvstate.transport.nixl import NixlTransport
        from kvstate.transport.nixl.exporting import NixlExportingHost

        use_loopback_ucx()
        nixl = NixlTransport()
        t = NixlExportingHost(host, nixl)
        extra = {"handle_kind": HandleKind.NIXL, "tcp_listen": ("127.0.0.1", 0)}
    config = ExportConfig(Deployment("kvstate-demo", bytes.fromhex(key_hex)), Path(socket_dir),
                          bytes.fromhex(source_hex), spec.tp, lease_timeout_s=spec.lease_timeout_s, **extra)
    inventory = Inventory(budget_blocks=spec.num_blocks)
    for _ in range(rank):  # every rank's inventory is its own: their epochs differ
        inventory.clear(INVENTORY_GROUP)
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
    send(conn, descriptor=ex.descriptor(rank).hex(), epoch=inventory.epoch(INVENTORY_GROUP), pid=os.getpid(),
         advertise_s=time.monotonic() - started)
    while True:
        cmd = recv(conn, 3600)
        if cmd["cmd"] == "leases":
            send(conn, leases=len(bank.leases))
        elif cmd["cmd"] == "drain":
            try:
                waited = ex.drain(spec.lease_timeout_s + spec.timeout_s)
                send(conn, quiescent_s=waited, states=states, leases=0)
            except KvStateError as exc:
                send(conn, error=str(exc), states=states)
        elif cmd["cmd"] == "exit":
            ex.stop()
            del view
            if nixl is not None:  # the agent keeps UCX connections to its peers until it is gone
                nixl.close()
            del ex, bank, t, nixl
            send(conn, leaks=leaks_since(baseline))
            return


# -- the orchestrator ----------------------------------------------------------------------


@attrs.define
class Worker:
    role: str
    rank: int
    process: Any
    conn: multiprocessing.connection.Connection
    killed: bool = False
    killed_at: float | None = None
    #: what it had open or mapped in /dev/shm when it was killed: none may remain after
    #: the next start (a SIGKILL runs no cleanup; /dev/shm is shared, so files are its by pid)
    shm: frozenset[str] = frozenset()

    def ask(self, wait: float, **cmd: Any) -> dict[str, Any]:
        send(self.conn, **cmd)
        return recv(self.conn, wait)

    def kill(self) -> None:
        self.shm = shm_held(self.process.pid)
        self.killed_at = time.monotonic()
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(5)
        self.killed = True


class Cluster:
    """A decode engine and a prefill engine of real processes. Use as a context manager."""

    def __init__(self, spec: ClusterSpec, *, log: Callable[[str], None] = lambda s: None) -> None:
        from kvstate.harness import prefill_procs

        self.spec = spec
        self.log = log
        self.key = os.urandom(32)
        self.dir = Path(tempfile.mkdtemp(prefix="kvstate-demo-"))
        self.dir.chmod(0o700)
        self.socket_dir = self.dir / "sockets"
        self.source = os.urandom(16)
        self.spec_json = json.dumps(attrs.asdict(spec))
        self.exporters: list[Worker] = []
        self.epochs: list[int] = []
        self.advertise_s = 0.0
        self.coordinator: Worker | None = None
        self.workers: list[Worker] = []
        self._procs = prefill_procs
        ctx = children.forkserver(["kvstate.harness.prefill_procs", "kvstate.share.exporter",
                                   "kvstate.share.coordinator", "kvstate.share.rank_worker",
                                   "kvstate.transport.host", "kvstate.reuse.inventory"])
        self.children = children.Children(ctx, self.dir / "logs")

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.everyone():
            if w.process.is_alive():
                w.process.kill()
            w.process.join(5)
            w.conn.close()
            if not w.process.is_alive():
                w.process.close()  # its sentinel fd, now rather than at a later collection
        # Every process of the run has exited: its sockets, marks and stderr logs go with
        # it, a killed one's included (a death was read from its log inside the run).
        shutil.rmtree(self.dir, ignore_errors=True)

    def everyone(self) -> list[Worker]:
        return [*self.exporters, *([self.coordinator] if self.coordinator else []), *self.workers]

    def live(self, workers: list[Worker]) -> list[Worker]:
        return [w for w in workers if not w.killed]

    def _start(self, role: str, rank: int, target: Any, *args: Any) -> Worker:
        p, parent = self.children.start(f"{role} {rank}", target, *args)
        return Worker(role, rank, p, parent)

    def death(self) -> children.ChildDied | None:
        """The process that ended unasked (not one this cluster killed), with its exit
        status and last stderr lines; None when every process it did not kill is alive."""
        return self.children.died([(f"{w.role} {w.rank}", w.process) for w in self.everyone() if not w.killed])

    def start_decode(self) -> list[bytes]:
        self.exporters = [self._start("exporter", r, exporter_main, self.spec_json, self.key.hex(),
                                      str(self.socket_dir), r, self.source.hex()) for r in range(self.spec.tp)]
        replies = [recv(w.conn, self.spec.timeout_s) for w in self.exporters]
        self.epochs = [int(r["epoch"]) for r in replies]
        self.advertise_s = max(float(r["advertise_s"]) for r in replies)
        return [bytes.fromhex(r["descriptor"]) for r in replies]

    def start_prefill(self) -> None:
        """The coordinator, then every worker, connected and welcomed."""
        s = self.spec
        self.coordinator = self._start("coordinator", 0, self._procs.coordinator_main, self.spec_json, self.key.hex(),
                                       str(self.dir / "coordinator"))
        path = recv(self.coordinator.conn, s.timeout_s)["path"]
        self.workers = [self._start("worker", r, self._procs.worker_main, self.spec_json, self.key.hex(), r, path)
                        for r in range(s.tp)]
        for w in self.workers:
            reply = w.ask(s.timeout_s, cmd="start")
            if "error" in reply:
                raise NativeError(NativeReason.FAILED, f"worker {w.rank} did not start: {reply['error']}")
        self.coordinator.ask(s.timeout_s, cmd="wait_workers")

    def import_command(self, wire: list[bytes], notify: tuple[str, int] | None = None) -> dict[str, Any]:
        return {"cmd": "import", "wire": [d.hex() for d in wire], "epochs": self.epochs,
                "inventory_group": INVENTORY_GROUP, "hashes": [block_hash(self.spec, b) for b in self.spec.prefix()],
                "notify": list(notify) if notify else None}

    def broadcast(self, workers: list[Worker], timeout: float | None = None, **cmd: Any) -> list[dict[str, Any]]:
        live = self.live(workers)
        for w in live:
            send(w.conn, **cmd)
        return [recv(w.conn, timeout or self.spec.timeout_s) for w in live]

    def victim(self, role: str) -> Worker:
        if role == "coordinator":
            assert self.coordinator is not None
            return self.coordinator
        return (self.exporters if role == "exporter" else self.workers)[-1]
