"""`kvstate demo` as a user runs it: a subprocess, its exit code and its output."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

DEMO = [sys.executable, "-m", "kvstate", "demo", "--tp", "2", "--layers", "2", "--blocks", "32", "--prefix-blocks", "8"]


def test_demo_verifies_reuse_and_prints_a_summary() -> None:
    out = subprocess.run(DEMO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"checksums +2/2 ranks loaded and verified", out.stdout)
    assert "OK: reuse verified, nothing partial, nothing leaked" in out.stdout
    # Timings are measured inside the workers and say what they measure; spawn is only in the total.
    assert "time, import: validate, lease, map, ready (slowest importer)" in out.stdout
    assert "time, total: parent's wall clock, with process spawn" in out.stdout


def test_demo_with_a_kill_shows_clean_failure_and_json() -> None:
    out = subprocess.run([*DEMO, "--kill", "exporter:advertised", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["kill"] == "exporter:advertised" and report["import_states"] == ["failed", "failed"]
    assert report["ok"] is True
    assert report["outcome"].startswith("failed cleanly, prefix recomputed: 0/2 ranks loaded")


def test_a_kill_during_the_load_is_not_reported_as_ok() -> None:
    """Killing one importer while loading leaves 1 of 2 ranks loaded: the group's load is
    unusable, and the demo says so instead of "OK"."""
    out = subprocess.run([*DEMO, "--kill", "importer:loading"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "failed cleanly, prefix recomputed: 1/2 ranks loaded" in out.stdout
    assert "OK" not in out.stdout.split("verdict", 1)[1]


@pytest.mark.parametrize(("args", "message"), [
    (["--kill", "exporter"], "expected ROLE:PHASE"),
    (["--kill", "decoder:ready"], "expected ROLE:PHASE"),
    (["--tp", "0"], "must be between 1 and 16"),
    (["--tp", "four"], "is not an integer"),
    (["--prefix-blocks", "64"], "exceeds --blocks"),
])
def test_bad_options_get_a_clear_error(args: list[str], message: str) -> None:
    out = subprocess.run([*DEMO, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr
