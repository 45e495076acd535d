"""``kvstate check``: model-check the lifecycle tables with Spin (see kvstate.harness.modelcheck)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from kvstate.core.errors import ArgumentInvalid
from kvstate.core.reasons import ArgumentReason
from kvstate.harness import modelcheck

from kvstate.derive import coord_world, promela_coord
from kvstate.derive import promela as models
from kvstate.core.spec import load_spec

help = "model-check the tables with Spin (safety, liveness); `kvstate generate` writes models/"

#: the tp each model is checked at (its documented range): per-rank unrolls a bank per rank
#: (its committed models are tp 2..4), the coordinator model unrolls ranks up to 8
#: (promela_coord.generate), and the counting model is meant for tp up to 64 (its counts
#: are bytes, so a tp past 255 wraps them and reports nonsense)
TP_RANGES = {models.PER_RANK: (min(models.PER_RANK_TPS), max(models.PER_RANK_TPS)),
             promela_coord.COORD_MODEL: (1, 8),
             models.COUNTING: (1, max(models.COUNTING_TPS))}
#: pan's memory bound in MB: 1 TiB is past any machine this runs on (a bound pan cannot
#: start under fails the check as an incomplete search)
MAX_MEMLIM_MB = 1 << 20


def _within(low: int, high: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}")
        return n
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=[*models.KINDS, promela_coord.COORD_MODEL], default=models.PER_RANK,
                        help="per_rank and counting: the group, parts, banks and ops; coordinator: the "
                             "coordinator protocol across processes (spec/coordinator.toml, spec/rank.toml)")
    parser.add_argument("--tp", type=_within(1, max(high for _, high in TP_RANGES.values())), default=2,
                        help="tensor-parallel size (per-rank: 2..4; coordinator: 1..8, symmetry-reduced above 2; "
                             "counting: 1..64)")
    parser.add_argument("--symmetric", action="store_true",
                        help="coordinator: the symmetry-reduced model even at tp 2 (it is the default above 2)")
    parser.add_argument("--liveness", action="store_true",
                        help="check the liveness property under weak fairness (pan -a -f) instead of safety: "
                             "INV-DRAIN-QUIESCES, or INV-COORD-UNMAP-AFTER-DEATH for the coordinator model")
    parser.add_argument("--all", action="store_true",
                        help="every benchmark configuration: per-rank tp 2,3 (safety and liveness), coordinator "
                             "tp 2 (safety and liveness) and tp 3,4 (symmetric, safety), counting tp 8,16,32,64")
    parser.add_argument("--table", action="store_true", help="print one table row per run")
    parser.add_argument("--spec", type=Path, help="check a variant of the tables in this directory")
    parser.add_argument("--memlim", type=_within(1, MAX_MEMLIM_MB), default=2048,
                        help=f"pan memory bound in MB (-DMEMLIM; 1..{MAX_MEMLIM_MB}, default 2048)")


#: (model, tp, liveness, symmetric: None for the model's default)
_Config = tuple[str, int, bool, bool | None]


def _configs(args: argparse.Namespace) -> list[_Config]:
    if args.all:
        # A bank per rank makes per-rank tp=4 too large to check exhaustively (tp=3 stores
        # about 4 million states); its model is still generated and committed.
        checked = [tp for tp in models.PER_RANK_TPS if tp <= 3]
        coord = list(coord_world.COORD_TPS)
        configs: list[_Config] = []
        configs += [(models.PER_RANK, tp, live, None) for live in (False, True) for tp in checked]
        configs += [(promela_coord.COORD_MODEL, tp, live, False) for live in (False, True) for tp in coord]
        configs += [(promela_coord.COORD_MODEL, tp, False, True) for tp in coord_world.SYMMETRIC_TPS]
        configs += [(models.COUNTING, tp, False, None) for tp in models.COUNTING_TPS]
        return configs
    low, high = TP_RANGES[args.model]
    if not low <= args.tp <= high:
        raise ArgumentInvalid.of("--tp", ArgumentReason.RANGE,
                                 f"the {args.model} model is checked at tp {low}..{high}, not {args.tp}")
    return [(args.model, args.tp, args.liveness, True if args.symmetric else None)]


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    failed = 0
    if args.table:
        print(f"{'model':15} {'tp':>3} {'check':9} {'result':9} {'states':>10} {'transitions':>12} "
              f"{'depth':>6} {'MB':>7} {'pan s':>7} {'total s':>8}")
    for model, tp, liveness, symmetric in _configs(args):
        result = modelcheck.check(model, tp, liveness=liveness, spec=spec, memlim_mb=args.memlim,
                                  symmetric=symmetric)
        failed += not result.ok
        if args.table:
            print(f"{result.model:15} {tp:>3} {result.mode:9} {'ok' if result.ok else result.verdict:9} "
                  f"{result.states_stored:>10} {result.transitions:>12} {result.depth:>6} "
                  f"{result.memory_mb:>7.1f} {result.pan_seconds:>7.2f} {result.wall_seconds:>8.1f}")
            if result.trace is not None:
                print(result.report())
        else:
            print(result.report())
    return 1 if failed else 0
