"""A rank group as the coordinator sees it: the group machine of ``spec/coordinator.toml``,
fed by its workers' reports and deaths. :mod:`kvstate.share.coordinator` serves the
workers and starts groups (its theory of operation says how the protocol runs)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from kvstate import channel as chan
from kvstate.core.args import need_choice, need_items, need_seconds
from kvstate.core.errors import ChannelError, DescriptorRejected, GroupFailed, TransitionError, TimedOut
from kvstate.core.machine import Lifecycle, Observer, StateChange, effect, guard
from kvstate.core.reasons import RejectReason, TimeoutReason, ChannelReason, TransitionReason
from kvstate.core.spec import load_machine
from kvstate.core.validate import ValidatedGroup
from kvstate.share import protocol_msgs as msgs
from kvstate.share.importer import BlockRequest

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvstate.share.coordinator import Coordinator

#: Coordinator events a worker's report fires: ``part_<state>``.
ReportEvent = Literal["part_validated", "part_rejected", "part_imported", "part_failed", "part_draining",
                      "part_quiescent", "part_closed"]
REPORT_EVENTS: Mapping[str, ReportEvent] = {
    "validated": "part_validated", "rejected": "part_rejected", "imported": "part_imported",
    "failed": "part_failed", "draining": "part_draining", "quiescent": "part_quiescent", "closed": "part_closed",
}
#: States of a rank whose part is gone for good.
GONE = ("failed", "rejected", "closed")
#: States with a deadline: the coordinator waits on the workers there.
TIMED = ("checking", "importing", "aborting")
#: Completion events, fired when their guard holds after any report or death.
Completion = Literal["begin_import", "complete", "quiesce", "close", "aborted"]
COMPLETIONS: tuple[Completion, ...] = ("begin_import", "complete", "quiesce", "close", "aborted")


@attrs.define(eq=False)
class WorkerLink:
    """One connected worker: its rank, pid and connection."""

    rank: int
    pid: int
    channel: chan.Channel
    send_lock: threading.Lock = attrs.field(factory=threading.Lock)
    alive: bool = True


@attrs.frozen
class RankRecord:
    """What the coordinator knows of one rank of a group (for reports and the demo)."""

    rank: int
    pid: int | None
    state: str | None            # the last state the worker reported
    import_s: float | None       # the worker's own lease + open + map time
    leases: int | None           # leases the worker held when it reported imported
    dead: bool


class CoordinatedGroup(Lifecycle):
    """One rank group as the coordinator sees it, driven by spec/coordinator.toml."""

    table = load_machine("coordinator")

    def __init__(self, coordinator: Coordinator, gid: str, wire: Sequence[bytes],
                 blocks: BlockRequest | None, observers: Iterable[Observer]) -> None:
        super().__init__(label=f"{coordinator.config.name}/{gid}", observers=observers)
        self.coordinator = coordinator
        self.gid = gid
        self.tp = coordinator.config.tp
        self.wire = tuple(wire)
        self.blocks = blocks
        self.validated: ValidatedGroup | None = None
        self.rejections: list[DescriptorRejected] = []
        self.reports: dict[str, set[int]] = {s: set() for s in msgs.REPORTS}
        self.last: dict[int, str] = {}
        self.info: dict[int, tuple[bytes, int, int, int, int, float]] = {}
        self.pids: dict[int, int] = {}
        self.dead: set[int] = set()
        self.failure: GroupFailed | None = None
        self.deadline = float("inf")
        self.started = time.monotonic()
        self.history: list[tuple[str, float]] = [(self.state, 0.0)]
        self.changed = threading.Condition(self._kv_lock)
        self.observe(self._on_change)

    def _on_change(self, change: StateChange) -> None:
        # Observers run after the commit, outside the lock, in commit order.
        with self.changed:
            self.history.append((change.dest, change.monotonic_ns / 1e9 - self.started))
            if change.dest not in TIMED:
                self.deadline = float("inf")  # the row entering a timed phase set it (_start_phase)
            self.changed.notify_all()

    # -- what the engine reads ----------------------------------------------------------

    def ranks(self) -> list[RankRecord]:
        return [RankRecord(r, self.pids.get(r), self.last.get(r), self.info[r][5] if r in self.info else None,
                           self.info[r][4] if r in self.info else None, r in self.dead) for r in range(self.tp)]

    def wait(self, states: Iterable[str], timeout: float) -> bool:
        """Wait until the group's last delivered change entered one of ``states`` (or a
        terminal state); whether it did."""
        timeout = need_seconds("timeout", timeout)
        wanted = {need_choice("states", name, self.table.state_names)
                  for name in need_items("states", tuple(states) if isinstance(states, (set, frozenset)) else states,
                                         str, max_len=64)}
        ended = self.table.terminal
        deadline = time.monotonic() + timeout
        with self.changed:  # the history, not the state: it is complete once a change was delivered
            while self.history[-1][0] not in wanted and self.history[-1][0] not in ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(min(left, 0.1))
            return self.history[-1][0] in wanted

    def drain(self, timeout: float = 30.0) -> float:
        """Stop the group (or abandon its import): fan out drain and close, wait until every
        live worker reported its part closed. Returns the seconds that took."""
        timeout = need_seconds("timeout", timeout)
        start = time.monotonic()
        with self.locked():
            if self.may("drain"):
                self.fire("drain")
        if not self.wait(self.table.terminal, timeout):
            raise TimedOut(TimeoutReason.DRAIN, f"{self.label}: still {self.state} after {timeout} s "
                           f"(ranks {self.ranks()})")
        return time.monotonic() - start

    # -- guards -------------------------------------------------------------------------

    def _every(self, *states: str, dead_ok: bool = True) -> bool:
        done = set().union(*(self.reports[s] for s in states))
        return all(r in done or (dead_ok and r in self.dead) for r in range(self.tp))

    @guard("group_validated")
    def _group_validated(self, **kw: Any) -> bool:
        return self.validated is not None and all(self._connected(r) for r in range(self.tp))

    @guard("all_parts_validated")
    def _all_validated(self, **kw: Any) -> bool:
        return self._every("validated", dead_ok=False)

    @guard("all_parts_imported")
    def _all_imported(self, **kw: Any) -> bool:
        # A set per rank: a repeat counts once. Stricter than the table's reading: reports
        # read after the phase's deadline, or from a worker that has hung up since, complete
        # nothing. A coordinator stalled past the deadline reads reports that waited in its
        # sockets while their workers, hearing nothing, rolled back and closed.
        return self._every("imported", dead_ok=False) and time.monotonic() < self.deadline and \
            all(self._connected(r, hung_up_too=True) for r in range(self.tp))

    def _connected(self, rank: int, *, hung_up_too: bool = False) -> bool:
        link = self.coordinator.links.get(rank)  # one read: a death may remove it meanwhile
        return link is not None and link.alive and not (hung_up_too and link.channel.hung_up())

    @guard("report_compatible")
    def _compatible(self, *, rank: int, report: msgs.Report, **kw: Any) -> bool:
        assert self.validated is not None
        d = self.validated.parts[self.coordinator.config.source(rank)]
        try:
            fingerprint, tp, generation, size, _, _ = msgs.imported_info(report.info)
        except ChannelError as exc:
            if exc.reason is not ChannelReason.PROTOCOL:
                raise
            return False
        return (fingerprint, tp, generation, size) == (d.geometry.fingerprint(), d.tp, d.generation, d.size)

    @guard("all_parts_quiescent")
    def _all_quiescent(self, **kw: Any) -> bool:
        return self._every("quiescent", *GONE)

    @guard("all_parts_closed")
    def _all_closed(self, **kw: Any) -> bool:
        return self._every(*GONE)

    @guard("all_parts_gone")
    def _all_gone(self, **kw: Any) -> bool:
        return self._every(*GONE)

    # -- effects ------------------------------------------------------------------------

    def _send(self, cmd: msgs.CommandName, why: str = "") -> None:
        for r in range(self.tp):
            if r in self.dead or (r in self.last and self.last[r] in GONE):
                continue  # nothing to tell: its part is gone
            extra: dict[str, Any] = {}
            if cmd == "check":
                extra["descriptor"] = self.wire[r]
                if self.blocks is not None:
                    extra["blocks"] = {"group": self.blocks.group, "epochs": list(self.blocks.epochs),
                                       "hashes": list(self.blocks.hashes)}
            self.coordinator._send_to(r, msgs.Command(cmd, self.gid, why=why, **extra))
            log.debug("t=%.6f %s: %s sent to rank %d", time.monotonic(), self.gid, cmd, r)

    def _start_phase(self) -> None:
        """The row's command starts a timed phase (checking, importing, aborting): its
        clock runs from now, set before the commit so that no report is read against the
        previous phase's deadline, and reports do not extend it."""
        self.deadline = time.monotonic() + self.coordinator.config.phase_timeout_s

    @effect("send_check")
    def _send_check(self, **kw: Any) -> None:
        self._start_phase()
        self._send("check")

    @effect("send_open")
    def _send_open(self, **kw: Any) -> None:
        self._start_phase()
        self._send("open")

    @effect("send_ready")
    def _send_ready(self, **kw: Any) -> None:
        self._send("ready")

    @effect("send_drain")
    def _send_drain(self, **kw: Any) -> None:
        self._send("drain")

    @effect("send_close")
    def _send_close(self, **kw: Any) -> None:
        self._send("close")

    @effect("send_abort")
    def _send_abort(self, **kw: Any) -> None:
        self._start_phase()
        self._send("abort", why=str(self.failure or "aborted"))

    @effect("note_report")
    def _note(self, *, rank: int, report: msgs.Report, **kw: Any) -> None:
        self.reports[report.state].add(rank)
        self.last[rank] = report.state
        if report.state == "imported":
            try:
                self.info[rank] = msgs.imported_info(report.info)
            except ChannelError as exc:
                if exc.reason is not ChannelReason.PROTOCOL:
                    raise  # report_compatible refused a malformed one already
        elif report.state == "rejected":
            for reason in report.reasons:
                try:
                    why = RejectReason(reason)
                except ValueError:
                    why = RejectReason.MALFORMED
                self.rejections.append(DescriptorRejected(why, f"worker: {report.detail}", rank))
        if self.failure is not None:
            return
        if report.state in ("failed", "rejected", "draining"):
            self.failure = GroupFailed(f"part_{report.state}", rank, report.detail)
        elif report.state == "imported" and self.state == "importing" and not self._compatible(rank=rank,
                                                                                              report=report):
            self.failure = GroupFailed("part_imported", rank, "the imported part disagrees with the group "
                                       "(geometry fingerprint, tp, generation or size)")

    @effect("note_death")
    def _note_death(self, *, rank: int, **kw: Any) -> None:
        self.dead.add(rank)
        if self.failure is None:
            self.failure = GroupFailed("worker_died", rank, "its connection closed or its process exited")


def complete(group: CoordinatedGroup, event: Completion) -> bool:
    with group.locked():
        if not group.may(event):
            return False
        try:
            group.fire(event)
        except TransitionError as exc:
            if exc.reason is not TransitionReason.GUARD:
                raise
            return False
        return True
