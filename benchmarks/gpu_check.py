"""The GPU check of the cuda backend, in one run: the same as ``kvstate gpucheck`` (see
kvstate/harness/gpucheck.py for what it does and its exit statuses).

    python benchmarks/gpu_check.py [--device GPU-...] [--rounds 50] [--repeats 20] [--mib 512]
"""

import sys

from kvstate.harness.gpucheck import main

if __name__ == "__main__":
    sys.exit(main())
