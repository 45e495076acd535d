"""Real peer processes for transport tests, driven command by command over a pipe.

Each :class:`Peer` is a fresh ``spawn``-ed interpreter (so no NIXL or UCX state leaks
from pytest or between tests) that runs named functions of a command module against its
own state dict. Every wait is bounded: a command that does not answer within its
timeout fails the test and the process is killed.

UCX is confined to TCP over the loopback device, the cross-node path on one machine.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

LOOPBACK_UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}


class PeerError(Exception):
    """A command raised in the peer; ``kind`` is the exception's qualified class name (and
    a kvstate error's reason: :func:`kind_of`)."""

    def __init__(self, kind: str, message: str, tb: str) -> None:
        self.kind = kind
        super().__init__(f"{kind}: {message}\n--- in peer ---\n{tb}")


def kind_of(exc: BaseException) -> str:
    """The exception's qualified class name, then ``:reason`` and ``/defect`` of a kvstate
    error (its class alone says little: ``kvstate.core.errors.ImportFailed:handle/stale_generation``)."""
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    reason, defect = getattr(exc, "reason", None), getattr(exc, "defect", None)
    if reason is not None:
        kind += f":{reason.value}"
    if defect is not None:
        kind += f"/{defect.value}"
    return kind


def _serve(conn: Connection, module: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    commands = importlib.import_module(module)
    state: dict[str, Any] = {}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        name, kwargs = msg
        try:
            conn.send(("ok", getattr(commands, name)(state, **kwargs)))
        except BaseException as exc:  # report everything, including KvStateError subclasses
            conn.send(("err", kind_of(exc), str(exc), traceback.format_exc()))
    conn.close()


class Peer:
    def __init__(self, module: str, env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, module, {**LOOPBACK_UCX, **(env or {})}), daemon=True)
        self.process.start()
        child.close()

    def call(self, name: str, /, *, wait: float = 30.0, **kwargs: Any) -> Any:
        """Run command ``name`` with ``kwargs`` in the peer; ``wait`` bounds the answer."""
        self._conn.send((name, kwargs))
        if not self._conn.poll(wait):
            self.kill()
            raise TimeoutError(f"peer command {name!r} gave no answer within {wait} s")
        try:
            reply = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise PeerError("PeerDied", f"peer exited with code {self.process.exitcode} during {name!r}", "") from None
        if reply[0] == "err":
            raise PeerError(reply[1], reply[2], reply[3])
        return reply[1]

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@contextmanager
def peers(module: str, n: int, env: dict[str, str] | None = None) -> Iterator[list[Peer]]:
    started = [Peer(module, env) for _ in range(n)]
    try:
        yield started
    finally:
        for p in started:
            p.stop()
