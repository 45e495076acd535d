"""`kvstate demo` as a user runs it: a subprocess, its exit code and its output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

DEMO = [sys.executable, "-m", "kvstate", "demo", "--tp", "2", "--layers", "2", "--blocks", "32", "--prefix-blocks", "8"]


def test_demo_verifies_reuse_and_prints_a_summary() -> None:
    out = subprocess.run(DEMO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"checksums +2/2 ranks loaded and verified", out.stdout) and "per-rank-process" in out.stdout
    assert "OK: reuse verified, nothing partial, nothing leaked" in out.stdout
    # Timings are measured inside the workers and say what they measure; none has process spawn.
    assert "time, import: validate, check, lease, map, ready (coordinator)" in out.stdout
    assert "time, total: the four phases above (no process spawn, no engine start)" in out.stdout


def test_demo_json_reports_the_topology_per_rank() -> None:
    """Each rank is its own process, leases sum to tp, the group's history is the table's."""
    out = subprocess.run([*DEMO, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["topology"] == "per-rank-process" and report["ok"] is True
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    assert all(r["import_s"] > 0 for r in ranks) and sum(r["leases"] for r in ranks) == 2
    states = [h[0] for h in report["coordinator"]["history"]]
    assert [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]] == [
        "advertised", "checking", "importing", "ready", "draining", "quiescent", "closed"]
    assert report["time_to_ready_s"] > 0
    # `kvstate status` before and after draining: what the servers held, then released.
    before, after = (report["status"][w]["endpoints"] for w in ("before draining", "after draining"))
    banks = lambda eps: [b for e in eps if e["kind"] == "exporter" for b in e["banks"]]  # noqa: E731
    assert [(b["rank"], b["state"], b["lease_count"]) for b in banks(before)] == [(0, "ready", 1), (1, "ready", 1)]
    assert {lease["pid"] for b in banks(before) for lease in b["leases"]} == {r["pid"] for r in ranks}
    assert [(b["state"], b["lease_count"]) for b in banks(after)] == [("released", 0)] * 2
    coord = [e for e in before if e["kind"] == "coordinator"]
    assert len(coord) == 1 and [g["state"] for g in coord[0]["groups"]] == ["ready"]
    timings = report["timings_s"]
    assert all("spawn" not in k for k in timings if not k.startswith("total"))
    total = next(v for k, v in timings.items() if k.startswith("total"))
    assert total == pytest.approx(sum(v for k, v in timings.items() if not k.startswith("total")))


def test_demo_with_a_kill_shows_clean_failure_and_json() -> None:
    out = subprocess.run([*DEMO, "--kill", "exporter:advertised", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["kill"] == "exporter:advertised" and report["group"]["state"] == "failed"
    assert report["worker_final"] == ["failed", "failed"] and report["ok"] is True
    assert report["outcome"].startswith("failed cleanly, prefix recomputed: 0/2 ranks loaded")


def test_a_kill_during_the_load_is_not_reported_as_ok() -> None:
    """Killing one worker while loading leaves 1 of 2 ranks loaded: the group's load is
    unusable, and the demo says so instead of "OK"."""
    out = subprocess.run([*DEMO, "--kill", "worker:loading"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "failed cleanly, prefix recomputed: 1/2 ranks loaded" in out.stdout
    assert "OK" not in out.stdout.split("verdict", 1)[1]


@pytest.mark.parametrize(("args", "message"), [
    (["--kill", "exporter"], "expected ROLE:PHASE"),
    (["--kill", "decoder:ready"], "expected ROLE:PHASE"),
    (["--kill", "importer:ready"], "expected ROLE:PHASE"),
    (["--tp", "0"], "must be between 1 and 16"),
    (["--tp", "four"], "is not an integer"),
    (["--prefix-blocks", "64"], "exceeds --blocks"),
])
def test_bad_options_get_a_clear_error(args: list[str], message: str) -> None:
    out = subprocess.run([*DEMO, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.parametrize("kill", [None, "exporter:ready", "coordinator:importing", "worker:loading"])
def test_a_demo_run_leaves_nothing_on_the_node(kill: str | None) -> None:
    """With or without a SIGKILL, every folder, socket and mark of the run is gone after it."""
    tmp = Path(tempfile.mkdtemp(prefix="kvs-t-"))  # short: socket paths must fit sun_path
    try:
        out = subprocess.run([*DEMO, *(["--kill", kill] if kill else [])], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "TMPDIR": str(tmp)})
        assert out.returncode == 0, out.stdout + out.stderr
        assert sorted(os.listdir(tmp)) == []
    finally:
        shutil.rmtree(tmp)
