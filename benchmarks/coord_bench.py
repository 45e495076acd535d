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
(median and worst over the repeats).
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


def _values(tuples: list[tuple[int, ...]]) -> str:
    """Every per-rank value seen over the runs (one value means every rank, every run)."""
    return ",".join(sorted({str(x) for t in tuples for x in t}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.coord_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
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
