"""kvstate.harness.children: a child that dies is named with its exit status and its last
stderr lines, read from its own log; a live one is not reported."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvstate.harness import children


def says_and_exits(conn: Connection, code: int) -> None:
    print("first line\n\n  second line  ", file=sys.stderr)
    print("third line\nfourth line", file=sys.stderr, flush=True)
    os._exit(code)


def kills_itself(conn: Connection) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def waits(conn: Connection) -> None:
    conn.recv_bytes()


def test_a_dead_child_is_named_with_its_status_and_last_lines(tmp_path: Path) -> None:
    kids = children.Children(children.forkserver([__name__]), tmp_path / "logs")
    started: list[tuple[Any, Connection]] = []

    def start(name: str, target: Callable[..., None], *args: Any) -> Any:
        started.append(kids.start(name, target, *args))
        return started[-1][0]

    try:
        alive = start("waiter", waits)
        quiet = start("quiet one", kills_itself)
        died = kids.died([("waiter", alive), ("quiet one", quiet)])
        assert died is not None and str(died) == (
            f"quiet one (pid {quiet.pid}) was killed by SIGKILL before it answered; it wrote nothing to stderr")
        talker = start("talker", says_and_exits, 3)
        died = kids.died([("waiter", alive), ("talker", talker)])
        assert died is not None and (died.name, died.exitcode) == ("talker", 3)
        assert died.tail == ["second line", "third line", "fourth line"]  # the last 3, stripped, blanks dropped
        assert str(died).endswith("exited with status 3 before it answered; last lines of its stderr: "
                                  "second line | third line | fourth line")
        assert kids.died([("waiter", alive)], wait_s=0.2) is None  # alive: nothing to report
    finally:
        for p, conn in started:
            if p.is_alive():
                conn.send_bytes(b"done")
            p.join(10)
            p.close()
            conn.close()
