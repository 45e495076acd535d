"""The op lifecycle in Python comes from spec/op.toml (kvstate/transport/optable.py):
what a state allows is read from the table, a stepper fires only its rows, and no module
under kvstate/transport names an op state itself. Each check is shown to catch a plant."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest

from kvstate.core.errors import BindingError, GuardRejected, IllegalTransition
from kvstate.core.spec import load_machine, parse_machine
from kvstate.transport.optable import CANCEL, FAIL, FINISH, OPS, REAP, START, SUBMIT, OpStepper, OpTable

TRANSPORT = Path(__file__).resolve().parents[1] / "kvstate" / "transport"
SPEC = Path(__file__).resolve().parents[1] / "spec" / "op.toml"


@attrs.define
class Thing:
    state: str
    ok: bool = True
    pins: int = 0
    log: list[str] = attrs.field(factory=list)


def stepper(table: OpTable = OPS) -> OpStepper[Thing]:
    def pin(t: Thing) -> None:
        t.pins += 1
        t.log.append("pin")

    def unpin(t: Thing) -> None:
        t.pins -= 1
        t.log.append("unpin")

    return OpStepper[Thing](guards={"regions_mapped": lambda t: t.ok},
                            effects={"pin_regions": pin, "unpin_regions": unpin}, table=table)


def test_every_row_of_the_table_and_only_those_fire() -> None:
    steps = stepper()
    spec = load_machine("op")
    for state in spec.state_names:
        for event in spec.event_names:
            thing = Thing(state)
            rows = spec.rows(event, state)
            if rows:
                steps.step(thing, event)
                assert thing.state == rows[0].dest
                assert thing.log == [e.removesuffix("_regions") for e in rows[0].effects]
            else:
                with pytest.raises(IllegalTransition) as info:
                    steps.step(thing, event)
                assert (info.value.machine, info.value.state, info.value.event) == ("op", state, event)
                assert thing == Thing(state), "an illegal step changed the object"


def test_a_guard_refusal_changes_nothing_and_names_the_guard() -> None:
    thing = Thing(OPS.initial, ok=False)
    with pytest.raises(GuardRejected) as info:
        stepper().step(thing, SUBMIT)
    assert info.value.failed == ("regions_mapped",) and thing == Thing(OPS.initial, ok=False)


def test_a_gather_lifecycle_pins_exactly_while_in_flight() -> None:
    steps, thing = stepper(), Thing(OPS.initial)
    for event, pins in ((SUBMIT, 1), (START, 1), (FINISH, 0), (REAP, 0)):
        steps.step(thing, event)
        assert thing.pins == pins, event
    assert thing.state in load_machine("op").terminal
    failed = Thing(OPS.initial)
    for event in (SUBMIT, START, FAIL):
        steps.step(failed, event)
    assert OPS.faulted(failed.state) and OPS.collectable(failed.state) and failed.pins == 0
    cancelled = Thing(OPS.initial)
    steps.step(cancelled, SUBMIT)
    steps.step(cancelled, CANCEL)
    assert cancelled.pins == 0 and OPS.collectable(cancelled.state) and not OPS.faulted(cancelled.state)


def test_binding_must_match_the_table() -> None:
    with pytest.raises(BindingError, match="unpin_regions"):
        OpStepper[Thing](guards={"regions_mapped": lambda t: True}, effects={"pin_regions": lambda t: None})
    with pytest.raises(BindingError, match="extra"):
        OpStepper[Thing](guards={"regions_mapped": lambda t: True, "extra": lambda t: True},
                         effects={"pin_regions": lambda t: None, "unpin_regions": lambda t: None})


def test_a_changed_table_changes_the_steps() -> None:
    """Built from a table where cancel applies to running ops too, the stepper follows it:
    nothing about the op lifecycle is fixed in Python."""
    text = SPEC.read_text(encoding="utf-8") + '\n[[transitions]]\ntrigger = "cancel"\nsource = "running"\n' \
        'dest = "cancelled"\neffects = ["unpin_regions"]\n'
    variant = OpTable(parse_machine(text, "variant op.toml"))
    thing = Thing(OPS.initial)
    steps = stepper(variant)
    for event in (SUBMIT, START, CANCEL):
        steps.step(thing, event)
    assert thing.pins == 0 and variant.collectable(thing.state)
    with pytest.raises(IllegalTransition):
        stepper().step(Thing("running"), CANCEL)


def op_state_literals(source: str, filename: str) -> list[str]:
    """String constants in ``source`` that are op state names (docstrings aside)."""
    tree = ast.parse(source, filename)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    states = set(OPS.states)
    return [f"{filename}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in states and id(node) not in docstrings]


def test_no_transport_module_names_an_op_state() -> None:
    found = []
    for path in sorted(TRANSPORT.rglob("*.py")):
        found += op_state_literals(path.read_text(encoding="utf-8"), str(path.relative_to(TRANSPORT)))
    assert found == []


def test_the_state_scan_catches_a_planted_literal() -> None:
    planted = '"""Module doc naming running is fine."""\ndef f(op):\n    return op.state == "running"\n'
    assert op_state_literals(planted, "planted.py") == ["planted.py:3: 'running'"]
