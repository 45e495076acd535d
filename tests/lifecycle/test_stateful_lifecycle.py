"""Hypothesis stateful test of the real exporter and importer, over each backend.

Two exporters (sources of tp 1 and 3) serve real sockets in this process; one importer
imports, loads and drains groups from them while rules inject faults: registration
failure at each step, part import failure, peer death, incarnation change, expiry, drain
during import and drain during load. Invariants are checked after every step, by id.

It runs over the host backend (memfds), and over the cuda backend on the C engine with
the CPU shim driver (tests/cudashim): the same machine, the real CUDA code path, with
registration also failed inside the driver, and the shim's record of what would be
undefined on a GPU (an unmap under a queued copy...) checked after every step.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from support.errors import raises
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from backends import CudaBackend, HostBackend
from conftest import DEPLOYMENT, GEOMETRY, expected_blocks, make_exporter
from kvstate.core.errors import TimedOut
from kvstate.core.reasons import TimeoutReason
from kvstate.core.errors import GroupRejected, ImportFailed, KvStateError, TransitionError, NativeError
from kvstate.core.reasons import NativeReason, TransitionReason
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.core.identity import Incarnation
from kvstate.share import adopt
from kvstate.share.importer import Group, ImportConfig, Importer, Part
from kvstate.core.machine import StateChange, effect
from support.faults import KINDS as FAULT_KINDS, FaultyTransport
from support.reuse import reuse_for
from support.waiting import wait_until

TPS = (1, 3)
GROUP_STATES = tuple(Group.table.state_names)



class LifecycleMachine(RuleBasedStateMachine):
    importer_class: type[Importer] = Importer
    backend_class: type[HostBackend] | type[CudaBackend] = HostBackend
    park_s = 0.0  # ImportConfig.park_s (kvstate.share.parked)

    @initialize()
    def start(self) -> None:
        self.backend = self.backend_class()
        self.transport = self.backend.transport
        self.baseline = self.transport.native.stats()
        self.faulty = FaultyTransport(self.transport)
        self.changes: list[StateChange] = []
        self.released_mapped: list[str] = []
        self.dying: Exporter | None = None  # an exporter "process" that dies: its release is moot
        self.exporters = {tp: make_exporter(tp, self.transport, name=f"tp{tp}", backend=self.backend)
                          for tp in TPS}
        for ex in self.exporters.values():
            self.watch(ex)
        self.importer = self.importer_class(ImportConfig(DEPLOYMENT, park_s=self.park_s, **reuse_for(self.faulty)),
                                            self.faulty, observers=[self._on_change])  # type: ignore[arg-type]
        self.groups: list[Group] = []
        self.drain_on_import = False

    def _on_change(self, change: StateChange) -> None:
        self.changes.append(change)
        if self.drain_on_import and change.machine == "part" and change.dest == "imported":
            self.drain_on_import = False
            self.importer.groups[-1].drain(5.0)

    def teardown(self) -> None:
        if not hasattr(self, "importer"):
            return
        self.backend.hold(False)
        for g in self.importer.groups:
            if not g.is_terminal:
                g.drain(timeout=5)
        self.importer.close()
        for ex in self.exporters.values():
            ex.drain(5.0)
            ex.stop()
        s, b = self.transport.native.stats(), self.baseline
        assert (s.allocations, s.reservations, s.regions, s.pins) == \
            (b.allocations, b.reservations, b.regions, b.pins), "leaked native objects"
        self.backend.close()

    def unpark(self, ex: Exporter) -> None:
        """Drop the leases parked for ``ex``'s banks (kvstate.share.parked), if any."""
        address = ex.lease_address
        for parked in self.importer.peers.take_parked_where(lambda p: p.link.address == address):
            self.importer._drop_parked(parked)

    def pick(self, data: st.DataObject, *states: str) -> Group | None:
        """A live group in one of ``states``, or None. What is drawn never depends on the
        live state (an index into a fixed range): watcher and expiry threads move groups
        between replays, and Hypothesis needs the same draws to mean the same test. So a
        rule draws everything else it needs before it looks at what this returns (a rule
        that draws less when no group is found replays as FlakyStrategyDefinition)."""
        index = data.draw(st.integers(0, 63))
        found = [g for g in self.importer.groups if g.state in states]
        return found[index % len(found)] if found else None

    def live(self, state: str) -> list[Group]:
        return [g for g in self.importer.groups if g.state == state]

    # -- imports -------------------------------------------------------------------------

    @rule(tp=st.sampled_from(TPS),
          fault=st.sampled_from([None, "receive_handle", "import_", "reserve", "map", "set_access"]),
          kind=st.sampled_from(sorted(FAULT_KINDS)), rank=st.integers(0, 2), drain_midway=st.booleans())
    def import_group(self, tp: int, fault: str | None, kind: str, rank: int, drain_midway: bool) -> None:
        """A fault of any kind (typed or not) at any step of any rank: ImportFailed, the
        group failed and rolled back, every lease returned (checked by the invariants)."""
        ex = self.exporters[tp]
        if fault is not None:
            self.unpark(ex)  # an adopted part skips the faulted step
            self.faulty.fail(fault, after=rank % tp, kind=kind)
        self.drain_on_import = drain_midway and tp > 1
        expect_failure = fault is not None or self.drain_on_import
        try:
            group = self.importer.import_group([ex.descriptor(r) for r in range(tp)])
        except ImportFailed:
            assert expect_failure
            assert self.importer.groups[-1].state == "failed"
        else:
            assert not expect_failure and group.state == "ready"
        finally:
            self.faulty.clear()
            self.drain_on_import = False

    @rule(tp=st.sampled_from(TPS))
    def exporter_restarts(self, tp: int) -> None:
        """Incarnation change: the exporter process dies and a new one takes its socket.
        Importers see peer death; the old descriptors are refused at lease time."""
        ex = self.exporters[tp]
        self.dying = ex
        old = [ex.descriptor(r) for r in range(tp)]
        for bank in ex.banks.values():
            for lease in list(bank.leases.values()):
                lease.channel.close()
        ex.stop()
        ex.drain(5.0)
        mine = [g for g in self.importer.groups if g.parts and g.parts[0].descriptor.source_id == ex.config.source_id]
        assert wait_until(lambda: all(g.state != "ready" for g in mine)), "peer death not noticed"
        self.exporters[tp] = new = make_exporter(tp, self.transport, name=f"tp{tp}", socket_dir=ex.config.socket_dir,
                                                 source=ex.config.source_id, backend=self.backend)
        self.watch(new)
        with pytest.raises(ImportFailed, match="stale_incarnation"):
            self.importer.import_group(old)

    # -- loads ---------------------------------------------------------------------------

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        """INV-LOAD-BYTES: what a ready group reads equals what the exporter wrote."""
        blocks = data.draw(st.lists(st.integers(0, GEOMETRY.num_blocks - 1), min_size=1, max_size=6))
        group = self.pick(data, "ready")
        if group is None:
            return
        n = len(blocks) * GEOMETRY.block_bytes
        dst = [self.backend.destination(n) for _ in range(group.tp)]
        try:
            group.load_prefix(blocks, dst)
            for part, buf in zip(group.parts, dst):
                assert self.backend.read(buf, n) == expected_blocks(part.rank, blocks), "INV-LOAD-BYTES: bytes differ"
        finally:
            for buf in dst:
                self.backend.free(buf)

    @rule(data=st.data())
    def drain_during_load(self, data: st.DataObject) -> None:
        group = self.pick(data, "ready")
        if group is None:
            return
        n = 2 * GEOMETRY.block_bytes
        dst = [self.backend.destination(n) for _ in range(group.tp)]
        self.backend.hold(True)
        errors: list[BaseException] = []

        def load() -> None:
            try:
                group.load_prefix([1, 2], dst)
            except BaseException as exc:  # reported below
                errors.append(exc)
        t = threading.Thread(target=load)
        t.start()
        assert wait_until(lambda: bool(group.loads))
        try:
            group.drain(timeout=0.02)
        except TimedOut as exc:
            if exc.reason is not TimeoutReason.DRAIN:
                raise
            assert group.state == "draining" and all(p.mapping is not None for p in group.parts)
        finally:
            self.backend.hold(False)
        t.join(5)
        assert not errors, errors
        for part, buf in zip(group.parts, dst):
            assert self.backend.read(buf, n) == expected_blocks(part.rank, [1, 2])
            self.backend.free(buf)

    # -- faults and drains ---------------------------------------------------------------

    @rule(data=st.data())
    def exporter_connection_dies(self, data: st.DataObject) -> None:
        which = data.draw(st.integers(0, 7))
        group = self.pick(data, "ready")
        if group is None:
            return
        part = group.parts[which % group.tp]
        for ex in self.exporters.values():
            for bank in ex.banks.values():
                for lease in list(bank.leases.values()):
                    if lease.id == part.lease_id and bank.rank == part.rank:
                        lease.channel.close()
        assert wait_until(lambda: group.state != "ready"), "peer death not noticed"

    @rule(data=st.data())
    def lease_expires(self, data: st.DataObject) -> None:
        """Issue 14, class 7: a lease runs out at its exporter (a renewal was lost). The
        bank drains but keeps the lease while the importer maps it; the importer's next
        renewal is refused, its group expires and closes itself; only then may the bank
        be released (INV-NO-RELEASE-MAPPED, checked when any bank is released)."""
        group = self.pick(data, "ready")
        if group is None:
            return
        ex = self.exporters[group.tp]
        # The lease table is native: one expiry round that looks past every term runs out
        # all of this exporter's leases (it is replaced right after anyway).
        ex.lease_server.expire(ahead_s=3600.0)
        assert wait_until(lambda: group.state == "closed"), f"expired lease not let go: {group.state}"
        self.replace_exporter(group.tp)

    def replace_exporter(self, tp: int) -> None:
        """Drain and release an exporter (its importers let go on their own), start a new one."""
        ex = self.exporters[tp]
        ex.drain(5.0)
        ex.stop()
        self.exporters[tp] = new = make_exporter(tp, self.transport, name=f"tp{tp}", socket_dir=ex.config.socket_dir,
                                                 source=ex.config.source_id, backend=self.backend)
        self.watch(new)

    def watch(self, ex: Exporter) -> None:
        def released(change: StateChange) -> None:
            self.changes.append(change)
            if change.machine == "bank" and change.dest == "released" and ex is not self.dying:
                rank = int(change.label.split("rank ")[1].rstrip("]"))
                mapped = [p.label for g in self.importer.groups for p in g.parts
                          if p.descriptor.source_id == ex.config.source_id and p.rank == rank and p.mapping is not None]
                if mapped:
                    self.released_mapped.append(f"{change.label} released while {mapped} map it")
        for bank in ex.banks.values():
            bank.observe(released)

    @rule(data=st.data())
    def drain_group(self, data: st.DataObject) -> None:
        group = self.pick(data, "ready", "draining")
        if group is None:
            return
        group.drain(timeout=5)
        assert group.state == "closed"

    @rule(tp=st.sampled_from(TPS), step=st.sampled_from(["reserve", "map", "set_access", "export"]),
          kind=st.sampled_from(sorted(FAULT_KINDS)))
    def registration_fails(self, tp: int, step: str, kind: str) -> None:
        """INV-REGISTER-ATOMIC: a failing step leaves the bank allocated, owned by the engine."""
        self.register_failing(lambda: self.faulty.fail(step, kind=kind), self.faulty)

    def register_failing(self, plant: Any, transport: Any) -> None:
        ex = Exporter(ExportConfig(DEPLOYMENT, Path(tempfile.mkdtemp()) / "s", bytes(16), 1,
                                   handle_kind=self.backend.handle_kind), transport)
        bank = ex.add_bank(0, GEOMETRY)
        before = self.transport.native.stats()
        plant()
        with raises(NativeError, NativeReason.REGISTRATION):
            bank.register()
        self.faulty.clear()
        after = self.transport.native.stats()
        assert (bank.state, bank.owner) == ("allocated", "engine"), "INV-REGISTER-ATOMIC"
        assert (after.reservations, after.regions) == (before.reservations, before.regions)
        bank.fire("release")

    @rule(data=st.data())
    def illegal_event(self, data: st.DataObject) -> None:
        """INV-EVENT-DECLARED on live objects: an undeclared event changes nothing."""
        # Draw indices into fixed ranges, never from lists built from the live state: it can
        # change between Hypothesis replays (watchers, expiry), and generation must not.
        kind = data.draw(st.sampled_from(["group", "bank"]))
        index, which = data.draw(st.integers(0, 63)), data.draw(st.integers(0, 63))
        objs: list[Any] = list(self.importer.groups) if kind == "group" else \
            [b for ex in self.exporters.values() for b in ex.banks.values()]
        if not objs:
            return
        obj = objs[index % len(objs)]
        events = sorted(obj.table.event_names)
        event = events[which % len(events)]
        with obj.locked():  # watchers, expiry and exporter threads move objects too
            if obj.may(event):
                return
            before = obj.state
            with raises(TransitionError, TransitionReason.ILLEGAL):
                obj.fire(event)
            assert obj.state == before

    @rule(data=st.data())
    def part_event_on_live_group(self, data: st.DataObject) -> None:
        """Issue 14, class 5: any part event on any part of a ready or draining group is
        refused or moves the group out of ready; a ready group never holds a part that left."""
        which = data.draw(st.integers(0, 7))
        event = data.draw(st.sampled_from(sorted(Part.table.event_names)))
        group = self.pick(data, "ready", "draining")
        if group is None:
            return
        part = group.parts[which % group.tp]
        with group.locked():
            before = group.state
            if before not in ("ready", "draining"):  # moved on since the pick, which is outside
                return                                  # the lock (expiry, a peer's death, a drain)
            assert all(p.state == "imported" and p.mapping is not None for p in group.parts), \
                f"INV-GROUP-COMPLETE: the {before} group holds {[p.state for p in group.parts]}"
            try:
                part.fire(event)
            except TransitionError:
                assert part.state == "imported", f"a refused {event} moved {part.label} to {part.state}"
            if group.state == before:
                assert all(p.state == "imported" and p.mapping is not None for p in group.parts), \
                    f"INV-GROUP-COMPLETE: {event} on {part.label} left the {before} group with {part.state}"

    @rule(data=st.data())
    def guided_fault(self, data: st.DataObject) -> None:
        """Guided: a fault event legal in the group's current state, through the real API."""
        event = data.draw(st.sampled_from(("peer_died", "expired", "incarnation_changed")))
        group = self.pick(data, *GROUP_STATES)
        if group is None:
            return
        if group.may(event):  # drawn before looking at the live state (see illegal_event)
            before = group.state
            try:
                group.fault(event)
            except TransitionError:
                assert group.state == before

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def nothing_undefined_reached_the_driver(self) -> None:
        """INV-NO-UNMAP-PINNED at the driver: nothing unmapped, freed or closed under a
        queued copy, no copy outside device memory with access (the cuda backend's shim)."""
        if hasattr(self, "backend"):
            assert not self.backend.violations(), f"INV-NO-UNMAP-PINNED: {self.backend.violations()}"

    @invariant()
    def no_partial_group_is_ready(self) -> None:
        """INV-GROUP-COMPLETE."""
        if not hasattr(self, "importer"):
            return
        for g in self.importer.groups:
            if g.state in ("ready",):
                assert g.validated is not None and len(g.parts) == g.validated.tp
                assert [p.state for p in g.parts] == ["imported"] * g.tp, "INV-GROUP-COMPLETE"
                assert all(p.mapping is not None for p in g.parts), "INV-GROUP-COMPLETE: unmapped part"
            if g.state in ("failed", "rejected", "closed"):
                kept = [p.label for p in g.parts if p.mapping is not None or p.channel is not None
                        or p.received is not None]
                assert not kept, f"INV-ROLLBACK-COMPLETE: {kept} kept a mapping, lease or received handle"

    @invariant()
    def no_release_before_quiescent(self) -> None:
        """INV-RELEASE-QUIESCENT: every release came from quiescent (or never-registered)."""
        if not hasattr(self, "changes"):
            return
        assert not self.released_mapped, f"INV-NO-RELEASE-MAPPED: {self.released_mapped}"
        for c in self.changes:
            if c.machine == "bank" and c.dest == "released":
                assert c.source in ("quiescent", "allocated"), f"INV-RELEASE-QUIESCENT: {c}"
            if c.machine == "bank" and c.event == "grant_lease":
                assert c.source not in ("draining", "quiescent"), "INV-DRAIN-NO-NEW"


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)


class ParkingLifecycleMachine(LifecycleMachine):
    """The same, closed parts parking their leases and later imports adopting them: every
    fault above meets a parked lease too (an import with an injected fault takes the
    ordinary path), and nothing may be left after the importer's close (teardown)."""

    park_s = 30.0

    @rule(tp=st.sampled_from(TPS), drain=st.booleans())
    def import_and_close(self, tp: int, drain: bool) -> None:
        """An import without a planted fault (it may adopt what the last close parked),
        checked by a load, and closed again (parking its leases) or left ready."""
        group = self.importer.import_group([self.exporters[tp].descriptor(r) for r in range(tp)])
        assert group.state == "ready"
        dst = [bytearray(GEOMETRY.block_bytes) for _ in range(tp)]
        group.load_prefix([3], dst)
        assert [bytes(b) for b in dst] == [expected_blocks(r, [3]) for r in range(tp)]
        if drain:
            group.drain(timeout=5)
            assert group.state == "closed"


def test_parking_lifecycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine above, which must have adopted parked leases (else it tested nothing new)."""
    adopted = [0]
    parked = adopt.parked

    def counted(importer: Any, parts: Any, failures: Any) -> Any:
        out = parked(importer, parts, failures)
        adopted[0] += len(out)
        return out

    monkeypatch.setattr(adopt, "parked", counted)
    run_state_machine_as_test(ParkingLifecycleMachine,
                              settings=settings(max_examples=20, stateful_step_count=25, deadline=None))
    assert adopted[0] > 0


class CudaLifecycleMachine(LifecycleMachine):
    backend_class = CudaBackend

    @rule(call=st.sampled_from(["cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemExportToShareableHandle"]))
    def registration_fails_in_the_driver(self, call: str) -> None:
        """INV-REGISTER-ATOMIC with the failure inside the driver."""
        assert isinstance(self.backend, CudaBackend)
        shim = self.backend.shim
        self.register_failing(lambda: shim.fail(call, 1, 2), self.transport)


TestCudaLifecycle = CudaLifecycleMachine.TestCase
TestCudaLifecycle.settings = settings(max_examples=20, stateful_step_count=25, deadline=None)


class LeakyGroup(Group):
    """Planted bug: rolling back a failed import forgets to unmap the imported parts."""

    @effect("rollback_parts")
    def _rollback(self, **kw: Any) -> None:
        pass


class LeakyImporter(Importer):
    group_class = LeakyGroup


@pytest.mark.no_leakcheck  # the planted bug leaks part mappings on purpose
def test_self_test_stateful_catches_rollback_that_leaks_parts() -> None:
    class Planted(LifecycleMachine):
        importer_class = LeakyImporter

        def teardown(self) -> None:  # the planted bug leaks mappings on purpose
            if hasattr(self, "importer"):
                self.backend.hold(False)
                self.importer.close()
                for ex in self.exporters.values():
                    ex.stop()

    with pytest.raises(AssertionError, match="INV-ROLLBACK-COMPLETE"):
        run_state_machine_as_test(Planted, settings=settings(max_examples=50, stateful_step_count=20,
                                                             deadline=None, derandomize=True, database=None))
