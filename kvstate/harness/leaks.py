"""What this process holds, from /proc: the one leak probe.

The test suite's leak check (the ``leak_check`` fixture in tests/conftest.py), the demo
cluster's and the soak's per-worker leak verdicts all read the process through
:func:`snapshot`, so there is one definition of "what a test or a cycle left behind":

- open fds, with what each points to (a closed and reused fd number is a new fd);
- memfd mappings, line by line from /proc/self/maps (an unmap followed by a new map is
  a leak, even though the count is unchanged);
- direct child processes (from every thread's ``children`` list);
- live Python threads (the native engine's worker pthreads are process-global and
  reused, so they are not counted);
- the native engine's object counters, when the native module is loaded.

:func:`leaks` names everything a later snapshot holds that an earlier one did not;
:func:`settled_leaks` retries for a grace period, because daemon threads of a stopped
server or watcher exit on their next poll, and a SIGKILLed child is reaped
asynchronously. Long-lived helpers that multiprocessing starts once per process (the
resource tracker, the forkserver) and their pipe fds are not leaks of whoever happened
to start them: they are excluded by identity, not by name patterns.

Files in /dev/shm outlive a SIGKILLed process, and /dev/shm is shared by every job on the
machine, so a diff of the directory would blame others. :func:`shm_held` attributes by
owner instead: the entries a process has open or mapped, read from its /proc while it
lives (the demo's kill matrix and the soak read a victim just before its SIGKILL);
:func:`shm_left` says which of those remain.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs

SHM = "/dev/shm"

#: Native engine counters that must come back to their earlier value.
NATIVE_COUNTERS = ("allocations", "reservations", "regions", "pins", "ops_live")


@attrs.frozen
class Snapshot:
    fds: Mapping[int, str]           # fd -> readlink target
    memfd_maps: tuple[str, ...]      # lines of /proc/self/maps backed by a memfd
    children: frozenset[int]         # pids of direct children (of every thread)
    threads: frozenset[int]          # idents of live Python threads
    native: Mapping[str, int]        # native engine counters; empty if never loaded

    def counts(self) -> dict[str, int]:
        """The numbers a worker process reports across a pipe: fds and memfd mappings."""
        return {"fds": len(self.fds), "memfd_maps": len(self.memfd_maps)}


def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the fd listdir itself used, closed by now
    return out


def _memfd_maps() -> tuple[str, ...]:
    with open("/proc/self/maps", encoding="utf-8") as f:
        return tuple(line.rstrip() for line in f if "/memfd:" in line)


def _children() -> frozenset[int]:
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children", encoding="ascii") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass  # the thread exited meanwhile
    return frozenset(pids)


def _native() -> dict[str, int]:
    native = sys.modules.get("kvstate.transport.native")
    engine: Any = getattr(native, "_default", None)
    if engine is None:
        return {}  # never loaded: nothing native can be held
    stats = engine.stats()
    return {k: int(getattr(stats, k)) for k in NATIVE_COUNTERS}


def shm_held(pid: int) -> frozenset[str]:
    """Paths under /dev/shm that process ``pid`` has open (its fds) or mapped (its maps),
    for example a POSIX semaphore or a ``SharedMemory`` block; empty once it has exited."""
    found = set()
    prefix = SHM + "/"
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith(prefix):
                found.add(target.removesuffix(" (deleted)"))
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                i = line.find(prefix)
                if i >= 0:
                    found.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
    except OSError:
        pass  # exited meanwhile: what was read so far stands
    return frozenset(found)


def shm_left(paths: frozenset[str] | set[str]) -> list[str]:
    """Those of ``paths`` (from :func:`shm_held`) that still exist."""
    return sorted(p for p in paths if os.path.lexists(p))


def snapshot() -> Snapshot:
    return Snapshot(_fds(), _memfd_maps(), _children(),
                    frozenset(t.ident or 0 for t in threading.enumerate()), _native())


def _mp_helpers() -> tuple[set[int], set[int]]:
    """(pids, fds) of multiprocessing's per-process helpers, which outlive any one test."""
    pids: set[int] = set()
    fds: set[int] = set()
    tracker: Any = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    if tracker is not None:
        if getattr(tracker, "_pid", None):
            pids.add(tracker._pid)
        if getattr(tracker, "_fd", None) is not None:
            fds.add(tracker._fd)
    server: Any = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    if server is not None:
        if getattr(server, "_forkserver_pid", None):
            pids.add(server._forkserver_pid)
        if getattr(server, "_forkserver_alive_fd", None) is not None:
            fds.add(server._forkserver_alive_fd)
    return pids, fds


def leaks(before: Snapshot, after: Snapshot) -> list[str]:
    """Everything ``after`` holds that ``before`` did not, one line each."""
    helper_pids, helper_fds = _mp_helpers()
    found = [f"fd {fd} -> {target}" for fd, target in sorted(after.fds.items())
             if before.fds.get(fd) != target and fd not in helper_fds]
    new_maps = collections.Counter(after.memfd_maps) - collections.Counter(before.memfd_maps)
    found += [f"memfd mapping {line}" for line in sorted(new_maps.elements())]
    found += [f"child process {pid}" for pid in sorted(after.children - before.children - helper_pids)]
    alive = {t.ident: t.name for t in threading.enumerate()}
    found += [f"thread {alive.get(t, t)!r}" for t in sorted(after.threads - before.threads)]
    for key in NATIVE_COUNTERS:
        if after.native.get(key, 0) > before.native.get(key, 0):
            found.append(f"native {key}: {before.native.get(key, 0)} -> {after.native[key]}")
    return found


def settled_leaks(before: Snapshot, grace_s: float = 5.0) -> list[str]:
    """:func:`leaks` after waiting up to ``grace_s`` for asynchronous teardown to finish."""
    deadline = time.monotonic() + grace_s
    while True:
        found = leaks(before, snapshot())
        if not found or time.monotonic() >= deadline:
            return found
        gc.collect()  # objects in reference cycles (agents, channels) close their fds when collected
        time.sleep(0.02)
