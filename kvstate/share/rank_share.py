"""A rank worker's share of one coordinated group: its own rank's part, driven by
``spec/rank.toml``. :mod:`kvstate.share.rank_worker` runs the coordinator's commands on
it and says how (its theory of operation)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic

from kvstate.core.args import need, need_text
from kvstate.core.descriptor import Descriptor
from kvstate.core.errors import DescriptorRejected, KvStateError, TransitionError, ArgumentInvalid, TransferFailed
from kvstate.core.machine import Lifecycle, Observer, StateChange, effect, guard
from kvstate.core.reasons import ArgumentReason, TransferFailReason
from kvstate.core.spec import load_machine
from kvstate.share import attach, native_import
from kvstate.share import load as loads
from kvstate.share.importer import Importer, LoadResult
from kvstate.share.part import BlockRequest, Part
from kvstate.share.plan import Plan, block_ids
from kvstate.share.remote_part import RemotePart
from kvstate.share.transfer import TransferHandle, check_timeout
from kvstate.transport.nixl.transport import NixlAllocation
from kvstate.transport.protocol import A, E, H, M, R

if TYPE_CHECKING:
    from kvstate.share.rank_worker import RankWorker

log = logging.getLogger(__name__)


class RankShare(Lifecycle, Generic[H, A, R, M, E]):
    """One worker's share of one coordinated group: its own rank's part. Driven by
    spec/rank.toml; it is also the :class:`~kvstate.share.importer.PartOwner` of that part.
    ``H, A, R, M, E``: the transport's types."""

    table = load_machine("rank")

    def __init__(self, worker: RankWorker[H, A, R, M, E], gid: str) -> None:
        super().__init__(label=f"rank{worker.config.rank}/{gid}", observers=(self._after, *worker.observers))
        self.worker = worker
        self.gid = gid
        self.rank = worker.config.rank
        self.observers: tuple[Observer, ...] = worker.observers
        self.importer: Importer[H, A, R, M, E] = worker.importer
        self.blocks: BlockRequest | None = None
        self.validated: Descriptor | None = None
        self.part: Part[H, A, R, M, E] | None = None
        self.releasing = False  # True only while the share's own row closes its part
        #: Loads submitted and not yet finished: their ops pin the part.
        self.loads: set[TransferHandle] = set()
        self.problems: list[DescriptorRejected] = []
        self.cause = ""
        self.import_s: float | None = None
        self.lease_took_s = 0.0
        self.bank_withdrawn = False  # exporter_died was fired: renewal stops
        self.unmapped_at: float | None = None  # time.monotonic() when its part was unmapped
        #: Committed steps whose report has not gone out yet.
        self.reports_due = 0
        self.changed = threading.Condition(self._kv_lock)

    @property
    def leasing(self) -> bool:
        """Phase 1 runs while this rank checks its descriptor: the coordinator validated the
        whole group first, and opens only once every rank reported a checked lease."""
        return self.state == "checking" and self.validated is not None

    @property
    def parts(self) -> list[Part[H, A, R, M, E]]:
        """The parts that import together here: this rank's own (PartOwner)."""
        return [] if self.part is None else [self.part]

    # -- reports ------------------------------------------------------------------------

    def _after(self, change: StateChange) -> None:
        """Observers run after the commit, outside the lock, in commit order: a step's
        report goes out once its state is committed, and before any later step's. Whether
        a step reports is its row's (the ``report`` effect)."""
        row = next(r for r in self.table.rows(change.event, change.source) if r.dest == change.dest)
        with self.changed:
            if "report" in row.effects:
                self.reports_due -= 1
            self.changed.notify_all()
        if "report" in row.effects:
            self.worker._report(self, change.dest)

    # -- guards -------------------------------------------------------------------------

    @guard("part_unpinned")
    def _unpinned(self, **kw: Any) -> bool:
        return not self.loads and (self.part is None or self.part.pins() == 0)

    @guard("coordinator_gone")
    def _coordinator_gone(self, **kw: Any) -> bool:
        return self.worker.coordinator_gone

    # -- effects ------------------------------------------------------------------------

    @effect("report")
    def _queue_report(self, **kw: Any) -> Callable[[], None]:
        self.reports_due += 1  # sent by _after once the step is committed (it names the state entered)

        def undo() -> None:
            self.reports_due -= 1
        return undo

    @effect("lease_part")
    def _lease_part(self, **kw: Any) -> Callable[[], None]:
        """Phase 1 for this rank: lease its bank and check the exporter's report against the
        descriptor. Nothing is opened: the coordinator says open only once every rank
        reported this (so a rank refused here means zero opens for the whole group)."""
        part: Part[H, A, R, M, E] | None = self.part
        assert part is not None  # _check made it
        self.importer.check_gates()  # reuse enabled (and, for GPU memory, an admitted profile)
        start = time.monotonic()
        native_import.lease_part(part)  # one native call on the host backend
        self.lease_took_s = time.monotonic() - start
        return self._close_part

    @effect("import_part")
    def _import_part(self, **kw: Any) -> Callable[[], None]:
        """Phase 2: open and map the handle leased in phase 1."""
        part: Part[H, A, R, M, E] | None = self.part
        assert part is not None  # _check made it
        start = time.monotonic()
        try:
            attach.open_part(part)  # one native call on the host backend (kvstate.share.attach)
        except BaseException:
            if part.may("import_failed"):
                part.fire("import_failed")  # returns the lease
            raise
        self.import_s = self.lease_took_s + time.monotonic() - start  # both phases
        log.debug("t=%.6f %s: open took %.6f s", time.monotonic(), self.label, self.import_s - self.lease_took_s)
        return self._close_part

    @effect("rollback_part")
    def _rollback(self, **kw: Any) -> None:
        self._close_part()

    @effect("unmap_part")
    def _unmap(self, **kw: Any) -> None:
        self._close_part()

    def _close_part(self) -> None:
        part: Part[H, A, R, M, E] | None = self.part
        if part is not None and part.may("close"):
            was_mapped = part.state == "imported"  # mapped here, or a remote view
            self.releasing = True  # the share's own row lets its part go (Part's group_releasing)
            try:
                part.fire("close")
            finally:
                self.releasing = False
            if was_mapped:
                self.unmapped_at = time.monotonic()

    @effect("submit_load")
    def _submit(self, *, plan: Plan | None = None, **kw: Any) -> Callable[[], None] | None:
        part = self.part
        assert part is not None
        if isinstance(part, RemotePart):  # a NIXL READ follows, outside the lock; it pins until done
            return part.pin()
        if not isinstance(plan, Plan) or plan.kind != "load":
            raise ArgumentInvalid.transfer(ArgumentReason.PLAN, "fire('load')", "needs the plan RankShare.load builds")
        voucher = part._voucher(plan.sources)  # before any copy
        handle = plan.submit(self.importer.transport)  # all or nothing; raises TransferFailed (LOAD)
        self.loads.add(handle)
        try:
            handle._activate(self._load_finished, held=lambda rank: voucher())
        except BaseException:  # not watched: nothing of it is in flight (_activate)
            self.loads.discard(handle)
            raise
        return None

    def _load_finished(self, handle: TransferHandle) -> None:
        self.loads.discard(handle)  # its ops no longer pin the part: a drain may quiesce
        self.worker.kick()

    # -- what the part and the engine call ----------------------------------------------

    def peer_closed(self, part: Part[H, A, R, M, E]) -> None:
        """The exporter of this share's part went away."""
        self._withdrawn("its exporter's connection closed")

    def lease_lost(self, part: Part[H, A, R, M, E], why: str) -> bool:
        """The importer's renewal thread could not renew the part's lease."""
        need("part", part, Part)
        need_text("why", why)
        if part.channel is None:  # just closed by the share's own row
            return False
        self._withdrawn(why)
        return True

    def _withdrawn(self, why: str) -> None:
        """The bank under this share's part is gone for it (its exporter died, refused to
        renew the lease, or the lease ran out): before ready roll back, after ready drain."""
        with self.locked():
            self.bank_withdrawn = True
            if self.may("exporter_died"):
                self.cause = self.cause or why
                self.fire("exporter_died", reason=why)
        self.worker.kick()

    def _renew_due(self, every: float) -> None:
        """Renew the part's lease once half its term or ``every`` seconds have passed since
        the grant or the last renewal; a refusal or a lapse withdraws the bank."""
        part: Part[H, A, R, M, E] | None = self.part
        if part is None or part.channel is None or part.lease_id is None or self.is_terminal or self.bank_withdrawn:
            return
        now = time.monotonic()
        if part.lease_expires_at <= now:
            self._withdrawn(f"the lease of {part.label} ran out unrenewed")
        elif part.renewal_key is None and now - part.renewed_at >= min(part.lease_s / 2, every):
            # (a part on a link is renewed by the importer's native thread: lease_lost)
            try:
                part.renew()
            except (KvStateError, OSError) as exc:
                if part.channel is not None:  # not just closed by the share's own row
                    self._withdrawn(f"lease renewal of {part.label} failed: {exc}")

    def load(self, bank_block_ids: Sequence[int], dst_tensors: Mapping[str, Any],
             dst_block_ids: Sequence[int], cut: loads.Sliced | None = None) -> TransferHandle:
        """Scatter bank blocks of this rank's part into the engine's paged KV tensors:
        for every region, bank block ``bank_block_ids[i]`` into page ``dst_block_ids[i]`` of
        ``dst_tensors[name]`` (``Group.load`` for one rank: the same checks, the same handle
        with per-region waits); ``cut``: only that slice of every block (the KV heads
        of a heterogeneous-TP part), into ``dst_tensors`` shaped like it. Returns at once. Only in ``ready``: TransitionError (ILLEGAL) before
        the coordinator released loads or after a drain; ArgumentInvalid (a load/store reason) for bad
        arguments, before anything is submitted."""
        if not self.may("load"):
            raise TransitionError.illegal(self.table.name, self.state, "load")
        part = self._mapped_part()
        plan = loads.paged_parts(self.label, part.descriptor.geometry, {self.rank: part}, {self.rank: dst_tensors},
                                 bank_block_ids, dst_block_ids, cut)
        return self._fire_load(plan)

    def load_prefix(self, blocks: Sequence[int], dst: E | NixlAllocation, *, timeout: float = 30.0) -> LoadResult:
        """Copy ``blocks`` (in order) of this rank's part into one dense buffer, and wait: a
        native gather from a mapped part, or NIXL READs of a remote part (``dst`` is then
        memory registered with this worker's NIXL agent). Only in ``ready``."""
        t = check_timeout(timeout)
        if not self.may("load"):
            raise TransitionError.illegal(self.table.name, self.state, "load")
        part = self.part
        if isinstance(part, RemotePart):
            return self._read_remote(part, blocks, dst, t)
        mapped = self._mapped_part()
        if isinstance(dst, NixlAllocation):
            raise ArgumentInvalid.transfer(ArgumentReason.TENSOR, "dst", "a mapped part loads into host memory")
        g = mapped.descriptor.geometry
        ids = block_ids(blocks, g.num_blocks, "blocks")
        host = hasattr(self.importer.transport, "submit_blocks")
        handle = self._fire_load(loads.dense_parts(self.label, g, {self.rank: mapped}, {self.rank: dst}, ids, host))
        if not handle.wait(t):
            handle.cancel()
            raise TransferFailed(TransferFailReason.LOAD,
                                 f"{self.label}: prefix load still running after {timeout} s; cancelled")
        result = handle.result()
        if result is None or not result.ok:
            raise TransferFailed(TransferFailReason.LOAD, f"{self.label}: prefix load failed")
        return LoadResult(result.blocks, result.bytes, result.seconds)

    def _mapped_part(self) -> Part[H, A, R, M, E]:
        part = self.part
        if part is None or part.mapping is None or part.state != "imported":
            raise ArgumentInvalid.transfer(ArgumentReason.STATE, self.label, "its part is not mapped")
        return part

    def _fire_load(self, plan: Plan) -> TransferHandle:
        try:
            self.fire("load", plan=plan)
        finally:
            plan.release()  # a plan the share refused still holds its tensors
        assert plan.handle is not None
        return plan.handle

    def _read_remote(self, part: RemotePart[H, A, R, M, E], blocks: Sequence[int], dst: object,
                     timeout: float) -> LoadResult:
        if not isinstance(dst, NixlAllocation):
            raise ArgumentInvalid.transfer(ArgumentReason.TENSOR,
                                           "dst", "a NIXL part reads into memory registered with "
                                           "this worker's NixlTransport")
        ids = block_ids(blocks, part.descriptor.geometry.num_blocks, "blocks")
        start = time.monotonic()
        self.fire("load")  # submit_load pins the part (one step under the lock); the READ runs outside it
        try:
            done = part.read(ids, dst, timeout=timeout)
        except KvStateError as exc:
            raise TransferFailed(TransferFailReason.LOAD, f"{self.label}: load failed: {exc}") from exc
        finally:
            part.unpin()
            self.worker.kick()
        return LoadResult(len(ids), done, time.monotonic() - start)
