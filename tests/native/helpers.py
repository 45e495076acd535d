"""Helpers of the native tests: variant builds, peer processes."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstate.transport.native import Native

ROOT = Path(__file__).resolve().parents[2]
FFI = ROOT / "ffi"
PEERS = Path(__file__).resolve().parent / "peers.py"


# -- variant builds of the native module --------------------------------------------------


def build_variant_lib(out: Path, module: str, *, defines: Sequence[tuple[str, str | None]] = (),
                      op_table_header: str | None = None,
                      headers: Mapping[str, str] | None = None) -> tuple[Any, Any]:
    """Compile a test-only copy of the native module (a planted bug, another op table, or
    other generated headers: file name -> text) into ``out`` and load it; returns (ffi,
    lib). ``kvstate._native`` is never touched."""
    src = out / f"{module}_src"
    shutil.copytree(FFI, src, ignore=shutil.ignore_patterns("__pycache__", "*.o", "*.so"))
    if op_table_header is not None:
        (src / "kvs_op_table.h").write_text(op_table_header, encoding="utf-8")
    for name, text in (headers or {}).items():
        (src / name).write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"_kvs_builder_{module}", src / "build_host.py")
    assert spec and spec.loader
    builder_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder_mod)
    ffi = builder_mod.builder(module, defines, src_dir=src)
    so_path = ffi.compile(tmpdir=str(out / f"{module}_build"), verbose=False)
    loader = importlib.machinery.ExtensionFileLoader(module, so_path)
    mod_spec = importlib.util.spec_from_file_location(module, so_path, loader=loader)
    assert mod_spec
    mod = importlib.util.module_from_spec(mod_spec)
    loader.exec_module(mod)
    return mod.ffi, mod.lib


def build_variant(out: Path, module: str, *, defines: Sequence[tuple[str, str | None]] = ()) -> Native:
    """A test-only module built from the committed table, wrapped (and table-checked)."""
    return Native(*build_variant_lib(out, module, defines=defines))


# -- peer processes ---------------------------------------------------------------------


def peer(role: str, *args: str) -> subprocess.Popen[bytes]:
    """Start ``tests/native/peers.py ROLE ARGS`` with unbuffered pipes."""
    return subprocess.Popen([sys.executable, str(PEERS), role, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)


_pending: dict[int, bytes] = {}


def expect_line(proc: subprocess.Popen[bytes], want: str, timeout: float = 20.0) -> str:
    """Read the peer's next stdout line (bounded) and check it starts with ``want``.

    Reads the pipe with os.read and keeps what follows the line for the next call: a
    buffered reader could hold the next line where select() cannot see it."""
    import select
    import time

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = _pending.pop(proc.pid, b"")
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            proc.kill()
            raise AssertionError(f"peer said {buf!r} and then nothing within {timeout} s "
                                 f"(or exited); stderr: {_stderr(proc)}")
        buf += chunk
    line, rest = buf.split(b"\n", 1)
    _pending[proc.pid] = rest
    text = line.decode().strip()
    assert text.startswith(want), f"peer said {text!r}, expected {want!r}; stderr: {_stderr(proc)}"
    return text


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None or proc.stderr is None:
        return "(still running)"
    return proc.stderr.read().decode(errors="replace")


def reap(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    """Wait for a peer (bounded), close its pipes, return its exit status."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
    _pending.pop(proc.pid, None)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return proc.returncode
