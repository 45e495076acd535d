"""The native request link (ffi/kvs_link.c) under the syscall shim: a restartable failure
(EINTR, EAGAIN) is retried and the request completes; any other failure is a typed
ChannelError; a short send closes the link (part of a frame went out); a receive whose
fds the kernel dropped (MSG_CTRUNC) is refused as a frame error with every fd that did
arrive closed. Each case runs in its own process (link_case.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from syscalls import cases as C
from syscalls.build import build

pytestmark = [pytest.mark.multiproc]

#: (call, errno or "short", the outcome, the ChannelError reason, whether the link ends closed)
CASES = [
    ("sendmsg", "EINTR", "ok", None, False),
    ("sendmsg", "EAGAIN", "ok", None, False),
    ("sendmsg", "ENOBUFS", "refused", "failed", True),
    ("sendmsg", "short", "refused", "frame", True),
    ("recvmsg", "EINTR", "ok", None, False),
    ("recvmsg", "EAGAIN", "ok", None, False),
    ("recvmsg", "ENOMEM", "refused", "failed", True),
    ("recvmsg", "short", "refused", "frame", True),
    ("poll", "EINTR", "ok", None, False),
    ("poll", "ENOMEM", "refused", "failed", True),
]


def run_case(call: str, err: str) -> dict[str, object]:
    rule = f"{call}:1:0:short" if err == "short" else f"{call}:1:{getattr(errno, err)}"
    env = dict(os.environ, LD_PRELOAD=str(build()), KVS_SYSFAIL=rule,
               PYTHONPATH=os.pathsep.join([str(C.ROOT), str(C.ROOT / "tests")]))
    # a short recvmsg needs the answer queued already (the shim shortens a call that received)
    early = ["early"] if (call, err) == ("recvmsg", "short") else []
    out = subprocess.run([sys.executable, str(C.HERE / "link_case.py"), *early], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("call,err,outcome,reason,closed", CASES, ids=[f"{c}-{e}" for c, e, *_ in CASES])
def test_a_link_request_under_a_failing_syscall(call: str, err: str, outcome: str, reason: str | None,
                                                closed: bool) -> None:
    r = run_case(call, err)
    assert r["fired"] == 1, r
    assert r["outcome"] == outcome and r["closed"] is closed, r
    if outcome == "ok":
        assert r["payload"] == '{"ok":true}' and r["nfds"] == 1, r
    else:
        assert r["reason"] == reason, r
    if err == "short" and call == "recvmsg":
        assert "MSG_CTRUNC" in str(r["error"]), r
    if outcome == "refused":
        assert r["fds_after"] == r["fds_before"], r  # no fd of a refused answer left open
