"""Spin on the generated models: states, transitions, depth, memory and time for the
per-rank model at tp 2, 3, 4 (safety and liveness) and the counting model at tp 8..64.

Goals (issue 5): per-rank tp=4 with every fault under 30 s; counting tp=64 under 60 s.
Times are wall clock of spin -a + cc + pan, and pan's own time, measured in this run.
"""

from __future__ import annotations

import sys

from kvstate.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["check", "--all", "--table"]))
