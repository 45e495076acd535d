"""Real processes on both sides: a coordinator process, tp rank worker processes and tp
exporter processes; the tp matrix, and SIGKILL of each role in every phase.

Each scenario checks: no partial readiness (the coordinator is ready only with every
rank's imported report, and no worker's share is ready without its part mapped: both
checked inside the processes at the moment it happens), tp leases in all when ready,
verified bytes for every completed load, every surviving worker's share ended with its
part unmapped, exporters quiescent and released within their lease timeout, no leaked fds
or memfd mappings in any surviving process (from /proc), and no stray process. The leak
check of this directory (tests/conftest.py) covers the test process itself.
"""

from __future__ import annotations

import json

import pytest

from kvstate.harness.cluster import PHASES, ROLES, ClusterSpec
from kvstate.harness.scenario import run_scenario

SMALL = dict(layers=2, kv_heads=2, head_dim=64, block_tokens=16, num_blocks=64, prefix_blocks=16,
             lease_timeout_s=3.0, timeout_s=10.0, phase_timeout_s=3.0, silence_s=1.5)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_reuse_across_processes(tp: int) -> None:
    """INV-LOAD-BYTES across processes, INV-COORD-LEASES (tp leases, one per worker) and
    INV-RELEASE-QUIESCENT at the end."""
    report = run_scenario(ClusterSpec(tp=tp, **SMALL))  # type: ignore[arg-type]
    assert report["ok"], json.dumps(report)
    assert report["topology"] == "per-rank-process"
    assert report["group"]["state"] == "ready" and report["coordinator"]["state"] == "closed"
    assert [r["leases"] for r in report["ranks"]] == [1] * tp and report["leases_total"] == tp
    assert report["mappings_per_rank"] == [1] * tp  # /proc of each worker: one memfd mapping
    assert report["exporter_leases"] == [1] * tp    # each bank leased once, by its own rank
    assert len({r["pid"] for r in report["ranks"]}) == tp  # one process per rank
    assert report["verified"] == [(r, True) for r in range(tp)]
    assert report["worker_final"] == ["closed"] * tp
    assert report["exporter_states"][-3:] == ["draining", "quiescent", "released"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("role", ROLES)
def test_sigkill_in_every_phase(role: str, phase: str) -> None:
    """INV-COORD-READY-COMPLETE, INV-COORD-NO-ORPHAN-MAPPING and INV-COORD-UNMAP-AFTER-DEATH
    under process death: the highest rank's exporter or worker, or the coordinator, is
    SIGKILLed while the phase is open (workers are held at check or open to keep it open)."""
    spec = ClusterSpec(tp=2, **SMALL)  # type: ignore[arg-type]
    report = run_scenario(spec, (role, phase))
    assert report["ok"], json.dumps(report)
    group = report["group"]
    before_ready = PHASES.index(phase) < PHASES.index("ready")
    if before_ready and role != "coordinator":
        assert group["state"] == "failed" and report["verified"] == []  # a rank is gone: never ready
    if not before_ready:
        assert group["state"] == "ready" and report["leases_total"] == spec.tp
    if role != "coordinator" and group.get("state") is not None:
        assert report["coordinator"]["state"] in ("failed", "closed")
    # every survivor's share ended (on the coordinator's word, or alone when it died)
    assert all(s in ("closed", "failed", None) for s in report["worker_final"])
    if role == "coordinator" and phase != "advertised":
        assert all(s in ("closed", "failed") for s in report["worker_final"]), json.dumps(report)[:3000]
    if phase == "draining":  # a load still in flight pins each part: its share cannot quiesce yet
        assert all(s == "draining" for s in report["draining_states"]), report["draining_states"]
    if "death_to_unmapped_s" in report:
        assert report["death_to_unmapped_s"] < spec.silence_s  # EOF or pidfd, not the silence bound
    assert report["exporter_quiescent_s"] <= spec.lease_timeout_s
    # A killed server's socket and mark stay until the next start in its directory sweeps them.
    if role != "worker":  # workers serve no socket
        assert report["leftovers_before_next_start"], json.dumps(report)[:3000]
    assert report["leftovers_after_next_start"] == []
    assert report["shm_after_next_start"] == []  # what the victim had in /dev/shm, by its pid


def test_the_verdict_catches_a_worker_that_keeps_its_part() -> None:
    """Self-test: a planted share that ends without unmapping its part on abort is caught
    (from inside its process) when a kill fails the group during import."""
    spec = ClusterSpec(tp=2, plant="planted.coordinator_bugs:KeepsPartOnAbort", **SMALL)  # type: ignore[arg-type]
    report = run_scenario(spec, ("worker", "importing"))
    assert not report["ok"]
    assert any("still mapping its part" in v for v in report["violations"]), report["violations"]
