"""``kvstate generate [--check]``: write every file derived from spec/, or check them.

The artifacts and their producers are listed in :mod:`kvstate.derive.generate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstate.derive import generate

help = "write every file derived from spec/ (C header, Promela models, spec docs), or check them"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each stale file (0 when all are fresh)")
    parser.add_argument("--root", type=Path, help="source tree (default: the one kvstate runs from)")


def run(args: argparse.Namespace) -> int:
    root: Path = args.root or generate.source_root()
    if args.check:
        stale = generate.stale(root)
        for path, why in stale:
            print(f"stale: {path}: {why}", file=sys.stderr)
        if stale:
            print(f"{len(stale)} stale file(s); run `kvstate generate`", file=sys.stderr)
        return 1 if stale else 0
    done = generate.write(root)
    for path, what in done:
        print(f"{what} {path}")
    if not done:
        print(f"all {len(generate.ARTIFACTS)} generated files are fresh")
    return 0
