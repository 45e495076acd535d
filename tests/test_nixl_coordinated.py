"""Cross-node parts: a coordinated group whose banks live in other processes that export
them through NIXL (UCX over loopback TCP) and lease them over the TCP control channel, so
every worker's part is remote. The same tables drive everything: leased (one lease per
bank, per rank), pinned (a READ in flight holds a drain), drained and released (the bank is
released only once no lease is live). Real processes throughout; each checks for leaks
against its state before its NIXL agent existed (the agent keeps UCX connections to its
peers until it is gone, so each process tears its agent down before judging).
"""

from __future__ import annotations

import json

import pytest

from kvstate.harness.cluster import ClusterSpec
from kvstate.harness.scenario import run_scenario
from support.need import need_nixl

SMALL = dict(layers=2, kv_heads=2, head_dim=64, block_tokens=16, num_blocks=64, prefix_blocks=16,
             lease_timeout_s=5.0, timeout_s=20.0, phase_timeout_s=10.0, silence_s=3.0, granularity=64 * 1024,
             nixl=True)


@pytest.fixture(autouse=True)
def _nixl() -> None:
    need_nixl()


@pytest.mark.slow
def test_a_group_of_remote_parts_loads_over_nixl() -> None:
    """INV-COORD-LEASES and INV-LOAD-BYTES across nodes: every part is a NIXL view, leased
    over TCP; each worker READs its own rank's bytes; nothing is mapped locally."""
    report = run_scenario(ClusterSpec(tp=2, **SMALL))  # type: ignore[arg-type]
    assert report["ok"], json.dumps(report)
    assert all(d["handle_kind"] == "nixl" and d["fabric"] == "network" and d["lease_address"].startswith("tcp://")
               for d in report["descriptors"])
    assert report["verified"] == [(0, True), (1, True)]
    assert [r["leases"] for r in report["ranks"]] == [1, 1] and report["exporter_leases"] == [1, 1]
    assert report["mappings_per_rank"] == [0, 0]  # READs, never a mapping of another node's memory
    assert report["exporter_states"][-4:] == ["advertised", "draining", "quiescent", "released"]
    assert report["worker_final"] == ["closed", "closed"]


@pytest.mark.slow
def test_an_exporter_death_is_seen_over_tcp_and_drains_the_group() -> None:
    """The lease channel's end (EOF on TCP) is the exporter's death: its rank's worker
    drains, the coordinator drains every rank, every remote view is retired."""
    report = run_scenario(ClusterSpec(tp=2, **SMALL), ("exporter", "ready"))  # type: ignore[arg-type]
    assert report["ok"], json.dumps(report)
    states = [h[0] for h in report["coordinator"]["history"]]
    assert "draining" in states and report["coordinator"]["state"] == "closed"
    assert report["worker_final"] == ["closed", "closed"]


@pytest.mark.slow
def test_a_pinned_remote_part_holds_the_drain_and_an_orphan_closes_alone() -> None:
    """Pinned: a READ in flight keeps the share draining (part_unpinned); the coordinator
    dies meanwhile; once the READ ends each worker closes its part alone and returns its
    lease, and the exporters release their banks."""
    report = run_scenario(ClusterSpec(tp=2, **SMALL), ("coordinator", "draining"))  # type: ignore[arg-type]
    assert report["ok"], json.dumps(report)
    assert report["draining_states"] == ["draining", "draining"]  # pinned: the drain waits for the READ
    assert report["worker_final"] == ["closed", "closed"]
    assert report["exporter_states"][-3:] == ["draining", "quiescent", "released"]
