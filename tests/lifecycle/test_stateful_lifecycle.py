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
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from backends import CudaBackend, HostBackend
from conftest import DEPLOYMENT, GEOMETRY, expected_blocks, make_exporter
from kvstate.core.errors import (DrainTimeout, GroupRejected, IllegalTransition, ImportFailed, KvStateError,
                            LoadFailed, RegistrationFailed, TransitionError)
from kvstate.share.exporter import Exporter, ExportConfig
from kvstate.core.identity import Incarnation
from kvstate.share.importer import Group, ImportConfig, Importer
from kvstate.core.machine import StateChange, effect
from support.faults import FaultyTransport

TPS = (1, 3)


def wait_until(predicate: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class LifecycleMachine(RuleBasedStateMachine):
    importer_class: type[Importer] = Importer
    backend_class: type[HostBackend] | type[CudaBackend] = HostBackend

    @initialize()
    def start(self) -> None:
        self.backend = self.backend_class()
        self.transport = self.backend.transport
        self.baseline = self.transport.native.stats()
        self.faulty = FaultyTransport(self.transport)
        self.changes: list[StateChange] = []
        self.exporters = {tp: make_exporter(tp, self.transport, name=f"tp{tp}", backend=self.backend) for tp in TPS}
        for ex in self.exporters.values():
            for bank in ex.banks.values():
                bank.observe(self.changes.append)
        self.importer = self.importer_class(ImportConfig(DEPLOYMENT), self.faulty, observers=[self._on_change])  # type: ignore[arg-type]
        self.groups: list[Group] = []
        self.drain_on_import = False

    def _on_change(self, change: StateChange) -> None:
        self.changes.append(change)
        if self.drain_on_import and change.machine == "part" and change.dest == "imported":
            self.drain_on_import = False
            self.importer.groups[-1].fault("drain")

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

    def live(self, state: str) -> list[Group]:
        return [g for g in self.importer.groups if g.state == state]

    # -- imports -------------------------------------------------------------------------

    @rule(tp=st.sampled_from(TPS), fault=st.sampled_from([None, "import_", "reserve", "map", "set_access"]),
          rank=st.integers(0, 2), drain_midway=st.booleans())
    def import_group(self, tp: int, fault: str | None, rank: int, drain_midway: bool) -> None:
        ex = self.exporters[tp]
        if fault is not None:
            self.faulty.fail(fault, after=rank % tp)
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
        for bank in new.banks.values():
            bank.observe(self.changes.append)
        with pytest.raises(ImportFailed, match="stale_incarnation"):
            self.importer.import_group(old)

    # -- loads ---------------------------------------------------------------------------

    @precondition(lambda self: bool(self.live("ready")))
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        """INV-LOAD-BYTES: what a ready group reads equals what the exporter wrote."""
        group = data.draw(st.sampled_from(self.live("ready")))
        blocks = data.draw(st.lists(st.integers(0, GEOMETRY.num_blocks - 1), min_size=1, max_size=6))
        n = len(blocks) * GEOMETRY.block_bytes
        dst = [self.backend.destination(n) for _ in range(group.tp)]
        try:
            group.load_prefix(blocks, dst)
            for part, buf in zip(group.parts, dst):
                assert self.backend.read(buf, n) == expected_blocks(part.rank, blocks), "INV-LOAD-BYTES: bytes differ"
        finally:
            for buf in dst:
                self.backend.free(buf)

    @precondition(lambda self: bool(self.live("ready")))
    @rule(data=st.data())
    def drain_during_load(self, data: st.DataObject) -> None:
        group = data.draw(st.sampled_from(self.live("ready")))
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
        except DrainTimeout:
            assert group.state == "draining" and all(p.mapping is not None for p in group.parts)
        finally:
            self.backend.hold(False)
        t.join(5)
        assert not errors, errors
        for part, buf in zip(group.parts, dst):
            assert self.backend.read(buf, n) == expected_blocks(part.rank, [1, 2])
            self.backend.free(buf)

    # -- faults and drains ---------------------------------------------------------------

    @precondition(lambda self: bool(self.live("ready")))
    @rule(data=st.data())
    def exporter_connection_dies(self, data: st.DataObject) -> None:
        group = data.draw(st.sampled_from(self.live("ready")))
        part = data.draw(st.sampled_from(group.parts))
        for ex in self.exporters.values():
            for bank in ex.banks.values():
                for lease in list(bank.leases.values()):
                    if lease.id == part.lease_id and bank.rank == part.rank:
                        lease.channel.close()
        assert wait_until(lambda: group.state != "ready"), "peer death not noticed"

    @precondition(lambda self: bool(self.live("ready")))
    @rule(data=st.data())
    def lease_expires(self, data: st.DataObject) -> None:
        group = data.draw(st.sampled_from(self.live("ready")))
        for part in group.parts:
            part.lease_expires_at = 0.0
        assert wait_until(lambda: group.state == "draining"), "expired lease not noticed"

    @precondition(lambda self: bool(self.live("ready") or self.live("draining")))
    @rule(data=st.data())
    def drain_group(self, data: st.DataObject) -> None:
        group = data.draw(st.sampled_from(self.live("ready") + self.live("draining")))
        group.drain(timeout=5)
        assert group.state == "closed"

    @rule(tp=st.sampled_from(TPS), step=st.sampled_from(["reserve", "map", "set_access", "export"]))
    def registration_fails(self, tp: int, step: str) -> None:
        """INV-REGISTER-ATOMIC: a failing step leaves the bank allocated, owned by the engine."""
        self.register_failing(lambda: self.faulty.fail(step), self.faulty)

    def register_failing(self, plant: Any, transport: Any) -> None:
        ex = Exporter(ExportConfig(DEPLOYMENT, Path(tempfile.mkdtemp()) / "s", bytes(16), 1,
                                   handle_kind=self.backend.handle_kind), transport)
        bank = ex.add_bank(0, GEOMETRY)
        before = self.transport.native.stats()
        plant()
        with pytest.raises(RegistrationFailed):
            bank.fire("register")
        self.faulty.clear()
        after = self.transport.native.stats()
        assert (bank.state, bank.owner) == ("allocated", "engine"), "INV-REGISTER-ATOMIC"
        assert (after.reservations, after.regions) == (before.reservations, before.regions)
        bank.fire("release")

    @rule(data=st.data())
    def illegal_event(self, data: st.DataObject) -> None:
        """INV-EVENT-DECLARED on live objects: an undeclared event changes nothing."""
        objs: list[Any] = [*self.importer.groups] + [b for ex in self.exporters.values() for b in ex.banks.values()]
        obj = data.draw(st.sampled_from(objs))
        # Draw from every event, not from the ones illegal right now: the live state can
        # change between Hypothesis replays (watchers, expiry), and generation must not.
        event = data.draw(st.sampled_from(sorted(obj.table.event_names)))
        with obj.locked():  # watchers, expiry and exporter threads move objects too
            if obj.may(event):
                return
            before = obj.state
            with pytest.raises(IllegalTransition):
                obj.fire(event)
            assert obj.state == before

    @precondition(lambda self: bool(self.importer.groups))
    @rule(data=st.data())
    def guided_fault(self, data: st.DataObject) -> None:
        """Guided: a fault event legal in the group's current state, through the real API."""
        group = data.draw(st.sampled_from(self.importer.groups))
        event = data.draw(st.sampled_from(("peer_died", "expired", "incarnation_changed")))
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
            if g.state in ("failed", "rejected", "closed"):
                assert all(p.mapping is None for p in g.parts), "INV-ROLLBACK-COMPLETE"

    @invariant()
    def no_release_before_quiescent(self) -> None:
        """INV-RELEASE-QUIESCENT: every release came from quiescent (or never-registered)."""
        if not hasattr(self, "changes"):
            return
        for c in self.changes:
            if c.machine == "bank" and c.dest == "released":
                assert c.source in ("quiescent", "allocated"), f"INV-RELEASE-QUIESCENT: {c}"
            if c.machine == "bank" and c.event == "grant_lease":
                assert c.source not in ("draining", "quiescent"), "INV-DRAIN-NO-NEW"


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)


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
