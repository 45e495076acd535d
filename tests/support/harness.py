"""Generic harnesses: any table bound to a Lifecycle whose guards and effects are
controlled by the test. Used to drive every machine into every state.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvstate.core.machine import Lifecycle, effect, guard
from kvstate.core.spec import MachineSpec, TransitionSpec

__all__ = ["HarnessBase", "PlantedFailure", "drive_to", "harness_class", "paths_to_states"]


class PlantedFailure(RuntimeError):
    """Raised by a harness effect that the test told to fail: an untyped exception, which
    the machine rolls back and reports as :class:`~kvstate.core.errors.NativeError` (reason EFFECT)."""


class HarnessBase(Lifecycle):
    def __init__(self) -> None:
        super().__init__(label="harness")
        self.guard_values: dict[str, bool] = {}
        self.failing: set[str] = set()
        self.log: list[str] = []

    def _guard(self, name: str) -> bool:
        return self.guard_values.get(name, True)

    def _effect(self, name: str) -> Any:
        if name in self.failing:
            raise PlantedFailure(name)
        self.log.append(name)
        return lambda: self.log.append(f"undo {name}")

    def admit(self, row: TransitionSpec) -> None:
        """Set guard values so that ``row`` (and no earlier row refusing it) fires."""
        self.guard_values = {g: True for g in row.guards} | {g: False for g in row.unless}


def harness_class(spec: MachineSpec) -> type[HarnessBase]:
    ns: dict[str, Any] = {"table": spec}
    for g in spec.guards:
        ns[f"_guard_{g}"] = guard(g)(lambda self, _g=g, **kw: self._guard(_g))
    for e in spec.effects:
        ns[f"_effect_{e}"] = effect(e)(lambda self, _e=e, **kw: self._effect(_e))
    return type(f"{spec.name.title()}Harness", (HarnessBase,), ns)


def paths_to_states(spec: MachineSpec) -> dict[str, list[TransitionSpec]]:
    """A shortest sequence of rows from the initial state to each reachable state."""
    paths: dict[str, list[TransitionSpec]] = {spec.initial: []}
    queue = deque([spec.initial])
    while queue:
        state = queue.popleft()
        for row in spec.transitions:
            if row.source == state and row.dest not in paths:
                paths[row.dest] = paths[state] + [row]
                queue.append(row.dest)
    return paths


def drive_to(cls: type[HarnessBase], path: list[TransitionSpec]) -> HarnessBase:
    obj = cls()
    for row in path:
        obj.admit(row)
        obj.fire(row.trigger)
    obj.guard_values = {}
    obj.log.clear()
    return obj
