"""The prefill side as real processes: one coordinator process and one worker process per
rank, for the demo, the kill matrix and the stateful process tests.

Each process is driven by its parent over a pipe, one JSON message per command (nothing
is pickled after start-up). Replies carry what the parent needs to judge the run: group
and share state histories, per-rank import times and lease counts, when each part was
unmapped (``time.monotonic()``, one clock for every process of the host), violations seen
from the inside (a share ready without its part mapped, a share that ended still
mapping), and what each process holds beyond its baseline when it exits (fds, memfd
mappings, from ``/proc``).

Hold points let a parent SIGKILL a process while a phase is open: a worker told to hold
``check`` or ``open`` stops there (its reader, or its opener thread) until released.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvstate.core.errors import KvStateError
from kvstate.core.identity import Deployment
from kvstate.core.machine import StateChange
from kvstate.harness.cluster import ClusterSpec, leaks_since, recv, resources, send
from kvstate.share import protocol_msgs as msgs
from kvstate.reuse.policy import ReuseSettings
from kvstate.share.rank_share import RankShare
from kvstate.share.rank_worker import RankWorker
from kvstate.share.remote_part import RemotePart
from kvstate.transport.protocol import A, E, H, M, R

#: item size -> the buffer-protocol format of an unsigned integer that size (raw bits)
_RAW_BITS: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}

if TYPE_CHECKING:
    from kvstate.transport.host import HostAllocation, HostEndpoint, HostHandle, HostMapping, HostReservation
    from kvstate.transport.nixl import NixlTransport

    HostShare = RankShare[HostHandle, HostAllocation, HostReservation, HostMapping, HostEndpoint]

DEPLOYMENT_NAME = "kvstate-demo"


class _Pipe:
    """The pipe to the parent; two threads of a process may answer on it."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, **msg: Any) -> None:
        with self.lock:
            send(self.conn, **msg)


# -- the coordinator process ---------------------------------------------------------------


def coordinator_main(conn: multiprocessing.connection.Connection, spec_json: str, key_hex: str,
                     socket_dir: str) -> None:
    from kvstate.share.coordinated_group import CoordinatedGroup
    from kvstate.share.coordinator import Coordinator, CoordinatorConfig
    from kvstate.share.importer import BlockRequest

    spec = ClusterSpec(**json.loads(spec_json))
    pipe = _Pipe(conn)
    baseline = resources()
    violations: list[str] = []
    coord: Coordinator | None = None

    def on_change(change: StateChange) -> None:
        # INV-COORD-READY-COMPLETE from the inside: ready only with every rank's report.
        if change.machine == "coordinator" and change.dest == "ready" and coord is not None:
            group = next((g for g in coord.groups.values() if g.label == change.label), None)
            if group is not None and group.reports["imported"] != set(range(spec.tp)):
                violations.append(f"{change.label} ready with imported reports from {sorted(group.reports['imported'])}")

    coord = Coordinator(CoordinatorConfig(Deployment(DEPLOYMENT_NAME, bytes.fromhex(key_hex)), spec.tp,
                                          Path(socket_dir), phase_timeout_s=spec.phase_timeout_s,
                                          silence_s=spec.silence_s, heartbeat_s=spec.silence_s / 8),
                        observers=[on_change])
    coord.start()
    pipe.send(path=str(coord.socket_path), pid=os.getpid())
    groups: dict[str, CoordinatedGroup] = {}

    def notify_when(group: CoordinatedGroup, state: str, imported: int) -> None:
        deadline = time.monotonic() + spec.timeout_s
        while time.monotonic() < deadline and not group.is_terminal:
            if group.state == state and len(group.reports["imported"]) >= imported:
                pipe.send(reached=state, gid=group.gid)
                return
            time.sleep(0.0005)
        pipe.send(reached=None, state=group.state, gid=group.gid)

    def describe(group: CoordinatedGroup) -> dict[str, Any]:
        ready_at = next((t for s, t in group.history if s == "ready"), None)
        return {"gid": group.gid, "state": group.state, "history": group.history, "time_to_ready_s": ready_at,
                "ranks": [{"rank": r.rank, "pid": r.pid, "state": r.state, "import_s": r.import_s,
                           "leases": r.leases, "dead": r.dead} for r in group.ranks()],
                "failure": None if group.failure is None else str(group.failure)}

    while True:
        cmd = recv(conn, 3600)
        try:
            if cmd["cmd"] == "wait_workers":
                coord.wait_for_workers(spec.timeout_s)
                pipe.send(ok=True)
            elif cmd["cmd"] == "import":
                blocks = BlockRequest(cmd["inventory_group"], tuple(cmd["epochs"]), tuple(cmd["hashes"])) \
                    if cmd.get("epochs") else None
                t0 = time.monotonic()
                try:
                    group = coord.start_group([bytes.fromhex(w) for w in cmd["wire"]], blocks=blocks)
                except KvStateError as exc:  # refused here: the group ended before any worker heard of it
                    last = list(coord.groups.values())[-1]
                    groups[last.gid] = last
                    pipe.send(**describe(last), error=f"{type(exc).__name__}: {exc}")
                    continue
                groups[group.gid] = group
                if cmd.get("notify"):
                    threading.Thread(target=notify_when, args=(group, *cmd["notify"]), daemon=True).start()
                group.wait(("ready",), spec.timeout_s + 3 * spec.phase_timeout_s)
                if group.state != "ready":
                    group.wait(group.table.terminal, 3 * spec.phase_timeout_s)
                pipe.send(**describe(group), wall_s=time.monotonic() - t0)
            elif cmd["cmd"] == "drain":
                group = groups[cmd["gid"]]
                seconds = group.drain(spec.timeout_s)
                pipe.send(**describe(group), drain_s=seconds)
            elif cmd["cmd"] == "describe":
                pipe.send(**describe(groups[cmd["gid"]]))
            elif cmd["cmd"] == "exit":
                coord.close()
                pipe.send(leaks=leaks_since(baseline), violations=violations)
                return
        except KvStateError as exc:
            pipe.send(error=f"{type(exc).__name__}: {exc}")


# -- a worker process ----------------------------------------------------------------------


class HoldingWorker(RankWorker[H, A, R, M, E]):
    """A RankWorker that can be held at ``check`` (before validating and leasing) or
    ``open`` (before opening and mapping), so a parent can kill a process while that phase
    is open."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holds: set[str] = set()
        self.released = threading.Event()
        self.released.set()

    def hold(self, points: set[str]) -> None:
        self.holds = points
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def _check(self, cmd: msgs.Command) -> None:
        if "check" in self.holds:
            self.released.wait(30)
        super()._check(cmd)

    def _open(self, share: RankShare[H, A, R, M, E]) -> None:
        if "open" in self.holds:
            self.released.wait(30)
        super()._open(share)


def worker_main(conn: multiprocessing.connection.Connection, spec_json: str, key_hex: str, rank: int,
                coordinator_path: str) -> None:
    from kvstate.share.rank_worker import WorkerConfig
    from kvstate.transport.host import HostTransport

    spec = ClusterSpec(**json.loads(spec_json))
    pipe = _Pipe(conn)
    baseline = resources()
    t = HostTransport(granularity=spec.granularity)
    remote: NixlTransport | None = None
    if spec.nixl:
        from kvstate.harness.cluster import use_loopback_ucx
        from kvstate.transport.nixl import NixlTransport

        use_loopback_ucx()
        remote = NixlTransport()
    violations: list[str] = []
    histories: dict[str, list[str]] = {}
    worker: HoldingWorker[HostHandle, HostAllocation, HostReservation, HostMapping, HostEndpoint] | None = None

    changes: list[StateChange] = []

    def on_change(change: StateChange) -> None:
        # Observers run after the commit, so these are judged from commit times, not now.
        changes.append(change)
        if change.machine == "rank":
            histories.setdefault(change.label.split("/", 1)[1], ["idle"]).append(change.dest)

    def judge() -> list[str]:
        """INV-COORD-LOAD-AFTER-READY and INV-COORD-NO-ORPHAN-MAPPING from the inside, by
        commit time: a share entered ready only while its part was imported (opened before,
        not yet closed), and a share that ended had closed its part by then (if it opened one)."""
        found = list(violations)
        for c in list(changes):
            if c.machine != "rank" or c.dest not in ("ready", "closed", "failed", "rejected") or c.source == c.dest:
                continue
            part = [p for p in changes if p.machine == "part" and p.label.startswith(c.label + "/")]
            opened = [p.monotonic_ns for p in part if p.dest == "imported"]
            closed = [p.monotonic_ns for p in part if p.dest == "closed" and p.source == "imported"]
            if c.dest == "ready" and not (opened and opened[0] < c.monotonic_ns
                                          and not any(t < c.monotonic_ns for t in closed)):
                found.append(f"{c.label} ready without its part mapped")
            if c.dest != "ready" and opened and not any(t <= c.monotonic_ns for t in closed):
                found.append(f"{c.label} {c.dest} still mapping its part")
        return found

    worker = HoldingWorker(WorkerConfig(Deployment(DEPLOYMENT_NAME, bytes.fromhex(key_hex)), rank, spec.tp,
                                        Path(coordinator_path),
                                        reuse=ReuseSettings(enable_decode_to_prefill_reuse=True)),
                           t, remote=remote, observers=[on_change])
    if spec.plant is not None:  # a self-test: a deliberately broken share (tests/planted)
        module, _, name = spec.plant.partition(":")
        worker.share_class = getattr(importlib.import_module(module), name)
    loader: threading.Thread | None = None

    def status(gid: str) -> dict[str, Any]:
        assert worker is not None
        share = worker.share(gid)
        return {"rank": rank, "pid": os.getpid(), "state": None if share is None else share.state,
                "history": histories.get(gid, []), "import_s": None if share is None else share.import_s,
                "unmapped_at": None if share is None else share.unmapped_at, "leases": worker.leases(),
                "memfd_maps": resources()["memfd_maps"] - baseline["memfd_maps"],
                "violations": judge()}

    worker_released = threading.Event()

    def worker_kick() -> None:
        if worker is not None:
            worker.kick()

    def start_load(cmd: dict[str, Any]) -> threading.Thread | None:
        """Load this rank's prefix and answer with its checksum; with ``stall`` the load
        stays in flight (its op queued, pinning the part) until release, on a thread that
        is returned. Its locals end with it (a NIXL agent goes only once nothing holds it)."""
        assert worker is not None
        share = worker.wait(cmd["gid"], ("ready",), spec.timeout_s)
        if share is None or share.state != "ready":
            pipe.send(error=f"share is {None if share is None else share.state}", **status(cmd["gid"]))
            return None
        s: HostShare = share
        g = spec.geometry()
        blocks: list[int] = cmd["blocks"]

        def reply(data: bytes, seconds: float, nbytes: int) -> None:
            pipe.send(checksum=hashlib.blake2b(data, digest_size=16).hexdigest(), seconds=seconds, bytes=nbytes)

        def read_remote() -> None:
            """NIXL READs land in memory registered with this worker's agent."""
            assert remote is not None
            n = len(blocks) * g.block_bytes
            dst = remote.create(-(-n // 4096) * 4096)
            try:
                result = s.load_prefix(blocks, dst, timeout=spec.timeout_s)
                reply(bytes(dst.view()[:n]), result.seconds, result.bytes)
            finally:
                remote.release(dst)

        def submit() -> Callable[[], None]:
            """The paged load (the engine's path: bank blocks into pages 0..n-1 of one
            tensor per region), submitted; returns what waits for it and replies. The
            pages are plain buffers shaped as the engine's tensors (raw bits of each
            region's dtype): the demo needs only kvstate's base dependencies, not numpy."""
            memory = {r.name: bytearray(len(blocks) * r.block_bytes) for r in g.regions}
            pages = {r.name: memoryview(memory[r.name]).cast(_RAW_BITS[r.itemsize], (len(blocks), *r.block_shape))
                     for r in g.regions}
            handle = s.load(blocks, pages, list(range(len(blocks))))

            def finish() -> None:
                try:
                    if not handle.wait(spec.timeout_s):
                        pipe.send(error=f"TransferFailed: load still running after {spec.timeout_s} s")
                        return
                    result = handle.result()
                    if result is None or not result.ok:
                        pipe.send(error=f"TransferFailed: load blocks {sorted(handle.failed_blocks())[:8]} failed")
                        return
                    data = b"".join(memory[r.name][i * r.block_bytes:(i + 1) * r.block_bytes]
                                    for i in range(len(blocks)) for r in g.regions)
                    reply(data, result.seconds, result.bytes)
                finally:
                    handle.close()
            return finish

        def guarded(fn: Callable[[], None]) -> None:
            try:
                fn()
            except KvStateError as exc:
                pipe.send(error=f"{type(exc).__name__}: {exc}")

        stall = bool(cmd.get("stall"))
        if remote is not None and isinstance(s.part, RemotePart):
            if not stall:
                guarded(read_remote)
                return None
            # A NIXL READ cannot be paused: the part is pinned as a READ pins it until release.
            part = s.part
            part.pin()

            def pinned() -> None:
                worker_released.wait(spec.timeout_s)
                part.unpin()
                worker_kick()
                pipe.send(pinned=True)

            thread = threading.Thread(target=pinned)
            thread.start()
            pipe.send(loading=True)
            return thread
        if stall:
            t.native.pause(True)  # the ops stay queued, pinning the part, until release
        try:
            finish = submit()
        except KvStateError as exc:
            t.native.pause(False)
            pipe.send(error=f"{type(exc).__name__}: {exc}")
            return None
        if not stall:
            guarded(finish)
            return None
        thread = threading.Thread(target=guarded, args=(finish,))
        thread.start()
        pipe.send(loading=True)
        return thread

    while True:
        cmd = recv(conn, 3600)
        try:
            if cmd["cmd"] == "start":
                worker.start()
                pipe.send(pid=os.getpid())
            elif cmd["cmd"] == "hold":
                worker.hold(set(cmd["points"]))
                pipe.send(ok=True)
            elif cmd["cmd"] == "release":
                worker.release()
                worker_released.set()
                t.native.pause(False)
                pipe.send(ok=True)
            elif cmd["cmd"] == "load":
                loader = start_load(cmd) or loader
            elif cmd["cmd"] == "status":
                pipe.send(**status(cmd["gid"]))
            elif cmd["cmd"] == "wait_ended":
                worker.wait(cmd["gid"], ("closed", "failed", "rejected"), cmd.get("timeout", spec.timeout_s))
                pipe.send(**status(cmd["gid"]))
            elif cmd["cmd"] == "exit":
                t.native.pause(False)
                if loader is not None:
                    loader.join(spec.timeout_s)
                worker.close()
                if remote is not None:  # the agent keeps UCX connections to its peers until it is gone
                    remote.close()
                    worker.remote = remote = loader = None
                    worker.ended.clear()
                pipe.send(leaks=leaks_since(baseline), violations=judge(), histories=histories)
                return
        except KvStateError as exc:
            pipe.send(error=f"{type(exc).__name__}: {exc}")
