"""Runtime machines: the tables of ``spec/`` driving real objects.

Theory of operation
-------------------

A class that derives from :class:`Lifecycle` names its table (``table = load_machine(..)``)
and implements every guard and effect the table declares, marked with :func:`guard` and
:func:`effect`. When the class is created, the table is compiled once into a
``transitions.Machine`` shared by every instance of the class; a binding that misses a
declared guard or effect, or implements one the table does not declare, is a
:class:`ConfigInvalid` (BINDING) naming the table file and the entry.

Objects are driven only through :meth:`Lifecycle.fire`:

1. The event must be declared for the current state, else :class:`TransitionError` (ILLEGAL)
   (naming machine, state and event) and nothing changes. ``transitions`` never sees
   undeclared events, and it never ignores an invalid trigger.
2. The rows for (event, state) are tried in table order; the first whose guards hold
   fires. If none holds, :class:`TransitionError` (GUARD) lists the guards that refused.
3. The row's effects run in order *before* the state is committed. An effect may return
   an undo callable. If a later effect raises, the undos of the earlier ones run in
   reverse order and the exception propagates with the state unchanged
   (INV-EFFECT-ATOMIC). An effect that raises must itself leave nothing half done.
   Whatever an effect or guard raises is rolled back the same way: an untyped exception
   (``OSError``, ``RuntimeError``, ``MemoryError``, a bug) leaves the machine as
   :class:`NativeError` (EFFECT), which names the machine, state, event and
   step and chains the cause, so only typed errors leave ``fire`` and callers that roll
   back on ``KvStateError`` roll back on these too. (``KeyboardInterrupt`` and
   ``SystemExit`` are rolled back and re-raised as they are.)
4. The state is committed and a :class:`StateChange` is queued for the observers. A
   ``reason`` keyword of the event (a short text: why a lease expired, which rank failed)
   travels on the StateChange, so observed faults say why.

Concurrency: each object carries its own ``threading.RLock`` and ``fire`` holds it for
the whole transition, so a transition is atomic with respect to other threads driving
the same object while different objects never contend. The lock is reentrant only so
that a guard or effect firing on its own object is *detected* (TransitionError (REENTRANT))
instead of deadlocking.

Observers are called only when the calling thread holds no machine's lock: after the
outermost ``fire`` or ``with obj.locked()`` of that thread returns (a group's effect that
closes its parts delivers the parts' changes after the group's lock is released too).
So an observer may block, take other locks, or drive any object without deadlocking
against a thread that waits for one. Changes of one object reach its observers in commit
order, one at a time: one thread at a time drains an object's queue, so ``fire`` may
return before its change was delivered while another thread delivers earlier ones.

Logging: the ``transitions`` library logs every state change at INFO. kvstate sets its
loggers to WARNING unless the application set a level on them itself.

Scale: objects are never added to the shared machine with ``Machine.add_model``, whose
membership test on a list makes creating N models cost O(N^2). The initial state is set
directly, so creating an object is O(1).

Dispatch: ``transitions`` builds and checks the shared machine from the table (states,
events, rows, conditions). ``fire`` then runs the rows of (event, state) itself, from a
dict compiled with it: guards in order, then ``unless`` guards, effects, state -- the
order ``Event.trigger`` follows, without its per-call EventData and callback
resolution, which cost most of a transition (B3; ``benchmarks.import_profile``).
tests/test_machine.py checks both dispatchers agree on every row of every table.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any, ClassVar, TypeVar

import attrs
import transitions

from kvstate.core.errors import ArgumentInvalid, ConfigInvalid, NativeError, TransitionError
from kvstate.core.args import need, need_callable, need_items, need_text
from kvstate.core.reasons import ArgumentReason
from kvstate.core.errors import KvStateError
from kvstate.core.spec import MachineSpec, TransitionSpec

log = logging.getLogger(__name__)

for _name in ("transitions", "transitions.core"):
    _logger = logging.getLogger(_name)
    if _logger.level == logging.NOTSET:  # respect a level the application chose
        _logger.setLevel(logging.WARNING)

Undo = Callable[[], None]
F = TypeVar("F", bound=Callable[..., Any])

_GUARD_ATTR = "__kvstate_guard__"
_EFFECT_ATTR = "__kvstate_effect__"


def guard(name: str) -> Callable[[F], F]:
    """Mark a method as the implementation of the table guard ``name``.

    A guard is called as ``method(self, **event_kwargs)`` and returns a bool. It must not
    change anything.
    """

    def mark(fn: F) -> F:
        setattr(fn, _GUARD_ATTR, name)
        return fn

    return mark


def effect(name: str) -> Callable[[F], F]:
    """Mark a method as the implementation of the table effect ``name``.

    An effect is called as ``method(self, **event_kwargs)`` before the state is committed.
    It returns ``None`` or an undo callable that reverses it, used if a later effect of
    the same transition raises.
    """

    def mark(fn: F) -> F:
        setattr(fn, _EFFECT_ATTR, name)
        return fn

    return mark


@attrs.frozen
class StateChange:
    """One committed transition, as structured data for logs, metrics and tests."""

    machine: str
    label: str
    event: str
    source: str
    dest: str
    monotonic_ns: int
    reason: str | None = None   # the event's ``reason`` keyword, for faults observed from outside


Observer = Callable[[StateChange], None]


@attrs.frozen
class _Row:
    """One table row, resolved to functions: what :meth:`Lifecycle.fire` runs."""

    guards: tuple[Callable[..., Any], ...]
    unless: tuple[Callable[..., Any], ...]
    effects: tuple[Callable[..., Any], ...]
    dest: str


#: How many adopted paths a table remembers (:meth:`_Compiled.diverges`).
_PATHS_KEPT = 256


@attrs.frozen
class _Compiled:
    spec: MachineSpec
    machine: Any  # transitions.Machine; untyped library
    declared: frozenset[tuple[str, str]]
    guards: dict[str, Callable[..., Any]]
    effects: dict[str, Callable[..., Any]]
    rows: dict[tuple[str, str], tuple[_Row, ...]]  # (event, source) -> rows in table order
    #: (source, ((event, dest), ...)) -> the first step the table does not declare along
    #: that path from source (its index and state), or None: adopt_all asks per object.
    paths: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, str] | None] = attrs.field(factory=dict)

    def diverges(self, source: str, steps: tuple[tuple[str, str], ...]) -> tuple[int, str] | None:
        """Where the path ``steps`` from ``source`` leaves the table (the step's index and
        the state it is taken in), or None when every step is a declared row."""
        key = (source, steps)
        if key in self.paths:
            return self.paths[key]
        state, found = source, None
        for i, (event, dest) in enumerate(steps):
            if not any(row.dest == dest for row in self.rows.get((event, state), ())):
                found = (i, state)
                break
            state = dest
        if len(self.paths) < _PATHS_KEPT:  # the code's own paths are few; a caller's may not be
            self.paths[key] = found
        return found

    def trigger(self, model: Any, event: str, source: str, kwargs: dict[str, Any]) -> bool:
        """Fire the first row of (event, source) whose guards hold; False if none does.
        Effects run before the state is committed (rolled back as :func:`_run_effects`)."""
        for row in self.rows[(event, source)]:
            if all(_check(g, model, kwargs) for g in row.guards) and \
                    not any(_check(u, model, kwargs) for u in row.unless):
                if row.effects:
                    _apply_effects(row.effects, model, kwargs)
                model._kv_state = row.dest
                return True
        return False


class _StepFailed(Exception):
    """Carries an untyped exception of a guard or effect out of ``transitions`` to
    :meth:`Lifecycle.fire`, which raises it as NativeError (EFFECT) with the machine's context."""

    def __init__(self, step: str, cause: Exception) -> None:
        self.step = step
        self.cause = cause
        super().__init__(step)


def _call_guard(fn: Callable[..., Any], event_data: Any) -> bool:
    return _check(fn, event_data.model, event_data.kwargs)


def _check(fn: Callable[..., Any], model: Any, kwargs: dict[str, Any]) -> bool:
    try:
        return bool(fn(model, **kwargs))
    except (KvStateError, _StepFailed):
        raise
    except Exception as exc:  # a guard that raises refuses nothing silently: it fails the event
        raise _StepFailed(f"guard {getattr(fn, _GUARD_ATTR, fn.__name__)}", exc) from exc


def _run_effects(fns: tuple[Callable[..., Any], ...], event_data: Any) -> None:
    _apply_effects(fns, event_data.model, event_data.kwargs)


def _apply_effects(fns: tuple[Callable[..., Any], ...], model: Any, kwargs: dict[str, Any]) -> None:
    undos: list[Undo] = []
    step = ""
    try:
        for fn in fns:
            step = f"effect {getattr(fn, _EFFECT_ATTR, fn.__name__)}"
            undo = fn(model, **kwargs)
            if undo is not None:
                undos.append(undo)
    except BaseException as exc:
        for undo in reversed(undos):
            try:
                undo()
            except Exception as undo_exc:  # keep the original error; report the second
                exc.add_note(f"rollback step {undo!r} also failed: {undo_exc!r}")
        if isinstance(exc, Exception) and not isinstance(exc, (KvStateError, _StepFailed)):
            raise _StepFailed(step, exc) from exc
        raise


def _bindings(cls: type, spec: MachineSpec, attr: str, kind: str,
              declared: Iterable[str]) -> dict[str, Callable[..., Any]]:
    # Resolve by attribute name, so a subclass can drop a binding by shadowing it.
    found: dict[str, Callable[..., Any]] = {}
    for attr_name in dir(cls):
        value = getattr(cls, attr_name, None)
        name = getattr(value, attr, None)
        if isinstance(name, str) and callable(value):
            found[name] = value
    declared = set(declared)
    for name in sorted(declared - set(found)):
        raise ConfigInvalid.binding(spec.source, f"{kind}.{name}",
                                    f"{cls.__qualname__} implements no {kind[:-1]} {name!r}")
    for name in sorted(set(found) - declared):
        raise ConfigInvalid.binding(spec.source, f"{kind}.{name}", f"{cls.__qualname__} implements {kind[:-1]} "
                                    f"{name!r}, which the table does not declare")
    return found


def _native_only(kind: str, name: str) -> Callable[..., Any]:
    def refuse(model: Any, **kw: Any) -> Any:
        raise TransitionError.illegal(type(model).table.name, model.state,
                                      f"{kind} {name} (run by the native executor only)")
    return refuse


def compile_table(cls: type, spec: MachineSpec) -> _Compiled:
    """Build the shared ``transitions.Machine`` for ``cls`` from its table. Guards and
    effects the class names in ``native`` are implemented by a native executor that fires
    their rows (kvstate.share.lease_server); here they refuse, and bind nothing."""
    native: frozenset[str] = getattr(cls, "native", frozenset())
    guards = _bindings(cls, spec, _GUARD_ATTR, "guards", set(spec.guards) - native)
    effects = _bindings(cls, spec, _EFFECT_ATTR, "effects", set(spec.effects) - native)
    guards.update({g: _native_only("guard", g) for g in native & set(spec.guards)})
    effects.update({e: _native_only("effect", e) for e in native & set(spec.effects)})
    machine = transitions.Machine(
        model=None,
        states=list(spec.state_names),
        initial=spec.initial,
        auto_transitions=False,
        ignore_invalid_triggers=False,
        send_event=True,
        model_attribute="_kv_state",
        name=spec.name,
    )
    for row in spec.transitions:
        machine.add_transition(
            row.trigger, row.source, row.dest,
            conditions=[partial(_call_guard, guards[g]) for g in row.guards],
            unless=[partial(_call_guard, guards[g]) for g in row.unless],
            before=[partial(_run_effects, tuple(effects[e] for e in row.effects))] if row.effects else [],
        )
    declared = frozenset((t.trigger, t.source) for t in spec.transitions)
    rows: dict[tuple[str, str], tuple[_Row, ...]] = {}
    for row in spec.transitions:
        rows[(row.trigger, row.source)] = (*rows.get((row.trigger, row.source), ()), _Row(
            tuple(guards[g] for g in row.guards), tuple(guards[g] for g in row.unless),
            tuple(effects[e] for e in row.effects), row.dest))
    return _Compiled(spec=spec, machine=machine, declared=declared, guards=guards, effects=effects, rows=rows)


class _Held(threading.local):
    """Per thread: how many machine locks it holds through fire/locked(), and the objects
    whose changes wait for the last of them to be released."""

    def __init__(self) -> None:
        self.depth = 0
        self.dirty: list[Lifecycle] = []


_held = _Held()


def _flush(p: _Held) -> None:
    while p.dirty:
        objs, p.dirty = p.dirty, []
        for obj in dict.fromkeys(objs):  # each object once, in the order first changed
            obj._deliver()


class Lifecycle:
    """Base of every object whose state a table drives. See the module docstring."""

    table: ClassVar[MachineSpec]
    _kv_compiled: ClassVar[_Compiled]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if hasattr(cls, "table"):
            cls._kv_compiled = compile_table(cls, cls.table)

    def __init__(self, *, label: str = "", observers: Iterable[Observer] = ()) -> None:
        compiled = type(self)._kv_compiled
        self._kv_state: str = compiled.spec.initial
        self._kv_lock: threading.RLock = threading.RLock()
        self._kv_firing = False
        self._kv_pending: collections.deque[StateChange] = collections.deque()
        self._kv_queue_lock = threading.Lock()  # guards _kv_pending's consumer side
        self._kv_delivering = False
        self.label = label or f"{compiled.spec.name}@{id(self):x}"
        self._observers: tuple[Observer, ...] = tuple(observers)

    @classmethod
    def bound_to(cls, table: MachineSpec) -> type[Lifecycle]:
        """A subclass driven by ``table`` instead of the class's own (a variant of the spec,
        such as a deliberately broken one in a self-test). Implementations of guards and
        effects that ``table`` does not declare are dropped, so the binding check passes
        exactly when the variant only removes names."""
        need("table", table, MachineSpec)
        ns: dict[str, Any] = {"table": table}
        for attr in dir(cls):
            value = getattr(cls, attr, None)
            guard_name, effect_name = getattr(value, _GUARD_ATTR, None), getattr(value, _EFFECT_ATTR, None)
            if (isinstance(guard_name, str) and guard_name not in table.guards) or \
                    (isinstance(effect_name, str) and effect_name not in table.effects):
                ns[attr] = None
        return type(f"{cls.__name__}[{table.source}]", (cls,), ns)

    @classmethod
    def bindings(cls) -> dict[tuple[str, str], Callable[..., Any]]:
        """("guard" or "effect", name) -> the function bound to it from the class's table."""
        compiled = cls._kv_compiled
        native: frozenset[str] = getattr(cls, "native", frozenset())
        return {**{("guard", n): fn for n, fn in compiled.guards.items() if n not in native},
                **{("effect", n): fn for n, fn in compiled.effects.items() if n not in native}}

    @property
    def state(self) -> str:
        return self._kv_state

    @property
    def is_terminal(self) -> bool:
        return self._kv_state in type(self)._kv_compiled.spec.terminal

    def locked(self) -> AbstractContextManager[None]:
        """Hold the object's lock, to make a check and a fire one atomic step::

            with obj.locked():
                if obj.may("drain"):
                    obj.fire("drain")

        Observers of changes fired inside are called when the block exits."""
        return Lifecycle.locked_all((self,))

    @staticmethod
    @contextmanager
    def locked_all(objects: Sequence[Lifecycle]) -> Iterator[None]:
        """:meth:`locked` of every one of ``objects`` at once, taken in their order (a
        native call that decides a whole batch holds its machines across the call and
        :meth:`adopt_all`); one context instead of one per object."""
        p = _held
        taken: list[threading.RLock] = []
        try:
            for obj in objects:
                obj._kv_lock.acquire()
                taken.append(obj._kv_lock)
            p.depth += 1
            try:
                yield
            finally:
                p.depth -= 1
        finally:
            for lock in reversed(taken):
                lock.release()
            if p.depth == 0 and p.dirty:
                _flush(p)

    def may(self, event: str) -> bool:
        """Whether ``event`` is declared in the current state (guards not evaluated)."""
        return isinstance(event, str) and (event, self._kv_state) in type(self)._kv_compiled.declared

    def observe(self, observer: Observer) -> None:
        need_callable("observer", observer)
        with self._kv_lock:
            self._observers = (*self._observers, observer)

    def fire(self, event: str, **kwargs: Any) -> str:
        """Apply ``event``; return the new state. See the module docstring for the rules."""
        compiled = type(self)._kv_compiled
        spec = compiled.spec
        if not isinstance(event, str):  # no such event: undeclared, and said so in words
            raise TransitionError.illegal(spec.name, self._kv_state, f"{event!r:.40}")
        if "reason" in kwargs and kwargs["reason"] is not None:
            need_text("reason", kwargs["reason"], allow_empty=True)
        p = _held
        try:
            with self._kv_lock:
                p.depth += 1
                try:
                    source = self._kv_state
                    if self._kv_firing:
                        raise TransitionError.reentrant(spec.name, source, event)
                    if (event, source) not in compiled.declared:
                        raise TransitionError.illegal(spec.name, source, event)
                    self._kv_firing = True
                    try:
                        fired = compiled.trigger(self, event, source, kwargs)
                    except _StepFailed as failed:
                        raise NativeError.effect(spec.name, source, event, failed.step, failed.cause) from failed.cause
                    finally:
                        self._kv_firing = False
                    if not fired:
                        raise TransitionError.guard(spec.name, source, event,
                                                    self._refusing_guards(spec.rows(event, source), kwargs))
                    dest = self._kv_state
                    if self._observers:
                        reason = kwargs.get("reason")
                        self._kv_pending.append(StateChange(spec.name, self.label, event, source, dest,
                                                            time.monotonic_ns(),
                                                            reason if isinstance(reason, str) else None))
                        p.dirty.append(self)
                finally:
                    p.depth -= 1
        finally:
            if p.depth == 0 and p.dirty:
                _flush(p)
        return dest

    def adopt(self, event: str, dest: str, *, reason: str | None = None) -> None:
        """Commit a transition that another executor of this table already made (the
        native attach fires the part's rows in C), for this object's state and observers.
        Nothing is decided here: the row (event, current state -> ``dest``) must be one the
        table declares, else TransitionError (ILLEGAL), the two executors having diverged.
        The caller holds :meth:`locked` across the native call and this, so no fire here
        runs in between."""
        need_text("event", event)
        need_text("dest", dest)
        if reason is not None:
            need_text("reason", reason, allow_empty=True)
        compiled = type(self)._kv_compiled
        with self._kv_lock:
            source = self._kv_state
            if self._kv_firing or not any(row.dest == dest for row in compiled.rows.get((event, source), ())):
                raise TransitionError.illegal(compiled.spec.name, source, event)
            self._kv_state = dest
            if self._observers:
                self.record(StateChange(compiled.spec.name, self.label, event, source, dest, time.monotonic_ns(),
                                        reason))

    @classmethod
    def step_all(cls, objects: Sequence[Lifecycle], event: str) -> bool:
        """What :meth:`fire` of ``event`` on each of ``objects`` (machines of this table)
        would do, in one step (:meth:`adopt_all`), when they share a state whose one row for
        ``event`` runs nothing (no guard, no effect); False, doing nothing, otherwise: the
        caller fires each (a fire site the code map can see)."""
        objects = need_items("objects", objects, cls)
        states = {obj._kv_state for obj in objects}
        rows = cls.table.rows(event, next(iter(states))) if len(states) == 1 else ()
        if len(rows) != 1 or rows[0].guarded or rows[0].effects:
            return False
        cls.adopt_all(objects, ((event, rows[0].dest),))
        return True

    @classmethod
    def adopt_all(cls, objects: Sequence[Lifecycle], steps: Sequence[tuple[str, str]]) -> None:
        """:meth:`adopt` of the rows ``steps`` ((event, dest), in order) for every one of
        ``objects`` (machines of this table) at once: another executor made them for a
        whole batch (the native import leases and opens a group's parts in one C call).
        Every object's path is checked against the table first; TransitionError (ILLEGAL),
        and nothing committed, when any diverged. The caller holds every object's
        :meth:`locked` across the native call and this."""
        compiled = cls._kv_compiled
        objects = need_items("objects", objects, cls)
        pairs = []
        for i, step in enumerate(need_items("steps", steps, tuple)):
            if len(step) != 2:
                raise ArgumentInvalid.of(f"steps[{i}]", ArgumentReason.LENGTH, "must be one (event, dest) pair")
            pairs.append((need_text(f"steps[{i}] event", step[0]), need_text(f"steps[{i}] dest", step[1])))
        path = tuple(pairs)
        with Lifecycle.locked_all(objects):
            for obj in objects:
                off = compiled.diverges(obj._kv_state, path)
                if off is not None:
                    raise TransitionError.illegal(compiled.spec.name, off[1], path[off[0]][0])
                if obj._kv_firing and path:
                    raise TransitionError.illegal(compiled.spec.name, obj._kv_state, path[0][0])
            for obj in objects:
                source = obj._kv_state
                for event, dest in path:
                    obj._kv_state = dest
                    if obj._observers:
                        obj.record(StateChange(compiled.spec.name, obj.label, event, source, dest,
                                               time.monotonic_ns(), None))
                    source = dest

    def record(self, change: StateChange) -> None:
        """A change committed by another executor of this object's table (the native lease
        server: kvstate.share.lease_server), for the observers: delivered as :meth:`fire`
        delivers its own, when the outermost :meth:`locked` block of this thread exits."""
        if not self._observers:
            return
        self._kv_pending.append(change)
        p = _held
        if p.depth:
            p.dirty.append(self)
        else:
            self._deliver()

    def _deliver(self) -> None:
        """Call the observers with every queued change, in order, outside the object's
        lock; one thread at a time per object (the others leave their changes to it)."""
        with self._kv_queue_lock:
            if self._kv_delivering:
                return
            self._kv_delivering = True
        try:
            while True:
                with self._kv_queue_lock:
                    if not self._kv_pending:
                        self._kv_delivering = False
                        return
                    change = self._kv_pending.popleft()
                if log.isEnabledFor(logging.DEBUG):  # a timeline across processes (one monotonic clock)
                    log.debug("t=%.6f %s %s: %s -(%s)-> %s", change.monotonic_ns / 1e9, change.machine,
                              change.label, change.source, change.event, change.dest)
                for observer in self._observers:
                    try:
                        observer(change)
                    except Exception:  # an observer must never undo a committed transition
                        log.exception("observer %r failed on %s", observer, change)
        except BaseException:
            with self._kv_queue_lock:
                self._kv_delivering = False
            raise

    def _refusing_guards(self, rows: tuple[TransitionSpec, ...], kwargs: dict[str, Any]) -> list[str]:
        guards = type(self)._kv_compiled.guards
        refused: list[str] = []
        for row in rows:
            refused += [g for g in row.guards if not guards[g](self, **kwargs)]
            refused += [f"not {g}" for g in row.unless if guards[g](self, **kwargs)]
        return refused
