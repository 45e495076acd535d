"""Where a host-group import's time goes: an exclusive-time breakdown by category.

``python -m benchmarks.import_profile --tp 8 --mib 64 --repeats 200`` runs B1's
exporter process and, in an importer process, ``repeats`` whole-group imports (after one
warm-up) with a :class:`~benchmarks.probe.Probe` wrapped around each step of the
path: descriptor decode and MAC, validation, machine transitions, connect, credential
checks, lease round trips, fd receipt, the native calls (fd checks, reserve, mmap,
set_access), watcher arming, thread pool dispatch. ``--mode rank`` profiles the per-rank
path instead (one worker's part). ``--serial`` opens the parts one after another in the
calling thread, so the importer's categories add up to its wall time; without it the
parts open on the importer's thread pool and thread times overlap (the table then says
so). Code that opens parts without a pool (the fast path) is always serial. The exporter process is probed too: its per-import cost is what the importer's
"wait for the exporter" line waits on.

Each step's figure is its median over the imports (and its mean, beside it).
Categories the code no longer has are skipped, so the same script profiles the code
before and after a change. ``--json`` prints the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.probe import Probe
from benchmarks.procs import run_pair

MiB = 1 << 20

#: (target, category) for the importer process, innermost categories last. Targets the
#: code no longer has are skipped (Probe.wrap), so one list profiles before and after.
IMPORTER = [
    ("kvstate.share.importer:Importer.import_group", "import_group glue"),
    ("kvstate.share.importer:Importer.expectation", "validation (rules)"),
    ("kvstate.share.importer:validate_group", "validation (rules)"),
    ("kvstate.core.validate:descriptor_problems", "validation (rules)"),
    ("kvstate.share.importer:decode_group", "descriptor decode + MAC"),
    ("kvstate.share.importer:decode_cached", "descriptor decode + MAC"),
    ("kvstate.core.descriptor:decode", "descriptor decode + MAC"),
    ("kvstate.share.importer:Part.__init__", "part/group objects"),
    ("kvstate.share.importer:Group.__init__", "part/group objects"),
    ("kvstate.core.machine:Lifecycle.fire", "part/group machine fires"),
    ("transitions.core:Machine.callback", "effect bodies (Python glue)"),
    ("kvstate.core.machine:_apply_effects", "effect bodies (Python glue)"),  # fire's own dispatch
    ("kvstate.core.machine:Lifecycle._deliver", "observers (delivery)"),
    ("kvstate.core.machine:Lifecycle.adopt", "part machine fed after native attach"),
    ("kvstate.share.importer:Importer._open_parts", "open_parts glue (+ thread pool wait before)"),
    ("kvstate.share.importer:Importer._pool", "thread pool dispatch + wait"),
    ("kvstate.channel:connect", "connect (socket path checks, connect(2))"),
    ("kvstate.channel.conn:check_socket_path", "connect (socket path checks, connect(2))"),
    ("kvstate.channel.conn:Channel.__init__", "credential checks (SO_PEERCRED, pidfd)"),
    ("kvstate.channel:encode", "JSON codec"),
    ("kvstate.channel:decode", "JSON codec"),
    ("kvstate.channel.conn:Channel.send", "send (lease request, mapped note)"),
    ("kvstate.channel.conn:Channel.recv", "lease round trip (wait for the exporter)"),
    ("socket:recv_fds", "receive fds (recvmsg)"),
    ("kvstate.share.link:NativeLink.send", "send (lease request, mapped note)"),
    ("kvstate.share.link:NativeLink.recv", "lease round trip (wait for the exporter)"),
    ("kvstate.transport.host:HostTransport.receive_handle", "fd checks, phase 1 (fstat identity, seals)"),
    ("kvstate.transport.host:HostTransport.import_", "fd checks + adopt (import_)"),
    ("kvstate.transport.host:HostTransport.reserve", "reserve address space"),
    ("kvstate.transport.host:HostTransport.map", "map (MAP_FIXED)"),
    ("kvstate.transport.host:HostTransport.set_access", "set_access (mprotect)"),
    ("kvstate.share.attach:open_natively", "native attach: Python glue (batching, locks, items)"),
    ("kvstate.share.attach:attach", "native attach: Python glue (batching, locks, items)"),
    ("kvstate.share.attach:_holds", "native attach: guards evaluated in Python"),
    ("kvstate.share.attach:run", "native attach: C array filled"),
    ("kvstate.share.attach:_adopt", "native attach: objects recorded, fds closed"),
    ("kvstate.share.attach:_call", "native attach (fd checks, reserve, map, set_access, part rows)"),
    ("kvstate.share.native_import:lease_and_open", "native import: Python glue (locks, link, keys, frame)"),
    ("kvstate.share.native_import:_fill", "native import: C array filled"),
    ("kvstate.share.native_import:_call", "native import (lease round trip, checks, renewal, attach, rows)"),
    ("kvstate.share.native_import:_call_lease", "native lease (lease round trip, checks, renewal, part rows)"),
    ("kvstate.share.native_import:_native", "native import: Python glue (locks, link, keys, frame)"),
    ("kvstate.share.native_import:_array", "native import: C array filled"),
    ("kvstate.share.native_import:_adopt_leases", "native import: outcome recorded, machines fed"),
    ("kvstate.share.importer:Importer.check_gates", "validation (rules)"),
    ("kvstate.core.descriptor:decode_cached", "descriptor decode + MAC"),
    ("kvstate.share.native_import:_adopt", "native import: outcome recorded, machines fed"),
    ("kvstate.core.machine:Lifecycle.adopt_all", "part machines fed after native import (bulk)"),
    ("kvstate.share.renewal:Renewal.reserve", "renewal register"),
    ("kvstate.share.renewal:Renewal.settle", "renewal register"),
    ("kvstate.share.importer:Importer.watch", "watcher arm"),
    ("kvstate.share.importer:Importer._watch", "watcher arm"),
    ("kvstate.share.renewal:Renewal.add", "renewal register"),
    ("kvstate.share.peers:PeerLink.notify", "mapped note (notify)"),
    # Added by the fast path, when present:
    ("kvstate.share.peers:exchange", "lease round trip (wait for the exporter)"),
    ("kvstate.share.peers:PeerLink.request", "lease round trip (wait for the exporter)"),
    ("kvstate.share.peers:Peers._take", "connect, or reuse a checked link"),
    ("kvstate.share.peers:grants", "grant parsing (batched answer)"),
    # Parked leases (--park):
    ("kvstate.share.adopt:parked", "adopt parked leases (glue)"),
    ("kvstate.share.peers:Peers.take_parked", "adopt parked leases: take from the table"),
    ("kvstate.share.parked:Parked.live", "adopt parked leases: live (renewal state, link poll)"),
    ("kvstate.share.parked:Parked.fits", "adopt parked leases: fits the descriptor"),
]

#: The exporter process: what it spends per import (waits are idle time, left out; its
#: figures include the teardown's lease releases, which the importer's leave out).
EXPORTER = [
    ("kvstate.channel.server:Server.accept", "_wait"),
    ("threading:Thread.start", "thread start (per connection)"),
    ("kvstate.channel.conn:Channel.__init__", "credential checks (SO_PEERCRED, pidfd)"),
    ("kvstate.share.exporter:Exporter._handle", "request handling (checks, lease table)"),
    ("kvstate.core.machine:Lifecycle.fire", "machine transitions"),
    ("kvstate.channel:encode", "JSON codec"),
    ("kvstate.channel:decode", "JSON codec"),
    ("kvstate.channel.conn:Channel.send", "send (grant + SCM_RIGHTS)"),
    ("kvstate.channel.conn:Channel.recv", "_wait"),
    ("kvstate.channel.watcher:Watcher.watch", "watcher arm"),
    ("kvstate.channel.watcher:Watcher.unwatch", "watcher arm"),
]


def _install(probe: Probe, targets: list[tuple[str, str]]) -> list[str]:
    return [t for t, c in targets if probe.wrap(t, c)]


def _exporter(conn: Connection, p: dict[str, Any]) -> None:
    from benchmarks.b1_import import _kvstate_exporter

    probe = Probe()
    _install(probe, EXPORTER)

    class Tap:
        """The pipe to the importer, resetting and reporting the probe on request."""

        def send(self, obj: Any) -> None:
            conn.send(obj)

        def recv(self) -> Any:
            while True:
                msg = conn.recv()
                if msg == "reset":
                    probe.reset()
                elif msg == "report":
                    conn.send(({k: v for k, v in probe.totals.items() if not k.startswith("_")}, dict(probe.calls)))
                else:
                    return msg

    _kvstate_exporter(Tap(), p)


def _importer(conn: Connection, p: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.b1_import import import_config, import_rank
    from kvstate.share.importer import Importer
    from kvstate.transport.host import HostTransport

    wire = conn.recv()
    t = HostTransport()
    im: Any = Importer(import_config(p.get("park_s", 0.0)), t)
    if p["serial"] and hasattr(im, "_pool"):  # the code before the fast path opened parts on a pool
        def serial(parts: Any) -> dict[int, BaseException]:
            failures: dict[int, BaseException] = {}
            for part in parts:
                part.fire("open")
            return failures
        im._open_parts = serial
    probe = Probe()
    wrapped = _install(probe, IMPORTER)
    overhead = probe.overhead_per_call()
    walls: list[float] = []

    def one() -> tuple[float, dict[str, float], dict[str, int]]:
        """One measured import (teardown off the books): wall seconds and the probe's
        totals and call counts for the import alone (per rank in rank mode)."""
        if p["mode"] == "group":
            probe.reset()
            t0 = time.perf_counter()
            with probe.section("import_group glue"):
                group = im.import_group(wire)
            wall = time.perf_counter() - t0
            totals, calls = dict(probe.totals), dict(probe.calls)
            group.drain()
            return wall, totals, calls
        wall, totals, calls = 0.0, {}, {}
        for rank in range(p["tp"]):
            probe.reset()
            t0 = time.perf_counter()
            with probe.section("per-rank glue"):
                part = import_rank(im, wire[rank], rank, p["tp"])
            wall += time.perf_counter() - t0
            for k, v in probe.totals.items():
                totals[k] = totals.get(k, 0.0) + v / p["tp"]
            for k, n in probe.calls.items():
                calls[k] = calls.get(k, 0) + n
            part.fire("close")
        return wall / p["tp"], totals, calls

    try:
        one()  # warm-up
        probe_snapshots: list[dict[str, float]] = []
        calls_total: dict[str, int] = {}
        conn.send("reset")
        for _ in range(p["repeats"]):
            wall, totals, calls = one()
            walls.append(wall)
            probe_snapshots.append(totals)
            for k, n in calls.items():
                calls_total[k] = calls_total.get(k, 0) + n
        conn.send("report")
        exporter_totals, exporter_calls = conn.recv()
    finally:
        im.close()
        probe.restore()
        conn.send("done")
    keys = sorted({k for s in probe_snapshots for k in s})
    unit = p["repeats"] * (p["tp"] if p["mode"] == "rank" else 1)
    return {
        "tp": p["tp"], "mib": p["bank_bytes"] // MiB, "mode": p["mode"], "serial": p["serial"],
        "repeats": p["repeats"], "wall_median_s": statistics.median(walls), "wall_mean_s": statistics.mean(walls),
        "importer": {k: statistics.mean(s.get(k, 0.0) for s in probe_snapshots) for k in keys},
        # The median import's time per step: robust to the odd import a busy machine stalls.
        "importer_median": {k: statistics.median(s.get(k, 0.0) for s in probe_snapshots) for k in keys},
        "importer_calls": {k: v / unit for k, v in calls_total.items()},
        # The exporter's figures cover the timed imports and their teardown (lease releases).
        "exporter": {k: v / unit for k, v in exporter_totals.items() if k != "_wait"},
        "exporter_calls": {k: v / unit for k, v in exporter_calls.items()},
        "probe_overhead_s": overhead * sum(calls_total.values()) / unit, "wrapped": wrapped,
    }


def profile(tp: int, mib: int, repeats: int, mode: str = "group", serial: bool = True,
            park_s: float = 0.0) -> dict[str, Any]:
    # One CPU each for importer and exporter, as in B1 (benchmarks.procs).
    params = {"tp": tp, "bank_bytes": mib * MiB, "repeats": repeats, "mode": mode, "serial": serial,
              "placement": "split", "park_s": park_s}
    result: dict[str, Any] = run_pair(_exporter, _importer, params)
    return result


def table(r: dict[str, Any]) -> str:
    what = "per rank (one part per worker)" if r["mode"] == "rank" else "per whole-group import"
    out = [f"tp={r['tp']} x {r['mib']} MiB, {what}, {'serial' if r['serial'] else 'parallel (thread pool)'} "
           f"opens, {r['repeats']} repeats: wall median {r['wall_median_s'] * 1e6:.0f} us, "
           f"mean {r['wall_mean_s'] * 1e6:.0f} us",
           f"  {'importer step':<64} {'median us':>9} {'mean us':>9} {'share':>6} {'calls':>6}"]
    total = sum(r["importer"].values())
    med = r["importer_median"]
    for k, v in sorted(r["importer"].items(), key=lambda kv: -med[kv[0]]):
        out.append(f"  {k:<64} {med[k] * 1e6:>9.1f} {v * 1e6:>9.1f} {v / total:>6.1%} "
                   f"{r['importer_calls'].get(k, 0):>6.1f}")
    out.append(f"  {'(sum of the means' + (')' if r['serial'] else ', overlapping threads)'):<64} {'':>9} "
               f"{total * 1e6:>9.1f}")
    out.append(f"  {'(of which probe overhead, estimated per call)':<64} {'':>9} {r['probe_overhead_s'] * 1e6:>9.1f}")
    out.append(f"  {'exporter process, per import (incl. teardown)':<64} {'':>9} {'mean us':>9}")
    for k, v in sorted(r["exporter"].items(), key=lambda kv: -kv[1]):
        out.append(f"  {'  ' + k:<64} {'':>9} {v * 1e6:>9.1f}        {r['exporter_calls'].get(k, 0):>6.1f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.import_profile",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--mode", choices=["group", "rank"], default="group")
    ap.add_argument("--parallel", action="store_true", help="open parts on the importer's thread pool")
    ap.add_argument("--park", action="store_true",
                    help="park leases between imports (ImportConfig.park_s): each import adopts the last one's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = profile(args.tp, args.mib, args.repeats, args.mode, serial=not args.parallel,
                park_s=60.0 if args.park else 0.0)
    print(json.dumps(r, indent=2) if args.json else table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
