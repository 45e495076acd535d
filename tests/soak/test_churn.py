"""Lease churn held (bounded for CI; ``make churn`` runs ten minutes): 32 importer
processes against one tp=4 exporter group with random SIGKILLs. See tests/soak/churn.py."""

from __future__ import annotations

import os

import pytest

from soak.churn import run_churn

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SECONDS = float(os.environ.get("KVSTATE_CHURN_SECONDS", "30"))


def test_lease_churn_with_sigkills_holds_the_exporters_steady() -> None:
    report = run_churn(SECONDS, 32, log=print)
    print(report.summary())
    assert report.problems() == []
    assert report.cycles > 0 and report.kills >= SECONDS  # a kill every half second
    assert report.adopted_cycles > 0, "no importer adopted parked leases: half of them park"


def test_the_churn_verdict_catches_a_lease_that_leaks_an_fd() -> None:
    report = run_churn(12, 8, plant="leak_fd")
    assert any("fds grew" in g for g in report.growth), report.summary()
