"""The Python reference of the native lifecycle executor, for the differential tests
(tests/native/test_machine_differential.py, tests/native/test_machines.py): a real
:class:`~kvstate.core.machine.Lifecycle` on a table, whose guards and effects follow a
per-step plan as ``kvs_machine_fire_planned`` does in C, and the random steps both get."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from kvstate.core.errors import NativeError, TransitionError
from kvstate.core.reasons import NativeReason, TransitionReason
from kvstate.core.machine import Lifecycle, effect, guard
from kvstate.core.spec import MachineSpec, load_machine
from kvstate.derive.header import NATIVE_MACHINES
from kvstate.transport.machines import EFFECT, GUARD, ILLEGAL, OK, REENTRANT, Fired

UNKNOWN_EVENT = "no_such_event"


class _Plan:
    """What the next step of a reference object does: which guards hold, which effects
    (and undos) fail, which effects fire the event again."""

    holds: frozenset[str] = frozenset()
    fail: frozenset[str] = frozenset()
    fail_undo: frozenset[str] = frozenset()
    reenter: frozenset[str] = frozenset()
    event: str = ""


def reference_class(spec: MachineSpec) -> type[Lifecycle]:
    """A Lifecycle on the real table whose guards and effects follow a :class:`_Plan`
    and log each effect and undo, as the native planned callback does."""
    ns: dict[str, Any] = {"table": spec}

    def make_guard(name: str) -> Any:
        def check(self: Any, **_: Any) -> bool:
            return name in self.plan.holds
        return guard(name)(check)

    def make_effect(name: str) -> Any:
        def run(self: Any, **_: Any) -> Any:
            self.calls.append(f"do {name}")
            if name in self.plan.reenter:
                self.fire(self.plan.event)
            if name in self.plan.fail:
                raise RuntimeError(f"planned failure of {name}")

            def undo() -> None:
                self.calls.append(f"undo {name}")
                if name in self.plan.fail_undo:
                    raise RuntimeError(f"planned failure of the undo of {name}")
            return undo
        return effect(name)(run)

    for g in spec.guards:
        ns[f"guard_{g}"] = make_guard(g)
    for e in spec.effects:
        ns[f"effect_{e}"] = make_effect(e)
    return type(f"Reference_{spec.name}", (Lifecycle,), ns)


SPECS = {name: load_machine(name) for name in NATIVE_MACHINES}
REFERENCE = {name: reference_class(spec) for name, spec in SPECS.items()}


def reference_attempt(obj: Any, event: str, holds: Iterable[str], fail: Iterable[str],
                      fail_undo: Iterable[str], reenter: Iterable[str]) -> Fired:
    plan = _Plan()
    plan.holds, plan.fail, plan.fail_undo = frozenset(holds), frozenset(fail), frozenset(fail_undo)
    plan.reenter, plan.event = frozenset(reenter), event
    obj.plan, obj.calls = plan, []
    source = obj.state

    def undo_failed() -> int:
        return sum(1 for c in obj.calls if c.startswith("undo ") and c[5:] in plan.fail_undo)
    try:
        dest = obj.fire(event)
    except TransitionError as refused:
        if refused.reason is TransitionReason.ILLEGAL:
            return Fired(source, obj.state, ILLEGAL)
        if refused.reason is TransitionReason.GUARD:
            return Fired(source, obj.state, GUARD, refused=refused.failed)
        assert refused.reason is TransitionReason.REENTRANT, refused
        last = [c for c in obj.calls if c.startswith("do ")][-1][3:]
        return Fired(source, obj.state, REENTRANT, effect=last, calls=tuple(obj.calls), undo_failed=undo_failed())
    except NativeError as failed:
        assert failed.reason is NativeReason.EFFECT and failed.step is not None, failed
        return Fired(source, obj.state, EFFECT, effect=failed.step.removeprefix("effect "),
                     calls=tuple(obj.calls), undo_failed=undo_failed())
    return Fired(source, dest, OK, calls=tuple(obj.calls))


def draw_step(rng: random.Random, spec: MachineSpec, state: str) -> tuple[str, list[str], list[str],
                                                                          list[str], list[str]]:
    declared = [e for e in spec.event_names if spec.declared(e, state)]
    if declared and rng.random() < 0.75:
        event = rng.choice(declared)
    else:
        event = rng.choice([*spec.event_names, UNKNOWN_EVENT])
    holds = [g for g in spec.guards if rng.random() < 0.6]
    fail = [e for e in spec.effects if rng.random() < 0.08]
    fail_undo = [e for e in spec.effects if rng.random() < 0.1]
    reenter = [e for e in spec.effects if rng.random() < 0.03]
    return event, holds, fail, fail_undo, reenter
