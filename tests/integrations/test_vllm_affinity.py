"""kvstate's threads in an engine worker are not confined to the cores vLLM binds the
worker to (kvstate.integrations.vllm.affinity; issue 28, item 6).

A child process binds its thread to one CPU, as vLLM's CPU worker does, then starts a real
exporter (its native lease thread and its Python event thread) the way the connector's
worker hooks do: inside ``unpinned()``. Every thread it started may run on every CPU the
test may use, and the binding of the thread that started them is back as it was. The
same exporter started without ``unpinned()`` has its threads confined to the one CPU:
the cause measured in the vLLM suite, where those threads waited runnable for 10 s
beside a busy-polling worker on that CPU while the other CPU was idle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvstate.integrations.vllm import affinity

CHILD = textwrap.dedent("""
    import json, os, sys, tempfile
    from pathlib import Path
    from kvstate.integrations.vllm.affinity import unpinned
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.transport.host import HostTransport
    from support import gil_hostile as gh

    def masks():
        return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}

    bound, wrap = int(sys.argv[1]), sys.argv[2] == "unpinned"
    os.sched_setaffinity(0, {bound})  # what vLLM's worker does to its thread
    before = masks()
    d = Path(tempfile.mkdtemp(prefix="kvs-aff-"))
    os.chmod(d, 0o700)
    def start():
        ex = Exporter(ExportConfig(gh.DEPLOYMENT, d / "sock", os.urandom(16), gh.TP), HostTransport())
        for r in range(gh.TP):
            bank = ex.add_bank(r, gh.GEOMETRY)
            bank.fire("register")
            bank.fire("advertise")
        ex.start()
        return ex
    if wrap:
        with unpinned():
            inside = sorted(os.sched_getaffinity(0))
            ex = start()
    else:
        inside = sorted(os.sched_getaffinity(0))
        ex = start()
    after = masks()
    started = {t: m for t, m in after.items() if t not in before}
    print(json.dumps({"started": list(started.values()), "caller": sorted(os.sched_getaffinity(0)),
                      "inside": inside}), flush=True)
    ex.stop()
""")


def run_child(bound: int, mode: str) -> dict[str, list[list[int]] | list[int]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(bound), mode], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, list[list[int]] | list[int]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_threads_an_engine_hook_starts_may_use_every_cpu_and_the_engines_binding_stays(cpus: list[int]) -> None:
    got = run_child(cpus[0], "unpinned")
    assert got["started"], "the exporter started no thread"
    assert set(cpus) <= set(got["inside"]), got                       # widened to every CPU it may use
    assert all(mask == got["inside"] for mask in got["started"]), got  # lease server, event thread
    assert got["caller"] == [cpus[0]], got                            # the worker's own thread: still bound


def test_without_it_the_threads_inherit_the_workers_one_cpu(cpus: list[int]) -> None:
    """The cause: a thread inherits the mask of the thread that starts it."""
    got = run_child(cpus[0], "plain")
    assert got["started"] and all(mask == [cpus[0]] for mask in got["started"]), got


def test_where_the_mask_cannot_be_set_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    before = os.sched_getaffinity(0)

    def refuse(pid: int, mask: object) -> None:
        raise PermissionError("refused")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    ran = []
    with affinity.unpinned():
        ran.append(True)
    assert ran == [True] and os.sched_getaffinity(0) == before


def test_the_callers_mask_comes_back_when_the_block_raises(cpus: list[int]) -> None:
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        with pytest.raises(RuntimeError):
            with affinity.unpinned():
                assert set(cpus) <= os.sched_getaffinity(0)
                raise RuntimeError("hook failed")
        assert os.sched_getaffinity(0) == {cpus[0]}
    finally:
        os.sched_setaffinity(0, own)
