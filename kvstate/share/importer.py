"""The importer: a prefill worker's rank groups, driven by ``spec/group.toml`` and
``spec/part.toml``.

Theory of operation
-------------------

:meth:`Importer.import_group` takes the wire descriptors of one group (one per rank).
Every descriptor is decoded and the whole group validated *before* any connection is
made or handle opened (INV-REJECT-BEFORE-OPEN, INV-GROUP-ATOMIC); a rejected group ends
``rejected`` and nothing was touched. Then each rank part is imported: lease requested
over the exporter's channel, fd received and checked, address reserved, mapped, read
access set. The channel to each exporter is persistent and every rank an exporter serves
is leased in one request, whose answer carries every fd (:mod:`kvstate.share.peers`); the
parts then open one after another in the calling thread (native calls only: no thread
pool on this path). A group that one exporter serves on the host backend takes both phases
in one native call instead (:mod:`kvstate.share.native_import`: lease, checks, renewal
registration and, once every part passed, the attach), the Python path staying the
reference for every answer it does not take whole. If any part fails, every part imported so far is unmapped and closed and
the group ends ``failed`` (INV-ROLLBACK-COMPLETE). The group becomes ``ready`` only when
every rank 0..tp-1 has an imported, compatible part (INV-GROUP-COMPLETE).

:meth:`Group.load` scatters bank blocks into the engine's paged KV tensors at the
engine's block ids, one native op per (rank, region), and returns a
:class:`~kvstate.share.transfer.TransferHandle` at once (wait per region, cancel, failed
blocks, callback, fd); :meth:`Group.load_prefix` gathers blocks into dense caller
buffers and waits. Everything is checked before the first op is submitted, and a load
is submitted all or nothing (:mod:`kvstate.share.plan`). Ops pin the part mappings until
they finish, so a drain or close never unmaps memory under a copy
(INV-NO-UNMAP-PINNED). A finished load fires ``loaded`` (the load-complete change).
:meth:`Group.drain` refuses new loads, waits until every load is collected and the
native layer reports zero pins, then closes.

Faults reported by the environment (:meth:`Group.fault`): the exporter's connection
closing or its process exiting (``peer_died``, detected by a watcher on every part's
channel), a lease renewal refused or failed, or a lease reaching its expiry
(``expired``; leases on links are renewed by a native thread that never waits for the
GIL: :mod:`kvstate.share.renewal`), an exporter restart
(``incarnation_changed``: a lease refused as ``stale_incarnation`` while importing, or a
lease granted for the same source and rank under a new incarnation while the group
lives). Before ready they fail the group and roll back; after ready they drain it:
existing mappings stay readable until unmapped, but nothing new starts.
"""

from __future__ import annotations

import os
import threading
import time
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, Literal, NoReturn, get_args

import attrs

from kvstate import channel as chan
from kvstate.core.descriptor import decode_group
from kvstate.core.errors import (
    ArgumentInvalid, ChannelError, ConfigInvalid, GroupRejected, ImportFailed,
    KvStateError, ReuseRefused, TransitionError, TransferFailed, TimedOut,
)
from kvstate.core.args import need, need_callables, need_choice, need_items, need_mapping_keys, need_seconds, need_text
from kvstate.core.identity import host_boot_id
from kvstate.core.reasons import ArgumentReason, ImportReason, TransferFailReason, TimeoutReason, TransitionReason
from kvstate.reuse.gates import import_refusal
from kvstate.core.machine import Lifecycle, Observer, effect, guard
from kvstate.core.spec import load_machine
from kvstate.core.capabilities import MemoryKind
from kvstate.transport.protocol import A, E, H, M, MappedTransport, R, require_mapped
from kvstate.core.validate import Expectation, ValidatedGroup, group_complete
from kvstate.transport.native_rules import validate_group
from kvstate.share import attach
from kvstate.share import load as loads
from kvstate.share import native_import, peers
from kvstate.share import adopt
from kvstate.share.parked import Parked
from kvstate.share.import_config import ImportConfig as ImportConfig
from kvstate.share.part import BlockRequest as BlockRequest, Part as Part, PartOwner as PartOwner
from kvstate.share.part import lease_fields, lease_request as lease_request
from kvstate.share.renewal import LeaseKeeping, Renewal
from kvstate.share.plan import Plan
from kvstate.share.transfer import LoadResult as LoadResult, TransferHandle, check_timeout, stop_dispatcher_if_idle

log = logging.getLogger(__name__)


#: The group events that report a fault from the environment (see :meth:`Group.fault`).
GroupFault = Literal["part_failed", "peer_died", "incarnation_changed", "expired"]


class Group(Lifecycle, Generic[H, A, R, M, E]):
    """One rank group on the importer side, driven by spec/group.toml."""

    table = load_machine("group")

    def __init__(self, importer: Importer[H, A, R, M, E], label: str, observers: Iterable[Observer]) -> None:
        super().__init__(label=label, observers=observers)
        self.importer = importer
        self.observers = tuple(observers)
        self.validated: ValidatedGroup | None = None
        self.blocks: BlockRequest | None = None
        self.parts: list[Part[H, A, R, M, E]] = []
        #: Set only while the group closes its parts after use (``unmap_parts``, not a
        #: rollback): then they may park their leases (kvstate.share.parked).
        self.parking = False
        #: Set only while the group's own rows close its parts (see Part's group_releasing).
        self.releasing = False
        #: When a lease of the group was lost (``expired``): it is then closed as soon as
        #: no load pins it, so the exporter gets its bank back (INV-NO-RELEASE-MAPPED).
        self.expired_at: float | None = None
        #: Loads submitted and not yet collected (their `loaded` has not fired).
        self.loads: set[TransferHandle] = set()
        #: The first rank whose exporter went or whose lease was lost, why, and how: what an
        #: import that this fault interrupted reports (ImportFailed names the failing rank).
        self.fault_cause: tuple[int, ImportReason, str] | None = None

    @property
    def tp(self) -> int:
        return len(self.parts)

    @property
    def leasing(self) -> bool:
        """Phase 1 runs while the group, validated whole, is importing (PartOwner)."""
        return self.state == "importing" and self.validated is not None

    # -- guards -----------------------------------------------------------------------

    @guard("group_validated")
    def _validated(self, **kw: Any) -> bool:
        return self.validated is not None and len(self.parts) == self.validated.tp

    @guard("all_parts_imported")
    def _all_imported(self, **kw: Any) -> bool:
        return self.validated is not None and group_complete(
            self.validated.tp, [p.rank for p in self.parts if p.state == "imported"])

    @guard("parts_compatible")
    def _compatible(self, **kw: Any) -> bool:
        first = self.parts[0].descriptor
        return all(p.descriptor.geometry == first.geometry and p.descriptor.tp == first.tp
                   and p.descriptor.generation == first.generation and p.mapping is not None
                   and p.mapping.size == p.descriptor.size for p in self.parts)

    @guard("native_quiescent")
    def _quiescent(self, **kw: Any) -> bool:
        return not self.loads and all(p.pins() == 0 for p in self.parts)

    # -- effects ----------------------------------------------------------------------

    @effect("rollback_parts")
    def _rollback(self, **kw: Any) -> None:
        self._close_parts()

    @effect("unmap_parts")
    def _unmap(self, **kw: Any) -> None:
        self.parking = self.importer.config.park_s > 0
        try:
            self._close_parts()
        finally:
            self.parking = False

    def _close_parts(self) -> None:
        """Close every part that is open, trying each even when one refuses, so one
        failing part does not keep the others' mappings and leases; then raise the first
        failure (the group stays where it was and the caller may retry)."""
        first: KvStateError | None = None
        p: Part[H, A, R, M, E]
        self.releasing = True
        try:
            for p in self.parts:
                try:
                    if p.may("close"):
                        p.fire("close")
                except KvStateError as exc:
                    first = first or exc
        finally:
            self.releasing = False
        if first is not None:
            raise first

    @effect("submit_load")
    def _submit(self, *, plan: object = None, **kw: Any) -> None:
        if not isinstance(plan, Plan) or plan.kind != "load":
            raise ArgumentInvalid.transfer(ArgumentReason.PLAN, "fire('load')", "needs the plan Group.load builds")
        ranks = {c.rank for c in plan.copies}
        vouchers = {p.rank: p._voucher(plan.sources) for p in self.parts if p.rank in ranks}  # before any copy
        handle = plan.submit(self.importer.transport)  # all or nothing; raises TransferFailed (LOAD)
        self.loads.add(handle)
        try:
            handle._activate(self._load_finished, held=lambda rank: rank in vouchers and vouchers[rank]())
        except BaseException:  # not watched: nothing of it is in flight (_activate)
            self.loads.discard(handle)
            raise

    def _load_finished(self, handle: TransferHandle) -> None:
        try:
            self.fire("loaded", handle=handle)
        except TransitionError as exc:  # cannot happen while the table keeps `loaded` where loads run
            log.error("%s: a finished load was not collected: %s", self.label, exc)
            self.loads.discard(handle)

    @effect("collect_load")
    def _collect(self, *, handle: object = None, **kw: Any) -> None:
        self.loads.discard(handle)

    # -- what the engine calls --------------------------------------------------------

    def load(self, bank_block_ids: Sequence[int], dst_tensors: Mapping[Any, Any], dst_block_ids: Sequence[int], *,
             rank: int | None = None) -> TransferHandle:
        """Scatter bank blocks into the engine's paged KV cache: for every region, bank
        block ``bank_block_ids[i]`` into page ``dst_block_ids[i]`` of ``dst_tensors[name]``
        (torch tensors, numpy arrays, DLPack objects or buffers; see
        :mod:`kvstate.share.tensors`). ``dst_tensors`` maps region names to tensors for the
        part of ``rank`` (optional at tp=1), or ranks to such mappings.

        Returns at once; copies run on the op engine's threads. Every argument is checked
        first (ArgumentInvalid (a load/store reason) with a reason, nothing submitted); TransitionError (ILLEGAL) unless
        the group is ready; TransferFailed (LOAD) if submitting failed (everything submitted was
        cancelled or awaited). See TransferHandle for waiting per region and failures."""
        if not self.may("load"):
            raise TransitionError.illegal(self.table.name, self.state, "load")
        plan = loads.paged(self, bank_block_ids, dst_tensors, dst_block_ids, rank)
        return self._fire_load(plan)

    def _fire_load(self, plan: Plan) -> TransferHandle:
        try:
            self.fire("load", plan=plan)
        finally:
            plan.release()  # a plan the group refused still holds its tensors
        assert plan.handle is not None
        return plan.handle

    def load_prefix(self, blocks: Sequence[int], destinations: Sequence[Any] | Mapping[int, Any], *,
                    timeout: float = 30.0) -> LoadResult:
        """Gather ``blocks`` (in order) of each rank into its destination buffer, and wait.

        ``destinations`` is one buffer per rank (a sequence of tp buffers), or a mapping
        from rank to buffer to load only some ranks (a TP worker loading its own share).
        Each holds at least ``len(blocks) * block_bytes`` bytes. Raises TransferFailed (LOAD), and
        the data must not be used, if any op fails or the load outlasts ``timeout`` (it
        is then cancelled; ops already copying finish on their own)."""
        t = check_timeout(timeout)
        if not self.may("load"):
            raise TransitionError.illegal(self.table.name, self.state, "load")
        # Host memory is reached through the caller's tensors (tensors.adapt); device memory
        # (the cuda backend) goes to the transport as it is.
        host = MemoryKind.HOST in self.importer.transport.capabilities.memory_kinds
        handle = self._fire_load(loads.dense(self, blocks, destinations, host))
        if not handle.wait(t):
            handle.cancel()
            raise TransferFailed(TransferFailReason.LOAD,
                                 f"prefix load of {len(handle._blocks)} block(s) still running after {timeout} s; "
                                 "cancelled")
        result = handle.result()
        assert result is not None
        if not result.ok:
            raise TransferFailed(TransferFailReason.LOAD, f"prefix load failed: op(s) of rank(s) "
                                 f"{sorted({e.rank for e in handle._entries if e.state != 'done'})} did not complete")
        return LoadResult(result.blocks, result.bytes, result.seconds)

    def peer_closed(self, part: Part[H, A, R, M, E]) -> None:
        """A part's exporter went away (its channel closed or its process exited)."""
        need("part", part, Part)
        if self.fault_cause is None:
            self.fault_cause = (part.rank, ImportReason.PEER, f"the exporter of rank {part.rank} went away")
        try:
            self.fault("peer_died")
        except TransitionError:
            pass  # a concurrent transition already moved the group on

    def lease_lost(self, part: Part[H, A, R, M, E], why: str) -> bool:
        """The renewal of ``part``'s lease was refused or failed: the ``expired`` fault."""
        need("part", part, Part)
        if self.fault_cause is None:
            self.fault_cause = (part.rank, ImportReason.PEER, why)
        return self.fault("expired", reason=why)

    def fault(self, event: GroupFault, *, reason: str | None = None) -> bool:
        """Report a fault event; False when it is not declared in the current state (for
        example a terminal one). Check and transition are one atomic step. ``reason``
        travels to the observers (StateChange.reason)."""
        need_choice("event", event, get_args(GroupFault))
        if reason is not None:
            need_text("reason", reason, allow_empty=True)
        with self.locked():
            if not self.may(event):
                return False
            self.fire(event, reason=reason)
            if event == "expired":  # the importer's expiry thread closes it once unpinned
                self.expired_at = time.monotonic()
            return True

    def drain(self, timeout: float = 30.0) -> float:
        """Refuse new loads, wait for native quiescence, close. Returns seconds to quiescent.
        Safe to call while the importer's expiry thread settles the same group."""
        timeout = need_seconds("timeout", timeout)
        start = time.monotonic()
        with self.locked():
            if self.may("drain"):
                self.fire("drain")
        while True:
            for handle in list(self.loads):
                handle.done()  # finishes loads of backends without completion fds
            if self.settle():
                break
            if self.state != "draining":
                return 0.0  # an import in progress was aborted (failed), or already closed
            if time.monotonic() - start > timeout:
                raise TimedOut(TimeoutReason.DRAIN,
                               f"{self.label}: pins still held after {timeout} s; nothing unmapped")
            time.sleep(0.002)
        return time.monotonic() - start

    def settle(self) -> bool:
        """One step of a drain that does not wait: a draining group with no pins left is
        quiesced, and a quiescent one closed (unmapped, its leases returned). True when
        this call closed the group."""
        with self.locked():
            if self.state == "draining":
                try:
                    self.fire("quiesce")
                except TransitionError as exc:
                    if exc.reason is not TransitionReason.GUARD:
                        raise
                    return False  # loads or pins still running
            if self.state == "quiescent":
                self.fire("close")
                return True
        return False


class Importer(LeaseKeeping[H, A, R, M, E]):
    """A prefill worker's importing side: validates, imports, watches, loads; its leases
    are kept (watched, renewed, expired) by :class:`~kvstate.share.renewal.LeaseKeeping`."""

    group_class: type[Group[H, A, R, M, E]] = Group

    def __init__(self, config: ImportConfig, transport: MappedTransport[H, A, R, M, E], *,
                 observers: Iterable[Observer] = ()) -> None:
        if not isinstance(config, ImportConfig):
            raise ConfigInvalid.of("config", f"must be an ImportConfig, not {type(config).__name__}")
        observers = need_callables("observers", observers)
        require_mapped(transport)
        self.config = config
        self.transport = transport
        self.observers = tuple(observers)
        self.boot_id = host_boot_id()
        self._watcher = chan.Watcher(name="kvstate-importer-watch")
        #: Parts by the id of the channel their lease is on (one channel: many parts).
        self._owners: dict[int, dict[int, Part[H, A, R, M, E]]] = {}
        self._watched: set[int] = set()  # ids of the channels the watcher watches
        self._owners_lock = threading.Lock()
        #: One persistent channel per exporter address (kvstate.share.peers).
        self.peers = peers.Peers(self._connect, config.link_idle_s, config.answer_spin_s)
        self._count = 0
        #: Groups this importer made and that have not reached a terminal state.
        self.groups: list[Group[H, A, R, M, E]] = []
        self._stopping = threading.Event()
        #: The native renewal thread of every lease on a link (kvstate.share.renewal).
        self.renewal: Renewal[Part[H, A, R, M, E]] | None = None
        if config.native_renewal:
            try:
                self.renewal = Renewal(config.renew_interval_s, config.request_timeout_s)
            except BaseException:
                self._watcher.close()
                raise
        self._expiry = threading.Thread(target=self._expire_loop, name="kvstate-importer-expiry", daemon=True)
        self._expiry.start()

    def close(self) -> None:
        """Stop watching and expiring (idempotent). Groups stay as they are."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._expiry.join(2.0)
        self.peers.close()  # idle channels now, busy ones when their last lease returns; nothing parks now
        for parked in self.peers.take_parked_where(lambda p: True):
            self._drop_parked(parked)
        if self.renewal is not None:
            self.renewal.close()
        self._watcher.close()
        stop_dispatcher_if_idle()

    def check_gates(self) -> None:
        """ReuseRefused unless this importer's config enables reuse and, for a transport
        over device memory, GPU reuse under an admitted deployment profile
        (:mod:`kvstate.reuse.gates`). Every path that leases or opens calls it first."""
        refusal = import_refusal(self.config.reuse, self.config.admission, self.transport.name,
                                 self.transport.capabilities)
        if refusal is not None:
            raise ReuseRefused(*refusal)

    def expectation(self, **overrides: Any) -> Expectation:
        overrides = need_mapping_keys("overrides", overrides, [a.name for a in attrs.fields(Expectation)])
        e = Expectation(deployment=self.config.deployment, now_ns=time.time_ns(),
                        handle_kinds=self.transport.capabilities.handle_kinds, host_boot_id=self.boot_id, uid=os.getuid(),
                        geometry_fingerprint=self.config.geometry_fingerprint,
                        block_format=self.config.block_format,
                        device_uuids=self.config.device_uuids, max_tp=self.config.max_tp)
        return attrs.evolve(e, **overrides) if overrides else e

    def import_group(self, wire: Sequence[bytes], *, blocks: BlockRequest | None = None,
                     **expect: Any) -> Group[H, A, R, M, E]:
        """Validate the whole group, then import every part; see the module docstring.

        ``blocks`` names inventory blocks every part's lease must pin; if the decode
        worker no longer holds them (the inventory is advisory) this raises ImportFailed (STALE)
        and the caller recomputes. ``expect`` overrides fields of the Expectation.
        Refused with ReuseRefused, before anything is decoded or opened, unless the
        config enables reuse (and, for a GPU transport, GPU reuse under an admitted
        deployment profile): see :mod:`kvstate.reuse.gates`.
        """
        self.check_gates()
        need_items("wire", wire, object, max_len=self.config.max_tp)  # each item: decode checks it
        if blocks is not None:
            need("blocks", blocks, BlockRequest)
        expect = need_mapping_keys("expect", expect, [a.name for a in attrs.fields(Expectation)])
        if self._stopping.is_set():
            raise ArgumentInvalid.of("importer", ArgumentReason.STATE, "this importer is closed")
        if blocks is not None and len(blocks.epochs) != len(wire):
            raise ArgumentInvalid(ArgumentReason.INVENTORY,
                                  f"the block request names {len(blocks.epochs)} epoch(s) for a group of "
                                  f"{len(wire)} descriptor(s): one per rank")
        expectation = self.expectation(**expect)  # refuses a bad override before a group exists
        self._count += 1
        group: Group[H, A, R, M, E] = self.group_class(self, f"group#{self._count}", self.observers)
        self.groups = [g for g in self.groups if not g.is_terminal] + [group]
        descriptors, problems = decode_group(wire, self.config.deployment)
        try:
            if problems:
                raise GroupRejected(problems)
            validated = validate_group(descriptors, expectation)
        except GroupRejected:
            part: Part[H, A, R, M, E]
            group.parts = [Part(group, d) for d in descriptors]  # the ranks that decoded
            for part in group.parts:
                part.fire("reject")
            group.fire("reject")
            raise
        group.validated = validated
        group.blocks = blocks
        group.parts = [Part(group, d) for d in validated.parts]
        group.fire("begin_import")
        if not Part.step_all(group.parts, "validate"):  # one step where that row runs nothing
            for part in group.parts:
                part.fire("validate")
        # Phase 1 leases and checks every rank; phase 2 opens only when all passed.
        for phase in ("lease", "open"):
            if phase == "open" and all(p.state == "imported" for p in group.parts):
                break  # the native import opened them with their leases
            failures = self._each_part(group.parts, phase)
            if failures:
                self._fail(group, failures)
            if phase == "lease":  # granted: these incarnations are current (a replayed old one is refused)
                self._note_restarts(validated)
        if group.state != "importing":  # a fault arrived while importing: the rank it came from
            rank, reason, why = group.fault_cause or (0, ImportReason.INTERRUPTED, "the group was faulted")
            raise ImportFailed.of(rank, reason, f"group {group.state} during import: {why}")
        try:
            group.fire("complete")
        except TransitionError as exc:  # refused (or a concurrent fault): never left importing
            if group.may("drain"):
                group.fire("drain", reason=f"complete refused: {exc}")
            raise ImportFailed.wrap(0, exc) from exc
        return group

    def _fail(self, group: Group[H, A, R, M, E], failures: dict[int, Exception]) -> NoReturn:
        """Fail the group after part failures: every part leased or imported so far is
        rolled back (its lease returned), and the first failure is raised."""
        part: Part[H, A, R, M, E]
        for rank in sorted(failures):
            part = group.parts[rank]
            with part.locked():
                if part.may("import_failed"):
                    part.fire("import_failed", reason=str(failures[rank]))
        first, cause = min(failures.items())
        reason = f"rank {first}: {cause}"
        if any(isinstance(c, ImportFailed) and c.code == "stale_incarnation" for c in failures.values()):
            group.fault("incarnation_changed", reason=reason)
        else:
            group.fault("part_failed", reason=reason)
        raise ImportFailed.wrap(first, cause) from cause  # STALE when the blocks are gone: recompute

    def _note_restarts(self, validated: ValidatedGroup) -> None:
        """A descriptor of a (source, rank) that a live group imported, from another
        incarnation that the exporter then leased, shows that exporter restarted: the
        group hears it. Called only after the leases were granted, so that a replayed
        descriptor of an older incarnation (refused as ``stale_incarnation``) harms no
        live group."""
        current = {(d.source_id, d.rank): d.incarnation for d in validated.parts}
        group: Group[H, A, R, M, E]
        for group in list(self.groups):
            if any(current.get((p.descriptor.source_id, p.rank), p.descriptor.incarnation)
                   != p.descriptor.incarnation for p in group.parts):
                try:
                    group.fault("incarnation_changed")
                except TransitionError:
                    pass  # a concurrent transition already moved the group on

    def _each_part(self, parts: Sequence[Part[H, A, R, M, E]], event: Literal["lease", "open"]) -> dict[int, Exception]:
        """Fire ``event`` on every part, in this thread. ``lease``: one batched request per
        exporter, every request sent before any answer is read (one round trip for the
        group, :mod:`kvstate.share.peers`), then each part takes its grant. ``open``: one
        native call per exporter on the host backend (else part by part), then one
        ``mapped`` note per exporter. Returns failures by rank (anything raised, typed or
        not: the caller rolls back on every one)."""
        if event == "lease":
            return self._lease_parts(parts)
        # The host backend opens each exporter's batch in one native call (kvstate.share.attach).
        failures, native, parts = attach.open_natively(parts, self.transport)
        opened: dict[int, tuple[peers.PeerLink, list[tuple[int, int]]]] = {}
        part: Part[H, A, R, M, E]
        for part in native:
            if part.link is not None and part.lease_id is not None:
                opened.setdefault(id(part.link), (part.link, []))[1].append((part.rank, part.lease_id))
        for part in parts:
            grant, link = part.received, part.link
            if grant is not None:
                grant.report_mapped = False
            try:
                # A fault may fail the group (and close this part) before its step starts:
                # that is the group's failure, reported by the caller, not this part's.
                with part.locked():
                    if part.may("open"):
                        part.fire("open")
                        if grant is not None and link is not None and part.lease_id is not None:
                            opened.setdefault(id(link), (link, []))[1].append((part.rank, part.lease_id))
            except Exception as exc:
                failures[part.rank] = exc
        for link, leases in opened.values():  # one notification per exporter
            try:
                link.notify(peers.mapped_payload(leases), self.config.request_timeout_s)
            except ChannelError as exc:
                failures.update((rank, exc) for rank, _ in leases)
        return failures

    def _lease_parts(self, parts: Sequence[Part[H, A, R, M, E]]) -> dict[int, Exception]:
        """Phase 1 of every part: batched per exporter address (parts of another kind, or
        reached over TCP, lease on their own). A group that one exporter serves on the
        host backend takes both phases in one native call (:mod:`kvstate.share.native_import`)."""
        failures: dict[int, Exception] = {}
        if self.config.park_s > 0:
            adopted = adopt.parked(self, parts, failures)
            parts = [p for p in parts if p not in adopted and p.rank not in failures]
            if not parts:
                return failures
        if not failures and native_import.eligible(parts, self.transport):
            native = native_import.lease_and_open(parts, self._fire_lease)
            if native is not None:
                return native
        timeout = self.config.request_timeout_s
        by_peer: dict[str, list[Part[H, A, R, M, E]]] = {}
        part: Part[H, A, R, M, E]
        for part in parts:
            if type(part) is Part and "://" not in part.descriptor.socket_path:
                by_peer.setdefault(part.descriptor.socket_path, []).append(part)
            else:
                self._fire_lease(part, None, failures)
        batches = list(by_peer.values())
        answers = self.peers.leases([(served[0].descriptor.socket_path,
                                      [lease_fields(p.descriptor, p.group.blocks) for p in served])
                                     for served in batches], timeout)
        granted: list[peers.Grant] = []
        try:
            for served, answer in zip(batches, answers):
                if isinstance(answer, peers.RankRefused):  # that rank's failure; the others hold no lease
                    failures[answer.rank] = answer.refusal
                    continue
                if isinstance(answer, Exception):
                    failures.update((p.rank, answer) for p in served)
                    continue
                granted += answer
                for part, grant in zip(served, answer):
                    self._fire_lease(part, grant, failures)
        finally:
            for grant in granted:
                if not grant.taken:  # its part never leased: the lease goes back
                    grant.give_back()
        return failures

    @staticmethod
    def _fire_lease(part: Part[H, A, R, M, E], grant: peers.Grant | Parked | None,
                    failures: dict[int, Exception]) -> None:
        try:
            # A fault may fail the group (and close this part) before its step starts.
            with part.locked():
                if part.may("lease"):
                    if grant is None:
                        part.fire("lease")
                    else:
                        part.fire("lease", grant=grant)
        except Exception as exc:
            failures[part.rank] = exc

    def _connect(self, address: str, timeout: float) -> chan.Channel:
        return chan.connect(address, timeout=timeout, limits=peers.LINK_LIMITS)
