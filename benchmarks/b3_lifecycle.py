"""B3, lifecycle overhead: kvstate.core.machine driving the real tables.

Minimal harness classes implement the bank, group and part tables with bookkeeping
only (no native layer), so the figures are the cost of the machines themselves:
``fire()``, table lookup, guards, effects with undo, observers.

Readiness: the harness group keeps a count of imported parts and the set of distinct
(fingerprint, tp, generation) they report, maintained by an observer on each part, so
``all_parts_imported`` and ``parts_compatible`` are O(1). The row times one
``complete`` (the readiness check) as tp grows; it should stay flat.

Figures are CPU seconds of this process (``time.process_time``), not wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from benchmarks.framework import Figure, no_gc

if TYPE_CHECKING:
    from kvstate.transport.host import HostEndpoint

#: B3 is single-threaded pure Python: it is timed in CPU time of this process, so a busy
#: neighbour on a shared machine does not bill its time slices to the machines.
clock = time.process_time
from kvstate.core.machine import Lifecycle, StateChange, effect, guard
from kvstate.core.spec import load_machine


class BenchBank(Lifecycle):
    table = load_machine("bank")

    def __init__(self) -> None:
        super().__init__(label="bench-bank")
        self.leases = 0
        self.generation = 0

    @guard("accepting_leases")
    def _accepting(self, **_: Any) -> bool:
        return self.leases < 64

    @guard("last_lease")
    def _last(self, **_: Any) -> bool:
        return self.leases == 1

    @guard("native_quiescent")
    def _quiescent(self, **_: Any) -> bool:
        return self.leases == 0

    @guard("lease_live")
    def _live(self, **_: Any) -> bool:
        return self.leases > 0

    @effect("expire_lease")
    def _expire(self, **_: Any) -> None:
        return None

    @effect("renew_lease")
    def _renew(self, **_: Any) -> None:
        return None

    @effect("withdraw_descriptor")
    def _withdraw(self, **_: Any) -> None:
        return None

    @effect("native_register")
    def _register(self, **_: Any) -> None:
        return None

    @effect("publish_descriptor")
    def _publish(self, **_: Any) -> Any:
        self.generation += 1

        def undo() -> None:
            self.generation -= 1
        return undo

    @effect("grant_lease")
    def _grant(self, **_: Any) -> Any:
        self.leases += 1

        def undo() -> None:
            self.leases -= 1
        return undo

    @effect("end_lease")
    def _end(self, **_: Any) -> None:
        self.leases -= 1

    @effect("native_release")
    def _release(self, **_: Any) -> None:
        return None

    @effect("submit_store")
    def _store(self, **_: Any) -> None:
        return None

    @effect("collect_store")
    def _stored(self, **_: Any) -> None:
        return None


BANK_CYCLE = ("register", "advertise", "grant_lease", "lease_mapped", "release_lease", "drain", "quiesce", "release")


class BenchPart(Lifecycle):
    table = load_machine("part")

    def __init__(self, group: BenchGroup, rank: int, observed: bool = True) -> None:
        super().__init__(label=f"bench-part-{rank}", observers=[group.part_changed] if observed else [])
        self.group = group
        self.fingerprint = b"geometry"

    @guard("group_importing")
    def _importing(self, **_: Any) -> bool:
        return self.group.state == "importing"

    @guard("group_admitted")
    def _admitted(self, **_: Any) -> bool:
        return self.group.state == "importing"

    @guard("group_releasing")
    def _releasing(self, **_: Any) -> bool:
        return self.group.state not in ("ready", "draining")

    @guard("part_unpinned")
    def _unpinned(self, **_: Any) -> bool:
        return True

    @effect("native_lease")
    def _lease(self, **_: Any) -> None:
        return None

    @effect("return_lease")
    def _return(self, **_: Any) -> None:
        return None

    @effect("native_import")
    def _import(self, **_: Any) -> None:
        return None

    @effect("unmap_close")
    def _close(self, **_: Any) -> None:
        return None


class BenchGroup(Lifecycle):
    table = load_machine("group")

    def __init__(self, tp: int, counted: bool = True) -> None:
        super().__init__(label=f"bench-group-tp{tp}")
        self.tp = tp
        #: Readiness from counts an observer keeps (O(1)); else from the parts (no observers).
        self.counted = counted
        self.imported = 0
        self.kinds: dict[tuple[bytes, int, int], int] = {}
        self.loads = 0
        self.parts = [BenchPart(self, r, observed=counted) for r in range(tp)]

    def part_changed(self, change: StateChange) -> None:
        key = (b"geometry", self.tp, 1)
        if change.dest == "imported":
            self.imported += 1
            self.kinds[key] = self.kinds.get(key, 0) + 1
        elif change.source == "imported":
            self.imported -= 1
            self.kinds[key] -= 1
            if not self.kinds[key]:
                del self.kinds[key]

    @guard("group_validated")
    def _validated(self, **_: Any) -> bool:
        return True

    @guard("all_parts_imported")
    def _all(self, **_: Any) -> bool:
        if self.counted:
            return self.imported == self.tp
        return all(p.state == "imported" for p in self.parts)

    @guard("parts_compatible")
    def _compatible(self, **_: Any) -> bool:
        if self.counted:
            return len(self.kinds) == 1
        return len({p.fingerprint for p in self.parts}) == 1

    @guard("native_quiescent")
    def _quiescent(self, **_: Any) -> bool:
        return True

    @effect("rollback_parts")
    def _rollback(self, **_: Any) -> None:
        return None

    @effect("submit_load")
    def _load(self, **_: Any) -> None:
        self.loads += 1

    @effect("collect_load")
    def _loaded(self, **_: Any) -> None:
        return None

    @effect("unmap_parts")
    def _unmap(self, **_: Any) -> None:
        return None


GROUP_CYCLE = ("begin_import", "complete", "load", "load", "drain", "quiesce", "close")


def bank_transition(p: dict[str, Any]) -> Figure:
    """Seconds per bank transition, over whole register-to-release cycles."""
    samples = []
    for _ in range(p["repeats"]):
        banks = [BenchBank() for _ in range(p["cycles"])]
        with no_gc():
            t0 = clock()
            for bank in banks:
                for event in BANK_CYCLE:
                    bank.fire(event)
            samples.append((clock() - t0) / (p["cycles"] * len(BANK_CYCLE)))
        assert all(b.state == "released" for b in banks)
    return Figure(tuple(samples), note=f"{len(BANK_CYCLE)}-transition bank cycle; goal <= 15 us; CPU time")


def group_transition(p: dict[str, Any]) -> Figure:
    """Seconds per group transition over import-to-close cycles (the part's own, untimed)."""
    samples = []
    for _ in range(p["repeats"]):
        groups = [BenchGroup(1) for _ in range(p["cycles"])]
        with no_gc():
            t0 = clock()
            for g in groups:
                g.fire("begin_import")
            timed_s = clock() - t0
            for g in groups:  # rank part import: not a group transition
                g.parts[0].fire("validate")
                g.parts[0].fire("lease")
                g.parts[0].fire("open")
            t0 = clock()
            for g in groups:
                for event in GROUP_CYCLE[1:]:
                    g.fire(event)
            timed_s += clock() - t0
        samples.append(timed_s / (p["cycles"] * len(GROUP_CYCLE)))
        assert all(g.state == "closed" and g.loads == 2 for g in groups)
    return Figure(tuple(samples), note=f"{len(GROUP_CYCLE)}-transition group cycle; goal <= 15 us; CPU time")


def readiness(tp: int) -> Any:
    def run(p: dict[str, Any]) -> Figure:
        samples = []
        for _ in range(p["repeats"]):
            groups = [BenchGroup(tp) for _ in range(p["groups"])]
            for g in groups:
                g.fire("begin_import")
                for part in g.parts:
                    part.fire("validate")
                    part.fire("lease")
                for part in g.parts:
                    part.fire("open")
            with no_gc():
                t0 = clock()
                for g in groups:
                    g.fire("complete")
                samples.append((clock() - t0) / p["groups"])
            assert all(g.state == "ready" for g in groups)
        return Figure(tuple(samples), note=f"one readiness check (complete) at tp={tp}; CPU time")
    return run


def real_group_readiness(tp: int) -> Any:
    """The real ``kvstate.share.importer.Group`` guards (recomputed from its parts' states on every
    check, O(tp) by design: a safety guard reads the truth, not a counter). Its parts are
    real ``Part`` machines whose native import effect is replaced by a stand-in mapping
    (no native call: the groups are never drained), so the row times the machine and
    guards only."""
    from kvstate.share.importer import Group, ImportConfig, Importer, Part
    from kvstate.reuse.policy import ReuseSettings
    from kvstate.core.machine import effect
    from kvstate.core.validate import ValidatedGroup
    from kvstate.core.identity import Deployment
    from kvstate.transport.host import HostAllocation, HostHandle, HostMapping, HostReservation, HostTransport

    class StandInPart(Part[HostHandle, HostAllocation, HostReservation, HostMapping, "HostEndpoint"]):
        @effect("native_lease")
        def _lease(self, **_: Any) -> Callable[[], None]:
            return lambda: None

        @effect("native_import")
        def _import(self, **_: Any) -> None:
            size = self.descriptor.size
            self.mapping = HostMapping(0, 0, size, HostAllocation(0, size, True), HostReservation(0, 0, size))

    def run(p: dict[str, Any]) -> Figure:
        descriptors = _descriptors(tp)
        importer = Importer(ImportConfig(Deployment("bench", bytes(32)), reuse=ReuseSettings(enable_decode_to_prefill_reuse=True)), HostTransport())
        samples = []
        try:
            for _ in range(p["repeats"]):
                groups = []
                for _ in range(p["groups"]):
                    g = Group(importer, "bench", ())
                    g.validated = ValidatedGroup(descriptors)
                    g.parts = [StandInPart(g, d) for d in descriptors]
                    g.fire("begin_import")
                    for part in g.parts:
                        part.fire("validate")
                        part.fire("lease")
                    for part in g.parts:
                        part.fire("open")
                    groups.append(g)
                with no_gc():
                    t0 = clock()
                    for g in groups:
                        g.fire("complete")
                    samples.append((clock() - t0) / p["groups"])
                assert all(g.state == "ready" for g in groups)
        finally:
            importer.close()
        return Figure(tuple(samples), note=f"importer.Group complete at tp={tp}, guards recomputed; CPU time")
    return run


def _descriptors(tp: int) -> tuple[Any, ...]:
    import os
    import time as _time

    from kvstate.core.descriptor import Descriptor
    from kvstate.core.geometry import DType, Geometry, Layout
    from kvstate.core.handles import HandleKind
    from kvstate.core.identity import FabricDomain, FabricKind

    g = Geometry.uniform(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype=DType.BF16,
                 layout=Layout.BLOCK_MAJOR, num_blocks=64)
    return tuple(Descriptor(
        deployment_id=bytes(16), source_id=bytes(16), fabric=FabricDomain(FabricKind.NODE, "n"),
        host_boot_id=bytes(16), device_uuid=bytes(16), incarnation=bytes(16), pid=os.getpid(), rank=r, tp=tp,
        geometry=g, handle_kind=HandleKind.MEMFD, handle=bytes(16), size=g.bank_size(4096), granularity=4096,
        generation=1, expires_at_ns=_time.time_ns() + 10**12, socket_path="/x", inventory_epoch=0,
    ) for r in range(tp))
