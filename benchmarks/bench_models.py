"""Spin on the generated models: states, transitions, depth, memory and time for the
per-rank model at tp 2, 3 (safety and liveness; a bank per rank), the coordinator
protocol at tp 2 (safety and liveness) and, symmetry-reduced, at tp 3 and 4 (safety), and
the counting model at tp 8..64.

Goals (issue 5): counting tp=64 under 60 s; (issue 29) the coordinator at tp 3 and tp 4
under 60 s each. Since every rank has its own bank, per-rank
tp=4 is too large to check exhaustively here (tp=3 stores about 4 million states); the
counting model covers large tp. Times are wall clock of spin -a + cc + pan, and pan's
own time, measured in this run.
"""

from __future__ import annotations

import sys

from kvstate.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["check", "--all", "--table"]))
