"""``kvstate spec show|render|check``: the tables in the terminal, as docs, or checked."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstate.derive import docs as render
from kvstate.core.spec import load_spec

help = "show, render or check the lifecycle tables"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["show", "render", "check"],
                        help="show: print the tables; render: write docs/spec/*.md; "
                             "check: exit 1 if docs/spec is stale")
    parser.add_argument("--machine", help="only this machine (show)")
    parser.add_argument("--out", type=Path, default=Path("docs/spec"), help="docs directory (render, check)")


def run(args: argparse.Namespace) -> int:
    spec = load_spec()
    if args.action == "show":
        names = [args.machine] if args.machine else list(spec.machines)
        for name in names:
            if name not in spec.machines:
                print(f"kvstate spec: unknown machine {name!r}; known: {', '.join(spec.machines)}", file=sys.stderr)
                return 2
            print(render.terminal_table(spec.machines[name]))
        return 0
    pages = render.pages(spec)
    if args.action == "render":
        args.out.mkdir(parents=True, exist_ok=True)
        for name, text in pages.items():
            (args.out / name).write_text(text, encoding="utf-8")
            print(f"wrote {args.out / name}")
        return 0
    stale = [name for name, text in pages.items()
             if not (args.out / name).is_file() or (args.out / name).read_text(encoding="utf-8") != text]
    for name in stale:
        print(f"stale: {args.out / name} (run `kvstate spec render`)", file=sys.stderr)
    return 1 if stale else 0
