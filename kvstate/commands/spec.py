"""``kvstate spec show``: the tables in the terminal. (``kvstate generate`` writes the docs.)"""

from __future__ import annotations

import argparse
import sys

from kvstate.derive import docs as render
from kvstate.core.spec import load_spec

help = "show the lifecycle tables"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["show"], help="show: print the tables")
    parser.add_argument("--machine", help="only this machine")


def run(args: argparse.Namespace) -> int:
    spec = load_spec()
    names = [args.machine] if args.machine else list(spec.machines)
    for name in names:
        if name not in spec.machines:
            print(f"kvstate spec: unknown machine {name!r}; known: {', '.join(spec.machines)}", file=sys.stderr)
            return 2
        print(render.terminal_table(spec.machines[name]))
    return 0
