"""``kvstate demo``: decode-to-prefill KV reuse across real processes on the host backend.

A decode engine of ``--tp`` exporter processes fills its banks with a deterministic KV
pattern and advertises them. The prefill engine is a coordinator process (the scheduler
side) and ``--tp`` rank worker processes: the coordinator validates the group, each worker
checks, leases, imports and maps only its own rank's part (tp leases in all), the
coordinator declares the group ready once every rank reported imported, each worker loads
its rank's prefix and verifies its checksum; then the coordinator drains and closes every
part and the exporters release their banks. ``--kill ROLE:PHASE`` SIGKILLs one process at a
phase to show the failure handling; ``--json`` prints the report as JSON (``"topology":
"per-rank-process"``, each rank's pid, import time and lease count, the group's state
history).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from kvstate.harness.children import ChildDied
from kvstate.harness.cluster import PHASES, ROLES, ClusterSpec
from kvstate.harness.scenario import run_scenario

help = "run the decode-to-prefill reuse demo"


def _kill(value: str) -> tuple[str, str]:
    role, _, phase = value.partition(":")
    if role not in ROLES or phase not in PHASES:
        raise argparse.ArgumentTypeError(
            f"expected ROLE:PHASE with ROLE one of {', '.join(ROLES)} and PHASE one of {', '.join(PHASES)}")
    return role, phase


def _positive(limit: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if not 1 <= n <= limit:
            raise argparse.ArgumentTypeError(f"must be between 1 and {limit}")
        return n
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=_positive(16), default=4, help="ranks on each side (default 4)")
    parser.add_argument("--layers", type=_positive(512), default=8, help="model layers (default 8)")
    parser.add_argument("--blocks", type=_positive(1 << 16), default=256, help="KV blocks per bank (default 256)")
    parser.add_argument("--prefix-blocks", type=_positive(1 << 16), default=64,
                        help="blocks of the reused prefix (default 64)")
    parser.add_argument("--kill", type=_kill, metavar="ROLE:PHASE",
                        help=f"SIGKILL one process: ROLE in {{{','.join(ROLES)}}}, PHASE in {{{','.join(PHASES)}}}")
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")


def run(args: argparse.Namespace) -> int:
    if args.prefix_blocks > args.blocks:
        print(f"kvstate demo: error: --prefix-blocks {args.prefix_blocks} exceeds --blocks {args.blocks}",
              file=sys.stderr)
        return 2
    spec = ClusterSpec(tp=args.tp, layers=args.layers, num_blocks=args.blocks, prefix_blocks=args.prefix_blocks)
    def log(line: str) -> None:
        if not args.json:
            print(line, flush=True)

    g = spec.geometry()
    log(f"kvstate demo: tp={spec.tp}, {spec.layers} layers, {spec.kv_heads} KV heads/rank, head dim {spec.head_dim}, "
        f"{spec.block_tokens}-token blocks of {g.block_bytes // 1024} KiB, {g.num_blocks} blocks/bank"
        + (f", kill {args.kill[0]} at {args.kill[1]}" if args.kill else ""))
    try:
        report = run_scenario(spec, args.kill, log=log)
    except ChildDied as exc:  # one line: which process, its exit status, its last stderr lines
        print(f"kvstate demo: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(summary(report))
    return 0 if report["ok"] else 1


def summary(r: dict[str, Any]) -> str:
    """The report of :func:`kvstate.harness.scenario.run_scenario` as a two-column table."""
    verified, leaks = r["verified"], r["leaks"]
    ranks = r.get("ranks") or []
    history = (r.get("coordinator") or {}).get("history") or []
    ready = r.get("time_to_ready_s")
    rows = [
        ("scenario", f"tp={r['tp']}, {r['topology']}" + (f", SIGKILL {r['kill']}" if r["kill"] else ", no faults")),
        ("coordinator group states", " -> ".join(_dedupe([h[0] for h in history])) or "-"),
        ("time to ready", f"{ready * 1e3:.1f} ms (check, lease, open, map on every rank)" if ready is not None
         else "never ready"),
        ("per rank: pid / import / leases", "; ".join(
            f"{x['rank']}: {x['pid']} / {(x['import_s'] or 0) * 1e3:.1f} ms / {x['leases']}" for x in ranks) or "-"),
        ("leases in all", f"{r.get('leases_total', 0)} (tp {r['tp']})"),
        ("worker shares at the end", ", ".join(str(s) for s in r["worker_final"]) or "-"),
        ("exporter bank states", " -> ".join(_dedupe(r["exporter_states"])) or "-"),
        ("prefix bytes loaded", f"{r['load_bytes'] / 2**20:.1f} MiB"),
        ("checksums", f"{sum(ok for _, ok in verified)}/{r['tp']} ranks loaded and verified"),
        ("exporter time to quiescent", f"{r['exporter_quiescent_s'] * 1e3:.1f} ms"),
        ("leaked fds / memfd maps", f"{sum(x.get('fds', 0) for x in leaks)} / {sum(x.get('memfd_maps', 0) for x in leaks)}"),
        *((f"time, {k}", f"{v * 1e3:.1f} ms") for k, v in r["timings_s"].items()),
        ("verdict", r["outcome"]),
    ]
    if r.get("death_to_unmapped_s") is not None:
        rows.insert(-2, ("death to every part unmapped", f"{r['death_to_unmapped_s'] * 1e3:.1f} ms"))
    width = max(len(k) for k, _ in rows)
    line = "-" * min(100, width + 2 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k.ljust(width)}  {v}" for k, v in rows), line])


def _dedupe(states: list[str]) -> list[str]:
    return [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]
