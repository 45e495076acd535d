"""The descriptor rules of ``spec/rules.toml``: loaded strictly, evaluated in Python. Pure.

The declaration is the one home of the per-descriptor rules. This module parses it into
small typed expression trees and evaluates them for :mod:`kvstate.core.validate`, as
per-check closures (the reference) and, on the import path, through the function
:mod:`kvstate.derive.rules_py` writes into :mod:`kvstate.core.rules_table` when that
file was generated from this very declaration; :mod:`kvstate.derive.rules_c` turns the
same trees into C for ``ffi/kvs_validate.c``.
Both follow the semantics the declaration states: unsigned 64-bit values, ``-`` wrapping
modulo 2**64, ``x % 0 == x``, 0 for a kind column at an unknown kind. A Python value
C could not hold (negative, or above 2**64-1) makes the check that reads it fail, so
Python never accepts what the C executor could not even be asked.

The expression grammar (no operator precedence: mixing operators needs parentheses)::

    check := expr CMP expr | name "in" name          CMP: == != < <= > >=
    expr  := term (OP term)*  with one OP            OP: - % &
    term  := INT | CONST | d.FIELD | e.FIELD | kind.COLUMN[expr] | "(" expr ")"
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any, Union

import attrs

from kvstate.core.errors import ConfigInvalid
from kvstate.core.handles import HandleKind
from kvstate.core.reasons import RejectReason

U64_MAX = (1 << 64) - 1
ID_BYTES = 16
TYPES = ("u64", "id", "idset")
KIND_COLUMNS = ("bit", "fd", "min_bytes", "max_bytes")
COMPARISONS = ("==", "!=", "<", "<=", ">", ">=")
OPERATORS = ("-", "%", "&")

# -- expression trees ------------------------------------------------------------------


@attrs.frozen
class Int:
    value: int


@attrs.frozen
class Name:
    scope: str   # "d" or "e"
    field: str


@attrs.frozen
class Const:
    name: str
    value: int


@attrs.frozen
class KindColumn:
    column: str
    index: Expr


@attrs.frozen
class BinOp:
    op: str
    left: Expr
    right: Expr


Expr = Union[Int, Name, Const, KindColumn, BinOp]


@attrs.frozen
class Compare:
    op: str       # one of COMPARISONS, or "in"
    left: Expr
    right: Expr
    text: str     # as declared, for docs and messages


@attrs.frozen
class Check:
    reason: RejectReason
    test: Compare


@attrs.frozen
class Rule:
    id: str
    doc: str
    when_any: tuple[Compare, ...]
    checks: tuple[Check, ...]


@attrs.frozen
class Kind:
    name: str
    code: int
    fd: int
    min_bytes: int
    max_bytes: int


@attrs.frozen
class RuleSet:
    """The whole declaration, parsed and type-checked."""

    source: str
    constants: Mapping[str, int]
    kinds: tuple[Kind, ...]
    facts: Mapping[str, str]    # field -> type
    expect: Mapping[str, str]
    rules: tuple[Rule, ...]

    def rule(self, rule_id: str) -> Rule:
        for r in self.rules:
            if r.id == rule_id:
                return r
        raise KeyError(rule_id)

    def kind_column(self, column: str) -> tuple[int, ...]:
        return tuple((1 << k.code) if column == "bit" else getattr(k, column) for k in self.kinds)

    def reasons(self) -> tuple[RejectReason, ...]:
        """Every reason some check gives, in declaration order, once each."""
        return tuple(dict.fromkeys(c.reason for r in self.rules for c in r.checks))


# -- parsing -----------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)|(==|!=|<=|>=|<|>)|([-%&()\[\]]))")


class _Parser:
    def __init__(self, text: str, where: str, rs: dict[str, Any]) -> None:
        self.where, self.rs, self.text = where, rs, text
        self.tokens: list[str] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                if text[pos:].strip() == "":
                    break
                self.fail(f"cannot read {text[pos:]!r}")
            assert m is not None
            self.tokens.append(next(g for g in m.groups() if g is not None))
            pos = m.end()
        self.i = 0

    def fail(self, problem: str) -> Any:
        raise ConfigInvalid.spec(self.rs["source"], self.where, f"{self.text!r}: {problem}")

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            self.fail(f"expected {expected or 'more'} at token {self.i + 1}")
        self.i += 1
        return tok  # type: ignore[return-value]

    def compare(self) -> Compare:
        left = self.expr()
        op = self.take()
        if op not in (*COMPARISONS, "in"):
            self.fail(f"{op!r} is not a comparison")
        right = self.expr()
        if self.peek() is not None:
            self.fail(f"unexpected {self.peek()!r} after the comparison")
        lt, rt = self.type_of(left), self.type_of(right)
        if op == "in":
            if (lt, rt) != ("id", "idset"):
                self.fail("`in` takes an id on the left and an idset on the right")
        elif "idset" in (lt, rt) or (lt != rt) or (lt == "id" and op not in ("==", "!=")):
            self.fail(f"{op} cannot compare {lt} with {rt}")
        return Compare(op, left, right, self.text)

    def expr(self) -> Expr:
        node = self.term()
        op: str | None = None
        while self.peek() in OPERATORS:
            tok = self.take()
            if op is not None and tok != op:
                self.fail("mixing operators needs parentheses")
            op = tok
            node = BinOp(tok, node, self.term())
        return node

    def term(self) -> Expr:
        tok = self.take()
        if tok == "(":
            inner = self.expr()
            self.take(")")
            return inner
        if tok.isdigit():
            value = int(tok)
            return Int(value) if value <= U64_MAX else self.fail(f"{tok} does not fit 64 bits")
        scope, _, field = tok.partition(".")
        if not field:
            if tok not in self.rs["constants"]:
                self.fail(f"unknown constant {tok!r}")
            return Const(tok, self.rs["constants"][tok])
        if scope == "kind":
            if field not in KIND_COLUMNS:
                self.fail(f"unknown kind column {field!r}")
            self.take("[")
            index = self.expr()
            self.take("]")
            return KindColumn(field, index)
        table = {"d": self.rs["facts"], "e": self.rs["expect"]}.get(scope)
        if table is None or field not in table:
            self.fail(f"unknown name {tok!r}")
        return Name(scope, field)

    def type_of(self, node: Expr) -> str:
        if isinstance(node, Name):
            return str({"d": self.rs["facts"], "e": self.rs["expect"]}[node.scope][node.field])
        if isinstance(node, BinOp):
            if self.type_of(node.left) != "u64" or self.type_of(node.right) != "u64":
                self.fail(f"{node.op} takes u64 operands")
        if isinstance(node, KindColumn) and self.type_of(node.index) != "u64":
            self.fail("a kind index must be u64")
        return "u64"


def _need(cond: bool, source: str, entry: str, problem: str) -> None:
    if not cond:
        raise ConfigInvalid.spec(source, entry, problem)


def _table(doc: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = doc.get(key)
    if not isinstance(value, dict):
        raise ConfigInvalid.spec(source, key, "missing table")
    return value


def parse_rules(text: str, source: str = "spec/rules.toml") -> RuleSet:
    """Parse and type-check a declaration; anything malformed is ConfigInvalid (SPEC)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigInvalid.spec(source, "toml", str(exc)) from None
    _need(set(doc) == {"constants", "kinds", "facts", "expect", "rules"}, source, "top level",
          "needs exactly [constants], [kinds], [facts], [expect] and [[rules]]")
    constants = _table(doc, "constants", source)
    for name, value in constants.items():
        _need(name.isupper() and type(value) is int and 0 <= value <= U64_MAX, source, f"constants.{name}",
              "an UPPER name with a u64 value")
    kinds: list[Kind] = []
    for code, (name, cols) in enumerate(_table(doc, "kinds", source).items()):
        _need(isinstance(cols, dict) and set(cols) == {"fd", "min_bytes", "max_bytes"}
              and all(type(v) is int and 0 <= v <= U64_MAX for v in cols.values()),
              source, f"kinds.{name}", "needs fd, min_bytes and max_bytes (u64)")
        kinds.append(Kind(name, code, cols["fd"], cols["min_bytes"], cols["max_bytes"]))
    _need([k.name for k in kinds] == [h.value for h in HandleKind], source, "kinds",
          f"must list {[h.value for h in HandleKind]} in that order (HandleKind codes)")
    facts, expect = _table(doc, "facts", source), _table(doc, "expect", source)
    for where, table in (("facts", facts), ("expect", expect)):
        for field, kind in table.items():
            _need(kind in TYPES and re.fullmatch(r"[a-z][a-z0-9_]*", field) is not None,
                  source, f"{where}.{field}", f"a snake_case name of type {' or '.join(TYPES)}")
    _need(all(t != "idset" for t in facts.values()), source, "facts", "a fact is one value (u64 or id)")
    rs = {"source": source, "constants": constants, "facts": facts, "expect": expect}
    rules: list[Rule] = []
    entries = doc["rules"]
    _need(isinstance(entries, list) and bool(entries), source, "rules", "needs [[rules]] entries")
    for n, entry in enumerate(entries):
        where = f"rules[{n}]"
        _need(isinstance(entry, dict) and set(entry) <= {"id", "doc", "when_any", "checks"}
              and {"id", "doc", "checks"} <= set(entry), source, where, "keys: id, doc, when_any (optional), checks")
        rid = entry["id"]
        _need(isinstance(rid, str) and re.fullmatch(r"[a-z][a-z0-9_]*", rid) is not None
              and rid not in {r.id for r in rules}, source, where, f"id {rid!r} must be a new snake_case name")
        when_text = entry.get("when_any", [])
        _need(isinstance(when_text, list) and all(isinstance(t, str) for t in when_text), source, where,
              "when_any lists strings")
        when = tuple(_Parser(t, f"{where}.when_any", rs).compare() for t in when_text)
        checks: list[Check] = []
        _need(isinstance(entry["checks"], list) and bool(entry["checks"]), source, where, "needs checks")
        for k, c in enumerate(entry["checks"]):
            cw = f"{where}.checks[{k}]"
            _need(isinstance(c, dict) and set(c) == {"reason", "require"} and isinstance(c["require"], str),
                  source, cw, "needs reason and require")
            _need(c["reason"] in {r.value for r in RejectReason}, source, cw, f"unknown reason {c['reason']!r}")
            checks.append(Check(RejectReason(c["reason"]), _Parser(c["require"], cw, rs).compare()))
        rules.append(Rule(rid, str(entry["doc"]), when, tuple(checks)))
    _need(len(rules) <= 64, source, "rules", "at most 64 rules (one bit each in C)")
    return RuleSet(source, dict(constants), tuple(kinds), dict(facts), dict(expect), tuple(rules))


# Module-level caches, not functools.cache: with the rules reached through a
# functools.cache call, crosshair explored none of them and a planted bug in the
# declaration went unseen by the contracts of kvstate.core.validate (mutant
# validate_contract_rank_equal_to_tp); with these it finds it.
_installed: RuleSet | None = None
_text = ""
_fast: Callable[[Facts, Facts], "list[tuple[int, RejectReason]] | None"] | None = None
_compiled: tuple[tuple[Rule, RuleFn], ...] | None = None
_by_id: dict[str, RuleFn] = {}


def rules() -> RuleSet:
    """The installed declaration (``kvstate.tables``, the top-level ``spec/`` of a checkout)."""
    global _installed, _text
    if _installed is None:
        _text = (resources.files("kvstate.tables") / "rules.toml").read_text(encoding="utf-8")
        _installed = parse_rules(_text)
    return _installed


def declaration_digest(text: str) -> str:
    """Which declaration a generated file was written from (its exact text)."""
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# -- evaluation --------------------------------------------------------------------------

Facts = Mapping[str, Any]
_Value = Callable[[Facts, Facts], Any]   # None: a value C could not hold
_Test = Callable[[Facts, Facts], bool]


def _in_u64(v: Any) -> Any:
    # isinstance, not type(): crosshair's symbolic ints are ints to isinstance only.
    if isinstance(v, (bytes, frozenset)):
        return v
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= U64_MAX else None


def _value(rs: RuleSet, node: Expr) -> _Value:
    if isinstance(node, (Int, Const)):
        v = node.value
        return lambda d, e: v
    if isinstance(node, Name):
        field = node.field
        if node.scope == "d":
            return lambda d, e: _in_u64(d[field])
        return lambda d, e: _in_u64(e[field])
    if isinstance(node, KindColumn):
        column, index = rs.kind_column(node.column), _value(rs, node.index)

        def kind(d: Facts, e: Facts) -> Any:
            i = index(d, e)
            return None if i is None else column[i] if i < len(column) else 0
        return kind
    left, right, op = _value(rs, node.left), _value(rs, node.right), node.op

    def binop(d: Facts, e: Facts) -> Any:
        a, b = left(d, e), right(d, e)
        if a is None or b is None:
            return None
        if op == "-":
            return (a - b) & U64_MAX
        if op == "%":
            return a % b if b else a
        return a & b
    return binop


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "==": lambda a, b: bool(a == b), "!=": lambda a, b: bool(a != b), "<": lambda a, b: bool(a < b),
    "<=": lambda a, b: bool(a <= b), ">": lambda a, b: bool(a > b), ">=": lambda a, b: bool(a >= b),
    "in": lambda a, b: a in b,
}


def compile_test(rs: RuleSet, c: Compare) -> _Test:
    left, right, cmp = _value(rs, c.left), _value(rs, c.right), _COMPARE[c.op]

    def test(d: Facts, e: Facts) -> bool:
        a, b = left(d, e), right(d, e)
        return a is not None and b is not None and cmp(a, b)
    return test


RuleFn = Callable[[Facts, Facts], "RejectReason | None"]


def compile_rule(rs: RuleSet, rule: Rule) -> RuleFn:
    """The rule as a function of (facts, expectation): its reason, or None when it passes
    (or does not apply)."""
    when = [compile_test(rs, c) for c in rule.when_any]
    checks = [(compile_test(rs, c.test), c.reason) for c in rule.checks]

    def run(d: Facts, e: Facts) -> RejectReason | None:
        if when and not any(w(d, e) for w in when):
            return None
        for test, reason in checks:
            if not test(d, e):
                return reason
        return None
    return run


def compiled() -> tuple[tuple[Rule, RuleFn], ...]:
    """Every installed rule with its function, in declaration order (compiled once)."""
    global _compiled, _fast
    if _compiled is None:
        rs = rules()
        _compiled = tuple((r, compile_rule(rs, r)) for r in rs.rules)
        _by_id.update((r.id, run) for r, run in _compiled)
        from kvstate.core import rules_table  # generated from this declaration
        _fast = rules_table.broken if rules_table.DIGEST == declaration_digest(_text) else None
    return _compiled


def check(rule_id: str, d: Facts, e: Facts) -> RejectReason | None:
    """One installed rule's verdict; ``d`` and ``e`` need only the names it reads."""
    compiled()
    return _by_id[rule_id](d, e)


def broken(d: Facts, e: Facts) -> list[tuple[Rule, RejectReason]]:
    """Every installed rule the facts break, in declaration order, with its reason.

    Through :mod:`kvstate.core.rules_table` (the declaration written as one straight-line
    function by ``kvstate generate``, about five times faster on the import path) when it
    was generated from this very declaration and every u64 input is an int in range;
    otherwise through the per-check closures, which give any value its declared meaning."""
    rules_fns = compiled()
    if _fast is not None:
        fast = _fast(d, e)
        if fast is not None:
            return [(rules_fns[n][0], reason) for n, reason in fast]
    return broken_by_checks(d, e)


def broken_by_checks(d: Facts, e: Facts) -> list[tuple[Rule, RejectReason]]:
    """:func:`broken` through the per-check closures only (any value: the reference)."""
    out = []
    for r, run in compiled():
        reason = run(d, e)
        if reason is not None:
            out.append((r, reason))
    return out
