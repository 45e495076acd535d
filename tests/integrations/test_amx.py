"""``request_amx_tiles``: the tile state vLLM's "amx" CPU attention needs is granted to the
process (see kvstate.integrations.vllm.amx for the SIGILL it prevents)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: In a fresh process (a grant is for the life of the process): the permitted extended
#: features before and after the call (arch_prctl ARCH_GET_XCOMP_PERM), and its result.
PROBE = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
def permitted():
    mask = ctypes.c_uint64(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0, ctypes.get_errno()  # arch_prctl GET_XCOMP_PERM
    return mask.value
XTILEDATA = 1 << 18
before = permitted() & XTILEDATA
from kvstate.integrations.vllm.amx import request_amx_tiles
got = request_amx_tiles()
again = request_amx_tiles()
import torch
print(json.dumps({"before": bool(before), "got": got, "again": again, "after": bool(permitted() & XTILEDATA),
                  "cpu_has_amx": bool(torch.cpu._is_amx_tile_supported())}))
"""


def test_the_tile_state_is_granted_exactly_where_the_cpu_has_amx() -> None:
    pytest.importorskip("torch")  # the test extra installs it; vLLM's workers always have it
    if sys.platform != "linux" or __import__("platform").machine() != "x86_64":
        pytest.skip("AMX and arch_prctl are x86-64 Linux")
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True, text=True,
                                    timeout=120).stdout)
    assert not out["before"], "granted before the call: this check would prove nothing"
    assert out["got"] is out["again"] is out["after"] is out["cpu_has_amx"], out
