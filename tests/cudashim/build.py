"""Build the CUDA driver shim, ``libcudashim.so``, from its C sources when they changed.

The test suite calls :func:`build` (``make test`` runs it first, too); nothing is committed
as a binary. The shim implements the driver calls ``ffi/kvs_cuda_driver.h`` declares, with
that same header, so the engine and the shim cannot disagree about a signature. It needs
only a C compiler (``$CC``, default ``cc``) and pthreads.

    python tests/cudashim/build.py      # prints the library's path
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SOURCES = [HERE / "cudashim_core.c", HERE / "cudashim_api.c", HERE / "cudashim_stream.c"]
HEADERS = [HERE / "cudashim.h", ROOT / "ffi" / "kvs_cuda_driver.h"]
OUT = HERE / "_build" / "libcudashim.so"
FLAGS = ["-std=gnu11", "-shared", "-fPIC", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
         "-pthread"]


def build(out: Path = OUT) -> Path:
    """The shim's path, compiled first if it is missing or older than a source."""
    newest = max(p.stat().st_mtime for p in SOURCES + HEADERS + [Path(__file__)])
    if out.exists() and out.stat().st_mtime >= newest:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libcudashim-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [os.environ.get("CC", "cc"), *FLAGS, f"-I{ROOT / 'ffi'}", *map(str, SOURCES), "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        os.unlink(tmp)
        raise RuntimeError(f"building the CUDA shim failed:\n{' '.join(cmd)}\n{exc.stderr}") from None
    os.replace(tmp, out)  # atomic: a concurrent build never sees half a library
    return out


if __name__ == "__main__":
    print(build())
    sys.exit(0)
