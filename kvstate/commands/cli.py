"""The ``kvstate`` command line: one module per command under ``kvstate.commands``.

Each command module exposes ``help``, ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their command runs, so ``kvstate spec`` never loads
native code and a missing optional dependency affects only the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvstate.core.errors import KvStateError

#: command name -> module under kvstate.commands
COMMANDS = {
    "demo": "demo",
    "spec": "spec",
    "policy": "policy",
    "bench": "bench",
    "check": "check",
    "generate": "generate",
    "gpucheck": "gpucheck",
    "status": "status",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstate", description="Safe KV-cache reuse between engine workers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"kvstate.commands.{module}")
        cmd = sub.add_parser(name, help=mod.help, description=mod.help)
        cmd.set_defaults(_module=module)
        mod.add_arguments(cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"kvstate.commands.{args._module}")
    try:
        code: int = module.run(args)
    except KvStateError as exc:
        print(f"kvstate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
