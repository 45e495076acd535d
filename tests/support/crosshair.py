"""Run ``crosshair check`` on PEP 316 contracts, bounded in time.

Used by every contract test and by the planted-bug self-tests, which assert that the
same command *does* report a counterexample when a contract is broken on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def crosshair(targets: Sequence[str | Path], *, per_condition_timeout: float = 4.0,
              wall_timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    """Check ``targets`` (files or dotted module/function names) with PEP 316 contracts.

    Exit code 0 means no counterexample was found within the bound; 1 means crosshair
    reported at least one (its stdout lists them).
    """
    cmd = [sys.executable, "-m", "crosshair", "check", "--analysis_kind=PEP316",
           f"--per_condition_timeout={per_condition_timeout}", *map(str, targets)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=wall_timeout, check=False)
