"""The syscall failure cases: which errnos each call gets, which occurrences are tried,
and the runner that puts one case in one fresh process under the shim."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import queue
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from syscalls.build import build

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CASE_TIMEOUT_S = 60.0

#: Per call, the errnos its man page lists that a busy host (or a sealed file, or a
#: signal) can produce; "short" is a short transfer (shim.c says what each does).
ERRNOS: dict[str, tuple[str, ...]] = {
    "memfd_create": ("EMFILE", "ENFILE", "ENOMEM"),
    "ftruncate": ("EINTR", "EIO", "EPERM"),
    "fcntl_add_seals": ("EPERM", "EBUSY"),
    "fcntl_get_seals": ("EINVAL",),
    "fcntl_dupfd": ("EMFILE",),
    "mmap": ("ENOMEM", "EAGAIN", "ENFILE"),
    "munmap": ("ENOMEM",),
    "mprotect": ("ENOMEM", "EACCES"),
    "socket": ("EMFILE", "ENFILE", "ENOBUFS", "ENOMEM"),
    "connect": ("EINTR", "EAGAIN"),
    "accept4": ("EMFILE", "ENFILE", "ENOBUFS", "ENOMEM", "ECONNABORTED", "EINTR"),
    "sendmsg": ("EINTR", "EAGAIN", "ENOBUFS", "ENOMEM", "ETOOMANYREFS", "short"),
    "send": ("EINTR", "EAGAIN", "ENOBUFS", "ENOMEM", "short"),
    "recvmsg": ("EINTR", "EAGAIN", "ENOMEM", "short"),
    "poll": ("EINTR", "ENOMEM"),
    "select": ("EINTR", "ENOMEM"),
    "pidfd_open": ("EMFILE", "ENFILE", "ENOMEM"),
    "eventfd": ("EMFILE", "ENFILE", "ENOMEM"),
    # kvstate's eventfds are all EFD_NONBLOCK: EINTR is for blocking ones only.
    "eventfd_read": ("EAGAIN",),
    "eventfd_write": ("EAGAIN",),
    "read": ("EAGAIN",),
    "write": ("EAGAIN",),
    "epoll_create1": ("EMFILE", "ENFILE", "ENOMEM"),
    "epoll_ctl": ("ENOMEM", "ENOSPC"),
    "epoll_wait": ("EINTR",),
    "pipe2": ("EMFILE", "ENFILE"),
}

#: Every public operation of the host path the test runs (scenario.OPS).
OPS = ("add_bank", "register", "advertise", "start", "import_group", "import_tp2", "load", "store", "drain", "release", "hello",
       "watch")

#: Every errno a call gets at its first occurrence; later occurrences (up to the census
#: count) get the call's first errno, and beyond FULL_UP_TO only the last one is tried.
FULL_UP_TO = 3


@attrs.frozen
class Case:
    op: str
    call: str
    nth: int
    errno_name: str  # or "short"

    @property
    def rule(self) -> str:
        if self.errno_name == "short":
            return f"{self.call}:{self.nth}:0:short"
        return f"{self.call}:{self.nth}:{getattr(errno, self.errno_name)}"

    def __str__(self) -> str:
        return f"{self.op}/{self.call}#{self.nth}/{self.errno_name}"


def _env() -> dict[str, str]:
    env = dict(os.environ, LD_PRELOAD=str(build()), PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("KVS_SYSFAIL", None)
    return env


def run_cases(requests: Sequence[tuple[str, str | None]], workers: int = 2) -> list[dict[str, Any]]:
    """Each (op, rule) in a fresh forked process (rule None: the census), on ``workers``
    case servers (scenario.py --serve) fed in parallel."""
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(requests)):
        todo.put(i)
    results: list[dict[str, Any] | None] = [None] * len(requests)

    def worker() -> None:
        proc = subprocess.Popen([sys.executable, str(HERE / "scenario.py"), "--serve", str(CASE_TIMEOUT_S)],
                                env=_env(), cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                op, rule = requests[i]
                proc.stdin.write(json.dumps({"op": op, "rule": rule}) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                results[i] = json.loads(line) if line else {"op": op, "rule": rule, "outcome": "crash",
                                                              "problems": ["the case server died"]}
                if not line:
                    return
        finally:
            proc.stdin.close()
            proc.wait(30)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r if r is not None else {"outcome": "crash", "problems": ["not run"]} for r in results]


def census(ops: Iterable[str] = OPS, workers: int = 2) -> dict[str, dict[str, int]]:
    """Per operation, the calls it makes (armed) and how many of each."""
    ops = list(ops)
    out = {}
    for op, r in zip(ops, run_cases([(op, None) for op in ops], workers)):
        if r.get("outcome") != "ok" or r.get("problems"):
            raise AssertionError(f"the census run of {op} failed by itself: {r}")
        out[op] = r["counts"]
    return out


def cases(counts: dict[str, dict[str, int]]) -> list[Case]:
    out = []
    for op, calls in counts.items():
        for call, n in sorted(calls.items()):
            names = ERRNOS[call]
            for e in names:
                out.append(Case(op, call, 1, e))
            later = list(range(2, min(n, FULL_UP_TO) + 1)) + ([n] if n > FULL_UP_TO else [])
            for k in later:
                out.append(Case(op, call, k, names[0]))
                if "short" in names and names[0] != "short":
                    out.append(Case(op, call, k, "short"))
    return out


def verdict(case: Case, r: dict[str, Any]) -> list[str]:
    """What is wrong with one case's result (empty: the case passed)."""
    bad = list(r.get("problems", []))
    outcome = r.get("outcome")
    if outcome in ("hang", "crash"):
        return [f"{outcome}"] + bad
    if outcome == "raw":
        bad.insert(0, f"raw error left the API: {r.get('error')}")
    if case.errno_name == "EINTR" and r.get("fired") and outcome != "ok":
        bad.insert(0, f"EINTR is restartable, but the operation failed: {r.get('error')}")
    return bad


def run_all(all_cases: list[Case], workers: int = 2) -> list[tuple[Case, dict[str, Any]]]:
    return list(zip(all_cases, run_cases([(c.op, c.rule) for c in all_cases], workers)))
