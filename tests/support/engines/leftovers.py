"""What an engine left behind, and whose it is: vLLM's own, or kvstate's.

vLLM leaves files even when it exits cleanly, and more after a SIGKILL: its ZMQ
``ipc://`` sockets (named by a bare uuid4 in ``VLLM_RPC_BASE_PATH``, which defaults to the
temp dir; never unlinked, even on a clean exit), the rendezvous file store
``vllm_dist_<uuid>`` in its temp dir, the CPU communicator's
``vllm_dist_<uuid>-tp:...-cpushm_<n>`` in /dev/shm (tp > 1), and the shared-memory
message queues (Python ``SharedMemory``, named ``psm_<hex>``) that a killed engine never
unlinks. Those are reported and removed, never counted against kvstate. What kvstate
creates is named ``kvstate...``, and any such name left behind is a leak.

Attribution, so that other processes on the machine are never blamed:

- every engine runs with its own ``TMPDIR``: everything left there is the engine's, and
  whatever is neither vLLM's nor kvstate's by name is reported as *unattributed* (a leak:
  nothing else writes there);
- in /dev/shm, an entry is the engine's if one of its processes had it mapped (the runner
  records ``/proc/<pid>/maps`` while the engine lives) or if its name is kvstate's and it
  appeared while the engine ran;
- processes carry the engine's tag in their environment; any still alive after the
  engine was stopped is a leak.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

SHM = Path("/dev/shm")

#: Names vLLM 0.32 (and Python's SharedMemory under it) gives to what it leaves behind.
VLLM_NAMES = (
    re.compile(r"^vllm_dist_[0-9a-f]{32}(-.*cpushm.*)?$"),  # file store; TP all-reduce buffers
    re.compile(r"^psm_[0-9a-f]+$"),                           # shm_broadcast MessageQueue
    re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}$"),  # ZMQ ipc:// sockets
    re.compile(r"^torchinductor_"),                           # compile caches (not with enforce_eager)
    re.compile(r"^vllm_"),                                    # other vllm_-prefixed scratch
)
KVSTATE_NAMES = re.compile(r"^\.?kvstate", re.IGNORECASE)


def owner_of(name: str) -> str:
    """``"kvstate"``, ``"vllm"`` or ``"unattributed"`` for a leftover's file name."""
    if KVSTATE_NAMES.search(name):
        return "kvstate"
    if any(p.search(name) for p in VLLM_NAMES):
        return "vllm"
    return "unattributed"


@dataclass
class Leftovers:
    """Leftovers of one engine, by owner (paths as strings, pids as ints)."""

    vllm: list[str] = field(default_factory=list)
    kvstate: list[str] = field(default_factory=list)
    unattributed: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)

    def add(self, path: Path) -> None:
        getattr(self, owner_of(path.name)).append(str(path))

    @property
    def leaks(self) -> list[str]:
        """Everything that is not vLLM's own: kvstate's files, unattributed files, live processes."""
        return ([f"kvstate leftover {p}" for p in self.kvstate]
                + [f"unattributed leftover {p}" for p in self.unattributed]
                + [f"engine process {pid} still alive" for pid in self.processes])


def shm_names() -> set[str]:
    return set(os.listdir(SHM))


def shm_mapped(pids: Iterable[int]) -> set[str]:
    """Names of /dev/shm entries that these processes have mapped now."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    i = line.find(str(SHM) + "/")
                    if i >= 0:
                        found.add(line[i + len(str(SHM)) + 1:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            continue  # exited meanwhile
    return found


def collect(tmpdir: Path, shm_seen: set[str], shm_before: set[str], live: Iterable[int]) -> Leftovers:
    """Classify what remains: in the engine's ``tmpdir``; in /dev/shm, what it had mapped
    (``shm_seen``) plus kvstate-named entries that were not there before it started."""
    out = Leftovers(processes=sorted(live))
    if tmpdir.is_dir():
        for p in sorted(tmpdir.iterdir()):
            out.add(p)
    now = shm_names()
    for name in sorted(now & (shm_seen | {n for n in now - shm_before if owner_of(n) == "kvstate"})):
        out.add(SHM / name)
    return out


def remove_vllm_leftovers(found: Leftovers) -> None:
    """Remove vLLM's own leftovers (a killed engine leaves MiBs in /dev/shm)."""
    for path in map(Path, found.vllm):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
