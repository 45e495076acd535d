"""A prefill rank worker: its own rank's share of each coordinated group, driven by
``spec/rank.toml``.

Theory of operation
-------------------

One :class:`RankWorker` per TP rank process (in vLLM: the worker-side connector of that
rank). It connects to its coordinator (:mod:`kvstate.share.coordinator`), says hello with
its rank, and from then on keeps one :class:`RankShare` per group the coordinator names.
A share holds one :class:`~kvstate.share.importer.Part`, of this worker's rank only: the
worker leases, checks, opens and maps nothing of any other rank.

Commands arrive on one reader thread: ``check`` (decode and validate this rank's
descriptor completely, with this worker's own expectations: its transport's handle kinds,
its devices, the socket path; then, on a separate thread so the reader stays responsive,
lease this rank's bank and check the exporter's report: phase 1, nothing opened), ``open``
(open and map the leased part, on a separate thread; sent only once every rank holds a
checked lease), ``ready`` (loads may run), ``drain``, ``close`` and ``abort``.
Each step the coordinator needs is reported back (the table's ``report`` effect marks the
row; the report, naming the state entered, goes out once the state is committed).

What the worker sees for itself: its exporter's death (the part's channel, through the
importer's watcher) or withdrawal (the housekeeper renews each lease while it is held; a
refused renewal or a lapsed lease counts as the exporter's death), and its coordinator's death: EOF or pidfd on the coordinator's
connection, or silence past ``silence_s`` (the coordinator ticks every heartbeat, so a
hung coordinator is told from a busy one). A worker that survives its coordinator cleans
up alone, within the silence bound (at most the lease time): before ready it rolls back
at once, after ready it drains (loads in flight finish) and then closes.

A command for a share that already ended is dropped; a command the table does not declare
in the share's state is a protocol violation: the worker closes the coordinator's
connection and cleans up as if the coordinator had died.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Generic, Literal

import attrs

from kvstate import channel as chan
from kvstate.core.args import need, need_bytes, need_callables, need_choice, need_int, need_items, need_kinds, \
    need_seconds, need_socket_path, need_text
from kvstate.core.descriptor import Descriptor, decode_cached
from kvstate.core.errors import (
    ChannelError, ConfigInvalid, DescriptorRejected, KvStateError, TransitionError, ArgumentInvalid, Busy,
)
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment, host_boot_id
from kvstate.core.machine import Observer
from kvstate.core.reasons import (
    RejectReason, ArgumentReason, ChannelReason, TransitionReason,
)
from kvstate.core.validate import MAX_TP, Expectation, descriptor_problems
from kvstate.share import protocol_msgs as msgs
from kvstate.reuse.policy import ReuseSettings
from kvstate.reuse.inventory import refused_by_inventory
from kvstate.reuse.profile import Admitted
from kvstate.share.importer import ImportConfig, Importer
from kvstate.share.part import BlockRequest, Part
from kvstate.share.rank_share import RankShare
from kvstate.share.remote_part import RemotePart
from kvstate.transport.nixl.transport import NixlTransport
from kvstate.transport.protocol import A, E, H, M, MappedTransport, R

log = logging.getLogger(__name__)

_REPORT_STATES: dict[str, msgs.ReportState] = {s: s for s in msgs.REPORTS}

#: Share events a coordinator command fires (``check`` creates the share first).
CommandEvent = Literal["check", "open", "ready", "drain", "close", "abort"]


@attrs.frozen
class WorkerConfig:
    deployment: Deployment
    rank: int
    tp: int
    coordinator_path: Path
    request_timeout_s: float = 5.0    # hello, lease requests
    #: Leases are renewed every min(half the lease, this) seconds while the part holds one
    #: (phase 1 on), as the in-process importer does (ImportConfig.renew_interval_s).
    renew_interval_s: float = 1.0
    max_tp: int = 64
    geometry_fingerprint: bytes | None = None
    device_uuids: frozenset[bytes] | None = None
    check_socket: bool = True
    drain_poll_s: float = 0.002       # how often a draining share looks at its pins
    keep_ended: int = 32              # ended shares kept for inspection
    #: The reuse switches and profile admission its importer enforces (off by default).
    reuse: ReuseSettings = ReuseSettings()
    admission: Admitted | None = None
    #: Heterogeneous TP (CoordinatorConfig.sources): ``rank`` and ``tp`` name this worker's
    #: part among the coordinator's; the exporting rank it imports and that group's size
    #: (None: ``rank`` and ``tp``).
    source_rank: int | None = None
    source_tp: int | None = None

    def __attrs_post_init__(self) -> None:
        """Every field checked where the config is made (ConfigInvalid naming it)."""
        try:
            self._check()
        except ArgumentInvalid as exc:  # a config's refusal says: fix the configuration
            raise ConfigInvalid.of(exc.argument or "WorkerConfig", exc.detail) from None

    def _check(self) -> None:
        n = "WorkerConfig."
        need(n + "deployment", self.deployment, Deployment)
        need_int(n + "max_tp", self.max_tp, 1, MAX_TP)
        need_int(n + "tp", self.tp, 1, self.max_tp)
        need_int(n + "rank", self.rank, 0, self.tp - 1)
        # Shaped here, not first at start(): a relative or over-long path can never connect.
        need_socket_path(n + "coordinator_path", self.coordinator_path)
        for name in ("request_timeout_s", "renew_interval_s", "drain_poll_s"):
            need_seconds(n + name, getattr(self, name), allow_zero=False)
        if self.geometry_fingerprint is not None:
            need_bytes(n + "geometry_fingerprint", self.geometry_fingerprint, 64)
        if self.device_uuids is not None:
            need_kinds(n + "device_uuids", self.device_uuids, bytes)
        need(n + "check_socket", self.check_socket, bool)
        need_int(n + "keep_ended", self.keep_ended, 1, 1 << 16)
        if self.source_tp is not None:
            need_int(n + "source_tp", self.source_tp, 1, self.max_tp)
        if self.source_rank is not None:
            need_int(n + "source_rank", self.source_rank, 0, self.exporting[1] - 1)
        need(n + "reuse", self.reuse, ReuseSettings)
        if self.admission is not None:
            need(n + "admission", self.admission, Admitted)

    @property
    def exporting(self) -> tuple[int, int]:
        """(rank, tp) of the exporting rank this worker's part imports."""
        return (self.rank if self.source_rank is None else self.source_rank,
                self.tp if self.source_tp is None else self.source_tp)



def _blocks(raw: Any) -> BlockRequest | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"group", "epochs", "hashes"} or not isinstance(raw["group"], str) \
            or not isinstance(raw["hashes"], list) or not all(type(h) is int for h in raw["hashes"]):
        raise ArgumentInvalid(ArgumentReason.INVENTORY, f"malformed block request {raw!r:.100}")
    return BlockRequest(raw["group"], raw["epochs"], tuple(raw["hashes"]))


class RankWorker(Generic[H, A, R, M, E]):
    """One TP rank's worker side; see the module docstring."""

    share_class: type[RankShare[H, A, R, M, E]] = RankShare

    def __init__(self, config: WorkerConfig, transport: MappedTransport[H, A, R, M, E], *,
                 remote: NixlTransport | None = None, observers: Iterable[Observer] = ()) -> None:
        self.config = need("config", config, WorkerConfig)
        self.transport = transport  # the importer below checks it
        #: Reads parts on other nodes (NIXL descriptors); None: only parts this node can map.
        self.remote = None if remote is None else need("remote", remote, NixlTransport)
        self.observers = need_callables("observers", observers)
        self.importer: Importer[H, A, R, M, E] = self._new_importer()
        #: A failed start() closed the importer (a worker dropped then leaks nothing); a retry makes another.
        self._importer_closed = False
        self.boot_id = host_boot_id()
        self.shares: dict[str, RankShare[H, A, R, M, E]] = {}
        self.ended: collections.deque[RankShare[H, A, R, M, E]] = collections.deque(maxlen=config.keep_ended)
        self.coordinator_gone = False
        self.silence_s = 5.0
        self._channel: chan.Channel | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._last_heard = time.monotonic()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()
        #: close() gave up waiting for a share still ending: the housekeeper stops the worker
        #: once the last one ended (stopping sooner would leave its part mapped and leased).
        self._closing = False
        self._housekeeper: threading.Thread | None = None
        self._threads: list[threading.Thread] = []
        #: start() and close() exclude each other: a close never misses a connection being made.
        self._start_lock = threading.Lock()
        self._closed = False

    def _new_importer(self) -> Importer[H, A, R, M, E]:
        c = self.config
        return Importer(ImportConfig(
            c.deployment, request_timeout_s=c.request_timeout_s, max_tp=c.max_tp,
            geometry_fingerprint=c.geometry_fingerprint, device_uuids=c.device_uuids,
            reuse=c.reuse, admission=c.admission), self.transport)

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        """Connect to the coordinator and say hello; ChannelError (COORDINATOR_REFUSED) if it
        refuses, another ChannelError if it cannot be reached or answers wrongly. A failed
        start leaves nothing running and may be retried on the same worker: rank processes
        often come up before their coordinator listens.

        A worker joins one coordinator, once. start() while connected, after close(), or
        after its coordinator went away (closed, died, fell silent or broke the protocol:
        ``coordinator_gone``) is ArgumentInvalid (STATE): the shares ended with that
        coordinator, so a new RankWorker joins the next one (close this one)."""
        with self._start_lock:
            if self._closed:
                raise ArgumentInvalid.of("worker", ArgumentReason.STATE,
                                         "this worker is closed: make a new RankWorker to join a coordinator")
            if self._channel is not None:
                raise ArgumentInvalid.of("worker", ArgumentReason.STATE, (
                    "its coordinator went away: a worker joins one coordinator, once; make a new RankWorker "
                    "(and close this one)") if self.coordinator_gone else "started already")
            if self._importer_closed:
                self.importer = self._new_importer()
                self._importer_closed = False
            timeout = self.config.request_timeout_s
            ch: chan.Channel | None = None
            try:
                ch = chan.connect(self.config.coordinator_path, timeout=timeout)
                ch.send(msgs.encode(msgs.Hello(self.config.rank, self.config.tp, os.getpid())), timeout=timeout)
                with ch.recv(timeout=timeout) as msg:
                    answer = msgs.decode(msg.payload)
                if isinstance(answer, msgs.Refused):
                    raise ChannelError.coordinator_refused(answer.code, answer.detail)
                if not isinstance(answer, msgs.Welcome) or answer.tp != self.config.tp:
                    raise ChannelError(ChannelReason.PROTOCOL,
                                       f"expected a welcome for tp {self.config.tp}, got {answer!r:.100}")
            except BaseException:  # nothing left running: a worker dropped now leaks no thread
                if ch is not None:
                    ch.close()
                self.importer.close()
                self._importer_closed = True
                raise
            self._channel, self.silence_s = ch, answer.silence_s
            self._last_heard = time.monotonic()
            for target, name in ((self._read_loop, "reader"), (self._housekeep, "housekeeper")):
                t = threading.Thread(target=target, name=f"kvstate-rank{self.config.rank}-{name}", daemon=True)
                t.start()
                self._threads.append(t)
            self._housekeeper = t

    def close(self, timeout: float = 10.0) -> None:
        """Leave the coordinator: every share cleans up as if it had died (loads in flight
        finish first), then stop. Idempotent. A share still ending after ``timeout`` (a load
        still copying from its part) keeps its part: the worker then stops by itself once
        the last share ended, and a later close waits for that again."""
        timeout = need_seconds("timeout", timeout)
        with self._start_lock:  # a start() under way finishes first, so its connection is closed here
            self._closed = True
        if self._stopping.is_set():
            with self._stop_lock:  # the housekeeper may be stopping it: return once it is done
                return
        ch = self._channel
        if ch is not None:
            ch.close()
        else:  # never connected (a retry while the scheduler starts): nothing to announce
            self.coordinator_gone = True
        self._orphaned("the worker is closing")
        deadline = time.monotonic() + timeout
        while self._ending() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(self.config.drain_poll_s)
        if self._ending() and self._housekeeper is not None and self._housekeeper.is_alive():
            self._closing = True  # the housekeeper stops the worker after the last share
            self._wake.set()
            return
        self._stop()

    def _ending(self) -> bool:
        """A share has not ended yet: it may still hold its part."""
        return any(not s.is_terminal for s in list(self.shares.values()))

    def _stop(self) -> None:
        """Stop the threads and close the importer, once (from close, or from the
        housekeeper when close left it the last shares). Held under a lock throughout, so
        a close that finds the housekeeper stopping returns only once it is done."""
        with self._stop_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self._wake.set()
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join(2.0)
            self.importer.close()

    def kick(self) -> None:
        """Wake the housekeeper: a share may be able to quiesce now."""
        self._wake.set()

    # -- what the engine reads ----------------------------------------------------------

    def share(self, gid: str) -> RankShare[H, A, R, M, E] | None:
        need_text("gid", gid, 256)
        with self._lock:
            found = self.shares.get(gid)
            return found if found is not None else next((s for s in self.ended if s.gid == gid), None)

    def wait(self, gid: str, states: Iterable[str], timeout: float) -> RankShare[H, A, R, M, E] | None:
        """Wait until this worker's share of ``gid`` exists and is in ``states`` (or ended)."""
        need_text("gid", gid, 256)
        timeout = need_seconds("timeout", timeout)
        states = need_items("states", tuple(states) if isinstance(states, (set, frozenset)) else states,
                            str, max_len=64)
        wanted = {need_choice("states", name, self.share_class.table.state_names) for name in states}
        deadline = time.monotonic() + timeout
        while True:
            s = self.share(gid)
            if s is not None:
                with s.changed:
                    while s.state not in wanted and not s.is_terminal and time.monotonic() < deadline:
                        s.changed.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                return s
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.002)

    def leases(self) -> int:
        """Leases this worker holds now (one per mapped part of its own rank)."""
        with self._lock:
            shares = list(self.shares.values())
        return sum(1 for s in shares if s.part is not None and s.part.lease_id is not None and s.part.channel is not None)

    # -- talking to the coordinator -----------------------------------------------------

    def _report(self, share: RankShare[H, A, R, M, E], state: str) -> None:
        """Tell the coordinator the state ``share`` entered (called once it is committed)."""
        ch = self._channel
        if ch is None or self.coordinator_gone:
            return
        info = self._imported_info(share) if state == "imported" else None
        report = msgs.Report(share.gid, self.config.rank, _REPORT_STATES[state], detail=share.cause,
                             reasons=tuple(p.reason.value for p in share.problems), info=info)
        try:
            with self._send_lock:
                ch.send(msgs.encode(report), timeout=self.config.request_timeout_s)
            log.debug("t=%.6f %s: report %s sent by rank %d", time.monotonic(), share.gid, state, self.config.rank)
        except ChannelError as exc:
            log.info("rank %d: report %s not delivered (%s)", self.config.rank, state, exc)

    def _imported_info(self, share: RankShare[H, A, R, M, E]) -> dict[str, Any] | None:
        """What an imported report tells the coordinator of the part it mapped."""
        part = share.part
        if part is None:
            return None
        if isinstance(part, RemotePart):
            size = None if part.remote is None else part.remote.size
        else:
            size = None if part.mapping is None else part.mapping.size
        if size is None:
            return None
        d = part.descriptor
        return {"fingerprint": d.geometry.fingerprint(), "tp": d.tp, "generation": d.generation,
                "size": int(size), "leases": self.leases(), "import_s": share.import_s or 0.0}

    def _read_loop(self) -> None:
        ch = self._channel
        assert ch is not None
        why = "its connection closed"
        try:
            while not self._stopping.is_set():
                try:
                    msg = ch.recv(timeout=0.25)
                except ChannelError as exc:
                    if exc.reason is not ChannelReason.TIMEOUT:
                        raise
                    continue
                self._last_heard = time.monotonic()
                with msg:
                    message = msgs.decode(msg.payload)
                if isinstance(message, msgs.Command):
                    log.debug("t=%.6f %s: %s received at rank %d", time.monotonic(), message.group, message.cmd,
                              self.config.rank)
                    self._command(message)
                elif not isinstance(message, msgs.Tick):
                    raise ChannelError(ChannelReason.PROTOCOL,
                                       f"unexpected {type(message).__name__} from the coordinator")
        except KvStateError as exc:
            if isinstance(exc, ChannelError) and exc.closed:
                why = str(exc)
            else:
                why = f"protocol violation: {exc}"
                log.error("rank %d: %s; leaving the coordinator", self.config.rank, why)
        finally:
            ch.close()
            self._orphaned(why)

    def _command(self, cmd: msgs.Command) -> None:
        if cmd.cmd == "check":
            self._check(cmd)
            return
        with self._lock:
            found = self.shares.get(cmd.group)
        if found is None:
            return  # the share ended and was forgotten (or never existed here): nothing to do
        share: RankShare[H, A, R, M, E] = found
        event: CommandEvent = cmd.cmd
        with share.locked():  # the check and the fire are one step: an open may end the share meanwhile
            if share.is_terminal:
                return  # the share ended: it holds nothing any more
            share.fire(event)  # an undeclared command is the coordinator's protocol violation
        if cmd.cmd == "open":
            self._spawn(self._open, share)
        self._forget_ended()
        self.kick()

    def _check(self, cmd: msgs.Command) -> None:
        with self._lock:
            if cmd.group in self.shares:
                raise ChannelError(ChannelReason.PROTOCOL, f"check for group {cmd.group} twice")
            share: RankShare[H, A, R, M, E] = self.share_class(self, cmd.group)
            self.shares[cmd.group] = share
        share.fire("check")
        descriptor: Descriptor | None = None
        try:
            if cmd.descriptor is None:
                raise DescriptorRejected(RejectReason.MALFORMED, "the check carries no descriptor", self.config.rank)
            descriptor = decode_cached(cmd.descriptor, self.config.deployment)
            share.problems = self._problems(descriptor)
            share.blocks = _blocks(cmd.blocks)
        except DescriptorRejected as exc:
            share.problems = [exc]
        except (ArgumentInvalid, Busy) as exc:
            if not refused_by_inventory(exc):
                raise
            share.problems = [DescriptorRejected(RejectReason.MALFORMED, str(exc), self.config.rank)]
        part: Part[H, A, R, M, E]
        if share.problems:
            share.cause = "; ".join(str(p) for p in share.problems)
            if descriptor is not None:
                part = Part(share, descriptor)
                share.part = part
                part.fire("reject")
            share.fire("reject")
            self._forget_ended()
            return
        assert descriptor is not None
        share.validated = descriptor
        if descriptor.handle_kind is HandleKind.NIXL and self.remote is not None:
            part = RemotePart(share, descriptor, self.remote)  # another node's bank: read, never mapped
        else:
            part = Part(share, descriptor)
        share.part = part
        part.fire("validate")
        # Phase 1 (the lease) talks to the exporter: off the reader, like the open.
        self._spawn(self._lease, share)

    def _lease(self, share: RankShare[H, A, R, M, E]) -> None:
        """Validate the share: lease its bank and check the report (the rank's validate
        row); a refused or mismatched lease fails the share, having opened nothing."""
        log.debug("t=%.6f %s: lease thread started at rank %d", time.monotonic(), share.gid, self.config.rank)
        with share.locked():
            if not share.may("validate"):
                share._close_part()  # aborted (or orphaned) before the lease started
            else:
                try:
                    share.fire("validate")
                except (KvStateError, OSError) as exc:
                    share.cause = f"lease: {type(exc).__name__}: {exc}"
                    part: Part[H, A, R, M, E] | None = share.part
                    if part is not None and part.may("import_failed"):
                        part.fire("import_failed")
                    if share.may("import_failed"):
                        share.fire("import_failed")
        log.debug("t=%.6f %s: lease thread done at rank %d (%s, lease %.6f s)", time.monotonic(), share.gid,
                  self.config.rank, share.state, share.lease_took_s)
        self._forget_ended()

    def _problems(self, d: Descriptor) -> list[DescriptorRejected]:
        """Every rule this rank's descriptor breaks, checked by this worker completely."""
        kinds = self.transport.capabilities.handle_kinds
        if self.remote is not None:
            kinds |= self.remote.capabilities.handle_kinds
        expect = Expectation(deployment=self.config.deployment, now_ns=time.time_ns(),
                             handle_kinds=kinds, host_boot_id=self.boot_id,
                             uid=os.getuid(), geometry_fingerprint=self.config.geometry_fingerprint,
                             device_uuids=self.config.device_uuids, max_tp=self.config.max_tp,
                             check_socket=self.config.check_socket)
        problems = descriptor_problems(d, expect)
        rank, tp = self.config.exporting
        if d.tp != tp:
            problems.append(DescriptorRejected(RejectReason.TP_MISMATCH, f"descriptor of a tp={d.tp} group for the "
                                               f"worker of a part of a tp={tp} group", d.rank))
        if d.rank != rank:
            problems.append(DescriptorRejected(RejectReason.RANK_RANGE, f"descriptor of rank {d.rank} sent to the "
                                               f"worker of rank {rank}'s part", d.rank))
        return problems

    def _open(self, share: RankShare[H, A, R, M, E]) -> None:
        log.debug("t=%.6f %s: open thread started at rank %d", time.monotonic(), share.gid, self.config.rank)
        with share.locked():
            if not share.may("mapped"):
                return  # aborted (or orphaned) before the open started
            try:
                share.fire("mapped")
            except (KvStateError, OSError) as exc:
                share.cause = f"{type(exc).__name__}: {exc}"
                if share.may("import_failed"):
                    share.fire("import_failed")
        log.debug("t=%.6f %s: open thread done at rank %d (%s)", time.monotonic(), share.gid, self.config.rank,
                  share.state)
        self._forget_ended()

    def _spawn(self, target: Callable[[RankShare[H, A, R, M, E]], None], share: RankShare[H, A, R, M, E]) -> None:
        t = threading.Thread(target=target, args=(share,), name=f"kvstate-rank{self.config.rank}-{target.__name__[1:]}",
                             daemon=True)
        t.start()
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    # -- on its own ---------------------------------------------------------------------

    def _orphaned(self, why: str) -> None:
        """The coordinator is gone: every share cleans up alone (the rank table's
        coordinator_died rows; draining shares close once quiescent)."""
        if not self.coordinator_gone:
            log.info("rank %d: coordinator gone (%s)", self.config.rank, why)
        self.coordinator_gone = True
        with self._lock:
            shares = list(self.shares.values())
        share: RankShare[H, A, R, M, E]
        for share in shares:
            with share.locked():
                if share.may("coordinator_died"):
                    share.fire("coordinator_died")
        self._forget_ended()
        self.kick()

    def _housekeep(self) -> None:
        """Quiesce draining shares as soon as their pins drop; notice a silent coordinator."""
        while not self._stopping.is_set():
            with self._lock:
                draining = [s for s in self.shares.values() if s.state == "draining"]
            self._wake.wait(self.config.drain_poll_s if draining else 0.05)
            self._wake.clear()
            share: RankShare[H, A, R, M, E]
            for share in draining:
                with share.locked():
                    if share.may("quiesce"):
                        try:
                            share.fire("quiesce")
                        except TransitionError as exc:
                            if exc.reason is not TransitionReason.GUARD:
                                raise
                            # a load still pins the part: the next round looks again
            if draining:
                self._forget_ended()
            if self._closing and not self._ending():
                self._stop()  # close() gave up waiting; the last share has ended now
                return
            with self._lock:
                live = [s for s in self.shares.values() if not s.is_terminal]
            for share in live:
                share._renew_due(self.config.renew_interval_s)
            if not self.coordinator_gone and time.monotonic() - self._last_heard > self.silence_s:
                ch = self._channel
                if ch is not None and ch.pending():
                    continue  # not silent: this process was (stopped, starved), its reader will read
                if ch is not None:
                    ch.close()  # the reader wakes with ChannelError (CLOSED) and orphans every share
                self._orphaned(f"silent for {self.silence_s} s")

    def _forget_ended(self) -> None:
        with self._lock:
            for gid in [g for g, s in self.shares.items() if s.is_terminal]:
                self.ended.append(self.shares.pop(gid))
