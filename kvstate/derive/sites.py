"""The records of the code map (:mod:`kvstate.derive.codemap`): sites in the source tree,
the guards and effects they implement, and the events they fire."""

from __future__ import annotations

from collections.abc import Iterable

import attrs


@attrs.frozen(order=True)
class Site:
    """A function in the source tree: ``label`` is ``module:qualname`` for Python and
    ``path:function`` for C; ``path`` is the file, relative to the source root."""

    label: str
    path: str


@attrs.frozen
class Binding:
    """``site`` implements the guard or effect ``name`` of ``machine``."""

    machine: str
    kind: str  # "guard" | "effect"
    name: str
    site: Site


@attrs.frozen
class Fire:
    """``site`` fires ``event`` on a ``machine`` object (at ``line`` of its file)."""

    machine: str
    event: str
    site: Site
    line: int


@attrs.frozen
class CodeMap:
    bindings: tuple[Binding, ...]
    fires: tuple[Fire, ...]
    #: machine -> the function that runs its rows (the runtime's fire, or C's step)
    runners: tuple[tuple[str, Site], ...] = ()
    #: sites the scan could not attribute (``path:line: why``); they make generation fail
    problems: tuple[str, ...] = ()

    def implemented_by(self, machine: str, kind: str, name: str) -> tuple[Site, ...]:
        return tuple(sorted({b.site for b in self.bindings if (b.machine, b.kind, b.name) == (machine, kind, name)}))

    def fired_by(self, machine: str, event: str) -> tuple[Site, ...]:
        return tuple(sorted({f.site for f in self.fires if (f.machine, f.event) == (machine, event)}))

    def runner(self, machine: str) -> Site | None:
        return next((site for m, site in self.runners if m == machine), None)


def merge(maps: Iterable[CodeMap]) -> CodeMap:
    maps = list(maps)
    return CodeMap(bindings=tuple(b for m in maps for b in m.bindings),
                   fires=tuple(f for m in maps for f in m.fires),
                   runners=tuple(r for m in maps for r in m.runners),
                   problems=tuple(p for m in maps for p in m.problems))
