"""The op lifecycle of ``spec/op.toml``, for the Python side of every backend.

The C engine steps every op, host and CUDA alike, through the generated
``ffi/kvs_op_table.h``; Python holds no op state. It never names an op state itself
either: what it needs to know about one (may the caller reap it, did it end in a fault)
is read from the table here.
"""

from __future__ import annotations

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
