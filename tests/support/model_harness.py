"""Lifecycle-based stand-ins for the exporter/importer classes, for replaying Spin trails.

Each machine is a real :class:`kvstate.core.machine.Lifecycle` subclass bound to a given
(possibly broken) table; its guards and effects work over simple real state (part
states, pin counts, lease counts) with the same meaning as the Promela registry in
:mod:`kvstate.derive.promela`. A class implements exactly the guards and effects its table
declares, so a table with a guard removed yields the matching broken implementation.
When the real exporter/importer classes land, point :func:`kvstate.harness.modelcheck.replay`
at them instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstate.core.errors import TransitionError
from kvstate.core.reasons import TransitionReason
from kvstate.core.machine import Lifecycle, effect, guard
from kvstate.derive.promela import MAX_LEASES, OP_SLOTS
from kvstate.core.spec import MachineSpec, Spec


class World:
    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.pins = [0] * tp
        self.leases = [0] * tp  # a bank per rank
        self.expired = [0] * tp  # of which expired (the model's xl)
        self.incompatible = False
        self.objects: dict[str, Any] = {}

    def parts(self) -> list[Any]:
        return [self.objects[f"part[{r}]"] for r in range(self.tp)]

    def violations(self) -> list[str]:
        """The model's state invariants, evaluated on the Python objects."""
        found = []
        group = self.objects["group[0]"]
        states = [p.state for p in self.parts()]
        if group.state == "ready" and (any(s != "imported" for s in states) or self.incompatible):
            found.append("INV-GROUP-COMPLETE")
        if group.state == "failed" and "imported" in states:
            found.append("INV-ROLLBACK-COMPLETE")
        for b in range(self.tp):
            if self.objects[f"bank[{b}]"].state == "released" and (self.leases[b] or self.pins[b]):
                found.append("INV-RELEASE-QUIESCENT")
            if self.objects[f"bank[{b}]"].state == "released" and states[b] == "imported":
                found.append("INV-NO-RELEASE-MAPPED")
        if any(self.pins[r] and states[r] != "imported" for r in range(self.tp)):
            found.append("INV-NO-UNMAP-PINNED")
        return found


Impl = Callable[..., Any]


def _bank(w: World, b: int) -> dict[str, Impl]:
    def lease_delta(d: int) -> Impl:
        def run(self: Any, **kw: Any) -> None:
            w.leases[b] += d
            w.expired[b] = min(w.expired[b], w.leases[b])
        return run

    def expire(self: Any, **kw: Any) -> None:
        w.expired[b] += 1
    return {
        "accepting_leases": lambda self, **kw: w.leases[b] < MAX_LEASES,
        "last_lease": lambda self, **kw: w.leases[b] == 1,
        "lease_live": lambda self, **kw: w.leases[b] > w.expired[b],
        "native_quiescent": lambda self, **kw: w.leases[b] == 0 and w.pins[b] == 0,
        "grant_lease": lease_delta(+1), "end_lease": lease_delta(-1), "expire_lease": expire,
    }


def _close_all(w: World) -> Impl:
    def run(self: Any, **kw: Any) -> None:
        for part in w.parts():
            if part.may("close"):
                try:
                    part.fire("close")
                except TransitionError as exc:
                    if exc.reason is not TransitionReason.GUARD:
                        raise
                    pass  # the model skips a part whose close guard refuses, too
    return run


def _submit(w: World) -> Impl:
    def run(self: Any, **kw: Any) -> None:
        for k in range(OP_SLOTS):
            op = w.objects[f"op[{k}]"]
            if op.state == "created":
                op.fire("submit")
                return
    return run


def _group(w: World) -> dict[str, Impl]:
    return {
        "group_validated": lambda self, **kw: all(p.state == "validated" for p in w.parts()),
        "all_parts_imported": lambda self, **kw: all(p.state == "imported" for p in w.parts()),
        "parts_compatible": lambda self, **kw: not w.incompatible,
        "native_quiescent": lambda self, **kw: not any(w.pins),
        "rollback_parts": _close_all(w), "unmap_parts": _close_all(w), "submit_load": _submit(w),
    }


def _part(w: World, r: int) -> dict[str, Impl]:
    return {
        "group_importing": lambda self, **kw: w.objects["group[0]"].state == "importing",
        "group_admitted": lambda self, **kw: w.objects["group[0]"].state == "importing" and all(
            p.state in ("leased", "imported") for p in w.parts()),
        "group_releasing": lambda self, **kw: w.objects["group[0]"].state not in ("ready", "draining"),
        "part_unpinned": lambda self, **kw: w.pins[r] == 0,
    }


def _op(w: World) -> dict[str, Impl]:
    def pin(d: int) -> Impl:
        def undo() -> None:
            for r in range(w.tp):
                w.pins[r] -= d

        def run(self: Any, **kw: Any) -> Callable[[], None]:
            for r in range(w.tp):
                w.pins[r] += d
            return undo
        return run
    return {"regions_mapped": lambda self, **kw: all(p.state == "imported" for p in w.parts()),
            "pin_regions": pin(+1), "unpin_regions": pin(-1)}


def _bind(table: MachineSpec, impls: dict[str, Impl]) -> type[Lifecycle]:
    """A Lifecycle class for ``table`` implementing exactly its declared guards and effects."""
    body: dict[str, Any] = {"table": table}
    for name in table.guards:
        body[f"g_{name}"] = guard(name)(impls[name])
    for name in table.effects:
        body[f"e_{name}"] = effect(name)(impls.get(name, lambda self, **kw: None))
    return type(f"Harness_{table.name}", (Lifecycle,), body)


def build(spec: Spec, tp: int, world: dict[str, int] | None = None) -> World:
    """Objects keyed ``machine[index]`` (as in trails), bound to ``spec``'s tables."""
    w = World(tp)
    w.incompatible = bool((world or {}).get("incompatible", 0))
    for b in range(tp):
        w.objects[f"bank[{b}]"] = _bind(spec["bank"], _bank(w, b))(label=f"bank[{b}]")
    w.objects["group[0]"] = _bind(spec["group"], _group(w))(label="group[0]")
    for r in range(tp):
        w.objects[f"part[{r}]"] = _bind(spec["part"], _part(w, r))(label=f"part[{r}]")
    for k in range(OP_SLOTS):
        w.objects[f"op[{k}]"] = _bind(spec["op"], _op(w))(label=f"op[{k}]")
    return w
