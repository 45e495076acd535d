"""The runtime machine mechanism: bindings, effects, guards, reentrancy, observers, threads."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from support.errors import raises

from kvstate.core.errors import TransferFailed, ConfigInvalid, NativeError, TransitionError
from kvstate.core.reasons import TransferFailReason, ConfigReason, NativeReason, TransitionReason
from kvstate.core.machine import Lifecycle, StateChange, effect, guard
from kvstate.core.spec import load_machine, parse_machine
from support.harness import harness_class

OP = load_machine("op")


def test_binding_missing_guard_names_table_and_entry() -> None:
    with raises(ConfigInvalid, ConfigReason.BINDING) as info:
        class Incomplete(Lifecycle):  # noqa: F841 - the class statement is the test
            table = OP

            @effect("pin_regions")
            def _pin(self, **kw: Any) -> None: ...

            @effect("unpin_regions")
            def _unpin(self, **kw: Any) -> None: ...
    assert info.value.source == "spec/op.toml" and info.value.entry == "guards.regions_mapped"


def test_binding_undeclared_effect_is_refused() -> None:
    base = harness_class(OP)
    with raises(ConfigInvalid, ConfigReason.BINDING, match="does not declare"):
        class Extra(base):  # type: ignore[valid-type,misc]
            @effect("launch_rockets")
            def _rockets(self, **kw: Any) -> None: ...


def test_effects_run_before_commit_and_see_the_source_state() -> None:
    seen: list[str] = []

    class Op(harness_class(OP)):  # type: ignore[misc]
        def _effect(self, name: str) -> Any:
            seen.append(self.state)
            return None

    op = Op()
    op.fire("submit")
    assert seen == ["created"] and op.state == "queued"


def test_event_kwargs_reach_guards_and_effects() -> None:
    got: dict[str, Any] = {}

    class Op(Lifecycle):
        table = OP

        @guard("regions_mapped")
        def _mapped(self, *, regions: tuple[int, ...], **kw: Any) -> bool:
            return all(r >= 0 for r in regions)

        @effect("pin_regions")
        def _pin(self, *, regions: tuple[int, ...], **kw: Any) -> None:
            got["pinned"] = regions

        @effect("unpin_regions")
        def _unpin(self, **kw: Any) -> None: ...

    op = Op()
    with raises(TransitionError, TransitionReason.GUARD, match="regions_mapped"):
        op.fire("submit", regions=(1, -1))
    op.fire("submit", regions=(1, 2))
    assert got == {"pinned": (1, 2)}


def test_reentrant_fire_is_detected_not_deadlocked() -> None:
    class Op(harness_class(OP)):  # type: ignore[misc]
        def _effect(self, name: str) -> Any:
            self.fire("start")

    op = Op()
    with raises(TransitionError, TransitionReason.REENTRANT):
        op.fire("submit")
    assert op.state == "created"


def test_observers_receive_structured_changes_and_cannot_break_commit() -> None:
    changes: list[StateChange] = []
    op = harness_class(OP)()
    op.observe(changes.append)
    op.observe(lambda c: 1 / 0)
    op.fire("submit")
    op.fire("start")
    assert [(c.machine, c.event, c.source, c.dest) for c in changes] == [
        ("op", "submit", "created", "queued"), ("op", "start", "queued", "running")]
    assert op.state == "running"


def test_objects_never_join_the_shared_machine() -> None:
    """Creation is O(1): no add_model, whose list membership test is quadratic overall."""
    cls = harness_class(OP)
    objs = [cls() for _ in range(1000)]
    for o in objs[:10]:
        o.fire("submit")
    assert cls._kv_compiled.machine.models == []


def test_concurrent_events_on_one_object_are_serialised() -> None:
    """Many threads race to move one op; exactly one wins each step, none is lost."""
    counter = parse_machine("""
[machine]
name = "counter"
title = "Counter"
initial = "s0"
terminal = ["s8"]
doc = "steps"
[states]
s0 = "0"
s1 = "1"
s2 = "2"
s3 = "3"
s4 = "4"
s5 = "5"
s6 = "6"
s7 = "7"
s8 = "8"
[events]
step = { doc = "step" }
[effects]
count = "count"
""" + "".join(f'[[transitions]]\ntrigger = "step"\nsource = "s{i}"\ndest = "s{i+1}"\neffects = ["count"]\n'
              for i in range(8)), "counter.toml")

    class Counter(Lifecycle):
        table = counter

        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        @effect("count")
        def _count(self, **kw: Any) -> None:
            n = self.count
            threading.Event().wait(0.0005)  # widen the race window
            self.count = n + 1

    c = Counter()
    wins: list[str] = []
    errors: list[Exception] = []

    def worker() -> None:
        try:
            wins.append(c.fire("step"))
        except TransitionError as exc:
            if exc.reason is not TransitionReason.ILLEGAL:
                raise
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.state == "s8" and c.count == 8
    assert sorted(wins) == [f"s{i}" for i in range(1, 9)] and len(errors) == 8


# -- INV-EFFECT-ATOMIC for anything an effect raises (issue 14, class 6) ---------------------

THREE_EFFECTS = parse_machine("""
[machine]
name = "three"
title = "A row with three effects"
initial = "a"
terminal = ["b"]
doc = "A test table: one row whose three effects each take something an undo gives back."
[states]
a = "Nothing taken."
b = "All three taken."
[events]
go = { doc = "Take all three." }
[effects]
take_lease = "Take a lease."
open_handle = "Open a handle."
map_it = "Map it."
[[transitions]]
trigger = "go"
source = "a"
dest = "b"
effects = ["take_lease", "open_handle", "map_it"]
""", "tests/three-effects.toml")


class Three(Lifecycle):
    """Each effect takes a resource and returns its undo; ``fail`` makes one raise."""

    table = THREE_EFFECTS

    def __init__(self, fail: str | None, exc: BaseException) -> None:
        super().__init__(label="three")
        self.fail, self.exc = fail, exc
        self.held: list[str] = []
        self.log: list[str] = []

    def _take(self, name: str) -> Any:
        if name == self.fail:
            raise self.exc
        self.held.append(name)
        self.log.append(name)

        def undo() -> None:
            self.held.remove(name)
            self.log.append(f"undo {name}")
        return undo

    @effect("take_lease")
    def _lease(self, **kw: Any) -> Any:
        return self._take("take_lease")

    @effect("open_handle")
    def _open(self, **kw: Any) -> Any:
        return self._take("open_handle")

    @effect("map_it")
    def _map(self, **kw: Any) -> Any:
        return self._take("map_it")


@pytest.mark.parametrize("exc", [OSError(5, "EIO"), RuntimeError("boom"), MemoryError(), KeyError("k"),
                                 ValueError("v"), TypeError("t")], ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("fail", ["take_lease", "open_handle", "map_it"])
def test_untyped_effect_failure_rolls_back_and_is_typed(fail: str, exc: BaseException) -> None:
    """Whatever an effect raises, the earlier effects are undone in reverse (the lease is
    given back), later ones never run, the state stays, and only NativeError (EFFECT) leaves,
    naming the step with the original exception chained."""
    obj = Three(fail, exc)
    with raises(NativeError, NativeReason.EFFECT) as info:
        obj.fire("go")
    order = ["take_lease", "open_handle", "map_it"]
    done = order[:order.index(fail)]
    assert obj.state == "a" and obj.held == []
    assert obj.log == done + [f"undo {e}" for e in reversed(done)]
    err = info.value
    assert (err.machine, err.state, err.event, err.step) == ("three", "a", "go", f"effect {fail}")
    assert err.cause is exc and err.__cause__ is exc
    obj.fail = None
    assert obj.fire("go") == "b" and obj.held == order  # and the machine still works


def test_typed_effect_failure_passes_through_after_rollback() -> None:
    obj = Three("map_it", TransferFailed(TransferFailReason.LOAD, "typed"))
    with raises(TransferFailed, TransferFailReason.LOAD):
        obj.fire("go")
    assert obj.state == "a" and obj.held == []


def test_interrupt_in_effect_rolls_back_and_propagates_as_is() -> None:
    obj = Three("open_handle", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        obj.fire("go")
    assert obj.state == "a" and obj.held == [] and obj.log == ["take_lease", "undo take_lease"]


def test_guard_that_raises_is_a_typed_failure() -> None:
    class Op(harness_class(OP)):  # type: ignore[misc]
        def _guard(self, name: str) -> bool:
            raise ZeroDivisionError("guard bug")

    op = Op()
    with raises(NativeError, NativeReason.EFFECT, match="guard regions_mapped") as info:
        op.fire("submit")
    assert op.state == "created" and isinstance(info.value.cause, ZeroDivisionError)


def test_reason_of_an_event_is_observed() -> None:
    seen: list[StateChange] = []
    op = harness_class(OP)()
    op.observe(seen.append)
    op.fire("submit", reason="test: why")
    assert seen[-1].reason == "test: why"


# -- observers run outside the machine's lock -------------------------------------------------


def _lock_free_from_another_thread(obj: Lifecycle, wait: float = 2.0) -> bool:
    """True when another thread can take the object's lock (within ``wait`` seconds)."""
    got: list[bool] = []

    def probe() -> None:
        ok = obj._kv_lock.acquire(timeout=wait)
        if ok:
            obj._kv_lock.release()
        got.append(ok)

    t = threading.Thread(target=probe)
    t.start()
    t.join(5.0)
    return got == [True]


def test_observers_are_called_after_the_lock_is_released() -> None:
    """An observer may wait for another thread that needs the object: no deadlock, and
    the change reported is committed."""
    free: list[bool] = []

    class Op(harness_class(OP)):  # type: ignore[misc]
        pass

    op = Op()
    op.observe(lambda c: free.append(_lock_free_from_another_thread(op)))
    op.fire("submit")
    with op.locked():  # inside a locked() block the change waits for the block's end
        op.fire("start")
        assert free == [True]
    assert free == [True, True]


def test_locked_all_holds_every_object_and_delivers_after_the_last_lock_is_released() -> None:
    """``Lifecycle.locked_all``: the native import's one context for a batch. Every
    object is held until the block ends (also when it raises), and the changes made inside
    reach the observers after every lock is released."""

    class Op(harness_class(OP)):  # type: ignore[misc]
        pass

    ops = [Op(), Op(), Op()]
    free: list[tuple[bool, ...]] = []
    for op in ops:
        op.observe(lambda c: free.append(tuple(_lock_free_from_another_thread(o) for o in ops)))
    with Lifecycle.locked_all(ops):
        assert not any(_lock_free_from_another_thread(o, wait=0.0) for o in ops)
        for op in ops:
            op.fire("submit")
        assert free == []
    assert free == [(True, True, True)] * 3
    with pytest.raises(RuntimeError):
        with Lifecycle.locked_all(ops):
            raise RuntimeError("in the block")
    assert all(_lock_free_from_another_thread(o) for o in ops)
    with Lifecycle.locked_all([ops[0], ops[0]]):  # re-entrant, as locked() is
        ops[0].fire("start")
    assert _lock_free_from_another_thread(ops[0]) and len(free) == 4


def test_changes_of_an_effect_on_another_object_wait_for_the_outer_lock() -> None:
    """A group's effect closes its parts: the parts' observers run after the group's lock
    is released too, not under it."""
    free: list[bool] = []

    class Op(harness_class(OP)):  # type: ignore[misc]
        pass

    inner = Op()
    outer_holder: list[Any] = []

    class Outer(harness_class(OP)):  # type: ignore[misc]
        def _effect(self, name: str) -> Any:
            if name == "pin_regions":
                inner.fire("submit")  # another object's transition inside this one's effect
            return None

    outer = Outer()
    outer_holder.append(outer)
    inner.observe(lambda c: free.append(_lock_free_from_another_thread(outer)))
    outer.fire("submit")
    assert free == [True]


def test_an_observer_may_fire_on_its_own_object_and_order_is_kept() -> None:
    class Op(harness_class(OP)):  # type: ignore[misc]
        pass

    op = Op()
    seen: list[str] = []

    def observer(c: StateChange) -> None:
        seen.append(c.event)
        if c.event == "submit":
            op.fire("start")  # used to be TransitionError (REENTRANT) under the lock

    op.observe(observer)
    op.fire("submit")
    assert seen == ["submit", "start"] and op.state == "running"


def test_concurrent_changes_reach_observers_in_commit_order() -> None:
    class Op(harness_class(OP)):  # type: ignore[misc]
        pass

    ops = [Op() for _ in range(200)]
    seen: dict[int, list[str]] = {i: [] for i in range(len(ops))}
    for i, op in enumerate(ops):
        op.observe(lambda c, i=i: seen[i].append(c.dest))

    def drive(op: Lifecycle) -> None:
        for event in ("submit", "start", "finish", "reap"):
            op.fire(event)

    threads = [threading.Thread(target=lambda k=k: [drive(o) for o in ops[k::4]]) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(s == ["queued", "running", "done", "reaped"] for s in seen.values())


def test_transitions_library_logging_is_quiet_by_default(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    class Op(harness_class(OP)):  # type: ignore[misc]
        pass

    with caplog.at_level(logging.INFO):  # an application that logs INFO
        logging.getLogger().setLevel(logging.INFO)
        Op().fire("submit")
    assert not [r for r in caplog.records if r.name.startswith("transitions")]
    assert logging.getLogger("transitions.core").getEffectiveLevel() == logging.WARNING


TABLES = ["bank", "group", "part", "op", "rank", "coordinator"]


def _dispatch_disagreements(name: str, fast: Any) -> tuple[int, list[Any]]:
    """Run ``fast(compiled, obj, event, source)`` and ``transitions``' own Event.trigger on
    the same shared machine for every (event, state), every assignment of the guards its
    rows name, and each of its effects failing; return (cases, disagreements)."""
    import itertools

    spec = load_machine(name)
    cls = harness_class(spec)
    compiled = cls._kv_compiled
    cases, bad = 0, []
    for (event, source) in compiled.rows:
        names = sorted({g for r in spec.rows(event, source) for g in (*r.guards, *r.unless)})
        effects = sorted({e for r in spec.rows(event, source) for e in r.effects})
        for values in itertools.product([True, False], repeat=len(names)):
            for failing in [None, *effects]:
                outcomes = []
                for dispatch in ("fast", "transitions"):
                    obj = cls()
                    obj._kv_state = source
                    obj.guard_values = dict(zip(names, values))
                    obj.failing = {failing} if failing else set()
                    try:
                        fired = fast(compiled, obj, event, source) if dispatch == "fast" else \
                            compiled.machine.events[event].trigger(obj)
                        error = None
                    except Exception as exc:  # the harness's NativeError (EFFECT)
                        fired, error = None, type(exc).__name__
                    outcomes.append((fired, error, obj.state, tuple(obj.log)))
                cases += 1
                if outcomes[0] != outcomes[1]:
                    bad.append((event, source, values, failing, outcomes))
    return cases, bad


@pytest.mark.parametrize("name", TABLES)
def test_fire_dispatches_every_row_as_transitions_does(name: str) -> None:
    """``fire`` runs the compiled rows itself (the fast path); ``transitions``' own
    ``Event.trigger`` on the same shared machine is the reference: both pick the same row
    (fired flag, destination, effect log and its rollback) in every case."""
    cases, bad = _dispatch_disagreements(name, lambda c, obj, e, s: c.trigger(obj, e, s, {}))
    assert cases >= len(harness_class(load_machine(name))._kv_compiled.rows)
    assert bad == []


def test_the_dispatch_check_catches_a_planted_bug() -> None:
    """A fast path that skips ``unless`` guards, or every guard, disagrees with
    transitions: the check above can fail."""
    def no_unless(c: Any, obj: Any, event: str, source: str) -> bool:
        for row in c.rows[(event, source)]:
            if all(g(obj) for g in row.guards):
                obj._kv_state = row.dest
                return True
        return False

    def no_guards(c: Any, obj: Any, event: str, source: str) -> bool:
        obj._kv_state = c.rows[(event, source)][0].dest
        return True

    assert any(_dispatch_disagreements(name, no_guards)[1] for name in TABLES)
    with_unless = [n for n in TABLES if any(r.unless for r in load_machine(n).transitions)]
    assert all(_dispatch_disagreements(name, no_unless)[1] for name in with_unless)


# -- step_all: one step only where the row runs nothing -------------------------------------

BARE = parse_machine("""
[machine]
name = "bare"
title = "A row that runs nothing"
initial = "a"
terminal = ["b"]
doc = "A test table: one row without guard or effect."
[states]
a = "Before."
b = "After."
[events]
go = { doc = "Move on." }
[[transitions]]
trigger = "go"
source = "a"
dest = "b"
""", "tests/bare.toml")


class Bare(Lifecycle):
    table = BARE

    def __init__(self) -> None:
        super().__init__(label="bare")


def test_step_all_takes_one_step_for_a_bare_row_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare row is fed to every object in one step, observers told as by fire; a row
    with effects is left to the caller's fires, so its effects run (none skipped)."""
    seen: list[StateChange] = []
    bare = [Bare(), Bare()]
    for b in bare:
        b.observe(seen.append)
    fired: list[str] = []
    monkeypatch.setattr(Bare, "fire", lambda self, event, **kw: fired.append(event))
    assert Bare.step_all(bare, "go")
    assert fired == [] and [b.state for b in bare] == ["b", "b"]
    assert [(c.event, c.source, c.dest) for c in seen] == [("go", "a", "b")] * 2
    three = [Three(None, RuntimeError()), Three(None, RuntimeError())]
    assert not Three.step_all(three, "go") and [t.state for t in three] == ["a", "a"]
    for t in three:
        t.fire("go")
    assert [t.state for t in three] == ["b", "b"]
    assert all(t.log == ["take_lease", "open_handle", "map_it"] for t in three)
