"""Groups that passed validation, remembered, so that importing the same descriptors again
re-checks only what can have changed since. Pure but for the socket path rule's ``lstat``.

Why
---

An importer imports the same few groups again and again: ``decode_cached`` hands back the
same Descriptor objects for the same wire bytes. Every rule but two reads only the
descriptors and the importer's expectation, neither of which moves between those imports;
the whole check still cost about 60 µs of a tp=8 import
(``python -m benchmarks.import_profile``).

What is remembered, and what is checked each time
--------------------------------------------------

A group is remembered only when it passed every rule, under the descriptors' identity (the
entry holds them, so no other object takes their ids while it lives) and every field of
the Expectation but the clock (:data:`MOVING`), as it was then (a caller's mapping is
copied). On the next import of those very objects, in the same order, under an equal
expectation, two things are checked again:

- every declared rule that reads a moving field (:func:`clock_rules`: today ``freshness``,
  which compares ``now_ns`` with the descriptor's expiry), from the declaration itself, so
  a rule that comes to read the clock is re-checked without a change here;
- the socket path rule, which reads the filesystem.

Anything else found (another expectation, other objects, a broken clock rule or socket
path) is not decided here: the caller runs the whole validation, which names every
problem. A refusal is never remembered.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence

import attrs

from kvstate.core import rules
from kvstate.core.descriptor import Descriptor
from kvstate.core.handles import FD_KINDS
from kvstate.core.validate import Expectation, ValidatedGroup, expected_for, expected_of, facts_of, socket_path_reason

#: The Expectation fields that move between imports of the same group: the clock.
MOVING = frozenset({"now_ns"})
#: Every other field: a remembered verdict holds for an expectation equal in all of them.
_STILL = tuple(a.name for a in attrs.fields(Expectation) if a.name not in MOVING)


@functools.cache
def clock_rules() -> tuple[str, ...]:
    """The ids of the declared rules that read a moving field, in declaration order."""
    moving = {("e", f) for f in MOVING}
    return tuple(r.id for r in rules.rules().rules if rules.reads(r) & moving)


def still(expect: Expectation) -> tuple[object, ...]:
    """``expect``'s fields that do not move with the clock (:data:`_STILL`), as they are
    now: a mapping (``incarnations``) is copied, since a caller may keep one and update
    it between imports (a rank's restart learned)."""
    return tuple(_now(getattr(expect, f)) for f in _STILL)


def _now(value: object) -> object:
    return frozenset(value.items()) if isinstance(value, Mapping) else value


class Verdicts:
    """Groups that passed, by their descriptors' identity (see the module docstring).
    Bounded by the descriptors its entries hold, as ``decode_cached`` is by the ones it
    remembers: cleared when full."""

    def __init__(self, limit: int = 1024) -> None:
        self._limit = limit
        self._passed: dict[tuple[int, ...], tuple[tuple[Descriptor, ...], tuple[object, ...], ValidatedGroup]] = {}
        self._held = 0  # descriptors the entries hold
        self._lock = threading.Lock()

    def recheck(self, descriptors: Sequence[Descriptor], expect: Expectation) -> ValidatedGroup | None:
        """The remembered verdict on ``descriptors`` when it holds under ``expect`` now: the
        same objects passed under an expectation equal but for the clock, and they pass
        the clock rules and the socket path rule now. None otherwise (validate whole)."""
        held = self._passed.get(tuple(map(id, descriptors)))
        if held is None or held[1] != still(expect):
            return None
        base = expected_of(expect)
        paths: set[str] = set()
        for d in descriptors:
            facts, expected = facts_of(d, expect), expected_for(d.rank, expect, base)
            if any(rules.check(rule_id, facts, expected) is not None for rule_id in clock_rules()):
                return None
            if d.handle_kind in FD_KINDS and expect.check_socket and d.socket_path not in paths:
                if socket_path_reason(d.socket_path, expect.uid) is not None:
                    return None
                paths.add(d.socket_path)
        return held[2]

    def remember(self, descriptors: Sequence[Descriptor], expect: Expectation, validated: ValidatedGroup) -> None:
        """``descriptors`` passed every rule under ``expect`` (:func:`validate_group`)."""
        key = tuple(map(id, descriptors))
        with self._lock:
            if key not in self._passed:
                if self._held + len(key) > self._limit:
                    self._passed.clear()
                    self._held = 0
                self._held += len(key)
            self._passed[key] = (tuple(descriptors), still(expect), validated)
