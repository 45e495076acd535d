"""Rows linked to code: the static code map and the check that code and tables agree.

A fire site is attributed to a machine by the class of its receiver (self in a binding
class, or a name annotated with its class), never by the event's name; an event fired in
code must be declared, and a declared event must be fired somewhere or marked external.
Each rule is shown to catch a planted bug in a copy of the source tree.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvstate.core.spec import load_spec
from kvstate.derive import code_c, code_py, codemap
from kvstate.share.bank import Bank
from kvstate.share.importer import Group, Part
from support.variants import ROOT, replace, source_tree


def test_code_and_tables_agree() -> None:
    spec = load_spec()
    assert codemap.check(spec, codemap.scan(ROOT, spec)) == []


@pytest.mark.parametrize("cls", [Bank, Group, Part])
def test_static_bindings_are_the_runtime_bindings(cls: type[Bank | Group | Part]) -> None:
    """What the pages say implements a guard or effect is what Lifecycle binds."""
    code = code_py.scan(ROOT)
    static = {(b.kind, b.name): b.site.label for b in code.bindings if b.machine == cls.table.name}
    runtime = {key: f"{fn.__module__}:{fn.__qualname__}" for key, fn in cls.bindings().items()}
    assert static == runtime


def test_fire_sites_name_the_function_that_fires() -> None:
    spec = load_spec()
    code = codemap.scan(ROOT, spec)
    labels = {m: {e: [s.label for s in code.fired_by(m, e)] for e in spec[m].event_names} for m in spec.machines}
    assert "kvstate.share.bank:Bank.register" in labels["bank"]["register_failed"]
    assert "kvstate.share.importer:Importer._note_restarts" in labels["group"]["incarnation_changed"]
    assert "kvstate.share.importer:Importer._each_part" in labels["part"]["open"]
    assert "kvstate.share.importer:Importer._fire_lease" in labels["part"]["lease"]
    # host ops start in a worker, CUDA ops as their copies go on a stream: one table
    assert labels["op"]["start"] == ["ffi/kvs_cuda_ops.c:kvs_cuda_submit", "ffi/kvs_ops.c:worker"]
    assert labels["op"]["finish"] == ["ffi/kvs_cuda_ops.c:settle", "ffi/kvs_ops.c:worker"]
    assert [s.label for s in code.implemented_by("op", "effect", "pin_regions")] == ["ffi/kvs_op_table.c:effect"]
    assert code.runner("op") == codemap.Site("ffi/kvs_op_table.c:kvs_op_step", "ffi/kvs_op_table.c")


# -- planted bugs: each must be reported ----------------------------------------------------

EXTERNAL = 'external = "the engine registers banks"'


@pytest.mark.parametrize(("file", "old", "new", "spec_patch", "expected"), [
    # code fires an event its table does not have (and the real one is then fired nowhere)
    ("kvstate/share/bank.py", 'self.fire("stored", handle=handle)', 'self.fire("stored_now", handle=handle)', None,
     ["fires 'stored_now' on bank, which", "event 'stored' is fired nowhere"]),
    # a table event fired nowhere
    ("kvstate/share/bank.py", '                self.fire("register_failed")\n', "", None,
     ["event 'register_failed' is fired nowhere"]),
    # attribution is by the receiver's class, not by the event name: validate is a part event
    ("kvstate/share/importer.py", 'self.fire("load", plan=plan)', 'self.fire("validate", plan=plan)', None,
     ["fires 'validate' on group, which", "event 'load' is fired nowhere"]),
    # a receiver without an annotated class cannot be attributed
    ("kvstate/share/exporter.py", "        bank: Bank[H, A, R, M, E]\n        for bank in list(self.banks.values()):\n"
     "            with bank.locked():", "        for bank in list(self.banks.values()):\n            with bank.locked():",
     None, ["exporter.py: cannot tell which machine `bank.fire` drives: `bank` needs an annotation",
            "event 'descriptor_expired' is fired nowhere"]),
    # a helper taking any string cannot say which events it fires
    ("kvstate/share/importer.py", "def fault(self, event: GroupFault, *", "def fault(self, event: str, *", None,
     ["`self.fire` fires an event that is neither a string literal nor a name annotated Literal"]),
    # marked external although kvstate fires it: the marker would mislead
    (None, "", "", ("bank.toml", 'register = { doc', f'register = {{ {EXTERNAL}, doc'),
     ["event 'register' is marked external but kvstate.share.bank:Bank.register fires it"]),
    # C: the engine stops firing an op event
    ("ffi/kvs_ops.c", "kvs_op_step(op, KVS_OP_EV_REAP)", "kvs_op_step(op, 6)", None,
     ["spec/op.toml: event 'reap' is fired nowhere"]),
    # C: an effect no function implements
    ("ffi/kvs_op_table.c", "case KVS_OP_FX_UNPIN_REGIONS:", "case 99:", None,
     ["effect 'unpin_regions' is implemented by no function"]),
    # C lease server: a bank event its table does not have, and a lease effect nobody implements
    ("ffi/kvs_lease_answer.c", "KVS_BANK_EV_LEASE_MAPPED, &c", "KVS_BANK_EV_LEASE_MAPPED_NOW, &c", None,
     ["fires 'lease_mapped_now' on bank, which"]),
    ("ffi/kvs_lease.c", "case KVS_BANK_FX_EXPIRE_LEASE:", "case 99:", None,
     ["effect 'expire_lease' is implemented by no function"]),
], ids=["undeclared-event", "fired-nowhere", "other-machine", "unannotated-receiver", "untyped-helper",
        "external-but-fired", "c-fired-nowhere", "c-unimplemented-effect", "c-bank-undeclared-event",
        "c-bank-unimplemented-effect"])
def test_planted_disagreement_is_reported(file: str | None, old: str, new: str,
                                          spec_patch: tuple[str, str, str] | None,
                                          expected: list[str], tmp_path: Path) -> None:
    tree = source_tree(tmp_path)
    if file is not None:
        replace(tree, [(file, old, new)])
    if spec_patch is not None:
        replace(tree / "spec", [spec_patch])
    spec = load_spec(tree / "spec")
    problems = codemap.check(spec, codemap.scan(tree, spec))
    # each problem is one of the expected ones, as many times as expected
    matched = [next((t for t in expected if t in _unlined(p)), p) for p in problems]
    assert sorted(matched) == sorted(expected)


def _unlined(problem: str) -> str:
    """The problem without the line number of its site (which moves with the code)."""
    path, _, rest = problem.partition(":")
    line, _, rest = rest.partition(":")
    return f"{path}:{rest}" if line.isdigit() else problem


def test_an_external_event_needs_no_fire_site(tmp_path: Path) -> None:
    tree = source_tree(tmp_path)
    replace(tree, [("kvstate/share/bank.py", '                self.fire("register_failed")\n', "")])
    replace(tree / "spec", [("bank.toml", "register_failed = { doc",
                             'register_failed = { external = "the engine reports it", doc')])
    spec = load_spec(tree / "spec")
    assert codemap.check(spec, codemap.scan(tree, spec)) == []


# -- the scan's rules on small sources -------------------------------------------------------


def _tree(tmp_path: Path, **modules: str) -> Path:
    for name, text in modules.items():
        path = tmp_path / "kvstate" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


BASE = """
    from typing import Literal
    from kvstate.core.machine import Lifecycle, effect, guard
    from kvstate.core.spec import load_machine

    Ends = Literal["a", "b"]

    class Door(Lifecycle):
        table = load_machine("door")

        @guard("closed")
        def _closed(self) -> bool: ...

        @effect("open")
        def _open(self) -> None: ...

        def later(self) -> None:
            def inner() -> None:
                self.fire("open")
            inner()
"""


def test_python_scan_rules(tmp_path: Path) -> None:
    root = _tree(tmp_path, doors=BASE, users="""
        from kvstate.doors import Door, Ends

        class Red(Door):
            def _open(self) -> None: ...   # shadows the binding: Red binds no effect 'open'

        def one(door: Door, which: Ends, other: object) -> None:
            door.fire("knock")
            door.fault(which)
            d: Door | None = None
            for d in [door]:
                d.fire("slam")
            [x.fire("lost") for x in [door]]     # a comprehension's name has no annotation
            other.fire("x")                       # annotated, but binds no table
            g: "Door[int]" = door                  # a generic class with its type arguments
            g.fire("shut")
    """)
    code = code_py.scan(root)
    fires = {(f.machine, f.event, f.site.label) for f in code.fires}
    assert fires == {("door", "open", "kvstate.doors:Door.later.<locals>.inner"),
                     ("door", "knock", "kvstate.users:one"), ("door", "a", "kvstate.users:one"),
                     ("door", "b", "kvstate.users:one"), ("door", "slam", "kvstate.users:one"),
                     ("door", "shut", "kvstate.users:one")}
    assert len(code.problems) == 2
    assert code.problems[0].startswith("kvstate/users.py:13: ") and "`x` needs an annotation" in code.problems[0]
    assert code.problems[1].startswith("kvstate/users.py:14: ") and "annotated `object`" in code.problems[1]
    # Red shadows `_open` without the decorator: like Lifecycle, the scan binds nothing there
    bound = [(b.kind, b.name, b.site.label) for b in code.bindings]
    assert sorted(bound) == [("effect", "open", "kvstate.doors:Door._open"),
                             ("guard", "closed", "kvstate.doors:Door._closed"),
                             ("guard", "closed", "kvstate.doors:Door._closed")]


def test_c_function_scan_skips_comments_literals_and_initialisers() -> None:
    text = textwrap.dedent("""\
        #include "x.h"
        /* static int fake(void) { kvs_op_step(op, KVS_OP_EV_REAP); } */
        static const int table[] = { 1, 2 };
        struct s { int a; };
        static const char *msg = "{ not a body }";
        #if defined(X)
        static int step_it(struct op *o, int n) {
            if (n) { return kvs_op_step(o, KVS_OP_EV_START); }
            return '{';
        }
        #endif
        __attribute__((unused)) static int other(void) { return KVS_OP_EV_REAP; }
        """)
    found = [(name, line) for name, line, _ in code_c.functions(text)]
    assert found == [("step_it", 7), ("other", 12)]
