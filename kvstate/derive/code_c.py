"""The C half of the code map: the op table, enforced by the op engine in ``ffi/*.c``.

The generated header (:mod:`kvstate.derive.header`) names every guard, effect and event of
``spec/op.toml`` as a C constant (``KVS_OP_GUARD_*``, ``KVS_OP_FX_*``, ``KVS_OP_EV_*``).
The scan reads the C sources (comments and string literals blanked out) function by
function:

* a function with ``case KVS_OP_GUARD_X:`` or ``case KVS_OP_FX_X:`` implements guard or
  effect ``x`` (``guard_holds`` and ``effect`` dispatch on them);
* a function that calls ``kvs_op_step`` fires every ``KVS_OP_EV_X`` it names (the engine
  fires ``start`` and ``finish``/``fail`` from a worker, ``submit`` from ``kvs_submit``...);
  a function that only reads the table (``table_usable``) fires nothing;
* ``kvs_op_step`` runs the rows (the header's contract).

Pure: reads text; needs no compiler.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from kvstate.core.spec import MachineSpec, Spec
from kvstate.derive.sites import Binding, CodeMap, Fire, Site
from kvstate.derive.header import ident

SOURCES = "ffi"
MACHINE = "op"
PREFIX = "KVS_OP_"
RUNNER = "kvs_op_step"

_NOISE = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_CASE = re.compile(rf"\bcase\s+{PREFIX}(GUARD|FX)_(\w+)\s*:")
_EVENT = re.compile(rf"\b{PREFIX}EV_(\w+)\b")
_CALLS_STEP = re.compile(rf"\b{RUNNER}\s*\(")


def _blank(text: str) -> str:
    """Comments and literals replaced by spaces, newlines kept (so line numbers hold)."""
    return _NOISE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)


def _function_name(head: str) -> str | None:
    """The name a top-level declarator ``head`` (the text before a ``{``) defines, if it
    is a function: the last identifier before a ``(`` outside parentheses."""
    if "=" in head or not head.rstrip().endswith(")"):
        return None  # an initialiser, a struct or enum body
    name, depth = None, 0
    for m in re.finditer(r"(\w+)?\s*([()])", head):
        if m.group(2) == "(":
            if depth == 0 and m.group(1):
                name = m.group(1)
            depth += 1
        else:
            depth -= 1
    return name


def functions(text: str) -> Iterator[tuple[str, int, str]]:
    """(name, line, body) of every function defined at the top level of C ``text``."""
    code = _blank(text)
    depth, start, head_from = 0, 0, 0
    name: str | None = None
    for i, ch in enumerate(code):
        if ch == "{":
            if depth == 0:
                name, start = _function_name(code[head_from:i]), i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                if name is not None:
                    yield name, code.count("\n", 0, start) + 1, code[start:i + 1]
                head_from = i + 1
        elif depth == 0 and ch == ";":
            head_from = i + 1
        elif depth == 0 and ch == "\n" and code[head_from:i].lstrip().startswith("#"):
            head_from = i + 1  # a preprocessor line ends at its newline


def scan(root: Path, spec: Spec) -> CodeMap:
    m: MachineSpec = spec.machines[MACHINE]
    names = {"GUARD": {ident(g): g for g in m.guards}, "FX": {ident(e): e for e in m.effects},
             "EV": {ident(e): e for e in m.event_names}}
    bindings: list[Binding] = []
    fires: list[Fire] = []
    runners: list[tuple[str, Site]] = []
    problems: list[str] = []
    for path in sorted((root / SOURCES).glob("*.c")):
        rel = path.relative_to(root).as_posix()
        for fn, line, body in functions(path.read_text(encoding="utf-8")):
            site = Site(f"{rel}:{fn}", rel)
            if fn == RUNNER:
                runners.append((MACHINE, site))
            for kind, name in _CASE.findall(body):
                if name in names[kind]:
                    bindings.append(Binding(MACHINE, "guard" if kind == "GUARD" else "effect", names[kind][name], site))
                else:
                    problems.append(f"{rel}:{line}: {fn} handles {PREFIX}{kind}_{name}, which {m.source} lacks")
            if _CALLS_STEP.search(body) and fn != RUNNER:
                for name in sorted(set(_EVENT.findall(body))):
                    event = names["EV"].get(name, name.lower())
                    fires.append(Fire(MACHINE, event, site, line))
    return CodeMap(bindings=tuple(bindings), fires=tuple(fires), runners=tuple(runners), problems=tuple(problems))
