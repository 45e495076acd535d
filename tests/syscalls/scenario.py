"""One case of the syscall failure test, in a fresh process under the shim.

    LD_PRELOAD=libsysshim.so KVS_SYSFAIL=call:nth:errno[:short] python scenario.py OP
    LD_PRELOAD=libsysshim.so python scenario.py --serve   # JSON {"op", "rule"} lines in

``--serve`` imports everything once and forks a fresh child per case (the parent never
starts a thread, arms the shim or makes a kvstate object, so each child starts clean);
a child that does not answer within its timeout is killed and reported as a hang.

Each case builds the state the operation ``OP`` starts from (unarmed), records what the process
holds, arms the shim, runs the operation once, disarms, and prints one JSON line:

- ``outcome``: ``ok``, ``typed`` (a KvStateError, or a transfer that reports its blocks
  failed) or ``raw`` (anything else leaving the public API: a defect);
- ``problems``: after a failure, what is not as it was before (fds, memfd mappings,
  native objects, threads, table states and leases), and whether the same operation
  succeeds when retried without the failure; after everything is torn down, anything
  left since the process began;
- ``counts``: the armed calls per name (the census), ``fired``: whether the rule fired.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvstate import Deployment, ExportConfig, Exporter, HostTransport, ImportConfig, Importer, ReuseSettings
from kvstate.channel import Channel, Watcher
from kvstate.core import layouts
from kvstate.core.errors import KvStateError
from kvstate.harness import leaks
from kvstate.share.coordinator import Coordinator, CoordinatorConfig
from kvstate.share.rank_worker import RankWorker, WorkerConfig
from kvstate.share.transfer import stop_dispatcher_if_idle

SHIM = ctypes.CDLL(None)  # the preloaded shim's controls are global symbols
SHIM.kvs_sys_name.restype = ctypes.c_char_p
SHIM.kvs_sys_count.restype = ctypes.c_long

DEPLOYMENT = Deployment("sysfail", b"k" * 32)
REUSE = ReuseSettings(enable_decode_to_prefill_reuse=True)
GRANULARITY = 64 * 1024
GEOMETRY = layouts.vllm_cpu(2, num_blocks=4, num_kv_heads=1, block_size=4, head_dim=8)
WAIT_S = 10.0


class Reported(Exception):
    """A transfer that ended and reported failed blocks: a typed outcome, not a raise."""


def pages() -> dict[str, Any]:
    return {n: np.zeros((4, 1, 4, 16), np.uint16) for n in GEOMETRY.names}


def counts() -> dict[str, int]:
    out, i = {}, 0
    while (name := SHIM.kvs_sys_name(i)) is not None:
        n = SHIM.kvs_sys_count(i)
        if n:
            out[name.decode()] = n
        i += 1
    return out


class World:
    """Exporter, importer, coordinator as each operation needs them."""

    def __init__(self, sockdir: Path) -> None:
        self.sockdir = sockdir
        self.exporter: Exporter[Any, Any, Any, Any, Any] | None = None
        self.bank: Any = None
        self.importer: Importer[Any, Any, Any, Any, Any] | None = None
        self.group: Any = None
        self.coordinator: Coordinator | None = None
        self.worker: RankWorker[Any, Any, Any, Any, Any] | None = None

    # -- steps -----------------------------------------------------------------------
    def new_exporter(self) -> None:
        self.exporter = Exporter(ExportConfig(DEPLOYMENT, self.sockdir / "e", b"s" * 16, tp=1),
                                 HostTransport(granularity=GRANULARITY), name="decode")

    def add_bank(self) -> None:
        assert self.exporter is not None
        self.bank = self.exporter.add_bank(0, GEOMETRY)

    def register(self) -> None:
        self.bank.register()

    def advertise(self) -> None:
        self.bank.advertise()

    def start(self) -> None:
        assert self.exporter is not None
        self.exporter.start()

    def new_exporter2(self) -> None:
        """A tp=2 exporter with both banks advertised: a group of two parts, one batch."""
        self.exporter = Exporter(ExportConfig(DEPLOYMENT, self.sockdir / "e", b"s" * 16, tp=2),
                                 HostTransport(granularity=GRANULARITY), name="decode")
        for rank in (0, 1):
            bank = self.exporter.add_bank(rank, GEOMETRY)
            bank.register()
            bank.advertise()

    def import_group2(self) -> None:
        assert self.importer is not None and self.exporter is not None
        self.group = self.importer.import_group([self.exporter.descriptor(0), self.exporter.descriptor(1)])

    def new_importer(self) -> None:
        self.importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE), HostTransport(granularity=GRANULARITY))

    def import_group(self) -> None:
        assert self.importer is not None and self.exporter is not None
        self.group = self.importer.import_group([self.exporter.descriptor(0)])

    def load(self) -> None:
        self._transfer(self.group.load([0], pages(), [1]))

    def store(self) -> None:
        self._transfer(self.bank.store(pages(), [1], [0]))

    @staticmethod
    def _transfer(h: Any) -> None:
        try:
            if not h.wait(WAIT_S):
                raise TimeoutError(f"the transfer did not end within {WAIT_S} s")
            if h.failed_blocks():
                raise Reported(f"failed blocks {sorted(h.failed_blocks())}")
        finally:
            h.close()

    def drain_group(self) -> None:
        self.group.drain(WAIT_S)

    def release(self) -> None:
        assert self.exporter is not None
        self.exporter.stop()
        self.exporter.drain(WAIT_S)

    def start_coordinator(self) -> None:
        self.coordinator = Coordinator(CoordinatorConfig(DEPLOYMENT, 1, self.sockdir / "c"))
        self.coordinator.start()

    def hello(self) -> None:
        assert self.coordinator is not None
        w: RankWorker[Any, Any, Any, Any, Any] = RankWorker(
            WorkerConfig(DEPLOYMENT, 0, 1, self.coordinator.socket_path, reuse=REUSE),
            HostTransport(granularity=GRANULARITY))
        w.start()  # on failure the worker is closed: a new one is the retry (documented)
        self.worker = w
        self.coordinator.wait_for_workers(WAIT_S)

    def watch(self) -> None:
        """The watcher that ends an exporter's leases tells a peer's hang-up."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        closed = threading.Event()
        w = Watcher(name="sysfail-watch")
        try:
            ch = Channel(a)
            try:
                w.watch(ch, lambda _: closed.set())
                b.close()
                if not closed.wait(WAIT_S):
                    raise TimeoutError(f"the watcher did not tell a hang-up within {WAIT_S} s")
            finally:
                ch.close()
        finally:
            b.close()
            w.close()

    # -- observation -----------------------------------------------------------------
    def tables(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.exporter is not None:
            out["banks"] = {r: [b.state, b.generation, sorted(b.leases), len(b.holds), b.pins()]
                            for r, b in self.exporter.banks.items()}
            out["serving"] = self.exporter._server is not None
        if self.group is not None:
            out["group"] = [self.group.state, [p.state for p in self.group.parts]]
        if self.importer is not None:  # a terminal group stays listed until the next import
            out["groups"] = len([g for g in self.importer.groups if not g.is_terminal])
        if self.coordinator is not None:
            out["workers"] = sorted(r for r, link in self.coordinator.links.items() if link.alive)
        return out

    def settle(self) -> None:
        """Idle links closed (a failed lease may end the link it used; a successful one
        keeps it) and no idle dispatcher, so before and after compare what the operation
        itself holds."""
        if self.importer is not None:
            self.importer.peers.close_idle(everything=True)
        # The transfer dispatcher's thread and fds come and go by themselves (it exits
        # after lingering idle): none while comparing.
        stop_dispatcher_if_idle()

    def teardown(self) -> None:
        if self.worker is not None:
            self.worker.close(WAIT_S)
        if self.coordinator is not None:
            self.coordinator.close()
        if self.group is not None and not self.group.is_terminal:
            self.group.drain(WAIT_S)
        if self.importer is not None:
            self.importer.close()
        if self.exporter is not None:
            self.exporter.stop()
            self.exporter.drain(WAIT_S)


#: op -> (steps that build its starting state, the operation itself).
OPS: dict[str, tuple[tuple[str, ...], str]] = {
    "add_bank": (("new_exporter",), "add_bank"),
    "register": (("new_exporter", "add_bank"), "register"),
    "advertise": (("new_exporter", "add_bank", "register"), "advertise"),
    "start": (("new_exporter", "add_bank", "register", "advertise"), "start"),
    "import_group": (("new_exporter", "add_bank", "register", "advertise", "start", "new_importer"), "import_group"),
    # Two parts in one native attach: a failure of the second rolls the first back too.
    "import_tp2": (("new_exporter2", "start", "new_importer"), "import_group2"),
    "load": (("new_exporter", "add_bank", "register", "advertise", "start", "new_importer", "import_group",
              "load"), "load"),
    "store": (("new_exporter", "add_bank", "register", "store"), "store"),
    "drain": (("new_exporter", "add_bank", "register", "advertise", "start", "new_importer", "import_group"),
              "drain_group"),
    "release": (("new_exporter", "add_bank", "register", "advertise", "start"), "release"),
    "hello": (("start_coordinator",), "hello"),
    "watch": ((), "watch"),
}


#: Operations made of several transitions, each atomic on its own: a failure leaves the
#: steps before it done (a group quiescent, a server stopped) and the operation, called
#: again, finishes from there. They are checked for a typed error, the retry and the
#: teardown, not for the state before.
RESUMABLE = frozenset({"drain", "release"})


def snapshot(world: World) -> tuple[leaks.Snapshot, dict[str, Any]]:
    world.settle()
    gc.collect()
    return leaks.snapshot(), world.tables()


def differences(world: World, before: leaks.Snapshot, before_tables: dict[str, Any]) -> list[str]:
    """What is held now and was not, or was and is gone (after a grace for threads and
    connections to wind down: a peer sees a closed link on its next poll)."""
    deadline = time.monotonic() + 3.0
    while (after_tables := world.tables()) != before_tables and time.monotonic() < deadline:
        time.sleep(0.02)
    world.settle()
    found = leaks.settled_leaks(before, grace_s=3.0)
    now = leaks.snapshot()
    gone = [f"fd {fd} -> {t} gone" for fd, t in sorted(before.fds.items()) if now.fds.get(fd) != t]
    lost_maps = collections.Counter(before.memfd_maps) - collections.Counter(now.memfd_maps)
    gone += [f"memfd mapping gone: {line}" for line in sorted(lost_maps.elements())]
    gone += [f"native {k}: {before.native.get(k, 0)} -> {now.native.get(k, 0)}"
             for k in leaks.NATIVE_COUNTERS if now.native.get(k, 0) < before.native.get(k, 0)]
    if after_tables != before_tables:
        gone.append(f"tables: {before_tables} -> {after_tables}")
    return found + gone


def run(op: str, rule: str = "") -> dict[str, Any]:
    setup, name = OPS[op]
    baseline = leaks.snapshot()
    sockdir = Path(tempfile.mkdtemp(prefix="kvs-sysfail-"))
    world = World(sockdir)
    # The operation is run once unarmed in setup where its first run starts something
    # process-wide (the transfer dispatcher): what it starts once is not a leak of a case.
    for step in setup:
        getattr(world, step)()
    before, before_tables = snapshot(world)
    step_fn: Callable[[], None] = getattr(world, name)
    result: dict[str, Any] = {"op": op, "rule": rule or os.environ.get("KVS_SYSFAIL", ""), "problems": []}
    SHIM.kvs_sys_arm(1)
    try:
        step_fn()
        result["outcome"] = "ok"
    except (KvStateError, Reported) as exc:
        result.update(outcome="typed", error=f"{type(exc).__name__}: {exc}"[:300])
    except BaseException as exc:  # noqa: BLE001 - the defect being looked for
        result.update(outcome="raw", error=f"{type(exc).__name__}: {exc}"[:300],
                      trace=traceback.format_exc()[-1500:])
    finally:
        SHIM.kvs_sys_arm(0)
    result["fired"] = bool(SHIM.kvs_sys_fired())
    result["counts"] = counts()
    problems: list[str] = result["problems"]
    if result["outcome"] != "ok":
        world.settle()
        if op not in RESUMABLE:
            problems += [f"not rolled back: {p}" for p in differences(world, before, before_tables)]
        try:
            step_fn()
        except BaseException as exc:  # noqa: BLE001
            problems.append(f"not usable: the retry raised {type(exc).__name__}: {exc}"[:300])
    try:
        world.teardown()
    except BaseException as exc:  # noqa: BLE001
        problems.append(f"teardown raised {type(exc).__name__}: {exc}"[:300])
    problems += [f"left after teardown: {p}" for p in leaks.settled_leaks(baseline, grace_s=3.0)]
    leftovers = sorted(str(p.relative_to(sockdir)) for p in sockdir.rglob("*") if not p.is_dir())
    if leftovers:
        problems.append(f"left in the socket directory after teardown: {leftovers}")
    shutil.rmtree(sockdir, ignore_errors=True)
    return result


def one(op: str, rule: str, timeout: float) -> dict[str, Any]:
    """Fork a child for one case and collect its answer (or kill it)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the case
        os.close(r)
        code = 0
        try:
            if rule and SHIM.kvs_sys_rule(rule.encode()) != 0:
                raise ValueError(f"bad rule {rule!r}")
            data = json.dumps(run(op, rule)).encode()
        except BaseException:  # noqa: BLE001 - the harness's own failure, reported
            data, code = json.dumps({"op": op, "rule": rule, "outcome": "crash",
                                     "problems": [traceback.format_exc()[-1500:]]}).encode(), 1
        while data:
            data = data[os.write(w, data):]
        os._exit(code)  # daemon threads of a broken case must not hold the exit
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    p = select.poll()
    p.register(r, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not p.poll(int(left * 1000) + 1):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return {"op": op, "rule": rule, "outcome": "hang", "problems": [f"no answer within {timeout} s"]}
        chunk = os.read(r, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    try:
        out: dict[str, Any] = json.loads(b"".join(chunks))
    except ValueError:
        out = {"op": op, "rule": rule, "outcome": "crash", "problems": [f"wait status {status}, no answer"]}
    return out


def serve(timeout: float) -> None:
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit("the case server must be single-threaded before it forks")
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.write(json.dumps(one(req["op"], req.get("rule") or "", timeout)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
    else:
        sys.stdout.write(json.dumps(run(sys.argv[1])) + "\n")
        sys.stdout.flush()
        os._exit(0)  # daemon threads of a broken case must not hold the exit
