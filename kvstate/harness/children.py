"""Child processes that import the same kvstate as their parent, and whose death at start
reads as one line.

Same kvstate: multiprocessing's forkserver is a fresh ``python -c`` process, so its
``sys.path`` starts with the current folder, and Python 3.11's forkserver ignores the
parent's ``sys.path`` while it preloads. Run from inside a source checkout, it imported
the checkout's kvstate instead of the installed one, and every child forked from it
inherited that (``ModuleNotFoundError: kvstate.tables``). :func:`forkserver` starts the
server with ``PYTHONSAFEPATH`` (no current folder) and the folders the parent finds the
preloaded packages in first on ``PYTHONPATH``; each child gets the parent's environment
back before its target runs.

Readable deaths: :func:`entry`, the first code a child runs, points the child's stderr at
a file of its own and only then imports its target, so a child that dies at start (a
broken import, a missing backend) leaves its last lines where the parent reads them.
:meth:`Children.died` turns that into :class:`ChildDied`: the child's name, exit status
and last stderr lines in one line, for the command line to print instead of a raw
``EOFError``.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import site
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

#: environment the forkserver is started with, undone in each child (see :func:`entry`)
_ENV = ("PYTHONSAFEPATH", "PYTHONPATH")
#: how many of a dead child's last stderr lines the one-line report carries
TAIL_LINES = 3


class ChildDied(Exception):
    """A child process ended without answering. Not a :class:`~kvstate.KvStateError`:
    it is the harness's, and ``kvstate demo`` prints it as its one-line error."""

    def __init__(self, name: str, pid: int | None, exitcode: int | None, tail: Sequence[str]) -> None:
        self.name, self.pid, self.exitcode, self.tail = name, pid, exitcode, list(tail)
        if exitcode is None:
            how = "stopped answering"
        elif exitcode < 0:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        else:
            how = f"exited with status {exitcode}"
        said = f"; last lines of its stderr: {' | '.join(self.tail)}" if self.tail else "; it wrote nothing to stderr"
        super().__init__(f"{name} (pid {pid}) {how} before it answered{said}")


def package_roots(modules: Sequence[str]) -> list[str]:
    """The folders this process imports the top packages of ``modules`` from (site
    folders left out: every interpreter of this environment finds those anyway)."""
    sites = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    roots: list[str] = []
    for top in dict.fromkeys(m.split(".")[0] for m in modules):
        spec = importlib.util.find_spec(top)
        for location in (spec.submodule_search_locations or []) if spec else []:
            root = os.path.realpath(Path(location).parent)
            if root not in sites and root not in roots:
                roots.append(root)
    return roots


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def forkserver(preload: Sequence[str]) -> ForkServerContext:
    """A forkserver context whose server preloads ``preload`` from where this process
    imports them, whatever the current folder. The server is started here (once per
    process; a running one is kept, as multiprocessing does)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    path = [*package_roots(preload), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    with _environment({"PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}):
        multiprocessing.forkserver.ensure_running()
    return ctx


def entry(log: str, target: str, env: dict[str, str | None], *args: Any) -> None:
    """A child's first code: stderr to ``log``, the parent's environment back, then
    ``target`` ("module:function") imported and called with ``args``. Anything it raises
    is printed to ``log`` by multiprocessing, and the child exits 1."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(*args)


class Children:
    """Starts named children of one context, each with its stderr in ``logs/<name>.log``."""

    def __init__(self, ctx: Any, logs: Path) -> None:
        self.ctx = ctx
        self.logs = logs
        logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._env = {k: os.environ.get(k) for k in _ENV}

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def start(self, name: str, target: Callable[..., None],
              *args: Any) -> tuple[Any, multiprocessing.connection.Connection]:
        """Starts ``target(conn, *args)`` in a child named ``name``; returns the process and
        this side of the pipe."""
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=entry, name=name, daemon=True,
                             args=(str(self.log(name)), f"{target.__module__}:{target.__qualname__}", self._env,
                                   child, *args))
        p.start()
        child.close()
        return p, parent

    def died(self, named: Sequence[tuple[str, Any]], wait_s: float = 5.0) -> ChildDied | None:
        """The first of ``named`` (name, process) that has ended, waiting up to ``wait_s``
        for one to end (a closed pipe comes just before the exit status), or None."""
        if not named:
            return None
        multiprocessing.connection.wait([p.sentinel for _, p in named], wait_s)
        for name, p in named:
            if p.exitcode is not None:
                return ChildDied(name, p.pid, p.exitcode, self.tail(name))
        return None

    def tail(self, name: str) -> list[str]:
        try:
            text = self.log(name).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return [line[:200] for line in lines[-TAIL_LINES:]]
