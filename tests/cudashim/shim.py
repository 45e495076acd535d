"""The CUDA driver shim from Python: build it, make this process's CUDA backend use it,
and drive its controls (failure injection, journal, violations, stall, live objects).

The C engine loads the driver once per process, so the first :func:`use` decides: it sets
``KVSTATE_LIBCUDA`` to the shim (and the shim's configuration) before anything loads the
driver. Subprocesses inherit the environment and so load the shim as well. A test that
needs another configuration (driver version, FABRIC, no device) runs in a subprocess.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import attrs

from cudashim.build import build

#: The shim's configuration for in-process tests: small granules keep them quick.
CONFIG = {"KVSTATE_CUDASHIM_GRANULARITY": str(64 * 1024)}

#: cudashim_live() order.
LIVE = ("contexts", "vmm_allocations", "reservations", "vmm_mappings", "legacy_allocations", "ipc_opens",
        "streams", "events", "queued_work")


@attrs.frozen
class Violations:
    count: int
    text: str


class Shim:
    """ctypes over the exported cudashim_* controls of the shim this process loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # the same object the engine dlopen()s: one state
        lib.cudashim_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        lib.cudashim_calls.argtypes = [ctypes.c_char_p]
        lib.cudashim_calls.restype = ctypes.c_long
        lib.cudashim_journal.argtypes = [ctypes.c_char_p, ctypes.c_long]
        lib.cudashim_journal.restype = ctypes.c_long
        lib.cudashim_violations.argtypes = [ctypes.c_char_p, ctypes.c_long]
        lib.cudashim_violations.restype = ctypes.c_long
        lib.cudashim_stall.argtypes = [ctypes.c_int]
        lib.cudashim_live.argtypes = [ctypes.POINTER(ctypes.c_long), ctypes.c_int]
        self._lib = lib

    def fail(self, call: str, nth: int = 1, result: int = 0) -> None:
        """The nth next call of ``call`` fails with ``result`` (0: the shim's default for it);
        ``"async"``: the nth next copy faults on the device."""
        if self._lib.cudashim_fail(call.encode(), nth, result) != 0:
            raise ValueError(f"cannot inject a failure into {call!r}")

    def reset(self) -> None:
        self._lib.cudashim_reset()

    def calls(self, call: str) -> int:
        return int(self._lib.cudashim_calls(call.encode()))

    def journal(self) -> list[str]:
        n = self._lib.cudashim_journal(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.cudashim_journal(buf, n + 1)
        return buf.value.decode().splitlines()

    def violations(self) -> Violations:
        buf = ctypes.create_string_buffer(64 * 1024)
        n = self._lib.cudashim_violations(buf, len(buf))
        return Violations(int(n), buf.value.decode())

    def stall(self, on: bool) -> None:
        self._lib.cudashim_stall(1 if on else 0)

    def live(self) -> dict[str, int]:
        out = (ctypes.c_long * len(LIVE))()
        self._lib.cudashim_live(out, len(LIVE))
        return dict(zip(LIVE, out))


_shim: Shim | None = None


def use() -> Shim:
    """Build the shim and make this process (and its children) load it as the driver."""
    global _shim
    if _shim is None:
        path = build()
        os.environ["KVSTATE_LIBCUDA"] = str(path)
        for k, v in CONFIG.items():
            os.environ.setdefault(k, v)
        from kvstate.transport.cuda.driver import load_driver

        load_driver()
        _shim = Shim(path)
    return _shim
