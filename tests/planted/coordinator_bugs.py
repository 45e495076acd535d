"""Deliberately broken rank shares, for the self-test of the multi-process tests: each must
be caught by the kill matrix and the stateful process test (from inside the processes)."""

from __future__ import annotations

from typing import Any

from kvstate.core.machine import effect
from kvstate.share.rank_share import RankShare


class KeepsPartOnAbort(RankShare):
    """Planted bug: a share rolled back by the coordinator (or by its death) ends but keeps
    its part mapped and its lease (breaks INV-COORD-NO-ORPHAN-MAPPING)."""

    @effect("rollback_part")
    def _rollback(self, **kw: Any) -> None:
        pass


class KeepsPart(KeepsPartOnAbort):
    """Planted bug: a share never gives its part back, on abort or on close (breaks
    INV-COORD-NO-ORPHAN-MAPPING on every path that ends a group)."""

    @effect("unmap_part")
    def _unmap(self, **kw: Any) -> None:
        pass
