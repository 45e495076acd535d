"""Where the tables live in code: the functions that implement each guard and effect, and
the places that fire each event. Built by a static scan of the source tree
(:mod:`kvstate.derive.code_py` for Python, :mod:`kvstate.derive.code_c` for the C op
engine), so it needs no import of the code it describes and it is exact, not guessed:
a site whose machine or event the scan cannot establish is a problem, never a guess.

The generated spec pages link every row to these sites, and :func:`check` holds code and
tables to each other: an event fired in code must be declared by its table, and every
declared event must be fired somewhere, unless the table marks it ``external`` (with the
reason: the engine or the world fires it, not kvstate).

Pure: reads files, imports nothing of what it reads.
"""

from __future__ import annotations

from pathlib import Path

from kvstate.core.spec import Spec
from kvstate.derive import code_c, code_py
from kvstate.derive.sites import Binding, CodeMap, Fire, Site, merge

__all__ = ["Binding", "CodeMap", "Fire", "Site", "check", "merge", "scan"]


def scan(root: Path, spec: Spec) -> CodeMap:
    """The code map of the source tree at ``root`` (``kvstate/`` and ``ffi/``)."""
    return merge([code_py.scan(root), code_c.scan(root, spec)])


def check(spec: Spec, code: CodeMap) -> list[str]:
    """Every disagreement between the tables and the code, one line each (empty: none).

    * a site the scan could not attribute;
    * an event fired in code that its machine's table does not declare;
    * a declared event fired nowhere and not marked ``external``, or marked ``external``
      but fired in kvstate after all (the marker would mislead);
    * a declared guard or effect with no implementing function.
    """
    out = list(code.problems)
    for f in code.fires:
        m = spec.machines.get(f.machine)
        if m is None:
            out.append(f"{f.site.path}:{f.line}: {f.site.label} fires {f.event!r} on {f.machine}, which has no table")
        elif f.event not in m.event_names:
            out.append(f"{f.site.path}:{f.line}: {f.site.label} fires {f.event!r} on {f.machine}, "
                       f"which {m.source} does not declare")
    for m in spec.machines.values():
        for e in m.events:
            sites = code.fired_by(m.name, e.name)
            if not sites and e.external is None:
                out.append(f"{m.source}: event {e.name!r} is fired nowhere in the code; fire it, "
                           f"remove it, or mark it external = \"why\"")
            if sites and e.external is not None:
                out.append(f"{m.source}: event {e.name!r} is marked external but "
                           f"{', '.join(s.label for s in sites)} fires it")
        for kind, names in (("guard", m.guards), ("effect", m.effects)):
            for name in names:
                if not code.implemented_by(m.name, kind, name):
                    out.append(f"{m.source}: {kind} {name!r} is implemented by no function")
    return out
