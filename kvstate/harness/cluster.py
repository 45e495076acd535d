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

from kvstate import channel as chan
from kvstate.channel import owner
from kvstate.core.errors import KvStateError, NativeError
from kvstate.core.reasons import NativeReason
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment
from kvstate.harness import children
from kvstate.harness.leaks import shm_held, shm_left, snapshot
from kvstate.share import status

PHASES = ("advertised", "checking", "importing", "ready", "loading", "draining")
ROLES = ("exporter", "worker", "coordinator")
# What each timing measures. Every phase is measured inside the processes doing the work,
# from the moment kvstate's work starts: never process spawn, Python imports or engine
# start (the harness's, not kvstate's). The total is the sum of the phases.
TIMING_ADVERTISE = "advertise: register, fill, sign, serve (slowest exporter)"
TIMING_IMPORT = "import: validate, check, lease, map, ready (coordinator)"
TIMING_LOAD = "load: submit to last op done (slowest worker)"
TIMING_DRAIN = "drain: every part closed (coordinator), quiescent (exporters)"
TIMING_TOTAL = "total: the four phases above (no process spawn, no engine start)"


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
    from kvstate.share.exporter import ExportConfig, Exporter
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


# -- one scenario, end to end ---------------------------------------------------------------


def run_scenario(spec: ClusterSpec, kill: tuple[str, str] | None = None, *,
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Decode-to-prefill reuse across real processes, optionally SIGKILLing one process
    (``(role, phase)``; the highest rank of that role) at that phase. Returns a report."""
    if kill is not None and (kill[0] not in ROLES or kill[1] not in PHASES):
        raise ValueError(f"kill must be ROLE:PHASE with ROLE in {ROLES} and PHASE in {PHASES}")
    with Cluster(spec, log=log) as c:
        try:
            return _Scenario(c, kill, log).run()
        except (EOFError, ConnectionError, TimeoutError) as exc:  # which process died, and what did it say?
            died = c.death()
            if died is None:
                raise
            raise died from exc


class _Scenario:
    def __init__(self, c: Cluster, kill: tuple[str, str] | None, log: Callable[[str], None]) -> None:
        self.c, self.kill, self.log, self.spec = c, kill, log, c.spec
        self.timings: dict[str, float] = {}
        self.report: dict[str, Any] = {"topology": "per-rank-process", "tp": c.spec.tp,
                                       "kill": ":".join(kill) if kill else None}

    def maybe_kill(self, phase: str) -> None:
        if self.kill and self.kill[1] == phase:
            victim = self.c.victim(self.kill[0])
            victim.kill()
            self.report["killed_pid"] = victim.process.pid
            self.log(f"  SIGKILL {victim.role} rank {victim.rank} (pid {victim.process.pid}) while {phase}")

    def run(self) -> dict[str, Any]:
        c, spec, report = self.c, self.spec, self.report
        wire = c.start_decode()
        self.timings[TIMING_ADVERTISE] = c.advertise_s
        report["descriptors"] = [_describe_descriptor(w, c.key) for w in wire]
        c.start_prefill()
        assert c.coordinator is not None
        self.log(f"decode engine: {spec.tp} exporter processes advertised their banks (inventory epochs "
                 f"{c.epochs}); prefill engine: coordinator pid {c.coordinator.process.pid}, "
                 f"{spec.tp} rank worker processes connected")
        self.maybe_kill("advertised")
        group = self.import_group(wire)
        ready = group.get("state") == "ready"
        gid = group.get("gid")
        if ready and gid:
            self.count_holdings(gid)
            self.maybe_kill("ready")
        loads = self.load(gid) if ready and gid else []
        report["verified"] = [(r["rank"], r.get("checksum") == expected_checksum(spec, r["rank"]))
                              for r in loads if "checksum" in r]
        report["load_errors"] = sorted({r["error"] for r in loads if "error" in r})
        report["load_bytes"] = sum(r.get("bytes", 0) for r in loads)
        if loads:
            self.log(f"prefix load: {len(spec.prefix())} blocks on each of {spec.tp} ranks, each worker its own, "
                     f"{report['load_bytes'] / 2**20:.1f} MiB, checksums "
                     + ("verified" if report["verified"] and all(ok for _, ok in report["verified"]) else "NOT verified"))
        self.finish(gid)
        self.timings[TIMING_TOTAL] = sum(self.timings.values())
        report["timings_s"] = self.timings
        report["ok"] = judge(report, self.kill)
        report["outcome"] = outcome(report)
        return report

    def import_group(self, wire: list[bytes]) -> dict[str, Any]:
        c, spec = self.c, self.spec
        assert c.coordinator is not None
        phase = self.kill[1] if self.kill else None
        notify: tuple[str, int] | None = None
        if phase == "checking" and not c.coordinator.killed:
            c.broadcast(c.workers, cmd="hold", points=["check"])
            notify = ("checking", 0)
        elif phase == "importing" and not c.coordinator.killed:
            c.workers[-1].ask(spec.timeout_s, cmd="hold", points=["open"])
            notify = ("importing", spec.tp - 1)
        t = time.monotonic()
        group: dict[str, Any] = {"state": None}
        if c.coordinator.killed:
            group["error"] = "no coordinator"
        else:
            send(c.coordinator.conn, **c.import_command(wire, notify))
            if notify is not None:
                reached = recv(c.coordinator.conn, spec.timeout_s)
                group["gid"] = reached.get("gid")  # known even if the coordinator dies now
                if reached.get("reached"):
                    self.maybe_kill(reached["reached"])
                c.broadcast(c.workers, cmd="release")
            if not c.coordinator.killed:
                group = recv(c.coordinator.conn, spec.timeout_s + 4 * spec.phase_timeout_s)
        if group.get("time_to_ready_s") is not None:
            self.timings[TIMING_IMPORT] = float(group["time_to_ready_s"])
        self.report["group"] = group
        self.report["time_to_ready_s"] = group.get("time_to_ready_s")
        ranks = group.get("ranks") or []
        self.report["ranks"] = ranks
        self.report["leases_total"] = sum(r.get("leases") or 0 for r in ranks)
        self.log(f"coordinator: group {group.get('gid')} -> {group.get('state')}"
                 + (f" in {group['time_to_ready_s'] * 1e3:.1f} ms; leases per rank "
                    f"{[r.get('leases') for r in ranks]}, import per rank (ms) "
                    f"{[round((r.get('import_s') or 0) * 1e3, 1) for r in ranks]}"
                    if group.get("time_to_ready_s") is not None else f" ({group.get('failure') or group.get('error')})"))
        return group

    def count_holdings(self, gid: str) -> None:
        """At ready, from outside kvstate's own bookkeeping: memfd mappings in each worker
        process (/proc) and leases on each exporter's bank."""
        c = self.c
        self.report["mappings_per_rank"] = [w.ask(self.spec.timeout_s, cmd="status", gid=gid)["memfd_maps"]
                                            for w in c.live(c.workers)]
        self.report["exporter_leases"] = [r["leases"] for r in c.broadcast(c.exporters, cmd="leases")]

    def load(self, gid: str) -> list[dict[str, Any]]:
        c, spec = self.c, self.spec
        phase = self.kill[1] if self.kill else None
        stall = phase in ("loading", "draining")
        t = time.monotonic()
        live = c.live(c.workers)
        for w in live:
            send(w.conn, cmd="load", gid=gid, blocks=spec.prefix(), stall=stall)
        if stall:
            for w in live:
                recv(w.conn, spec.timeout_s)  # "loading": the op is queued, pinning the part
            self.maybe_kill("loading")
            if phase == "draining":
                assert c.coordinator is not None
                if not c.coordinator.killed:
                    send(c.coordinator.conn, cmd="drain", gid=gid)
                self.wait_draining(gid)
                self.maybe_kill("draining")
            for w in c.live(c.workers):
                send(w.conn, cmd="release")
        replies = []
        for w in [w for w in live if not w.killed]:
            got = [recv(w.conn, spec.timeout_s) for _ in range(2 if stall else 1)]  # stalled: the release's too
            replies += [{"rank": w.rank, **r} for r in got if not r.get("ok")]
        if any("seconds" in r for r in replies):
            self.timings[TIMING_LOAD] = max(float(r.get("seconds", 0.0)) for r in replies)
        return replies

    def wait_draining(self, gid: str) -> None:
        """Until every live worker's share left ready; then, 50 ms later, record where each
        is: a share whose load still pins its part must still be draining."""
        deadline = time.monotonic() + self.spec.timeout_s
        for w in self.c.live(self.c.workers):
            while time.monotonic() < deadline:
                if w.ask(self.spec.timeout_s, cmd="status", gid=gid).get("state") in ("draining", "quiescent",
                                                                                      "closed", "failed"):
                    break
                time.sleep(0.001)
        time.sleep(0.05)
        self.report["draining_states"] = [w.ask(self.spec.timeout_s, cmd="status", gid=gid).get("state")
                                          for w in self.c.live(self.c.workers)]

    def show_status(self, when: str) -> None:
        """What `kvstate status` shows of this node's demo servers now (logged and reported)."""
        dirs = [self.c.socket_dir, self.c.dir / "coordinator"]
        snapshot = status.node_status(dirs, timeout=self.spec.timeout_s)
        self.report.setdefault("status", {})[when] = snapshot
        self.log(f"kvstate status {' '.join(f'--socket-dir {d}' for d in dirs)}  ({when})")
        self.log("\n".join("  " + line for line in status.render(snapshot).splitlines()[1:]))

    def finish(self, gid: str | None) -> None:
        c, spec, report = self.c, self.spec, self.report
        t = time.monotonic()
        coord = c.coordinator
        assert coord is not None
        final: dict[str, Any] = {}
        self.show_status("before draining")
        if gid and not coord.killed:
            drained = self.kill is not None and self.kill[1] == "draining"
            final = recv(coord.conn, spec.timeout_s) if drained else coord.ask(spec.timeout_s, cmd="drain", gid=gid)
            if "error" in final:
                final = {**coord.ask(spec.timeout_s, cmd="describe", gid=gid), "error": final["error"]}
        report["coordinator"] = {"pid": coord.process.pid, "killed": coord.killed, "state": final.get("state"),
                                 "history": final.get("history") or report.get("group", {}).get("history")}
        history = [h[0] for h in report["coordinator"]["history"] or []]
        heard = gid is not None and (coord.killed or "checking" in history)  # did any worker get its check?
        shares: list[dict[str, Any]] = []
        for w in c.live(c.workers):
            shares.append(w.ask(spec.timeout_s + spec.silence_s, cmd="wait_ended", gid=gid,
                                timeout=spec.silence_s + spec.timeout_s) if heard else {"rank": w.rank, "state": None})
        report["worker_final"] = [s.get("state") for s in shares]
        report["shares"] = shares
        killed = next((w for w in c.everyone() if w.killed), None)
        unmapped = [s["unmapped_at"] for s in shares if s.get("unmapped_at") is not None]
        if killed is not None and killed.killed_at is not None and unmapped \
                and min(unmapped) >= killed.killed_at:
            report["death_to_unmapped_s"] = max(unmapped) - killed.killed_at
        exp = c.broadcast(c.exporters, timeout=spec.lease_timeout_s + spec.timeout_s + 5, cmd="drain")
        self.timings[TIMING_DRAIN] = float(final.get("drain_s") or 0.0) + max(
            (r.get("quiescent_s", 0.0) for r in exp), default=0.0)
        report["exporter_quiescent_s"] = max((r.get("quiescent_s", 0.0) for r in exp), default=0.0)
        report["exporter_states"] = exp[0].get("states", []) if exp else []
        report["exporter_errors"] = [r["error"] for r in exp if "error" in r]
        self.log(f"drain: coordinator {final.get('state')}, workers {report['worker_final']}; exporters quiescent "
                 f"in {report['exporter_quiescent_s'] * 1e3:.1f} ms and released")
        self.show_status("after draining")
        live = c.live(c.everyone())
        held = frozenset().union(*(shm_held(w.process.pid) for w in live))  # by pid: /dev/shm is shared
        exits = dict(zip((id(w) for w in live), c.broadcast(live, cmd="exit")))
        report["leaks"] = [r.get("leaks", {}) for r in exits.values()]
        report["violations"] = [v for r in exits.values() for v in r.get("violations", [])]
        histories = {w.rank: exits[id(w)].get("histories", {}).get(gid or "", []) for w in c.live(c.workers)}
        for entry in report.get("ranks", []):
            entry["history"] = histories.get(entry["rank"])
        for w in c.everyone():
            w.process.join(5)
        report["stray_processes"] = [w.process.pid for w in c.everyone() if w.process.is_alive()]
        report["shm_left_at_exit"] = shm_left(held)
        self.next_start()

    def next_start(self) -> None:
        """What a killed process left in each socket directory, then what is left once the
        next server started there (its start sweeps: kvstate.channel.owner); and what it
        had in /dev/shm that is still there (nothing sweeps /dev/shm: nothing may be left)."""
        dirs = [d for d in (self.c.socket_dir, self.c.dir / "coordinator") if d.is_dir()]
        self.report["leftovers_before_next_start"] = [n for d in dirs for n in owner.leftovers(d)]
        after = []
        for d in dirs:
            with chan.Server(d / "next-start.sock"):
                after += owner.leftovers(d)
        self.report["leftovers_after_next_start"] = after
        self.report["shm_after_next_start"] = shm_left(
            frozenset().union(*(w.shm for w in self.c.everyone() if w.killed)))


def _describe_descriptor(wire: bytes, key: bytes) -> dict[str, Any]:
    from kvstate.core.descriptor import decode

    d = decode(wire, Deployment("kvstate-demo", key))
    return {"rank": d.rank, "handle_kind": d.handle_kind.value, "fabric": d.fabric.kind.value,
            "lease_address": d.socket_path}


def outcome(report: dict[str, Any]) -> str:
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


def judge(report: dict[str, Any], kill: tuple[str, str] | None) -> bool:
    """The safety verdict: no partial readiness, verified bytes, every part gone, no leaks."""
    clean = (not report["exporter_errors"] and not report["violations"] and not report["stray_processes"]
             and not report["leftovers_after_next_start"] and not report.get("shm_after_next_start")
             and not report.get("shm_left_at_exit")
             and all(v <= 0 for leak in report["leaks"] for v in leak.values()))
    every_load_ok = all(ok for _, ok in report["verified"])
    ended = all(s in ("closed", "failed", "rejected", None) for s in report["worker_final"])
    ready = report.get("group", {}).get("state") == "ready"
    leases = report.get("leases_total", 0) == report["tp"] if ready else True
    if kill is None:
        return clean and ended and every_load_ok and leases and len(report["verified"]) == report["tp"]
    return clean and ended and every_load_ok and leases
