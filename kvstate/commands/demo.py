"""``kvstate demo``: the main job.

Until the multi-process decode-to-prefill demo lands, the demo checks the specification
and prints its tables.
"""

from __future__ import annotations

import argparse

from kvstate import render
from kvstate.spec import load_spec

help = "run the decode-to-prefill reuse demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    spec = load_spec()
    for m in spec.machines.values():
        print(render.terminal_table(m))
    print(f"spec ok: {len(spec.machines)} machines, {len(spec.invariants)} invariants")
    return 0
