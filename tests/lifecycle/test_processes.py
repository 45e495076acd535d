"""Real exporter and importer processes: the tp matrix and SIGKILL in every phase.

Each scenario checks: no partial readiness (an importer is ready only with every part),
verified bytes for every completed load, importers drained to a terminal state,
exporters quiescent and released within their lease timeout, and no leaked fds or memfd
mappings in any surviving process (from /proc).
"""

from __future__ import annotations

import json

import pytest

from kvstate.harness.cluster import PHASES, ROLES, ClusterSpec, run_scenario

SMALL = dict(layers=2, kv_heads=2, head_dim=64, block_tokens=16, num_blocks=64, prefix_blocks=16,
             lease_timeout_s=3.0, timeout_s=10.0)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_reuse_across_processes(tp: int) -> None:
    """INV-LOAD-BYTES across processes, and INV-RELEASE-QUIESCENT at the end."""
    report = run_scenario(ClusterSpec(tp=tp, **SMALL))  # type: ignore[arg-type]
    assert report["import_states"] == ["ready"] * tp
    assert report["verified"] == [(r, True) for r in range(tp)]
    assert report["exporter_states"][-3:] == ["draining", "quiescent", "released"]
    assert report["ok"], json.dumps(report)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("role", ROLES)
def test_sigkill_in_every_phase(role: str, phase: str) -> None:
    """INV-GROUP-COMPLETE under process death: no importer is ready without every part."""
    spec = ClusterSpec(tp=2, **SMALL)  # type: ignore[arg-type]
    report = run_scenario(spec, (role, phase))
    assert report["ok"], json.dumps(report)
    assert set(report["import_states"]) <= {"ready", "failed"}
    if role == "exporter" and phase == "advertised":
        assert report["import_states"] == ["failed", "failed"]  # a rank is gone: never ready
    assert report["exporter_quiescent_s"] <= spec.lease_timeout_s
    assert all(ok for _, ok in report["verified"])
