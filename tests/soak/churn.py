"""Lease churn: many importer processes leasing, importing, loading and releasing against
one tp=4 exporter group, with random SIGKILLs of importers, for a set time. Every other
importer parks its leases between cycles (``PARK_S``), so a kill may take parked ones.

Each exporter process (one per rank) serves one bank for the whole run. Each importer
process loops on its own: import the whole group (validate, lease, map every rank's part),
load a prefix of its rank's bank and checksum it, drain and release. It reports each
cycle's import time (validate + lease + map of the tp parts, the grant as an importer sees
it) and load verdict over its own pipe, so a SIGKILL loses at most the cycle in flight. The
driver kills a random importer now and then and starts a new one in its place.

The exporters must hold steady: their open fds, RSS and threads are sampled every second
(from /proc), and none may grow after warm-up (the first third of the run, at most a
minute) beyond a small allowance; every load's bytes must match; and once every importer
is gone the exporters' leases must all have ended (read with ``kvstate status``'s query)
and each bank must drain to quiescent.

``make churn`` runs it for 10 minutes and prints the report (``CHURN_SECONDS``);
tests/soak/test_churn.py runs 30 seconds of it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from support.stalls import Heartbeat, collect

TP = 4
BLOCKS = 64
PREFIX = list(range(8))
LEASE_S = 2.0
#: Growth allowed after warm-up: a few fds and threads (a connection or handler in flight
#: when sampled), and RSS within 10% (allocator noise), never a per-cycle leak.
SLACK = {"fds": 4, "threads": 4, "rss_kib": 0.10}
#: A process whose Python stops for this many lease terms leaves every thread's stack.
STALL_TERMS = 2
#: One advertised generation serves the whole run (the default 300 s TTL would withdraw
#: it mid-run; re-advertising is the soak's and the vLLM suite's to test, not this one's).
DESCRIPTOR_TTL_S = 86400.0
#: More failed cycles than this fraction is a finding (a killed peer's cycle fails, rarely more).
FAILED_FRACTION = 0.01
#: Every other importer parks its leases between cycles (``ImportConfig.park_s``), so
#: SIGKILLs also take importers that hold parked leases and mappings.
PARK_S = 5 * LEASE_S


def _geometry() -> Any:
    from kvstate.core.geometry import DType, Geometry, Layout

    return Geometry.uniform(layers=2, kv_heads=1, head_dim=64, block_tokens=16, dtype=DType.BF16,
                            layout=Layout.LAYER_MAJOR, num_blocks=BLOCKS)


def _pattern(rank: int, nbytes: int) -> bytes:
    unit = bytes((rank * 41 + i) % 253 for i in range(253))
    return (unit * (nbytes // len(unit) + 1))[:nbytes]


def _expected(rank: int) -> str:
    g = _geometry()
    data = _pattern(rank, g.nbytes)
    want = b"".join(data[o:o + n] for b in PREFIX for o, n in g.block_extents(b))
    return hashlib.blake2b(want, digest_size=16).hexdigest()


def _send(conn: multiprocessing.connection.Connection, **msg: Any) -> None:
    conn.send_bytes(json.dumps(msg).encode())


# -- processes -------------------------------------------------------------------------------


def exporter_main(conn: multiprocessing.connection.Connection, key: str, socket_dir: str, source: str,
                  rank: int, plant: str | None, stall_dir: str) -> None:
    """One rank's bank, served for the whole run. ``plant="leak_fd"`` (the self-test) leaks
    an fd with every lease granted."""
    from kvstate.core.identity import Deployment
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.transport.host import HostTransport

    Heartbeat(Path(stall_dir), STALL_TERMS * LEASE_S)
    faults = _ErrorLog()  # a handler thread that died, or any error kvstate logged, is a finding
    logging.getLogger("kvstate").addHandler(faults)
    g = _geometry()
    ex = Exporter(ExportConfig(Deployment("churn", bytes.fromhex(key)), Path(socket_dir), bytes.fromhex(source), TP,
                               lease_timeout_s=LEASE_S, descriptor_ttl_s=DESCRIPTOR_TTL_S),
                  HostTransport(granularity=64 * 1024), name=f"rank{rank}")
    bank = ex.add_bank(rank, g)
    if plant == "leak_fd":
        bank.observe(lambda c: os.open("/dev/null", os.O_RDONLY) if c.event == "grant_lease" else None)
    bank.register()
    bank.view()[:g.nbytes] = _pattern(rank, g.nbytes)
    bank.advertise()
    ex.start()
    _send(conn, descriptor=ex.descriptor(rank).hex(), pid=os.getpid())
    conn.recv_bytes()  # drain when told
    ex.stop()
    try:
        waited = ex.drain(30.0)
    except Exception as exc:  # reported, not raised: the driver judges
        faults.records.append(f"drain: {type(exc).__name__}: {exc}")
    if faults.records:
        _send(conn, error="; ".join(faults.records[:5]) + f" ({len(faults.records)} in all)")
    else:
        _send(conn, quiescent_s=waited)


class _ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}"
                            + (f" ({record.exc_info[0].__name__})" if record.exc_info and record.exc_info[0] else ""))


def importer_main(conn: multiprocessing.connection.Connection, key: str, wire: list[str], seed: int,
                  stall_dir: str) -> None:
    from kvstate.core.identity import Deployment
    from kvstate.reuse.policy import ReuseSettings
    from kvstate.share.importer import ImportConfig, Importer
    from kvstate.transport.host import HostTransport

    rng = random.Random(seed)
    Heartbeat(Path(stall_dir), STALL_TERMS * LEASE_S)
    im = Importer(ImportConfig(Deployment("churn", bytes.fromhex(key)),
                               reuse=ReuseSettings(enable_decode_to_prefill_reuse=True),
                               park_s=PARK_S if seed % 2 else 0.0),
                  HostTransport(granularity=64 * 1024))
    descriptors = [bytes.fromhex(w) for w in wire]
    g = _geometry()
    last: list[int | None] = []
    while True:
        rank = rng.randrange(TP)
        t0 = time.monotonic()
        try:
            group = im.import_group(descriptors)
            grant = time.monotonic() - t0
            dst = bytearray(len(PREFIX) * g.block_bytes)
            group.load_prefix(PREFIX, {rank: dst}, timeout=20.0)
            digest = hashlib.blake2b(dst, digest_size=16).hexdigest()
            leases = [p.lease_id for p in group.parts]
            group.drain(20.0)
            # The same leases as the last cycle's: this import adopted them parked.
            _send(conn, grant_s=grant, rank=rank, checksum=digest, adopted=leases == last)
            last = leases
        except Exception as exc:  # counted by the driver; the loop goes on, after a pause
            _send(conn, error=f"{type(exc).__name__}: {exc}")
            time.sleep(0.01)
        if conn.poll():  # told to stop
            im.close()
            return


def _proc_status(pid: int) -> dict[str, float]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                fields[key] = float(value.split()[0])
    return {"fds": float(len(os.listdir(f"/proc/{pid}/fd"))), "threads": fields["Threads"], "rss_kib": fields["VmRSS"]}


# -- the driver ------------------------------------------------------------------------------


@attrs.define
class ChurnReport:
    seconds: float = 0.0
    importers: int = 0
    cycles: int = 0
    adopted_cycles: int = 0  # cycles whose import adopted the last cycle's parked leases
    failed_cycles: int = 0
    kills: int = 0
    grant_p50_ms: float = 0.0
    grant_p99_ms: float = 0.0
    leases_per_s: float = 0.0
    corrupt_loads: list[str] = attrs.Factory(list)
    growth: list[str] = attrs.Factory(list)
    leases_left: list[str] = attrs.Factory(list)
    exporter_errors: list[str] = attrs.Factory(list)
    importer_exits: list[str] = attrs.Factory(list)  # an importer that ended without being killed
    stalls: list[str] = attrs.Factory(list)  # stacks of processes whose Python stopped (support.stalls)
    failures: list[str] = attrs.Factory(list)  # more failed cycles than FAILED_FRACTION
    errors: dict[str, int] = attrs.Factory(dict)
    samples: dict[str, list[list[float]]] = attrs.Factory(dict)  # rank -> [t, fds, threads, rss_kib]

    def problems(self) -> list[str]:
        return (self.corrupt_loads + self.growth + self.leases_left + self.exporter_errors + self.importer_exits
                + self.stalls + self.failures)

    def summary(self) -> str:
        return (f"{self.importers} importers for {self.seconds:.0f} s: {self.cycles} cycles ({self.failed_cycles} failed,"
                f" {self.adopted_cycles} on parked leases,"
                f" {self.kills} importers SIGKILLed), {self.leases_per_s:.0f} leases/s, import (lease + map of {TP} "
                f"parts) p50 {self.grant_p50_ms:.1f} ms, p99 {self.grant_p99_ms:.1f} ms; failures by kind "
                f"{dict(sorted(self.errors.items(), key=lambda kv: -kv[1])[:4])}; problems: {len(self.problems())}")


def run_churn(seconds: float, importers: int = 32, *, kill_every_s: float = 0.5, seed: int = 1,
              log: Any = lambda s: None, plant: str | None = None) -> ChurnReport:
    rng = random.Random(seed)
    report = ChurnReport(importers=importers)
    root = Path(tempfile.mkdtemp(prefix="kvs-churn-"))
    root.chmod(0o700)
    stalls = root / "stalls"
    stalls.mkdir()
    key, source = os.urandom(32).hex(), os.urandom(16).hex()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["soak.churn", "kvstate.share.exporter", "kvstate.share.importer",
                                "kvstate.transport.host"])
    exporters: list[tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection]] = []
    workers: dict[multiprocessing.connection.Connection, multiprocessing.process.BaseProcess] = {}
    grants: list[float] = []
    killed: set[int] = set()
    expected = {r: _expected(r) for r in range(TP)}

    def start(target: Any, *args: Any) -> tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection]:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        child.close()
        return p, parent

    try:
        for r in range(TP):
            exporters.append(start(exporter_main, key, str(root / "s"), source, r, plant, str(stalls)))
        hello = [json.loads(c.recv_bytes()) for _, c in exporters]
        wire = [h["descriptor"] for h in hello]
        pids = {r: h["pid"] for r, h in enumerate(hello)}
        for n in range(importers):
            p, c = start(importer_main, key, wire, seed * 1000 + n, str(stalls))
            workers[c] = p
        t0 = time.monotonic()
        next_kill, next_sample, spawned = t0 + kill_every_s, t0, importers
        samples: dict[int, list[list[float]]] = {r: [] for r in range(TP)}
        while (now := time.monotonic()) < t0 + seconds:
            for c in multiprocessing.connection.wait(list(workers), timeout=0.05):
                try:
                    msg = json.loads(c.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    gone = workers.pop(c)  # type: ignore[arg-type]
                    gone.join(5)
                    c.close()  # type: ignore[union-attr]
                    if gone.pid not in killed:
                        report.importer_exits.append(f"pid {gone.pid} exited by itself ({gone.exitcode})")
                    continue
                if "error" in msg:
                    report.failed_cycles += 1
                    kind = msg["error"].split(":", 1)[0]
                    report.errors[kind] = report.errors.get(kind, 0) + 1
                    continue
                report.cycles += 1
                report.adopted_cycles += bool(msg["adopted"])
                grants.append(msg["grant_s"])
                if msg["checksum"] != expected[msg["rank"]]:
                    report.corrupt_loads.append(f"rank {msg['rank']}: {msg['checksum']}")
            if now >= next_kill and workers:
                victim = workers[rng.choice(list(workers))]
                killed.add(victim.pid)  # type: ignore[arg-type]
                victim.kill()
                report.kills += 1
                next_kill += kill_every_s
                p, c = start(importer_main, key, wire, seed * 1000 + spawned, str(stalls))
                spawned += 1
                workers[c] = p
            if now >= next_sample:
                for r, pid in pids.items():
                    s = _proc_status(pid)
                    samples[r].append([now - t0, s["fds"], s["threads"], s["rss_kib"]])
                next_sample += 1.0
        report.seconds = time.monotonic() - t0
        for c, p in list(workers.items()):  # stop: each finishes its cycle and closes
            try:
                c.send_bytes(b"stop")
            except OSError:
                pass
        for c, p in list(workers.items()):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
            c.close()
        workers.clear()
        report.samples = {str(r): v for r, v in samples.items()}
        report.growth = _growth(samples, warmup=min(60.0, seconds / 3))
        report.leases_left = _leases_left(root / "s")
        for r, (p, c) in enumerate(exporters):
            c.send_bytes(b"drain")
            reply = json.loads(c.recv_bytes())
            if "error" in reply:
                report.exporter_errors.append(f"rank {r}: {reply['error']}")
        if grants:
            ordered = sorted(grants)
            report.grant_p50_ms = statistics.median(ordered) * 1e3
            report.grant_p99_ms = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3
        report.leases_per_s = (report.cycles - report.adopted_cycles) * TP / report.seconds  # adoptions ask none
        report.stalls = collect(stalls)
        if report.failed_cycles > FAILED_FRACTION * max(report.cycles, 1):
            report.failures.append(f"{report.failed_cycles} failed cycles of {report.cycles + report.failed_cycles}: "
                                   f"{report.errors}")
        log(report.summary())
        return report
    finally:
        for c, p in workers.items():
            p.kill()
        for p, c in exporters:
            if p.is_alive():
                p.kill()
            p.join(5)
            c.close()
        shutil.rmtree(root, ignore_errors=True)


def _growth(samples: dict[int, list[list[float]]], warmup: float) -> list[str]:
    """Exporter resources after warm-up that exceed the warm-up's peak beyond SLACK."""
    out = []
    for rank, rows in samples.items():
        before = [row for row in rows if row[0] <= warmup]
        after = [row for row in rows if row[0] > warmup]
        if not before or not after:
            out.append(f"rank {rank}: too few samples to judge ({len(before)} in warm-up, {len(after)} after)")
            continue
        for i, name in enumerate(("fds", "threads", "rss_kib"), start=1):
            peak, late = max(r[i] for r in before), max(r[i] for r in after)
            slack = SLACK[name]
            allowed = peak * (1 + slack) if isinstance(slack, float) else peak + slack
            if late > allowed:
                out.append(f"rank {rank}: {name} grew from a warm-up peak of {peak:.0f} to {late:.0f}")
    return out


def _leases_left(socket_dir: Path) -> list[str]:
    """Every importer is gone: no lease may be left on any bank (asked as `kvstate status` asks)."""
    from kvstate.share import status

    deadline = time.monotonic() + LEASE_S * 3
    while True:
        left = [f"{ep['path']} rank {b['rank']}: {b['lease_count']} lease(s), state {b['state']}"
                for ep in status.node_status([socket_dir], timeout=30.0)["endpoints"] if ep["kind"] == "exporter"
                for b in ep["banks"] if b["lease_count"]]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make churn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--importers", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    report = run_churn(args.seconds, args.importers, log=print)
    if args.json:
        print(json.dumps(attrs.asdict(report)))
    for p in report.problems():
        print("PROBLEM:", p)
    return 1 if report.problems() else 0

