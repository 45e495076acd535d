"""The lifecycles that run natively: the bank and part tables of ``spec/``, generated into
C (``ffi/kvs_bank_table.h``, ``ffi/kvs_part_table.h``) and executed by
``kvs_machine_fire()`` (``ffi/kvs_machine.c``), the typed Python face of both.

The C executor has the rules of :class:`kvstate.core.machine.Lifecycle`, which stays the
reference: a native thread (the lease server, the renewal thread of the next steps)
fires events with the guards it evaluated as bits and its effects as a C callback, never
taking the GIL. Python drives the same executor here with *planned* effects (which of
them fail, which fire on their own machine), which is how the differential test holds C
and Python to the same states and refusals. Nothing here decides a transition itself.

:func:`native_table` loads a machine's table from ``kvstate._native`` and checks its
names and digest against the table Python loads from ``spec/``; a module built from
another table is refused (ConfigInvalid, reason spec), as the op table is by
:class:`kvstate.transport.native.Native`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import attrs

from kvstate.core import errors
from kvstate.core.errors import ConfigInvalid, KvStateError, NativeError, TransitionError
from kvstate.core.spec import MachineSpec, load_machine
from kvstate.derive.header import NATIVE_MACHINES, machine_header_path, table_digest
from kvstate.transport import native
from kvstate.transport.libkvs import Ffi, Lib

#: Outcomes of one fire, as :attr:`Fired.outcome` names them.
OK, ILLEGAL, GUARD, EFFECT, REENTRANT = "ok", "illegal", "guard", "effect", "reentrant"
_LOG = 16  # entries of the planned callback's log: KVS_MROW_MAX effects and their undos


@attrs.frozen
class Fired:
    """What one native fire did: the outcome, the state before and after, and the effect
    calls in order (``"do x"``, ``"undo x"``). A refusal leaves ``dest == source``."""

    source: str
    dest: str
    outcome: str
    refused: tuple[str, ...] = ()   # with GUARD: each refusing guard, "not g" for an unless guard
    effect: str | None = None       # with EFFECT or REENTRANT: the effect that failed
    calls: tuple[str, ...] = ()
    undo_failed: int = 0


class NativeTable:
    """One generated table inside the native module, checked against its spec table."""

    def __init__(self, ffi: Ffi, lib: Lib, spec: MachineSpec) -> None:
        self.ffi, self.lib, self.spec = ffi, lib, spec
        ids = {ffi.string(lib.kvs_machine_name(i, lib.KVS_MNAME_MACHINE, 0)).decode(): i
               for i in range(lib.kvs_machine_count())}
        if spec.name not in ids:
            raise ConfigInvalid.spec(machine_header_path(spec.name), spec.name,
                                     f"the native module executes no {spec.name!r} table; rebuild it (`make`)")
        self.id = ids[spec.name]
        self.states = self._names(lib.KVS_MNAME_STATE)
        self.events = self._names(lib.KVS_MNAME_EVENT)
        self.guards = self._names(lib.KVS_MNAME_GUARD)
        self.effects = self._names(lib.KVS_MNAME_EFFECT)
        built = ffi.string(lib.kvs_machine_digest(self.id)).decode()
        if (self.states, self.events, self.guards, self.effects) != (
                spec.state_names, spec.event_names, tuple(spec.guards), tuple(spec.effects)) \
                or built != table_digest(spec):
            raise ConfigInvalid.spec(machine_header_path(spec.name), spec.name,
                                     f"the native module was built from another {spec.name} table (digest "
                                     f"{built}); run `kvstate generate` and rebuild (`make`)")
        self._event_ids = {e: i for i, e in enumerate(self.events)}
        self._guard_bits = {g: 1 << i for i, g in enumerate(self.guards)}
        self._effect_bits = {e: 1 << i for i, e in enumerate(self.effects)}

    def _names(self, kind: int) -> tuple[str, ...]:
        lib, ffi = self.lib, self.ffi
        return tuple(ffi.string(lib.kvs_machine_name(self.id, kind, i)).decode()
                     for i in range(lib.kvs_machine_size(self.id, kind)))

    def mask(self, names: Iterable[str], kind: str) -> int:
        """The bits of guard or effect ``names``; an unknown name is refused before any call."""
        bits = self._guard_bits if kind == "guard" else self._effect_bits
        out = 0
        for n in names:
            if n not in bits:
                raise errors.ArgumentInvalid.native("kvs_machine_fire", self.lib.KVS_E_INVAL,
                                                    f"the {self.spec.name} table declares no {kind} {n!r}")
            out |= bits[n]
        return out

    def machine(self) -> NativeMachine:
        return NativeMachine(self)


class NativeMachine:
    """One instance of a native table, in its initial state. Each call fires one event
    through the C executor; the instance is the C state itself (nothing is mirrored)."""

    def __init__(self, table: NativeTable) -> None:
        self.table = table
        self._inst = table.ffi.new("kvs_machine_inst *")
        rc = table.lib.kvs_machine_init(self._inst, table.id)
        if rc != table.lib.KVS_OK:
            raise errors.NativeError.native("kvs_machine_init", rc, f"machine {table.spec.name}: refused ({rc})")

    @property
    def state(self) -> str:
        return self.table.states[self._inst.state]

    @property
    def is_terminal(self) -> bool:
        return bool(self.table.lib.kvs_machine_terminal(self.table.id, self._inst.state))

    def attempt(self, event: str, holds: Iterable[str] = (), *, fail: Iterable[str] = (),
                fail_undo: Iterable[str] = (), reenter: Iterable[str] = ()) -> Fired:
        """Fire ``event`` with the guards ``holds`` holding; effects in ``fail`` fail, undos
        of those in ``fail_undo`` fail, those in ``reenter`` fire ``event`` again from
        inside. A refusal is returned, not raised (see :meth:`fire`)."""
        t = self.table
        masks = (t.mask(holds, "guard"), t.mask(fail, "effect"), t.mask(fail_undo, "effect"),
                 t.mask(reenter, "effect"))
        source = self.state
        if event not in t._event_ids:  # not an event of the machine: undeclared everywhere
            return Fired(source, source, ILLEGAL)
        # A result and a log per call: a fire from another thread waits for the one in
        # progress, and its result must not land in this one's buffers.
        lib, ffi = t.lib, t.ffi
        out, log, nlog = ffi.new("kvs_fire_result *"), ffi.new("int32_t[]", _LOG), ffi.new("int32_t[]", 1)
        rc = lib.kvs_machine_fire_planned(self._inst, t._event_ids[event], *masks, log, _LOG, nlog, out)
        calls = tuple(f"do {t.effects[c]}" if c >= 0 else f"undo {t.effects[-1 - c]}"
                      for c in (log[i] for i in range(nlog[0])))
        dest = t.states[out.dest]
        if rc == lib.KVS_OK:
            return Fired(source, dest, OK, calls=calls)
        if rc == lib.KVS_E_ILLEGAL:
            return Fired(source, dest, ILLEGAL)
        if rc == lib.KVS_E_GUARD:
            refused = tuple(t.guards[g] if g >= 0 else f"not {t.guards[-1 - g]}"
                            for g in (out.refused[i] for i in range(out.nrefused)))
            return Fired(source, dest, GUARD, refused=refused)
        if rc in (lib.KVS_E_EFFECT, lib.KVS_E_REENTRANT):
            kind = REENTRANT if rc == lib.KVS_E_REENTRANT or out.error == lib.KVS_E_REENTRANT else EFFECT
            return Fired(source, dest, kind, effect=t.effects[out.effect] if out.effect >= 0 else None,
                         calls=calls, undo_failed=out.undo_failed)
        raise native.default().error(rc, "kvs_machine_fire_planned", f"{t.spec.name} event {event!r}")

    def fire(self, event: str, holds: Iterable[str] = (), *, fail: Iterable[str] = (),
             fail_undo: Iterable[str] = (), reenter: Iterable[str] = ()) -> str:
        """:meth:`attempt`, raising the error :meth:`Lifecycle.fire` raises for a refusal;
        the new state otherwise."""
        done = self.attempt(event, holds, fail=fail, fail_undo=fail_undo, reenter=reenter)
        name = self.table.spec.name
        if done.outcome == ILLEGAL:
            raise TransitionError.illegal(name, done.source, event)
        if done.outcome == GUARD:
            raise TransitionError.guard(name, done.source, event, done.refused)
        if done.outcome == REENTRANT:
            raise TransitionError.reentrant(name, done.source, event)
        if done.outcome == EFFECT:
            cause: KvStateError = NativeError.native("kvs_machine_fire", self.table.lib.KVS_E_EFFECT,
                                                     f"effect {done.effect} failed")
            raise NativeError.effect(name, done.source, event, f"effect {done.effect}", cause)
        return done.dest


@functools.cache
def native_table(name: str) -> NativeTable:
    """The checked native table of machine ``name`` (one of NATIVE_MACHINES)."""
    if name not in NATIVE_MACHINES:
        raise errors.ArgumentInvalid.native("native_table", -1, f"{name!r} is not executed natively; "
                                            f"those that are: {', '.join(NATIVE_MACHINES)}")
    nat = native.default()
    return NativeTable(nat.ffi, nat.lib, load_machine(name))
