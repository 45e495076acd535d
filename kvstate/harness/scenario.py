"""One decode-to-prefill scenario across real processes, judged: the demo's and the kill
matrix's run.

:func:`run_scenario` starts a :class:`~kvstate.harness.cluster.Cluster`, advertises, imports
the group, loads every rank's prefix, verifies the bytes, drains, and checks that nothing is
left: no partial readiness, no stray process, no socket, shm segment or fd leaked, and a
clean next start. Optionally it SIGKILLs one process at a named phase (``(role, phase)``)
and checks how the survivors recover. :func:`judge` is the safety verdict and
:func:`outcome` says it in words.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvstate import channel as chan
from kvstate.channel import owner
from kvstate.core.identity import Deployment
from kvstate.harness.cluster import PHASES, ROLES, Cluster, ClusterSpec, expected_checksum, recv, send
from kvstate.harness.leaks import shm_held, shm_left
from kvstate.share import status

# What each timing measures. Every phase is measured inside the processes doing the work,
# from the moment kvstate's work starts: never process spawn, Python imports or engine
# start (the harness's, not kvstate's). The total is the sum of the phases.
TIMING_ADVERTISE = "advertise: register, fill, sign, serve (slowest exporter)"
TIMING_IMPORT = "import: validate, check, lease, map, ready (coordinator)"
TIMING_LOAD = "load: submit to last op done (slowest worker)"
TIMING_DRAIN = "drain: every part closed (coordinator), quiescent (exporters)"
TIMING_TOTAL = "total: the four phases above (no process spawn, no engine start)"


def run_scenario(spec: ClusterSpec, kill: tuple[str, str] | None = None, *,
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Decode-to-prefill reuse across real processes, optionally SIGKILLing one process
    (``(role, phase)``; the highest rank of that role) at that phase. Returns a report."""
    if kill is not None and (kill[0] not in ROLES or kill[1] not in PHASES):
        raise ValueError(f"kill must be ROLE:PHASE with ROLE in {ROLES} and PHASE in {PHASES}")
    with Cluster(spec, log=log) as c:
        try:
            return _Scenario(c, kill, log).run()
        except (EOFError, ConnectionError, TimeoutError) as exc:  # which process died, and what did it say?
            died = c.death()
            if died is None:
                raise
            raise died from exc


class _Scenario:
    def __init__(self, c: Cluster, kill: tuple[str, str] | None, log: Callable[[str], None]) -> None:
        self.c, self.kill, self.log, self.spec = c, kill, log, c.spec
        self.timings: dict[str, float] = {}
        self.report: dict[str, Any] = {"topology": "per-rank-process", "tp": c.spec.tp,
                                       "kill": ":".join(kill) if kill else None}

    def maybe_kill(self, phase: str) -> None:
        if self.kill and self.kill[1] == phase:
            victim = self.c.victim(self.kill[0])
            victim.kill()
            self.report["killed_pid"] = victim.process.pid
            self.log(f"  SIGKILL {victim.role} rank {victim.rank} (pid {victim.process.pid}) while {phase}")

    def run(self) -> dict[str, Any]:
        c, spec, report = self.c, self.spec, self.report
        wire = c.start_decode()
        self.timings[TIMING_ADVERTISE] = c.advertise_s
        report["descriptors"] = [_describe_descriptor(w, c.key) for w in wire]
        c.start_prefill()
        assert c.coordinator is not None
        self.log(f"decode engine: {spec.tp} exporter processes advertised their banks (inventory epochs "
                 f"{c.epochs}); prefill engine: coordinator pid {c.coordinator.process.pid}, "
                 f"{spec.tp} rank worker processes connected")
        self.maybe_kill("advertised")
        group = self.import_group(wire)
        ready = group.get("state") == "ready"
        gid = group.get("gid")
        if ready and gid:
            self.count_holdings(gid)
            self.maybe_kill("ready")
        loads = self.load(gid) if ready and gid else []
        report["verified"] = [(r["rank"], r.get("checksum") == expected_checksum(spec, r["rank"]))
                              for r in loads if "checksum" in r]
        report["load_errors"] = sorted({r["error"] for r in loads if "error" in r})
        report["load_bytes"] = sum(r.get("bytes", 0) for r in loads)
        if loads:
            self.log(f"prefix load: {len(spec.prefix())} blocks on each of {spec.tp} ranks, each worker its own, "
                     f"{report['load_bytes'] / 2**20:.1f} MiB, checksums "
                     + ("verified" if report["verified"] and all(ok for _, ok in report["verified"]) else "NOT verified"))
        self.finish(gid)
        self.timings[TIMING_TOTAL] = sum(self.timings.values())
        report["timings_s"] = self.timings
        report["ok"] = judge(report, self.kill)
        report["outcome"] = outcome(report)
        return report

    def import_group(self, wire: list[bytes]) -> dict[str, Any]:
        c, spec = self.c, self.spec
        assert c.coordinator is not None
        phase = self.kill[1] if self.kill else None
        notify: tuple[str, int] | None = None
        if phase == "checking" and not c.coordinator.killed:
            c.broadcast(c.workers, cmd="hold", points=["check"])
            notify = ("checking", 0)
        elif phase == "importing" and not c.coordinator.killed:
            c.workers[-1].ask(spec.timeout_s, cmd="hold", points=["open"])
            notify = ("importing", spec.tp - 1)
        group: dict[str, Any] = {"state": None}
        if c.coordinator.killed:
            group["error"] = "no coordinator"
        else:
            send(c.coordinator.conn, **c.import_command(wire, notify))
            if notify is not None:
                reached = recv(c.coordinator.conn, spec.timeout_s)
                group["gid"] = reached.get("gid")  # known even if the coordinator dies now
                if reached.get("reached"):
                    self.maybe_kill(reached["reached"])
                c.broadcast(c.workers, cmd="release")
            if not c.coordinator.killed:
                group = recv(c.coordinator.conn, spec.timeout_s + 4 * spec.phase_timeout_s)
        if group.get("time_to_ready_s") is not None:
            self.timings[TIMING_IMPORT] = float(group["time_to_ready_s"])
        self.report["group"] = group
        self.report["time_to_ready_s"] = group.get("time_to_ready_s")
        ranks = group.get("ranks") or []
        self.report["ranks"] = ranks
        self.report["leases_total"] = sum(r.get("leases") or 0 for r in ranks)
        self.log(f"coordinator: group {group.get('gid')} -> {group.get('state')}"
                 + (f" in {group['time_to_ready_s'] * 1e3:.1f} ms; leases per rank "
                    f"{[r.get('leases') for r in ranks]}, import per rank (ms) "
                    f"{[round((r.get('import_s') or 0) * 1e3, 1) for r in ranks]}"
                    if group.get("time_to_ready_s") is not None else f" ({group.get('failure') or group.get('error')})"))
        return group

    def count_holdings(self, gid: str) -> None:
        """At ready, from outside kvstate's own bookkeeping: memfd mappings in each worker
        process (/proc) and leases on each exporter's bank."""
        c = self.c
        self.report["mappings_per_rank"] = [w.ask(self.spec.timeout_s, cmd="status", gid=gid)["memfd_maps"]
                                            for w in c.live(c.workers)]
        self.report["exporter_leases"] = [r["leases"] for r in c.broadcast(c.exporters, cmd="leases")]

    def load(self, gid: str) -> list[dict[str, Any]]:
        c, spec = self.c, self.spec
        phase = self.kill[1] if self.kill else None
        stall = phase in ("loading", "draining")
        live = c.live(c.workers)
        for w in live:
            send(w.conn, cmd="load", gid=gid, blocks=spec.prefix(), stall=stall)
        if stall:
            for w in live:
                recv(w.conn, spec.timeout_s)  # "loading": the op is queued, pinning the part
            self.maybe_kill("loading")
            if phase == "draining":
                assert c.coordinator is not None
                if not c.coordinator.killed:
                    send(c.coordinator.conn, cmd="drain", gid=gid)
                self.wait_draining(gid)
                self.maybe_kill("draining")
            for w in c.live(c.workers):
                send(w.conn, cmd="release")
        replies = []
        for w in [w for w in live if not w.killed]:
            got = [recv(w.conn, spec.timeout_s) for _ in range(2 if stall else 1)]  # stalled: the release's too
            replies += [{"rank": w.rank, **r} for r in got if not r.get("ok")]
        if any("seconds" in r for r in replies):
            self.timings[TIMING_LOAD] = max(float(r.get("seconds", 0.0)) for r in replies)
        return replies

    def wait_draining(self, gid: str) -> None:
        """Until every live worker's share left ready; then, 50 ms later, record where each
        is: a share whose load still pins its part must still be draining."""
        deadline = time.monotonic() + self.spec.timeout_s
        for w in self.c.live(self.c.workers):
            while time.monotonic() < deadline:
                if w.ask(self.spec.timeout_s, cmd="status", gid=gid).get("state") in ("draining", "quiescent",
                                                                                      "closed", "failed"):
                    break
                time.sleep(0.001)
        time.sleep(0.05)
        self.report["draining_states"] = [w.ask(self.spec.timeout_s, cmd="status", gid=gid).get("state")
                                          for w in self.c.live(self.c.workers)]

    def show_status(self, when: str) -> None:
        """What `kvstate status` shows of this node's demo servers now (logged and reported)."""
        dirs = [self.c.socket_dir, self.c.dir / "coordinator"]
        snapshot = status.node_status(dirs, timeout=self.spec.timeout_s)
        self.report.setdefault("status", {})[when] = snapshot
        self.log(f"kvstate status {' '.join(f'--socket-dir {d}' for d in dirs)}  ({when})")
        self.log("\n".join("  " + line for line in status.render(snapshot).splitlines()[1:]))

    def finish(self, gid: str | None) -> None:
        c, spec, report = self.c, self.spec, self.report
        coord = c.coordinator
        assert coord is not None
        final: dict[str, Any] = {}
        self.show_status("before draining")
        if gid and not coord.killed:
            drained = self.kill is not None and self.kill[1] == "draining"
            final = recv(coord.conn, spec.timeout_s) if drained else coord.ask(spec.timeout_s, cmd="drain", gid=gid)
            if "error" in final:
                final = {**coord.ask(spec.timeout_s, cmd="describe", gid=gid), "error": final["error"]}
        report["coordinator"] = {"pid": coord.process.pid, "killed": coord.killed, "state": final.get("state"),
                                 "history": final.get("history") or report.get("group", {}).get("history")}
        history = [h[0] for h in report["coordinator"]["history"] or []]
        heard = gid is not None and (coord.killed or "checking" in history)  # did any worker get its check?
        shares: list[dict[str, Any]] = []
        for w in c.live(c.workers):
            shares.append(w.ask(spec.timeout_s + spec.silence_s, cmd="wait_ended", gid=gid,
                                timeout=spec.silence_s + spec.timeout_s) if heard else {"rank": w.rank, "state": None})
        report["worker_final"] = [s.get("state") for s in shares]
        report["shares"] = shares
        killed = next((w for w in c.everyone() if w.killed), None)
        unmapped = [s["unmapped_at"] for s in shares if s.get("unmapped_at") is not None]
        if killed is not None and killed.killed_at is not None and unmapped \
                and min(unmapped) >= killed.killed_at:
            report["death_to_unmapped_s"] = max(unmapped) - killed.killed_at
        exp = c.broadcast(c.exporters, timeout=spec.lease_timeout_s + spec.timeout_s + 5, cmd="drain")
        self.timings[TIMING_DRAIN] = float(final.get("drain_s") or 0.0) + max(
            (r.get("quiescent_s", 0.0) for r in exp), default=0.0)
        report["exporter_quiescent_s"] = max((r.get("quiescent_s", 0.0) for r in exp), default=0.0)
        report["exporter_states"] = exp[0].get("states", []) if exp else []
        report["exporter_errors"] = [r["error"] for r in exp if "error" in r]
        self.log(f"drain: coordinator {final.get('state')}, workers {report['worker_final']}; exporters quiescent "
                 f"in {report['exporter_quiescent_s'] * 1e3:.1f} ms and released")
        self.show_status("after draining")
        live = c.live(c.everyone())
        held = frozenset().union(*(shm_held(w.process.pid) for w in live))  # by pid: /dev/shm is shared
        exits = dict(zip((id(w) for w in live), c.broadcast(live, cmd="exit")))
        report["leaks"] = [r.get("leaks", {}) for r in exits.values()]
        report["violations"] = [v for r in exits.values() for v in r.get("violations", [])]
        histories = {w.rank: exits[id(w)].get("histories", {}).get(gid or "", []) for w in c.live(c.workers)}
        for entry in report.get("ranks", []):
            entry["history"] = histories.get(entry["rank"])
        for w in c.everyone():
            w.process.join(5)
        report["stray_processes"] = [w.process.pid for w in c.everyone() if w.process.is_alive()]
        report["shm_left_at_exit"] = shm_left(held)
        self.next_start()

    def next_start(self) -> None:
        """What a killed process left in each socket directory, then what is left once the
        next server started there (its start sweeps: kvstate.channel.owner); and what it
        had in /dev/shm that is still there (nothing sweeps /dev/shm: nothing may be left)."""
        dirs = [d for d in (self.c.socket_dir, self.c.dir / "coordinator") if d.is_dir()]
        self.report["leftovers_before_next_start"] = [n for d in dirs for n in owner.leftovers(d)]
        after = []
        for d in dirs:
            with chan.Server(d / "next-start.sock"):
                after += owner.leftovers(d)
        self.report["leftovers_after_next_start"] = after
        self.report["shm_after_next_start"] = shm_left(
            frozenset().union(*(w.shm for w in self.c.everyone() if w.killed)))


def _describe_descriptor(wire: bytes, key: bytes) -> dict[str, Any]:
    from kvstate.core.descriptor import decode

    d = decode(wire, Deployment("kvstate-demo", key))
    return {"rank": d.rank, "handle_kind": d.handle_kind.value, "fabric": d.fabric.kind.value,
            "lease_address": d.socket_path}


def outcome(report: dict[str, Any]) -> str:
    """What a user should take from the run, in words."""
    loaded = sum(ok for _, ok in report["verified"])
    if not report["ok"]:
        return "FAILED"
    if loaded == report["tp"]:
        return ("OK: reuse verified, nothing partial, nothing leaked" if report["kill"] is None else
                f"OK: all {loaded} ranks loaded and verified before the kill; survivors drained, nothing leaked")
    # A group's KV is usable only when every rank loaded it: a partial load is thrown away.
    return (f"failed cleanly, prefix recomputed: {loaded}/{report['tp']} ranks loaded, so none uses the load; "
            "nothing partial was used, nothing leaked")


def judge(report: dict[str, Any], kill: tuple[str, str] | None) -> bool:
    """The safety verdict: no partial readiness, verified bytes, every part gone, no leaks."""
    clean = (not report["exporter_errors"] and not report["violations"] and not report["stray_processes"]
             and not report["leftovers_after_next_start"] and not report.get("shm_after_next_start")
             and not report.get("shm_left_at_exit")
             and all(v <= 0 for leak in report["leaks"] for v in leak.values()))
    every_load_ok = all(ok for _, ok in report["verified"])
    ended = all(s in ("closed", "failed", "rejected", None) for s in report["worker_final"])
    ready = report.get("group", {}).get("state") == "ready"
    leases = report.get("leases_total", 0) == report["tp"] if ready else True
    if kill is None:
        return clean and ended and every_load_ok and leases and len(report["verified"]) == report["tp"]
    return clean and ended and every_load_ok and leases
