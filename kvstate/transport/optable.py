"""The op lifecycle of ``spec/op.toml``, for the Python side of every backend.

The C engine steps host ops through the generated ``ffi/kvs_op_table.h``. Python never
names an op state itself: what it needs to know about one (may the caller reap it, did
it end in a fault) is read from the table here, and a backend whose ops are not in the C
engine (the cuda backend, until its ops move there) steps them with :class:`OpStepper`,
which fires only the table's rows. An undeclared (state, event) pair is
:class:`IllegalTransition` naming machine, state and event; a declared one whose guards
refuse is :class:`GuardRejected`; the state is committed only after the row's effects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

from kvstate.core.errors import BindingError, GuardRejected, IllegalTransition
from kvstate.core.spec import MachineSpec, load_machine

#: The events Python fires or asks about. Events are the table's vocabulary, as in C.
SUBMIT, START, FINISH, FAIL, CANCEL, REAP = "submit", "start", "finish", "fail", "cancel", "reap"


class OpTable:
    """What the op table says about states: read-only, shared by every backend."""

    def __init__(self, spec: MachineSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.initial = spec.initial
        self.states = spec.state_names
        faults = {e.name for e in spec.events if e.fault}
        self._declared = frozenset((t.source, t.trigger) for t in spec.transitions)
        self._faulted = frozenset(t.dest for t in spec.transitions if t.trigger in faults)

    def may(self, state: str, event: str) -> bool:
        """True when the table declares ``event`` in ``state`` (guards aside)."""
        return (state, event) in self._declared

    def collectable(self, state: str) -> bool:
        """The op finished: the caller may reap it (kvs_op_collectable in C)."""
        return self.may(state, REAP)

    def faulted(self, state: str) -> bool:
        """The op ended through a fault event: its result must not be used."""
        return state in self._faulted


#: The op table of the installed specification.
OPS = OpTable(load_machine("op"))


class Stepped(Protocol):
    """An object whose ``state`` an :class:`OpStepper` moves."""

    state: str


T = TypeVar("T", bound=Stepped)


class OpStepper(Generic[T]):
    """Fires the op table's rows on objects of one backend.

    ``guards`` and ``effects`` implement, by name, exactly the guards and effects the table
    declares (else :class:`BindingError`, naming the table file). Effects are bookkeeping
    that cannot fail (pin counts); they run in the row's order before the state changes.
    """

    def __init__(self, guards: Mapping[str, Callable[[T], bool]], effects: Mapping[str, Callable[[T], None]],
                 table: OpTable = OPS) -> None:
        spec = table.spec
        for kind, bound, declared in (("guards", guards, spec.guards), ("effects", effects, spec.effects)):
            for name in sorted(set(declared) ^ set(bound)):
                why = "is not implemented" if name in declared else "is not declared by the table"
                raise BindingError(spec.source, f"{kind}.{name}", f"{kind[:-1]} {name!r} {why}")
        self.table = table
        self._guards = dict(guards)
        self._effects = dict(effects)

    def step(self, obj: T, event: str) -> None:
        """Fire ``event`` on ``obj`` (named ``step``, as kvs_op_step in C: the code map of
        ``kvstate generate`` attributes op events to the C engine, which will run these ops
        too once CUDA ops move into it)."""
        state = obj.state
        rows = self.table.spec.rows(event, state)
        if not rows:
            raise IllegalTransition(self.table.name, state, event)
        refused: list[str] = []
        for row in rows:
            failing = [g for g in row.guards if not self._guards[g](obj)]
            failing += [g for g in row.unless if self._guards[g](obj)]
            if failing:
                refused += failing
                continue
            for name in row.effects:
                self._effects[name](obj)
            obj.state = row.dest
            return
        raise GuardRejected(self.table.name, state, event, refused)
