"""The op lifecycle in Python comes from spec/op.toml (kvstate/transport/optable.py): what
a state allows is read from the table (the C engine steps every op, host and CUDA), and no
module under kvstate/transport names an op state itself. Each check is shown to catch a
plant."""

from __future__ import annotations

import ast
from pathlib import Path

from kvstate.core.spec import load_machine, parse_machine
from kvstate.transport.optable import CANCEL, FAIL, FINISH, OPS, REAP, OpTable

TRANSPORT = Path(__file__).resolve().parents[1] / "kvstate" / "transport"
SPEC = Path(__file__).resolve().parents[1] / "spec" / "op.toml"


def test_what_python_reads_of_a_state_is_the_tables() -> None:
    spec = load_machine("op")
    for state in spec.state_names:
        assert OPS.collectable(state) == bool(spec.rows(REAP, state))
        assert OPS.faulted(state) == any(t.dest == state and t.trigger == FAIL for t in spec.transitions)
    assert OPS.may("running", FINISH) and not OPS.may("running", CANCEL) and OPS.may("queued", CANCEL)


def test_a_changed_table_changes_what_python_reads() -> None:
    """Nothing about the op lifecycle is fixed in Python: a table where cancel applies to
    running ops too says so here."""
    text = SPEC.read_text(encoding="utf-8") + '\n[[transitions]]\ntrigger = "cancel"\nsource = "running"\n' \
        'dest = "cancelled"\neffects = ["unpin_regions"]\n'
    variant = OpTable(parse_machine(text, "variant op.toml"))
    assert variant.may("running", CANCEL) and not OPS.may("running", CANCEL)


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
