"""``kvstate gpucheck`` and the GPU suite, end to end on the shim driver: their control
flow (two processes, legacy IPC lifetime, gather and scatter, a kill during a copy, the
JSON summary) runs in CI; only the figures need a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudashim.shim import use

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--rounds", "3", "--repeats", "2", "--mib", "4", "--block-kib", "64", "--kill-delay-us", "2000"]


def shim_env(**extra: str) -> dict[str, str]:
    path = use().path
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTATE_CUDASHIM")}
    return {**env, "KVSTATE_LIBCUDA": str(path), **extra}


def gpucheck(*args: str, **env: str) -> tuple[int, dict[str, object]]:
    out = subprocess.run([sys.executable, "-m", "kvstate", "gpucheck", *SMALL, *args], capture_output=True, text=True,
                         timeout=240, env=shim_env(**env), cwd=ROOT)
    return out.returncode, json.loads(out.stdout)


@pytest.mark.slow
def test_gpucheck_runs_end_to_end_on_the_shim() -> None:
    code, report = gpucheck()
    assert code == 0 and report["ok"] is True, report
    checks = report["checks"]
    assert isinstance(checks, dict)
    assert set(checks) == {"vmm_two_process", "legacy_ipc_two_process", "gather_scatter", "kill_during_copy"}
    assert all(c["ok"] for c in checks.values())
    assert checks["legacy_ipc_two_process"]["exporter_refused_while_open"]["refused"] is True
    assert checks["kill_during_copy"]["child_exit"] == -9
    assert checks["kill_during_copy"]["child_ops_unfinished_at_kill"] > 0, "the kill landed during copies"
    assert all(c["elapsed_s"] > 0 for c in checks.values())
    assert report["within_budget"] is True and 0 < report["elapsed_s"] < report["budget_s"] == 300
    figures = report["figures"]
    assert isinstance(figures, dict) and all(isinstance(v, float) and v > 0 for v in figures.values()), figures
    assert report["device_name"] == "kvstate CUDA shim 0" and report["batched_copy"] is True


@pytest.mark.slow
def test_gpucheck_fails_when_the_device_faults() -> None:
    """The check can fail: a copy that faults on the device makes it report failure."""
    code, report = gpucheck(KVSTATE_CUDASHIM_FAIL="async:1:700")
    assert code == 1 and report["ok"] is False, report
    checks = report["checks"]
    assert isinstance(checks, dict) and not all(c["ok"] for c in checks.values())


@pytest.mark.slow
def test_gpucheck_fails_over_its_time_budget() -> None:
    """Every check passes, but the run took longer than --budget-s: the run fails."""
    code, report = gpucheck("--budget-s", "0.01")
    assert code == 1 and report["ok"] is False and report["within_budget"] is False, report
    checks = report["checks"]
    assert isinstance(checks, dict) and all(c["ok"] for c in checks.values())


@pytest.mark.slow
def test_the_gpu_suite_runs_on_the_shim() -> None:
    """On a driver without the batched copy and with FABRIC (the paths gpucheck above does
    not take on the shim's defaults)."""
    env = shim_env(KVSTATE_CUDASHIM_FABRIC="1", KVSTATE_CUDASHIM_VERSION="12040")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cuda"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "skipped" not in out.stdout.strip().splitlines()[-1]
