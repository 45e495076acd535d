"""The GPU check of the cuda backend, in one run (see kvstate/harness/gpucheck.py for what it does).

    python benchmarks/gpu_check.py [--device GPU-...] [--rounds 50] [--repeats 20] [--json] [--strict]

Exit status: 0 checks passed (goals printed as MET or MISSED), 1 a check failed (or, with
--strict, a goal was missed), 2 not run: no GPU, driver or cuda-python here.
"""

import sys

from kvstate.harness.gpucheck import main

if __name__ == "__main__":
    sys.exit(main())
