"""Soak under process kills: many import-load-drain-release cycles across real processes,
with random SIGKILLs of exporter and importer processes at random phases.

The cheap real cycle
--------------------

Starting a fresh Python process per worker per cycle costs more than the cycle itself,
so worker processes are long-lived and forked from a preloaded forkserver; only a killed
worker is replaced. Everything else in a cycle is real and new:

1. every exporter process builds a new :class:`~kvstate.share.exporter.Exporter` (new
   incarnation, new memfd bank filled with the KV pattern, new socket) and advertises it;
2. every importer process imports the whole group over the control channel (lease, fd,
   map), loads its rank's prefix through native ops and checksums it;
3. importers drain and close; exporters drain (timed: seconds to quiescent), release and
   stop.

A cycle may SIGKILL one process (random role, rank and phase of
:data:`PHASES`); the survivors carry on and the victim is replaced
before the next cycle. After every cycle each surviving worker reports what it holds
beyond its baseline (fds and memfd mappings, from ``/proc``).

The verdict (:meth:`SoakReport.problems`): no importer was ever ready without every part
(partial readiness); no leaked fd or memfd mapping in any worker; every exporter became
quiescent within its lease timeout; every completed load's checksum matched; nothing a
killed process left in the socket directory or in /dev/shm (what it had open or mapped
there when it was killed: ``leaks.shm_held``) remains after the next start.

Run it with ``python -m support.soak --cycles N`` (``make soak``).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import hashlib
import json
import mmap
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kvstate.harness import children, leaks as probe
from support.stalls import Heartbeat, collect
from kvstate.harness.cluster import ClusterSpec, Worker, _recv, _send, expected_checksum, kv_pattern, resources
from kvstate.channel import owner
from kvstate.core.errors import KvStateError
from kvstate.core.identity import Deployment

if TYPE_CHECKING:
    from kvstate.share.exporter import Exporter
    from kvstate.share.importer import Group, Importer
    from kvstate.transport.host import HostAllocation, HostEndpoint, HostHandle, HostMapping, HostReservation

    # The lifecycle sides over the host transport, as the workers below build them.
    HostExporter = Exporter[HostHandle, HostAllocation, HostReservation, HostMapping, HostEndpoint]
    HostImporter = Importer[HostHandle, HostAllocation, HostReservation, HostMapping, HostEndpoint]
    HostGroup = Group[HostHandle, HostAllocation, HostReservation, HostMapping, HostEndpoint]

#: The soak's importers each import the whole group in one process (the in-process
#: Importer); the coordinated per-rank topology is the cluster's (kvstate.harness.cluster).
PHASES = ("advertised", "importing", "ready", "loading", "draining")
ROLES = ("exporter", "importer")

#: A worker whose Python stops for this many lease terms leaves every thread's stack.
STALL_TERMS = 2
SOAK_SPEC = ClusterSpec(tp=2, layers=2, kv_heads=2, head_dim=32, block_tokens=16, num_blocks=32,
                        prefix_blocks=8, granularity=64 * 1024, lease_timeout_s=3.0, timeout_s=10.0)


def _plant_shm() -> None:
    """The ``shm_left`` plant: a file in /dev/shm, mapped for the process's life and removed
    only when it is told to exit (:func:`_unplant_shm`), as a SharedMemory block or a POSIX
    semaphore would be: a SIGKILL leaves it."""
    path = f"{probe.SHM}/kvstate-soak-plant-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    _planted.append((path, mmap.mmap(fd, 4096)))
    os.close(fd)


def _unplant_shm() -> None:
    while _planted:
        path, mem = _planted.pop()
        mem.close()
        os.unlink(path)


_planted: list[tuple[str, mmap.mmap]] = []


def _settled(baseline: dict[str, int], grace_s: float) -> dict[str, int]:
    """What this process holds beyond ``baseline``, after up to ``grace_s`` for daemon
    threads of a stopped server to close their channels."""
    deadline = time.monotonic() + grace_s
    while True:
        now = resources()
        extra = {k: now[k] - baseline[k] for k in now if now[k] != baseline[k]}
        if not extra or time.monotonic() >= deadline:
            return extra
        time.sleep(0.01)


# -- worker processes -----------------------------------------------------------------


def exporter_worker(conn: multiprocessing.connection.Connection, spec_json: str, key_hex: str,
                    socket_dir: str, rank: int, source_hex: str, plant: str | None = None,
                    stall_dir: str | None = None) -> None:
    """One decode-rank process: a new Exporter per cycle, named as the library names it
    (pid and incarnation), so a killed one's socket is not reused by its replacement and
    only the other servers' starts can sweep it."""
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.transport.host import HostTransport

    if plant == "no_sweep":  # the self-test: starts leave what dead servers left
        owner.sweep = lambda directory: []
    if plant == "shm_left":
        _plant_shm()

    spec = ClusterSpec(**json.loads(spec_json))
    if stall_dir is not None:
        Heartbeat(Path(stall_dir), STALL_TERMS * spec.lease_timeout_s)
    deployment = Deployment("kvstate-soak", bytes.fromhex(key_hex))
    t = HostTransport(granularity=spec.granularity)
    g = spec.geometry()
    pattern = b"".join(kv_pattern(rank, b, g.block_bytes, spec.seed) for b in range(g.num_blocks))
    ex: HostExporter | None = None
    baseline = resources()
    while True:
        cmd = _recv(conn, 3600)
        if cmd["cmd"] == "advertise":
            leaks = _settled(baseline, 2.0)  # what the previous cycle's exporter left behind
            baseline = resources()
            ex = Exporter(ExportConfig(deployment, Path(socket_dir), bytes.fromhex(source_hex), spec.tp,
                                       lease_timeout_s=spec.lease_timeout_s), t)
            bank = ex.add_bank(rank, g)
            bank.register()
            bank.view()[:len(pattern)] = pattern
            bank.advertise()
            ex.start()
            _send(conn, descriptor=ex.descriptor(rank).hex(), leaks=leaks)
        elif cmd["cmd"] == "drain":
            assert ex is not None
            try:
                waited = ex.drain(spec.lease_timeout_s + spec.timeout_s)
                _send(conn, quiescent_s=waited)
            except KvStateError as exc:
                _send(conn, error=f"{type(exc).__name__}: {exc}")
            finally:
                ex.stop()
                ex = None
        elif cmd["cmd"] == "exit":
            _unplant_shm()
            _send(conn, leaks=_settled(baseline, 2.0))
            return


def importer_worker(conn: multiprocessing.connection.Connection, spec_json: str, key_hex: str, rank: int,
                    plant: str | None = None, stall_dir: str | None = None) -> None:
    """One prefill-rank process: one Importer for its whole life, a new group per cycle.
    ``plant`` plants a bug for the soak's self-test: ``leak_fd``, ``corrupt``, ``hold_gil``
    (a C call that keeps the GIL past the heartbeat limit before a load) or ``shm_left``."""
    from kvstate.share.importer import ImportConfig, Importer
    from kvstate.reuse.policy import ReuseSettings
    from kvstate.core.machine import StateChange
    from kvstate.transport.host import HostTransport

    spec = ClusterSpec(**json.loads(spec_json))
    if stall_dir is not None:
        Heartbeat(Path(stall_dir), STALL_TERMS * spec.lease_timeout_s)
    if plant == "shm_left":
        _plant_shm()
    t = HostTransport(granularity=spec.granularity)
    stalled: list[bool] = []  # the hold_gil plant stalls once
    partial: list[str] = []
    im_box: list[HostImporter] = []

    def on_change(change: StateChange) -> None:
        # INV-GROUP-COMPLETE, checked at the moment of readiness, from the parts themselves.
        if change.machine == "group" and change.dest == "ready":
            group = im_box[0].groups[-1]
            imported = sorted(p.rank for p in group.parts if p.state == "imported" and p.mapping is not None)
            if imported != list(range(spec.tp)):
                partial.append(f"{group.label} ready with parts {imported} of tp {spec.tp}")

    im = Importer(ImportConfig(Deployment("kvstate-soak", bytes.fromhex(key_hex)), reuse=ReuseSettings(enable_decode_to_prefill_reuse=True)), t, observers=[on_change])
    im_box.append(im)
    group: HostGroup | None = None
    loader: threading.Thread | None = None
    baseline = resources()

    def state() -> str | None:
        return im.groups[-1].state if im.groups else None  # the newest group, even a failed one

    while True:
        cmd = _recv(conn, 3600)
        try:
            if cmd["cmd"] == "import":
                group = None
                group = im.import_group([bytes.fromhex(w) for w in cmd["wire"]])
                _send(conn, state=state())
            elif cmd["cmd"] == "load":
                assert group is not None
                if plant == "hold_gil" and not stalled:  # libc's sleep through PyDLL: the GIL stays held
                    stalled.append(True)
                    ctypes.PyDLL(None).sleep(int(STALL_TERMS * spec.lease_timeout_s) + 1)
                g = group

                def load(blocks: list[int] = cmd["blocks"]) -> None:
                    dst = bytearray(len(blocks) * g.parts[rank].descriptor.geometry.block_bytes)
                    try:
                        g.load_prefix(blocks, {rank: dst}, timeout=spec.timeout_s)
                        if plant == "corrupt":
                            dst[len(dst) // 2] ^= 1
                        _send(conn, checksum=hashlib.blake2b(dst, digest_size=16).hexdigest(), state=g.state)
                    except KvStateError as exc:
                        _send(conn, error=f"{type(exc).__name__}: {exc}", state=g.state)

                if cmd.get("stall"):
                    t.native.pause(True)  # the load stays in flight, pinning the parts, until drain
                    loader = threading.Thread(target=load)
                    loader.start()
                    while not g.loads:
                        time.sleep(0.0005)
                    _send(conn, loading=True)
                else:
                    load()
            elif cmd["cmd"] == "drain":
                t.native.pause(False)
                if plant == "leak_fd":
                    os.open("/dev/null", os.O_RDONLY)
                waited = 0.0
                if group is not None and not group.is_terminal:
                    waited = group.drain(timeout=spec.timeout_s)
                # This cycle's exporters go away with it: its channels to them are not kept
                # for the next cycle (whose leak check would otherwise count them).
                im.peers.close_idle(everything=True)
                if loader is not None:
                    loader.join(spec.timeout_s)  # its reply goes out before the drain's
                    loader = None
                _send(conn, quiescent_s=waited, state=state(), partial=partial,
                      leaks=_settled(baseline, 1.0))
                partial.clear()
            elif cmd["cmd"] == "exit":
                im.close()
                _unplant_shm()
                _send(conn, ok=True)
                return
        except KvStateError as exc:
            _send(conn, error=f"{type(exc).__name__}: {exc}", state=state())


# -- the soak -----------------------------------------------------------------------------


@attrs.define
class SoakReport:
    cycles: int = 0
    clean_cycles: int = 0
    kills: collections.Counter[str] = attrs.Factory(collections.Counter)  # "role:phase" -> count
    loads_verified: int = 0
    corrupt_loads: list[str] = attrs.Factory(list)
    partial_ready: list[str] = attrs.Factory(list)
    leaks: list[str] = attrs.Factory(list)
    slow_quiescence: list[str] = attrs.Factory(list)
    exporter_errors: list[str] = attrs.Factory(list)
    leftovers: list[str] = attrs.Factory(list)  # of dead processes, in the socket dir or /dev/shm after the next start
    stalls: list[str] = attrs.Factory(list)  # stacks of processes whose Python stopped (support.stalls)
    worst_quiescent_s: float = 0.0
    ready_groups: int = 0
    failed_groups: int = 0
    restarts: int = 0
    seconds: float = 0.0

    def problems(self) -> list[str]:
        return (self.corrupt_loads + self.partial_ready + self.leaks + self.slow_quiescence + self.exporter_errors
                + self.leftovers + self.stalls)

    def summary(self) -> str:
        kills = ", ".join(f"{k} {v}" for k, v in sorted(self.kills.items())) or "none"
        return (f"{self.cycles} cycles in {self.seconds:.1f} s ({self.clean_cycles} without a kill); "
                f"{sum(self.kills.values())} SIGKILLs ({kills}); {self.restarts} worker restarts; "
                f"groups ready {self.ready_groups}, failed {self.failed_groups}; "
                f"{self.loads_verified} loads checksum-verified; worst time to quiescent "
                f"{self.worst_quiescent_s * 1e3:.1f} ms; problems: {len(self.problems())}")

    def as_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["kills"] = dict(self.kills)
        return d


class _Pool:
    """Long-lived workers forked from a preloaded forkserver; killed ones are replaced."""

    def __init__(self, spec: ClusterSpec, plant: str | None = None) -> None:
        self.spec = spec
        self.plant = plant
        self.key = os.urandom(32)
        self.source = os.urandom(16)
        self.dir = Path(tempfile.mkdtemp(prefix="kvstate-soak-"))
        self.dir.chmod(0o700)
        self.socket_dir = self.dir / "sockets"
        self.stall_dir = self.dir / "stalls"
        self.stall_dir.mkdir()
        # The server preloads support.soak from tests/ too, wherever the soak runs from.
        self.dead_shm: set[str] = set()  # what killed workers had in /dev/shm
        self.ctx = children.forkserver(["support.soak", "kvstate.share.exporter", "kvstate.share.importer",
                                        "kvstate.transport.host"])
        self.spec_json = json.dumps(attrs.asdict(spec))
        self.exporters = [self._start("exporter", r) for r in range(spec.tp)]
        self.importers = [self._start("importer", r) for r in range(spec.tp)]

    def _start(self, role: str, rank: int) -> Worker:
        parent, child = self.ctx.Pipe()
        if role == "exporter":
            args: tuple[Any, ...] = (child, self.spec_json, self.key.hex(), str(self.socket_dir), rank, self.source.hex(),
                                     self.plant, str(self.stall_dir))
            target: Callable[..., None] = exporter_worker
        else:
            args, target = (child, self.spec_json, self.key.hex(), rank, self.plant, str(self.stall_dir)), importer_worker
        p = self.ctx.Process(target=target, args=args, name=f"soak-{role}-{rank}", daemon=True)
        p.start()
        child.close()
        return Worker(role, rank, p, parent)

    def replace_killed(self) -> int:
        n = 0
        for workers in (self.exporters, self.importers):
            for i, w in enumerate(workers):
                if w.killed:
                    self.dead_shm |= w.shm
                    w.conn.close()
                    workers[i] = self._start(w.role, w.rank)
                    n += 1
        return n

    def shm_left(self) -> list[str]:
        """What killed workers had in /dev/shm and is still there. Nothing sweeps /dev/shm, so
        nothing may be left; once reported it is removed (that worker's, by pid), so the run
        leaves nothing behind."""
        for w in self.exporters + self.importers:
            if w.killed:
                self.dead_shm |= w.shm
        left = probe.shm_left(self.dead_shm)
        self.dead_shm.clear()
        for path in left:
            os.unlink(path)
        return left

    def close(self) -> list[str]:
        leaks = []
        for w in self.exporters + self.importers:
            if not w.killed and w.process.is_alive():
                try:
                    reply = w.ask(10.0, cmd="exit")
                    if reply.get("leaks"):
                        leaks.append(f"{w.role} {w.rank} at exit: {reply['leaks']}")
                except (TimeoutError, EOFError, OSError):
                    pass
            if w.process.is_alive():
                w.process.kill()
            w.process.join(5)
            w.conn.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return leaks


def run_soak(cycles: int, *, seed: int = 1, kill_rate: float = 0.7, spec: ClusterSpec = SOAK_SPEC,
             log: Callable[[str], None] = lambda s: None, plant: str | None = None) -> SoakReport:
    """Run ``cycles`` cycles; a fraction ``kill_rate`` of them SIGKILLs one random process.
    ``plant`` plants a bug in the importers (for the self-test that the verdict catches it)."""
    rng = random.Random(seed)
    report = SoakReport()
    expected = {r: expected_checksum(spec, r) for r in range(spec.tp)}
    start = time.monotonic()
    pool = _Pool(spec, plant)
    try:
        for n in range(cycles):
            kill = (rng.choice(ROLES), rng.choice(PHASES), rng.randrange(spec.tp)) if rng.random() < kill_rate else None
            try:
                _cycle(pool, spec, kill, expected, report, n)
            except TimeoutError as exc:  # a worker never answered: say when, what went wrong before, and where
                stalls = "\n".join(collect(pool.stall_dir))  # each stuck process's threads, if its Python stopped
                raise TimeoutError(f"cycle {n} (kill {kill}): {exc}; problems so far: {report.problems()[:10]}"
                                   + (f"\n{stalls}" if stalls else "")) from exc
            report.restarts += pool.replace_killed()
            report.cycles += 1
            if kill is None:
                report.clean_cycles += 1
            if (n + 1) % 50 == 0:
                report.seconds = time.monotonic() - start
                log(f"  {n + 1} cycles: {report.summary()}")
        report.stalls += collect(pool.stall_dir)
    finally:
        report.leaks += pool.close()
        shm = pool.shm_left()  # of the last cycle's victims: there is no next start
        if shm:
            report.leftovers.append(f"end of the run: a dead process's files in /dev/shm: {shm}")
        report.seconds = time.monotonic() - start
    return report


def _cycle(pool: _Pool, spec: ClusterSpec, kill: tuple[str, str, int] | None, expected: dict[int, str],
           report: SoakReport, n: int) -> None:
    timeout = spec.timeout_s

    def maybe_kill(phase: str) -> None:
        if kill and kill[1] == phase:
            victim = (pool.exporters if kill[0] == "exporter" else pool.importers)[kill[2]]
            victim.kill()
            report.kills[f"{kill[0]}:{phase}"] += 1

    def live(workers: list[Worker]) -> list[Worker]:
        return [w for w in workers if not w.killed]

    def gather(workers: list[Worker], t: float = timeout) -> list[tuple[Worker, dict[str, Any]]]:
        return [(w, _recv(w.conn, t)) for w in workers if not w.killed]

    # 1. advertise: new exporters in the long-lived processes
    for w in pool.exporters:
        _send(w.conn, cmd="advertise")
    wire = []
    for w, r in gather(pool.exporters):
        wire.append(r["descriptor"])
        if r.get("leaks"):
            report.leaks.append(f"cycle {n}: exporter {w.rank} kept {r['leaks']} after its previous cycle")
    # Every live exporter just started a server in the socket directory: whatever a
    # killed one left there was swept by those starts (kvstate.channel.owner).
    left = owner.leftovers(pool.socket_dir)
    if left:
        report.leftovers.append(f"cycle {n}: a dead process's files after the next start: {left}")
    shm = pool.shm_left()
    if shm:
        report.leftovers.append(f"cycle {n}: a dead process's files in /dev/shm after the next start: {shm}")
    maybe_kill("advertised")

    # 2. import the whole group in every importer
    for w in live(pool.importers):
        _send(w.conn, cmd="import", wire=wire)
    maybe_kill("importing")
    imports = gather(pool.importers)
    for _, r in imports:
        report.ready_groups += r.get("state") == "ready"
        report.failed_groups += r.get("state") in ("failed", "rejected")
    maybe_kill("ready")

    # 3. load and checksum (stalled in flight when a kill is due while loading)
    ready = [w for w, r in imports if r.get("state") == "ready" and not w.killed]
    stall = bool(kill and kill[1] == "loading")
    for w in ready:
        _send(w.conn, cmd="load", blocks=spec.prefix(), stall=stall)
    if stall:
        gather(ready)  # "loading": the ops are queued and pin the parts
        maybe_kill("loading")
    loads_pending = [w for w in ready if not w.killed]

    # 4. drain importers (this also lets a stalled load finish), then exporters
    drainers = live(pool.importers)
    for w in drainers:
        _send(w.conn, cmd="drain")
    maybe_kill("draining")
    for w in [w for w in drainers if not w.killed]:
        replies = [_recv(w.conn, timeout)]
        if w in loads_pending:
            replies.append(_recv(w.conn, timeout))  # the load's reply, then the drain's
        for r in replies:
            if "checksum" in r:
                if r["checksum"] == expected[w.rank]:
                    report.loads_verified += 1
                else:
                    report.corrupt_loads.append(f"cycle {n}: rank {w.rank} checksum {r['checksum']}")
            if "partial" in r:
                report.partial_ready += [f"cycle {n}: {p}" for p in r["partial"]]
                if r.get("leaks"):
                    report.leaks.append(f"cycle {n}: importer {w.rank} kept {r['leaks']}")
                if r.get("state") not in ("closed", "failed", "rejected", None):
                    report.leaks.append(f"cycle {n}: importer {w.rank} group left {r['state']}")
    for w in live(pool.exporters):
        _send(w.conn, cmd="drain")
    for w, r in gather(pool.exporters, spec.lease_timeout_s + timeout + 5):
        if "error" in r:
            report.exporter_errors.append(f"cycle {n}: exporter {w.rank}: {r['error']}")
            continue
        q = float(r["quiescent_s"])
        report.worst_quiescent_s = max(report.worst_quiescent_s, q)
        if q > spec.lease_timeout_s:
            report.slow_quiescence.append(f"cycle {n}: exporter {w.rank} quiescent after {q:.3f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m support.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kill-rate", type=float, default=0.7)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    report = run_soak(args.cycles, seed=args.seed, kill_rate=args.kill_rate, log=print)
    print(json.dumps(report.as_json(), indent=2) if args.json else report.summary())
    for p in report.problems()[:50]:
        print("PROBLEM", p, file=sys.stderr)
    return 1 if report.problems() else 0


if __name__ == "__main__":
    raise SystemExit(main())
