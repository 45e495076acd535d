"""Exporter/importer process pairs for benchmarks: real processes, bounded waits.

``run_pair(exporter, importer, params)`` spawns both, joined by a pipe; the importer
returns its timings (a tuple of seconds) to this process. Both functions are top-level
functions (spawn pickles them by name). A pair that does not finish within ``timeout``
is killed and reported as an error, never as a number.

Placement: with ``params["placement"] == "split"`` (B1) the importer runs on one CPU and
the exporter on another, for every row alike. Left to the scheduler, a request/answer
pair of single-threaded processes is often woken on one CPU (a direct hand-off, about
6 us per round trip on the 2-vCPU machines of this project) and sometimes on two (about
60 us: the wake-up crosses CPUs), so one row's figure moved by 6x between runs. Two
workers on two cores is also how an engine deploys them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.framework import Skipped

Side = Callable[[Connection, dict[str, Any]], Any]


def split_cpus() -> tuple[int, int] | None:
    """(importer CPU, exporter CPU) for a split placement, or None with fewer than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def _place(params: dict[str, Any], side: int) -> None:
    # Before the side starts any thread: threads inherit the CPU set of their creator.
    cpus = split_cpus() if params.get("placement") == "split" else None
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[side]})


def _exporter_main(fn: Side, conn: Connection, params: dict[str, Any], env: dict[str, str]) -> None:
    os.environ.update(env)
    _place(params, 1)
    fn(conn, params)


def _importer_main(fn: Side, conn: Connection, out: Connection, params: dict[str, Any], env: dict[str, str]) -> None:
    os.environ.update(env)
    _place(params, 0)
    try:
        out.send(("ok", fn(conn, params)))
    except Skipped as exc:
        out.send(("skip", str(exc)))
    except BaseException as exc:
        out.send(("err", f"{type(exc).__name__}: {exc}"))


def run_pair(exporter: Side, importer: Side, params: dict[str, Any], *, env: dict[str, str] | None = None,
             timeout: float = 300.0) -> Any:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    result_r, result_w = ctx.Pipe(duplex=False)
    env = env or {}
    pe = ctx.Process(target=_exporter_main, args=(exporter, a, params, env), daemon=True)
    pi = ctx.Process(target=_importer_main, args=(importer, b, result_w, params, env), daemon=True)
    pe.start()
    pi.start()
    for end in (a, b, result_w):  # the children hold their own copies
        end.close()
    try:
        if not result_r.poll(timeout):
            raise RuntimeError(f"benchmark pair gave no result within {timeout} s")
        try:
            status, value = result_r.recv()
        except EOFError:
            raise RuntimeError(f"benchmark importer died (exit code {pi.exitcode})") from None
    finally:
        for p in (pi, pe):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    if status == "skip":
        raise Skipped(value)
    if status == "err":
        raise RuntimeError(f"benchmark importer failed: {value}")
    return value
