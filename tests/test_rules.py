"""The declaration of the descriptor rules (spec/rules.toml) and its Python evaluator.

The loader refuses a malformed declaration naming the entry; the evaluator keeps the
declared semantics (u64 values, wrapping ``-``, ``x % 0 == x``, 0 at an unknown kind, a
value C could not hold fails its check); the declared kinds agree with
:mod:`kvstate.core.handles`. The C side is held to the same rules by
``tests/native/test_rules_differential.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.core import rules, rules_table
from kvstate.core.errors import ConfigInvalid
from kvstate.core.handles import FD_KINDS, HANDLE_BYTES, NIXL_HANDLE_MAX_BYTES, HandleKind
from kvstate.core.reasons import ConfigReason, RejectReason

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "spec" / "rules.toml").read_text(encoding="utf-8")

MINI = '''
[constants]
TOP = 10
[kinds]
memfd = { fd = 1, min_bytes = 16, max_bytes = 16 }
posix_fd = { fd = 1, min_bytes = 16, max_bytes = 16 }
fabric = { fd = 0, min_bytes = 64, max_bytes = 64 }
cuda_ipc = { fd = 0, min_bytes = 64, max_bytes = 64 }
nixl = { fd = 0, min_bytes = 1, max_bytes = 65536 }
[facts]
a = "u64"
b = "u64"
x = "id"
[expect]
y = "id"
s = "idset"
[[rules]]
id = "r"
doc = "a rule"
checks = [ { reason = "tp_size", require = "CHECK" } ]
'''


def mini(check: str) -> rules.RuleSet:
    return rules.parse_rules(MINI.replace("CHECK", check), "mini.toml")


def verdict(check: str, d: dict[str, object], e: dict[str, object] | None = None) -> bool:
    rs = mini(check)
    return rules.compile_rule(rs, rs.rules[0])(d, e or {}) is None


def test_the_installed_declaration_is_the_checkout_one() -> None:
    assert rules.rules() == rules.parse_rules(TEXT)


@pytest.mark.parametrize("check, problem", [
    ("d.nope == 1", "unknown name"),
    ("d.a == q", "unknown constant"),
    ("d.x == d.a", "cannot compare id with u64"),
    ("d.x < e.y", "cannot compare id with id"),
    ("d.a - d.b % 2 == 0", "mixing operators needs parentheses"),
    ("d.a in e.s", "`in` takes an id"),
    ("d.a + 1 == 2", "cannot read"),
    ("d.a == 1 == 2", "unexpected"),
    ("kind.colour[d.a] == 1", "unknown kind column"),
    ("d.a == 18446744073709551616", "does not fit 64 bits"),
])
def test_malformed_checks_are_refused_naming_the_entry(check: str, problem: str) -> None:
    with pytest.raises(ConfigInvalid) as info:
        mini(check)
    assert info.value.reason is ConfigReason.SPEC and info.value.entry == "rules[0].checks[0]"
    assert problem in str(info.value)


@pytest.mark.parametrize("old, new, entry", [
    ('reason = "tp_size"', 'reason = "too_big"', "rules[0].checks[0]"),
    ("memfd = {", "memfd2 = {", "kinds"),
    ('id = "r"', 'id = "R"', "rules[0]"),
    ("[constants]", "[constants]\nlow = 1", "constants.low"),
    ('s = "idset"', 's = "set"', "expect.s"),
])
def test_malformed_declarations_are_refused(old: str, new: str, entry: str) -> None:
    with pytest.raises(ConfigInvalid) as info:
        rules.parse_rules(MINI.replace("CHECK", "d.a == 1").replace(old, new, 1), "mini.toml")
    assert info.value.entry == entry


def test_u64_semantics() -> None:
    top = rules.U64_MAX
    assert verdict("(d.a - d.b) == 18446744073709551615", {"a": 0, "b": 1})  # wraps, as in C
    assert verdict("(d.a % d.b) == 7", {"a": 7, "b": 0})                     # x % 0 == x
    assert verdict("kind.max_bytes[d.a] == 0", {"a": 5})                     # unknown kind: 0
    assert verdict("kind.bit[d.a] == 16", {"a": 4})
    assert verdict("d.a <= TOP", {"a": 10}) and not verdict("d.a <= TOP", {"a": 11})
    assert verdict("d.a == 18446744073709551615", {"a": top})
    for value in (-1, top + 1, True, 1.0):   # values C could not hold fail the check
        assert not verdict("d.a >= 0", {"a": value})
        assert not verdict("d.a != 3", {"a": value})
    assert verdict("d.x in e.s", {"x": b"k" * 16}, {"s": frozenset({b"k" * 16})})
    assert not verdict("d.x in e.s", {"x": b"k" * 16}, {"s": frozenset()})


def test_checks_run_in_order_and_the_first_failure_is_the_reason() -> None:
    assert rules.check("rank", {"rank": 9, "tp": 0}, {"max_tp": 8}) is RejectReason.TP_SIZE
    assert rules.check("rank", {"rank": 9, "tp": 4}, {"max_tp": 8}) is RejectReason.RANK_RANGE
    assert rules.check("rank", {"rank": 3, "tp": 4}, {"max_tp": 8}) is None
    assert rules.check("freshness", {"generation": 1, "expires_at_ns": 0},
                       {"min_generation": 2, "now_ns": 5}) is RejectReason.GENERATION
    with pytest.raises(KeyError):
        rules.check("no_such_rule", {}, {})


def test_declared_kinds_agree_with_the_handle_vocabulary() -> None:
    kinds = {k.name: k for k in rules.rules().kinds}
    assert list(kinds) == [h.value for h in HandleKind]
    for h in HandleKind:
        k = kinds[h.value]
        exact = HANDLE_BYTES[h]
        assert (k.min_bytes, k.max_bytes) == ((exact, exact) if exact is not None else (1, NIXL_HANDLE_MAX_BYTES))
        assert bool(k.fd) == (h in FD_KINDS)


def test_every_per_descriptor_reason_is_declared() -> None:
    """Every reason validate gives one descriptor on its own is a declared rule's, except
    the socket path reasons (the filesystem rule stays in Python)."""
    declared = set(rules.rules().reasons())
    assert declared == {RejectReason.DOMAIN, RejectReason.TP_SIZE, RejectReason.RANK_RANGE,
                        RejectReason.HANDLE_KIND, RejectReason.HANDLE_SIZE, RejectReason.TOTAL_SIZE,
                        RejectReason.GENERATION, RejectReason.EXPIRED, RejectReason.GEOMETRY,
                        RejectReason.DEVICE_UUID, RejectReason.INCARNATION, RejectReason.HOST}


def test_the_generated_function_agrees_with_the_checks() -> None:
    """broken() runs kvstate/core/rules_table.py, generated from the declaration; the
    per-check closures are the reference, on 20,000 drawn pairs and on values C cannot
    hold (the function declines those and the closures answer)."""
    rules.compiled()
    assert rules._fast is rules_table.broken, "the generated rules are not in use"
    from support.rules_cases import cases
    rs = rules.rules()
    for d, e in cases(seed=7, n=20_000, rs=rs):
        assert rules.broken(d, e) == rules.broken_by_checks(d, e), (d, e)
    d, e = cases(seed=8, n=1, rs=rs, valid_share=1.0)[0]
    assert rules.broken(d, e) == []
    for value in (-1, rules.U64_MAX + 1, True):
        bad = {**d, "tp": value}
        assert rules.broken(bad, e) == rules.broken_by_checks(bad, e) != []


def test_generated_rules_from_another_declaration_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rules_table.py whose DIGEST names another declaration text is ignored: the
    closures, read from the installed declaration, answer."""
    monkeypatch.setattr(rules, "_compiled", None)
    monkeypatch.setattr(rules, "_fast", None)
    monkeypatch.setattr(rules_table, "DIGEST", "0" * 32)
    rules.compiled()
    assert rules._fast is None
    assert rules.check("rank", {"rank": 4, "tp": 4}, {"max_tp": 8}) is RejectReason.RANK_RANGE
