"""Build the syscall shim, ``libsysshim.so``, from ``shim.c`` when it changed.

The tests call :func:`build` on first use; nothing is committed as a binary. It needs
only a C compiler (``$CC``, default ``cc``) and libdl.

    python tests/syscalls/build.py      # prints the library's path
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "shim.c"]
OUT = HERE / "_build" / "libsysshim.so"
FLAGS = ["-std=gnu11", "-shared", "-fPIC", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]


def build(out: Path = OUT) -> Path:
    """The shim's path, compiled first if it is missing or older than a source."""
    newest = max(p.stat().st_mtime for p in SOURCES + [Path(__file__)])
    if out.exists() and out.stat().st_mtime >= newest:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libsysshim-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [os.environ.get("CC", "cc"), *FLAGS, *map(str, SOURCES), "-o", tmp, "-ldl"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        os.unlink(tmp)
        raise RuntimeError(f"building the syscall shim failed:\n{' '.join(cmd)}\n{exc.stderr}") from None
    os.replace(tmp, out)  # atomic: a concurrent build never sees half a library
    return out


if __name__ == "__main__":
    print(build())
    sys.exit(0)
