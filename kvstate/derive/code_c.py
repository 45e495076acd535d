"""The C half of the code map: the tables enforced in ``ffi/*.c``.

Two machines run natively with C guards and effects. The op table, by the op engine
(``kvs_op_step``); the bank table's lease rows, by the exporter's lease server
(``ffi/kvs_lease.c`` and its answers, ``ffi/kvs_lease_answer.c``, through
``kvs_machine_fire``). The generated headers (:mod:`kvstate.derive.header`) name every
guard, effect and event as a C constant (``KVS_OP_GUARD_*``, ``KVS_OP_FX_*``,
``KVS_OP_EV_*``; ``KVS_BANK_G_*``, ``KVS_BANK_FX_*``, ``KVS_BANK_EV_*``). The scan reads the C sources (comments and string
literals blanked out) function by function:

* a function with ``case KVS_OP_GUARD_X:`` or ``case KVS_OP_FX_X:`` implements op guard
  or effect ``x`` (``guard_holds`` and ``effect`` dispatch on them); one with
  ``case KVS_BANK_FX_X:`` implements bank effect ``x`` (``lease_fx``), and one that
  sets ``holds |= 1ull << KVS_BANK_G_X`` in the guard bits evaluates bank guard ``x`` (``guards``);
* a function that calls the machine's firing call (``kvs_op_step``; ``kvs_lease_fire_one`` or
  ``kvs_machine_fire`` for the bank) fires every ``..._EV_X`` it names; a function that
  only reads the table fires nothing;
* the same holds for the part table's rows that the importer's native attach fires
  (``ffi/kvs_attach.c``: ``KVS_PART_FX_*``, ``KVS_PART_G_*``, ``KVS_PART_EV_*``);
* ``kvs_op_step`` runs the op rows (the header's contract).

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
#: The bank's lease rows, fired by the lease server (ffi/kvs_lease.c), and the part's rows
#: the importer's native attach fires (ffi/kvs_attach.c): machine -> constant prefix.
BANK, BANK_PREFIX = "bank", "KVS_BANK_"
GENERIC = {BANK: BANK_PREFIX, "part": "KVS_PART_"}

_NOISE = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_CASE = re.compile(rf"\bcase\s+{PREFIX}(GUARD|FX)_(\w+)\s*:")
_EVENT = re.compile(rf"\b{PREFIX}EV_(\w+)\b")
_CALLS_STEP = re.compile(rf"\b{RUNNER}\s*\(")
_GEN_CASE = {m: re.compile(rf"\bcase\s+{p}FX_(\w+)\s*:") for m, p in GENERIC.items()}
_GEN_GUARD = {m: re.compile(rf"\|=\s*1ull\s*<<\s*{p}G_(\w+)\b") for m, p in GENERIC.items()}
_GEN_EVENT = {m: re.compile(rf"\b{p}EV_(\w+)\b") for m, p in GENERIC.items()}
_BANK_FIRES = re.compile(r"\b(kvs_lease_fire_one|kvs_machine_fire)\s*\(")


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
            for machine in GENERIC:
                _scan_generic(spec, machine, fn, line, body, site, bindings, fires)
    return CodeMap(bindings=tuple(bindings), fires=tuple(fires), runners=tuple(runners), problems=tuple(problems))


def _scan_generic(spec: Spec, machine: str, fn: str, line: int, body: str, site: Site, bindings: list[Binding],
                  fires: list[Fire]) -> None:
    """The rows of ``machine`` (run by kvs_machine_fire) one C function implements or fires."""
    b: MachineSpec = spec.machines[machine]
    effects, guards = {ident(e): e for e in b.effects}, {ident(g): g for g in b.guards}
    events = {ident(e): e for e in b.event_names}
    # A name the table lacks is bound as written, as kvstate.derive.code_py binds Python's:
    # what implements nothing declared is left to the table's own checks.
    for name in _GEN_CASE[machine].findall(body):
        bindings.append(Binding(machine, "effect", effects.get(name, name.lower()), site))
    for name in sorted(set(_GEN_GUARD[machine].findall(body))):
        bindings.append(Binding(machine, "guard", guards.get(name, name.lower()), site))
    if _BANK_FIRES.search(body) and fn not in ("kvs_machine_fire", "kvs_lease_fire_one"):
        for name in sorted(set(_GEN_EVENT[machine].findall(body))):
            fires.append(Fire(machine, events.get(name, name.lower()), site, line))
