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
from typing import Any

import attrs

from kvstate import channel as chan
from kvstate.core.args import (need, need_callables, need_int, need_items, need_kinds, need_mapping_keys,
                               need_seconds, need_socket_dir, need_text)
from kvstate.core.descriptor import decode_group
from kvstate.core.errors import (
    ArgumentInvalid, ChannelError, ConfigInvalid, DescriptorRejected, GroupFailed, GroupRejected, KvStateError,
    TransitionError,
)
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment, host_boot_id
from kvstate.core.machine import Observer
from kvstate.core.reasons import ArgumentReason, RejectReason, ChannelReason, TransitionReason
from kvstate.core.validate import MAX_TP, Expectation, ValidatedGroup
from kvstate.transport.native_rules import validate_group
from kvstate.share import protocol_msgs as msgs, status
from kvstate.share.importer import BlockRequest
from kvstate.share.coordinated_group import (
    COMPLETIONS, REPORT_EVENTS, CoordinatedGroup, ReportEvent, WorkerLink, complete,
)

log = logging.getLogger(__name__)

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
        """Every field checked where the config is made (ConfigInvalid naming it)."""
        try:
            self._check()
        except ArgumentInvalid as exc:  # a config's refusal says: fix the configuration
            raise ConfigInvalid.of(exc.argument or "CoordinatorConfig", exc.detail) from None

    def _check(self) -> None:
        n = "CoordinatorConfig."
        need(n + "deployment", self.deployment, Deployment)
        need_int(n + "max_tp", self.max_tp, 1, MAX_TP)
        need_int(n + "tp", self.tp, 1, self.max_tp)
        if "/" in need_text(n + "name", self.name, 64) or self.name in (".", ".."):
            raise ArgumentInvalid.of(n + "name", ArgumentReason.RANGE, "names the socket file: no '/', '.' or '..'")
        # Shaped here, not first at start(): a relative or over-long directory cannot hold the socket.
        need_socket_dir(n + "socket_dir", self.socket_dir, room=len(os.fsencode(f"/{self.name}.sock")))
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
        log.debug("t=%.6f %s: report %s from rank %d", time.monotonic(), report.group, report.state, link.rank)
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
                moved |= complete(group, event)
