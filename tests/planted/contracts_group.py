"""Planted bug for the crosshair self-test: an empty group counted as complete.

Same contract as kvstate.core.validate.group_complete; the body forgets that tp must be >= 1
and that a rank may appear only once.
"""

from __future__ import annotations

from collections.abc import Sequence


def group_complete(tp: int, ranks: Sequence[int]) -> bool:
    """
    post: not __return__ or (tp >= 1 and len(ranks) == tp)
    post: not __return__ or all(0 <= r < tp for r in ranks)
    post: not __return__ or len(set(ranks)) == len(ranks)
    """
    return set(ranks) == set(range(tp))
