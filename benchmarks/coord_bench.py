"""Measured figures of the coordinated topology, per tp: leases and mappings per rank, time
to ready, and time from a worker's death until every other worker has unmapped its part.

Each run is a real cluster (:mod:`kvstate.harness.cluster`): tp exporter processes, one
coordinator process and tp worker processes, forked before the clock starts.

- leases per rank: what each worker reported when it imported (kvstate's count);
- mappings per rank: memfd mappings in each worker process at ready, read from
  ``/proc/<pid>/maps`` (not kvstate's count), and leases on each exporter's bank;
- time to ready: inside the coordinator process, from the group's creation (before the
  coordinator's validation) to ``ready``: validation, every worker's check, lease, open
  and map, and every report;
- death to unmapped: SIGKILL the highest rank's worker once the group is ready; from just
  before ``kill(2)`` to the latest moment a surviving worker unmapped its part (one
  ``CLOCK_MONOTONIC`` for every process of the host). The path: the coordinator sees EOF
  or pidfd, drains the group, every survivor quiesces and the coordinator closes it.

``python -m benchmarks.coord_bench --tp 2 4 8 --repeats 5`` prints one row per tp
(median and worst over the repeats). Each repeat's group is its cluster's first, so its
time to ready includes each worker's first connection to its exporter.

``--warm N`` measures instead what a request pays in steady state: N groups, one after
another, in one cluster (each drained before the next), after three that warm the
connections up; it prints the median and best time to ready, the median of each
worker's own import (both phases, lease to mapped: ``RankShare.import_s``), and the
rest, which is the coordinator's and workers' messages and steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from kvstate.harness.cluster import ClusterSpec
from kvstate.harness.scenario import run_scenario

SPEC = dict(layers=8, kv_heads=2, head_dim=128, block_tokens=16, num_blocks=256, prefix_blocks=64,
            lease_timeout_s=5.0, timeout_s=20.0, phase_timeout_s=5.0, silence_s=2.0)


def measure(tp: int, repeats: int) -> dict[str, Any]:
    ready: list[float] = []
    unmapped: list[float] = []
    leases: set[tuple[int, ...]] = set()
    mappings: set[tuple[int, ...]] = set()
    bank_leases: set[tuple[int, ...]] = set()
    for _ in range(repeats):
        r = run_scenario(ClusterSpec(tp=tp, **SPEC))  # type: ignore[arg-type]
        if not r["ok"]:
            raise RuntimeError(f"tp={tp}: a clean run failed: {json.dumps(r)[:2000]}")
        ready.append(float(r["time_to_ready_s"]))
        leases.add(tuple(x["leases"] for x in r["ranks"]))
        mappings.add(tuple(r["mappings_per_rank"]))
        bank_leases.add(tuple(r["exporter_leases"]))
        if tp > 1:
            k = run_scenario(ClusterSpec(tp=tp, **SPEC), ("worker", "ready"))  # type: ignore[arg-type]
            if not k["ok"] or k.get("death_to_unmapped_s") is None:
                raise RuntimeError(f"tp={tp}: the kill run failed: {json.dumps(k)[:2000]}")
            unmapped.append(float(k["death_to_unmapped_s"]))
    return {"tp": tp, "repeats": repeats, "leases_per_rank": sorted(leases), "mappings_per_rank": sorted(mappings),
            "bank_leases": sorted(bank_leases),
            "ready_ms": (statistics.median(ready) * 1e3, max(ready) * 1e3),
            "death_to_unmapped_ms": (statistics.median(unmapped) * 1e3, max(unmapped) * 1e3) if unmapped else None}


def measure_warm(tp: int, groups: int, warm_up: int = 3) -> dict[str, Any]:
    """Time to ready of ``groups`` groups in one cluster, after ``warm_up`` others."""
    from kvstate.harness.cluster import Cluster, recv, send

    ready: list[float] = []
    imports: list[float] = []
    with Cluster(ClusterSpec(tp=tp, **SPEC)) as c:  # type: ignore[arg-type]
        wire = c.start_decode()
        c.start_prefill()
        assert c.coordinator is not None
        for i in range(warm_up + groups):
            send(c.coordinator.conn, **c.import_command(wire))
            group = recv(c.coordinator.conn, SPEC["timeout_s"] + 4 * SPEC["phase_timeout_s"])
            if group.get("state") != "ready":
                raise RuntimeError(f"tp={tp}: group {i} did not get ready: {json.dumps(group)[:2000]}")
            if i >= warm_up:
                ready.append(float(group["time_to_ready_s"]))
                imports.append(statistics.median(float(r["import_s"]) for r in group["ranks"]))
            send(c.coordinator.conn, cmd="drain", gid=group["gid"])
            drained = recv(c.coordinator.conn, SPEC["timeout_s"])
            if drained.get("state") not in ("quiescent", "closed"):
                raise RuntimeError(f"tp={tp}: group {i} did not drain: {json.dumps(drained)[:2000]}")
    ready_ms, import_ms = statistics.median(ready) * 1e3, statistics.median(imports) * 1e3
    return {"tp": tp, "groups": groups, "ready_ms": ready_ms, "best_ms": min(ready) * 1e3,
            "rank_import_ms": import_ms, "messages_ms": ready_ms - import_ms}


def _values(tuples: list[tuple[int, ...]]) -> str:
    """Every per-rank value seen over the runs (one value means every rank, every run)."""
    return ",".join(sorted({str(x) for t in tuples for x in t}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.coord_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warm", type=int, default=0, metavar="N",
                    help="measure N groups in one warm cluster per tp instead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.warm:
        warm = [measure_warm(tp, args.warm) for tp in args.tp]
        if args.json:
            print(json.dumps(warm, indent=2))
            return 0
        print(f"{'tp':>3} {'groups':>7} {'ready ms (median/best)':>24} {'rank import ms':>15} {'the rest ms':>12}")
        for w in warm:
            print(f"{w['tp']:>3} {w['groups']:>7} {w['ready_ms']:>12.2f} / {w['best_ms']:<9.2f} "
                  f"{w['rank_import_ms']:>15.2f} {w['messages_ms']:>12.2f}")
        return 0
    rows = [measure(tp, args.repeats) for tp in args.tp]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'tp':>3} {'leases/rank':>12} {'maps/rank':>10} {'bank leases':>12} {'ready ms (med/max)':>20} "
          f"{'death->unmapped ms (med/max)':>30}")
    for r in rows:
        d = r["death_to_unmapped_ms"]
        print(f"{r['tp']:>3} {_values(r['leases_per_rank']):>12} {_values(r['mappings_per_rank']):>10} "
              f"{_values(r['bank_leases']):>12} {r['ready_ms'][0]:>10.1f} / {r['ready_ms'][1]:<7.1f} "
              f"{'-' if d is None else f'{d[0]:.1f} / {d[1]:.1f}':>30}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
