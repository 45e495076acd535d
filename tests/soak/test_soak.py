"""Soak under process kills (bounded for CI; ``make soak`` runs the long one).

INV-GROUP-COMPLETE (no partial readiness), INV-LOAD-BYTES (checksums of every completed
load), INV-RELEASE-QUIESCENT (every exporter quiescent within its lease timeout), no
leaked fds or memfd mappings in any worker, and nothing of a killed process left in the
socket directory or /dev/shm after the next start, across cycles with random SIGKILLs of
exporter and importer processes at random phases. See tests/support/soak.py for the cycle.
"""

from __future__ import annotations

import itertools
import os

import pytest

from support.soak import PHASES, ROLES, SOAK_SPEC, run_soak

CYCLES = int(os.environ.get("KVSTATE_SOAK_CYCLES", "200"))


def test_soak_under_random_sigkills() -> None:
    report = run_soak(CYCLES, seed=int(os.environ.get("KVSTATE_SOAK_SEED", "1")), log=print)
    print(report.summary())
    assert report.problems() == []
    assert report.cycles == CYCLES
    assert report.worst_quiescent_s <= SOAK_SPEC.lease_timeout_s
    if CYCLES >= 200:  # the bounded run is long enough to hit every role in every phase
        assert set(report.kills) == {f"{r}:{p}" for r, p in itertools.product(ROLES, PHASES)}
        assert report.loads_verified >= CYCLES  # most cycles complete loads on surviving ranks
        assert report.failed_groups > 0 and report.ready_groups > 0


@pytest.mark.parametrize("plant, finding, kill_rate", [("leak_fd", "leaks", 0.0), ("corrupt", "corrupt_loads", 0.0),
                                                       ("no_sweep", "leftovers", 1.0), ("hold_gil", "stalls", 0.0),
                                                       ("shm_left", "leftovers", 1.0)])
def test_soak_verdict_catches_planted_bugs(plant: str, finding: str, kill_rate: float) -> None:
    report = run_soak(8, seed=3, kill_rate=kill_rate, plant=plant)
    assert getattr(report, finding), report.summary()
    if plant == "shm_left":  # a killed worker's file, attributed by its pid, and removed once reported
        assert all("/dev/shm/kvstate-soak-plant-" in f for f in report.leftovers), report.leftovers
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("kvstate-soak-plant-")
                    and not os.path.exists(f"/proc/{f.rsplit('-', 1)[1]}")]
    if plant == "hold_gil":  # the stack says where: the C call that held the GIL, in the worker's load
        assert "importer_worker" in report.stalls[0], report.stalls[0]
    assert report.problems()
