"""A Hypothesis state machine over real processes: a coordinator process, tp rank worker
processes and tp exporter processes, driven by random imports, loads, drains and
SIGKILLs of any process of any role.

After every step (invariants): no partial ready (the coordinator's group is ready only
with every rank's imported report, and then tp leases in all, one per worker), and no
violation seen from inside any process. At the end (teardown): every surviving worker's
share of every group ended with its part unmapped, every surviving exporter drained and
released its bank within its lease timeout, no process holds an fd or memfd mapping beyond
its baseline, and no process is left running. This directory's leak check covers the test
process itself.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvstate.harness.cluster import Cluster, ClusterSpec, expected_checksum, recv, send

SPEC = ClusterSpec(tp=2, layers=2, kv_heads=2, head_dim=32, block_tokens=16, num_blocks=32, prefix_blocks=4,
                   granularity=64 * 1024, lease_timeout_s=3.0, timeout_s=10.0, phase_timeout_s=3.0, silence_s=1.5)
ENDED = ("closed", "failed", "rejected")


class CoordinatedProcesses(RuleBasedStateMachine):
    spec = SPEC

    def __init__(self) -> None:
        super().__init__()
        self.c = Cluster(self.spec)
        self.wire = self.c.start_decode()
        self.c.start_prefill()
        self.groups: dict[str, dict[str, Any]] = {}  # gid -> the coordinator's last description
        self.live_gid: str | None = None

    # -- helpers -------------------------------------------------------------------------

    def coordinator_alive(self) -> bool:
        return self.c.coordinator is not None and not self.c.coordinator.killed

    def ask_coordinator(self, **cmd: Any) -> dict[str, Any]:
        assert self.c.coordinator is not None
        return self.c.coordinator.ask(SPEC.timeout_s + 4 * SPEC.phase_timeout_s, **cmd)

    # -- rules ---------------------------------------------------------------------------

    @precondition(lambda self: self.coordinator_alive() and self.live_gid is None)
    @rule()
    def import_group(self) -> None:
        reply = self.ask_coordinator(**self.c.import_command(self.wire))
        gid = reply.get("gid")
        assert gid is not None, reply
        self.groups[gid] = reply
        alive = all(not w.killed for w in [*self.c.exporters, *self.c.workers])
        if reply["state"] == "ready":
            self.live_gid = gid
        else:
            assert reply["state"] in ENDED and not alive, f"a healthy cluster failed to import: {reply}"

    @precondition(lambda self: self.live_gid is not None)
    @rule()
    def load(self) -> None:
        assert self.live_gid is not None
        for w in self.c.live(self.c.workers):
            r = w.ask(SPEC.timeout_s, cmd="load", gid=self.live_gid, blocks=SPEC.prefix())
            if "checksum" in r:  # a share still ready loads the exporter's bytes (INV-LOAD-BYTES)
                assert r["checksum"] == expected_checksum(SPEC, w.rank)
            else:  # refused: the share left ready (a fault drained it)
                assert "not declared in state" in r.get("error", "") or r.get("state") != "ready", r

    @precondition(lambda self: self.live_gid is not None and self.coordinator_alive())
    @rule()
    def drain(self) -> None:
        assert self.live_gid is not None
        reply = self.ask_coordinator(cmd="drain", gid=self.live_gid)
        assert reply.get("state") == "closed", reply
        self.groups[self.live_gid] = reply
        self.live_gid = None

    @rule(role=st.sampled_from(("exporter", "worker", "coordinator")), rank=st.integers(0, SPEC.tp - 1))
    def kill(self, role: str, rank: int) -> None:
        w = self.c.coordinator if role == "coordinator" else (self.c.exporters if role == "exporter"
                                                               else self.c.workers)[rank]
        assert w is not None
        if not w.killed:
            w.kill()

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def no_partial_ready(self) -> None:
        for gid, g in self.groups.items():
            if g.get("time_to_ready_s") is not None:  # it was ready at some point
                ranks = g["ranks"]
                assert [r["leases"] for r in ranks] == [1] * SPEC.tp, g  # tp leases, one per worker
                assert all(r["import_s"] is not None for r in ranks), g

    # -- the end -------------------------------------------------------------------------

    def teardown(self) -> None:
        c = self.c
        try:
            if self.live_gid is not None and self.coordinator_alive():
                self.groups[self.live_gid] = self.ask_coordinator(cmd="drain", gid=self.live_gid)
            for gid, g in self.groups.items():
                if "checking" not in [h[0] for h in g.get("history", [])]:
                    continue  # refused by the coordinator itself: no worker heard of it
                for w in c.live(c.workers):
                    s = w.ask(SPEC.timeout_s + SPEC.silence_s, cmd="wait_ended", gid=gid,
                              timeout=SPEC.silence_s + SPEC.timeout_s)
                    assert not s["violations"], s["violations"]
                    assert s["state"] in (*ENDED, None), f"rank {w.rank} share of {gid} left {s}"
            for w in c.live(c.exporters):
                r = w.ask(SPEC.lease_timeout_s + SPEC.timeout_s + 5, cmd="drain")
                assert "error" not in r and r["quiescent_s"] <= SPEC.lease_timeout_s, r
            for w in c.live(c.everyone()):
                send(w.conn, cmd="exit")
            for w in c.live(c.everyone()):
                r = recv(w.conn, SPEC.timeout_s)
                assert not r.get("violations"), r["violations"]
                assert all(v <= 0 for v in r["leaks"].values()), f"{w.role} {w.rank} leaked {r['leaks']}"
            for w in c.everyone():
                w.process.join(5)
            assert [w.process.pid for w in c.everyone() if w.process.is_alive()] == []
        finally:
            c.__exit__(None, None, None)


CoordinatedProcesses.TestCase.settings = settings(
    max_examples=15, stateful_step_count=8, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_coordinated_processes = pytest.mark.slow(CoordinatedProcesses.TestCase)


class PlantedKeepsPart(CoordinatedProcesses):
    """Self-test: the same machine over workers with a planted share that never gives its
    part back. Some run of rules must fail it."""

    spec = attrs.evolve(SPEC, plant="planted.coordinator_bugs:KeepsPart")


def test_the_stateful_test_catches_a_worker_that_keeps_its_part() -> None:
    with pytest.raises(AssertionError, match="still mapping its part"):
        run_state_machine_as_test(PlantedKeepsPart, settings=settings(
            max_examples=30, stateful_step_count=8, deadline=None, database=None, phases=[Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
