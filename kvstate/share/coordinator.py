"""The group coordinator: rank groups across processes, driven by ``spec/coordinator.toml``.

Theory of operation
-------------------

In every real engine each tensor-parallel rank is its own process. The coordinator runs
the group machine once, in one process, and each rank's worker
(:mod:`kvstate.share.rank_worker`) runs the part machine for its own rank only: it leases,
checks, opens and maps only its own part, so a group of tp ranks takes tp leases and tp
mappings in all, never tp squared.

Where it lives. The coordinator is a plain class with no engine in it. Its home is the one
process that already decides, for every rank at once, what each step loads: in vLLM the
scheduler-side connector in the EngineCore process (it sees block allocation and builds the
per-step metadata that reaches every worker); in an engine without such a process, rank 0
or the router. It must not be a worker itself if a worker's death is to be survived: the
coordinator must outlive the ranks it judges. (Rank 0 as coordinator works, but its death
is then the coordinator's too; the protocol handles that as well: workers clean up alone.)

The protocol (see the tables for every step):

1. :meth:`Coordinator.import_group` decodes every rank's descriptor and validates the whole
   group (every rule, and its tp equal to the exporting size the coordinator imports,
   else :class:`~kvstate.core.reasons.RejectReason` ``tp_mismatch``) before any worker
   hears of it. With heterogeneous TP (``source_tp``, ``sources``) the parts are head
   slices, (worker, exporting rank) pairs of :func:`kvstate.core.heads.split`; everything
   below says "rank" for a part. Then each worker gets its own descriptor (``check``) and validates it fully
   with its own expectations (device, transport, socket path); no worker opens anything
   until every rank reported valid (INV-COORD-VALIDATE-BEFORE-OPEN).
2. ``open``: each worker leases and maps its part and reports ``imported`` with what it
   mapped; the coordinator checks each report against the group.
3. ``ready`` goes out only when every rank 0..tp-1, each counted once, reported imported
   (INV-COORD-READY-COMPLETE); workers refuse loads until then (INV-COORD-LOAD-AFTER-READY).
4. ``drain`` then ``close`` fan out, and the coordinator waits for every live worker's
   report (quiescent, then closed). A dead worker's mapping died with its process.

Faults: a worker's death (EOF or pidfd on its connection, seen by the connection's reader),
a phase that outlasts its deadline (the clock thread), a rejected or failed part or an
exporter death reported by a worker fail the group before ready (``abort``: every worker
rolls back, and :meth:`import_group` returns only after each live one reported it) and
drain it after ready. The coordinator's own death is seen by every worker, which then
cleans up alone (the rank table's ``coordinator_died`` rows). A command that cannot be
delivered within the request timeout closes that worker's connection: a worker that cannot
be told is treated as dead.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from kvstate import channel as chan
from kvstate.core.args import (need, need_callables, need_choice, need_int, need_items, need_kinds, need_mapping_keys,
                               need_path, need_seconds, need_text)
from kvstate.core.descriptor import Descriptor, decode_group
from kvstate.core.errors import (
    ArgumentInvalid, ChannelError, DescriptorRejected, GroupFailed, GroupRejected, KvStateError,
    TransitionError, TimedOut,
)
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment, host_boot_id
from kvstate.core.machine import Lifecycle, Observer, StateChange, effect, guard
from kvstate.core.reasons import ArgumentReason, RejectReason, TimeoutReason, ChannelReason, TransitionReason
from kvstate.core.spec import load_machine
from kvstate.core.validate import MAX_TP, Expectation, ValidatedGroup, validate_group
from kvstate.share import protocol_msgs as msgs, status
from kvstate.share.importer import BlockRequest

log = logging.getLogger(__name__)

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

msgs.check_against_tables()


@attrs.frozen
class CoordinatorConfig:
    deployment: Deployment
    tp: int
    socket_dir: Path
    name: str = "coordinator"
    phase_timeout_s: float = 10.0     # checking, importing and aborting each
    heartbeat_s: float = 0.25         # ticks to every worker
    silence_s: float = 5.0            # a worker hearing nothing this long treats us as dead (<= lease time)
    request_timeout_s: float = 2.0    # a command not delivered in this time closes the worker's connection
    max_tp: int = 64
    check_socket: bool = True         # validate exporters' socket paths here too (same node)
    handle_kinds: frozenset[HandleKind] = frozenset(HandleKind)
    #: Heterogeneous TP: the exporting group's size (0: ``tp``), and for each of the ``tp``
    #: parts the exporting rank whose bank it imports (empty: part r imports rank r). A
    #: part is then one (worker, exporting rank) pair of :func:`kvstate.core.heads.split`.
    source_tp: int = 0
    sources: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        """Every field checked where the config is made (ArgumentInvalid naming it)."""
        n = "CoordinatorConfig."
        need(n + "deployment", self.deployment, Deployment)
        need_int(n + "max_tp", self.max_tp, 1, MAX_TP)
        need_int(n + "tp", self.tp, 1, self.max_tp)
        need_path(n + "socket_dir", self.socket_dir)
        if "/" in need_text(n + "name", self.name, 64) or self.name in (".", ".."):
            raise ArgumentInvalid.of(n + "name", ArgumentReason.RANGE, "names the socket file: no '/', '.' or '..'")
        for name in ("phase_timeout_s", "heartbeat_s", "silence_s", "request_timeout_s"):
            need_seconds(n + name, getattr(self, name), allow_zero=False)
        need_int(n + "source_tp", self.source_tp, 0, self.max_tp)
        for i, r in enumerate(need_items(n + "sources", self.sources, int, max_len=self.max_tp)):
            need_int(f"{n}sources[{i}]", r, 0, self.exporting_tp - 1)
        if self.sources and (len(self.sources) != self.tp or set(self.sources) != set(range(self.exporting_tp))):
            raise ArgumentInvalid.of(n + "sources", ArgumentReason.RANGE, f"{list(self.sources)[:8]}: one exporting "
                                     f"rank per part ({self.tp}), every rank of 0..{self.exporting_tp - 1} named")
        if not self.sources and self.exporting_tp != self.tp:
            raise ArgumentInvalid.of(n + "sources", ArgumentReason.RANGE, "required when source_tp differs from tp")
        need(n + "check_socket", self.check_socket, bool)
        need_kinds(n + "handle_kinds", self.handle_kinds, HandleKind)
        if self.silence_s <= 2 * self.heartbeat_s:
            raise ArgumentInvalid.of(n + "silence_s", ArgumentReason.RANGE, "must exceed two heartbeats")

    @property
    def exporting_tp(self) -> int:
        """The TP size of the exporting groups this coordinator imports."""
        return self.source_tp or self.tp

    def source(self, part: int) -> int:
        """The exporting rank whose bank part ``part`` imports."""
        return self.sources[part] if self.sources else part


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


class Coordinator:
    """A prefill engine's group coordinator: accepts its tp workers, imports groups through
    them, fans out drains; see the module docstring."""

    def __init__(self, config: CoordinatorConfig, *, observers: Iterable[Observer] = ()) -> None:
        self.config = need("config", config, CoordinatorConfig)
        self.observers = need_callables("observers", observers)
        self.socket_path = Path(config.socket_dir) / f"{config.name}.sock"
        self.links: dict[int, WorkerLink] = {}
        self.groups: dict[str, CoordinatedGroup] = {}
        self.boot_id = host_boot_id()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._joined = threading.Condition(self._lock)
        self._server: chan.Server | None = None
        self._clock: threading.Thread | None = None
        self._stopping = threading.Event()
        self._handlers = 0

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        """Listen for workers and start the clock (heartbeats and phase deadlines)."""
        chan.make_socket_dir(self.config.socket_dir)
        self._server = chan.Server(self.socket_path, max_connections=max(8, 2 * self.config.tp))
        self._server.serve_in_thread(self._serve, name="kvstate-coordinator")
        self._clock = threading.Thread(target=self._tick_loop, name="kvstate-coordinator-clock", daemon=True)
        self._clock.start()

    def close(self) -> None:
        """Stop serving and close every worker's connection (idempotent). Workers see it as
        the coordinator's death and clean up their shares alone."""
        self._stopping.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._lock:
            links = list(self.links.values())
        for link in links:
            link.channel.close()
        if self._clock is not None:
            self._clock.join(2.0)
            self._clock = None
        with self._joined:  # connection readers notice within one recv poll
            self._joined.wait_for(lambda: self._handlers == 0, timeout=2.0)

    def wait_for_workers(self, timeout: float) -> None:
        """Wait until a worker is connected for every rank."""
        timeout = need_seconds("timeout", timeout)
        deadline = time.monotonic() + timeout
        with self._joined:
            while len([r for r, link in self.links.items() if link.alive]) < self.config.tp:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelError(ChannelReason.TIMEOUT,
                                       f"{len(self.links)} of {self.config.tp} workers connected after {timeout} s")
                self._joined.wait(min(left, 0.1))

    # -- groups -------------------------------------------------------------------------

    def expectation(self, **overrides: Any) -> Expectation:
        overrides = need_mapping_keys("overrides", overrides, [a.name for a in attrs.fields(Expectation)])
        e = Expectation(deployment=self.config.deployment, now_ns=time.time_ns(),
                        handle_kinds=self.config.handle_kinds, host_boot_id=self.boot_id, uid=os.getuid(),
                        max_tp=self.config.max_tp, check_socket=self.config.check_socket)
        return attrs.evolve(e, **overrides)

    def start_group(self, wire: Sequence[bytes], *, blocks: BlockRequest | None = None,
                    **expect: Any) -> CoordinatedGroup:
        """Validate the whole group here, then send each worker its descriptor to check.
        Returns at once (the group is ``checking``); GroupRejected if this validation refuses
        it (the group is ``rejected`` and no worker heard of it)."""
        need_items("wire", wire, object, max_len=self.config.max_tp)  # each item: decode checks it
        if blocks is not None:
            need("blocks", blocks, BlockRequest)
        expect = need_mapping_keys("expect", expect, [a.name for a in attrs.fields(Expectation)])
        gid = f"g{next(self._ids)}-{secrets.token_hex(3)}"
        group: CoordinatedGroup = CoordinatedGroup(self, gid, wire, blocks, self.observers)
        with self._lock:
            self.groups = {k: g for k, g in self.groups.items() if not g.is_terminal}
            self.groups[gid] = group
        try:
            group.validated, group.wire = self._validate(wire, blocks, expect)
        except GroupRejected as exc:
            group.rejections = list(exc.problems)
            group.fire("reject")
            raise
        with group.locked():
            try:
                group.fire("begin_check")
            except TransitionError as exc:
                if exc.reason is not TransitionReason.GUARD:
                    raise
                group.fire("worker_died", rank=self._missing_rank())
                raise GroupFailed("worker_died", self._missing_rank(), "no worker is connected for that rank") \
                    from None
        return group

    def import_group(self, wire: Sequence[bytes], *, blocks: BlockRequest | None = None,
                     timeout: float | None = None, **expect: Any) -> CoordinatedGroup:
        """:meth:`start_group`, then wait until the group is ready. Raises GroupRejected
        (a worker refused its rank's descriptor; nothing was opened) or GroupFailed; either
        way no live worker maps a part of it when this returns. A group that ends while
        checking opened nothing, so it does not wait: the abort it sent makes the workers
        return the leases phase 1 took (or their connections' close does)."""
        group = self.start_group(wire, blocks=blocks, **expect)
        limit = timeout if timeout is not None else 3 * self.config.phase_timeout_s + 1.0
        group.wait(("ready",), limit)
        if group.state == "ready":
            return group
        group.wait(group.table.terminal, limit)
        if group.state == "rejected":
            raise GroupRejected(group.rejections or [DescriptorRejected(RejectReason.MALFORMED, "rejected")])
        if group.failure is not None:
            raise group.failure
        raise GroupFailed("timeout", None, f"{group.label} is {group.state} after {limit} s")

    def _validate(self, wire: Sequence[bytes], blocks: BlockRequest | None,
                  expect: Mapping[str, Any]) -> tuple[ValidatedGroup, tuple[bytes, ...]]:
        """The whole exporting group, before any worker hears of it (every rule, every
        rank); and for each part, in part order, the descriptor of the rank it imports
        (``wire`` may come in any order, as :meth:`Importer.import_group` takes it)."""
        tp = self.config.exporting_tp
        descriptors, problems = decode_group(wire, self.config.deployment)
        for d in descriptors:
            if d.tp != tp:
                problems.append(DescriptorRejected(
                    RejectReason.TP_MISMATCH, f"the exporting group has tp={d.tp}, this coordinator imports "
                    f"tp={tp} groups (heterogeneous TP: CoordinatorConfig.source_tp and sources)", d.rank))
        if len(wire) != tp:
            problems.append(DescriptorRejected(RejectReason.TP_MISMATCH,
                                               f"{len(wire)} descriptor(s) for an exporting group of tp={tp}"))
        if blocks is not None and len(blocks.epochs) != tp:
            problems.append(DescriptorRejected(RejectReason.MALFORMED,
                                               f"the block request names {len(blocks.epochs)} epoch(s) for tp={tp}"))
        if problems:
            raise GroupRejected(problems)
        validated = validate_group(descriptors, self.expectation(**expect))  # one part per rank 0..tp-1
        by_rank = {descriptors[i].rank: wire[i] for i in range(len(wire))}
        return validated, tuple(by_rank[self.config.source(p)] for p in range(self.config.tp))

    def _missing_rank(self) -> int | None:
        return next((r for r in range(self.config.tp) if r not in self.links or not self.links[r].alive), None)

    # -- sending ------------------------------------------------------------------------

    def _send_to(self, rank: int, message: msgs.Message) -> None:
        """Send to one worker; a worker that cannot be told in time is closed (dead)."""
        link = self.links.get(rank)
        if link is None or not link.alive:
            return
        try:
            with link.send_lock:
                link.channel.send(msgs.encode(message), timeout=self.config.request_timeout_s)
        except ChannelError as exc:
            log.warning("%s: worker %d cannot be told (%s): closing its connection", self.config.name, rank, exc)
            link.channel.close()  # its reader sees the close and reports the death

    def _tick_loop(self) -> None:
        while not self._stopping.wait(self.config.heartbeat_s):
            for rank in list(self.links):
                self._send_to(rank, msgs.Tick())
            now = time.monotonic()
            group: CoordinatedGroup
            for group in list(self.groups.values()):
                if group.deadline <= now:
                    with group.locked():
                        if group.may("timeout") and group.deadline <= now:
                            if group.failure is None:
                                group.failure = GroupFailed("timeout", None, f"still {group.state} after "
                                                            f"{self.config.phase_timeout_s} s")
                            group.fire("timeout")
                    self._settle(group)

    # -- receiving ----------------------------------------------------------------------

    def _serve(self, ch: chan.Channel) -> None:
        with self._joined:
            self._handlers += 1
        try:
            self._serve_link(ch)
        finally:
            with self._joined:
                self._handlers -= 1
                self._joined.notify_all()

    def _serve_link(self, ch: chan.Channel) -> None:
        link: WorkerLink | None = None
        try:
            link = self._hello(ch)
            if link is None:
                return
            while not self._stopping.is_set():
                try:
                    msg = ch.recv(timeout=0.25)
                except ChannelError as exc:
                    if exc.reason is not ChannelReason.TIMEOUT:
                        raise
                    continue
                with msg:
                    report = msgs.decode(msg.payload)
                if not isinstance(report, msgs.Report) or report.rank != link.rank:
                    raise ChannelError(ChannelReason.PROTOCOL,
                                       f"worker {link.rank} sent {type(report).__name__} for rank "
                                       f"{getattr(report, 'rank', None)}")
                self._on_report(link, report)
        except KvStateError as exc:
            gone = isinstance(exc, ChannelError) and (exc.closed or exc.reason is ChannelReason.TIMEOUT)
            if not gone:  # EOF or pidfd is a worker gone, not worth a warning
                log.warning("%s: closing a worker connection: %s", self.config.name, exc)
        finally:
            ch.close()
            if link is not None:
                self._gone(link)

    def _hello(self, ch: chan.Channel) -> WorkerLink | None:
        with ch.recv(timeout=self.config.request_timeout_s) as msg:
            if status.is_request(msg.payload):  # an operator's `kvstate status`, not a worker
                ch.send(chan.encode(status.coordinator_status(self)), timeout=self.config.request_timeout_s)
                return None
            hello = msgs.decode(msg.payload)
        if not isinstance(hello, msgs.Hello):
            raise ChannelError(ChannelReason.PROTOCOL, f"expected hello, got {type(hello).__name__}")
        refusal = self._refusal(hello, ch)
        if refusal is not None:
            ch.send(msgs.encode(refusal), timeout=self.config.request_timeout_s)
            return None
        link = WorkerLink(hello.rank, hello.pid, ch)
        with self._joined:
            self.links[hello.rank] = link
            self._joined.notify_all()
        self._send_to(hello.rank, msgs.Welcome(self.config.tp, self.config.heartbeat_s, self.config.silence_s))
        return link

    def _refusal(self, hello: msgs.Hello, ch: chan.Channel) -> msgs.Refused | None:
        if hello.version != msgs.VERSION:
            return msgs.Refused("version", f"protocol version {hello.version}, this coordinator speaks {msgs.VERSION}")
        if hello.tp != self.config.tp:
            return msgs.Refused("tp_mismatch", f"worker tp {hello.tp}, coordinator tp {self.config.tp}")
        if not 0 <= hello.rank < self.config.tp:
            return msgs.Refused("rank_range", f"rank {hello.rank} outside 0..{self.config.tp - 1}")
        if hello.pid != ch.peer.pid:
            return msgs.Refused("pid", f"hello says pid {hello.pid}, the socket says {ch.peer.pid}")
        with self._lock:
            held = self.links.get(hello.rank)
            if held is not None and held.alive:
                return msgs.Refused("duplicate_rank", f"rank {hello.rank} is held by pid {held.pid}")
        return None

    def _on_report(self, link: WorkerLink, report: msgs.Report) -> None:
        group = self.groups.get(report.group)
        if group is None:
            return  # a report about a group this coordinator no longer keeps
        event: ReportEvent = REPORT_EVENTS[report.state]
        g: CoordinatedGroup = group
        with g.locked():
            g.pids.setdefault(link.rank, link.pid)
            if g.is_terminal:
                return  # a late report about a group that ended: dropped, as the model drops it
            g.fire(event, rank=link.rank, report=report)  # TransitionError (ILLEGAL): a protocol violation
        self._settle(g)

    def _gone(self, link: WorkerLink) -> None:
        with self._joined:
            link.alive = False
            if self.links.get(link.rank) is link:
                del self.links[link.rank]
            self._joined.notify_all()
        group: CoordinatedGroup
        for group in list(self.groups.values()):
            with group.locked():
                if group.may("worker_died"):
                    group.fire("worker_died", rank=link.rank)
            self._settle(group)

    def _settle(self, group: CoordinatedGroup) -> None:
        """Fire every completion event whose guard now holds (begin_import, complete,
        quiesce, close, aborted), in table order, until none does."""
        moved = True
        while moved:
            moved = False
            for event in COMPLETIONS:
                moved |= _complete(group, event)


def _complete(group: CoordinatedGroup, event: Completion) -> bool:
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
