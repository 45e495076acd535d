"""The Python half of the code map: a static (``ast``) scan of ``kvstate/``.

Rules. The scan establishes every link from what the code says; it never guesses, and a
fire site it cannot attribute is reported as a problem (which fails generation):

* A class *binds* a table when its body says ``table = load_machine("<name>")``; a class
  derived from a binding class (within kvstate) binds the same table.
* In a binding class or its bases, a method decorated ``@guard("x")`` or ``@effect("x")``
  implements guard or effect ``x`` of that table. As at runtime, the attribute found on
  the class is the one bound, so an override wins.
* A *fire site* is a call ``R.fire(E, ...)`` or ``R.fault(E)``. Its machine is the table
  bound by the class of the receiver ``R``, where ``R`` is
    - ``self`` (the first parameter of a method) of a binding class, or
    - a name annotated in the function that binds it: a parameter, or a declaration
      ``name: Class`` (``Class | None`` and ``Class[T, ...]`` too). mypy checks the
      annotation, so it is right.
  The event ``E`` is a string literal, or a name annotated ``Literal[...]`` (inline, or an
  alias ``X = Literal[...]`` defined in or imported into the module): a helper that takes
  an event name declares in its signature the events it may fire, and is a fire site of
  each of them.
* ``kvstate/harness`` is not scanned: it drives machines the way tests do, with event
  names that are data (Spin trail replay, benchmarks of ``fire`` itself).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import attrs

from kvstate.derive.sites import Binding, CodeMap, Fire, Site

PACKAGE = "kvstate"
SKIP = ("harness",)
FIRE_METHODS = ("fire", "fault", "adopt")  # adopt: a row another executor fired (native attach)
_DECORATORS = {"kvstate.core.machine.guard": "guard", "kvstate.core.machine.effect": "effect"}
_LOAD_MACHINE = "kvstate.core.spec.load_machine"
_LITERAL = ("typing.Literal", "typing_extensions.Literal")

_Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef | ast.comprehension


@attrs.frozen
class _Module:
    name: str
    path: str
    tree: ast.Module
    imports: dict[str, str]

    def resolve(self, node: ast.expr) -> str | None:
        """The qualified name a Name or dotted Attribute refers to in this module."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        head = self.imports.get(node.id, f"{self.name}.{node.id}")
        return ".".join([head, *reversed(parts)])


@attrs.frozen
class _Class:
    module: _Module
    qualname: str
    node: ast.ClassDef


def _modules(root: Path) -> list[_Module]:
    out = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[1] in SKIP:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(rel))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out.append(_Module(name, rel.as_posix(), tree, _imports(tree, package)))
    return out


def _imports(tree: ast.Module, package: str) -> dict[str, str]:
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                names[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    head = a.name.split(".")[0]
                    names[head] = head
    return names


def _str_arg(call: ast.Call) -> str | None:
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


class _Scan:
    def __init__(self, modules: list[_Module]) -> None:
        self.modules = modules
        self.classes: dict[str, _Class] = {}
        self.aliases: dict[str, frozenset[str]] = {}
        for mod in modules:
            for node in mod.tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes[f"{mod.name}.{node.name}"] = _Class(mod, node.name, node)
                target = node.target if isinstance(node, ast.AnnAssign) else (
                    node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
                value = node.value if isinstance(node, (ast.AnnAssign, ast.Assign)) else None
                if isinstance(target, ast.Name) and value is not None:
                    values = self._literal(mod, value, aliases=False)
                    if values is not None:
                        self.aliases[f"{mod.name}.{target.id}"] = values
        self.fires: list[Fire] = []
        self.problems: list[str] = []

    # -- classes and tables ---------------------------------------------------------------

    def table(self, qual: str, depth: int = 0) -> str | None:
        cls = self.classes.get(qual)
        if cls is None or depth > 20:
            return None
        for stmt in cls.node.body:
            if (isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "table" for t in stmt.targets)
                    and isinstance(stmt.value, ast.Call) and cls.module.resolve(stmt.value.func) == _LOAD_MACHINE):
                return _str_arg(stmt.value)
        for base in cls.node.bases:
            name = cls.module.resolve(base)
            found = self.table(name, depth + 1) if name else None
            if found:
                return found
        return None

    def _lineage(self, qual: str) -> Iterator[_Class]:
        """The class, then its bases within kvstate, depth first (single inheritance here)."""
        seen: set[str] = set()
        todo = [qual]
        while todo:
            name = todo.pop(0)
            cls = self.classes.get(name)
            if cls is None or name in seen:
                continue
            seen.add(name)
            yield cls
            todo += [n for n in (cls.module.resolve(b) for b in cls.node.bases) if n]

    def bindings(self) -> list[Binding]:
        out = []
        for qual in self.classes:
            machine = self.table(qual)
            if machine is None:
                continue
            shadowed: set[str] = set()
            for cls in self._lineage(qual):
                for stmt in cls.node.body:
                    names = _defined_names(stmt)
                    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name not in shadowed:
                        for kind, name in self._marks(cls.module, stmt):
                            site = Site(f"{cls.module.name}:{cls.qualname}.{stmt.name}", cls.module.path)
                            out.append(Binding(machine, kind, name, site))
                    shadowed |= names
        return out

    def _marks(self, mod: _Module, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[str, str]]:
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call):
                kind = _DECORATORS.get(mod.resolve(dec.func) or "")
                name = _str_arg(dec)
                if kind and name:
                    yield kind, name

    # -- annotations ----------------------------------------------------------------------

    def _literal(self, mod: _Module, node: ast.expr, aliases: bool = True) -> frozenset[str] | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(node, ast.Subscript) and mod.resolve(node.value) in _LITERAL:
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            values = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
            return frozenset(values) if len(values) == len(items) else None
        if aliases and isinstance(node, (ast.Name, ast.Attribute)):
            return self.aliases.get(mod.resolve(node) or "")
        return None

    def _class(self, mod: _Module, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            sides = [s for s in (node.left, node.right) if not (isinstance(s, ast.Constant) and s.value is None)]
            return self._class(mod, sides[0]) if len(sides) == 1 else None
        if isinstance(node, ast.Subscript) and mod.resolve(node.value) == "typing.Optional":
            return self._class(mod, node.slice)
        if isinstance(node, ast.Subscript):  # a generic class with its type arguments
            return self._class(mod, node.value)
        name = mod.resolve(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        return name if name in self.classes else None

    # -- fire sites -----------------------------------------------------------------------

    def scan_fires(self, mod: _Module) -> None:
        self._visit(mod, mod.tree, [])

    def _visit(self, mod: _Module, node: ast.AST, scopes: list[_Scope]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in FIRE_METHODS:
                self._fire(mod, child, child.func.value, scopes)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                self._visit(mod, child, [*scopes, child])
            elif isinstance(child, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                self._visit(mod, child, [*scopes, *child.generators])
            else:
                self._visit(mod, child, scopes)

    def _fire(self, mod: _Module, call: ast.Call, receiver: ast.expr, scopes: list[_Scope]) -> None:
        where = f"{mod.path}:{call.lineno}"
        functions = [s for s in scopes if not isinstance(s, (ast.ClassDef, ast.comprehension))]
        if not functions:
            self.problems.append(f"{where}: a fire site outside any function")
            return
        site = Site(f"{mod.name}:{_qualname(scopes)}", mod.path)
        what = ast.unparse(call.func)
        if not isinstance(receiver, ast.Name):
            self.problems.append(f"{where}: cannot tell which machine `{what}` drives: "
                                 f"bind the receiver to a name annotated with its class")
            return
        cls, note = self._receiver(mod, receiver.id, scopes)
        machine = self.table(cls) if cls else None
        if machine is None:
            self.problems.append(f"{where}: cannot tell which machine `{what}` drives: `{receiver.id}` "
                                 + (f"is annotated `{note}`, which binds no table" if note else
                                    "needs an annotation with its class where it is bound"))
            return
        arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "event"), None)
        events: frozenset[str] | None = None
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            events = frozenset({arg.value})
        elif isinstance(arg, ast.Name):
            event_note = _annotation(arg.id, scopes)
            events = self._literal(mod, event_note) if event_note is not None else None
        if not events:
            self.problems.append(f"{where}: `{what}` fires an event that is neither a string literal "
                                 f"nor a name annotated Literal[...]")
            return
        self.fires += [Fire(machine, e, site, call.lineno) for e in sorted(events)]

    def _receiver(self, mod: _Module, name: str, scopes: list[_Scope]) -> tuple[str | None, str | None]:
        """(qualified class, annotation text) of the name ``name`` at the call."""
        for i in range(len(scopes) - 1, -1, -1):
            scope = scopes[i]
            if isinstance(scope, ast.ClassDef) or name not in _bound(scope):
                continue
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and i > 0 \
                    and isinstance(scopes[i - 1], ast.ClassDef) and _first_param(scope) == name:
                return f"{mod.name}.{_qualname(scopes[:i])}", "self"
            note = _annotation(name, scopes[: i + 1])
            return (self._class(mod, note), ast.unparse(note)) if note is not None else (None, None)
        return None, None


def _defined_names(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, ast.Assign):
        return {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return {stmt.target.id}
    return set()


def _qualname(scopes: list[_Scope]) -> str:
    parts: list[str] = []
    for i, s in enumerate(scopes):
        if isinstance(s, ast.comprehension):
            continue
        if i > 0 and isinstance(scopes[i - 1], (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            parts.append("<locals>")
        parts.append("<lambda>" if isinstance(s, ast.Lambda) else s.name)
    return ".".join(parts)


def _first_param(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        return None
    params = [*fn.args.posonlyargs, *fn.args.args]
    return params[0].arg if params else None


def _own_nodes(scope: _Scope) -> Iterator[ast.AST]:
    """Nodes of a scope's own body, not descending into nested scopes."""
    if isinstance(scope, ast.comprehension):
        yield from ast.walk(scope.target)
        return
    todo: list[ast.AST] = list(scope.body) if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) \
        else [scope.body] if isinstance(scope, ast.Lambda) else []
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef,
                                 ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            todo += ast.iter_child_nodes(node)


def _params(scope: _Scope) -> list[ast.arg]:
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        return [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                *([a.kwarg] if a.kwarg else [])]
    return []


def _bound(scope: _Scope) -> set[str]:
    names = {p.arg for p in _params(scope)}
    for node in _own_nodes(scope):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def _annotation(name: str, scopes: list[_Scope]) -> ast.expr | None:
    """The annotation of ``name`` in the innermost scope that binds it, if it has one."""
    for scope in reversed(scopes):
        if isinstance(scope, ast.ClassDef) or name not in _bound(scope):
            continue
        for p in _params(scope):
            if p.arg == name:
                return p.annotation
        notes = [n.annotation for n in _own_nodes(scope)
                 if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name]
        return notes[0] if len({ast.dump(n) for n in notes}) == 1 else None
    return None


def scan(root: Path) -> CodeMap:
    """Bindings and fire sites of every binding class and function under ``root/kvstate``."""
    s = _Scan(_modules(root))
    for mod in s.modules:
        s.scan_fires(mod)
    runner = Site("kvstate.core.machine:Lifecycle.fire", "kvstate/core/machine.py")
    machines = sorted({m for q in s.classes if (m := s.table(q)) is not None})
    return CodeMap(bindings=tuple(s.bindings()), fires=tuple(s.fires),
                   runners=tuple((m, runner) for m in machines), problems=tuple(s.problems))
