"""``kvstate check``: model-check the lifecycle tables with Spin (see kvstate.harness.modelcheck)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstate.harness import modelcheck

from kvstate.derive import promela as models
from kvstate.core.spec import load_spec

help = "model-check the tables with Spin (safety, liveness); `kvstate generate` writes models/"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=[*models.KINDS], default=models.PER_RANK)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (per-rank: 2..4; counting: any)")
    parser.add_argument("--liveness", action="store_true",
                        help="check INV-DRAIN-QUIESCES under weak fairness (pan -a -f) instead of safety")
    parser.add_argument("--all", action="store_true",
                        help="every benchmark configuration: per-rank tp 2,3,4 (safety and liveness), "
                             "counting tp 8,16,32,64")
    parser.add_argument("--table", action="store_true", help="print one table row per run")
    parser.add_argument("--spec", type=Path, help="check a variant of the tables in this directory")
    parser.add_argument("--memlim", type=int, default=2048, help="pan memory bound in MB (-DMEMLIM)")


def _configs(args: argparse.Namespace) -> list[tuple[str, int, bool]]:
    if args.all:
        return ([(models.PER_RANK, tp, False) for tp in models.PER_RANK_TPS]
                + [(models.PER_RANK, tp, True) for tp in models.PER_RANK_TPS]
                + [(models.COUNTING, tp, False) for tp in models.COUNTING_TPS])
    return [(args.model, args.tp, args.liveness)]


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    failed = 0
    if args.table:
        print(f"{'model':9} {'tp':>3} {'check':9} {'result':9} {'states':>10} {'transitions':>12} "
              f"{'depth':>6} {'MB':>7} {'pan s':>7} {'total s':>8}")
    for model, tp, liveness in _configs(args):
        result = modelcheck.check(model, tp, liveness=liveness, spec=spec, memlim_mb=args.memlim)
        failed += not result.ok
        if args.table:
            print(f"{model:9} {tp:>3} {result.mode:9} {'ok' if result.ok else 'VIOLATION':9} "
                  f"{result.states_stored:>10} {result.transitions:>12} {result.depth:>6} "
                  f"{result.memory_mb:>7.1f} {result.pan_seconds:>7.2f} {result.wall_seconds:>8.1f}")
            if result.trace is not None:
                print(result.report())
        else:
            print(result.report())
    return 1 if failed else 0
