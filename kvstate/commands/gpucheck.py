"""``kvstate gpucheck``: the cuda backend on a real device, in one run (see
:mod:`kvstate.harness.gpucheck`); prints a JSON summary. Exit status 0 passed, 1 a check
failed, 2 not run (no CUDA driver or device)."""

from __future__ import annotations

import argparse

help = "check the cuda backend on a GPU: imports across processes, copies, a kill; JSON figures"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvstate.harness import gpucheck

    gpucheck.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvstate.harness import gpucheck

    return gpucheck.run_args(args)
