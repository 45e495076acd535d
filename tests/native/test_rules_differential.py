"""The descriptor rules in C against the same rules in Python, on one declaration.

``spec/rules.toml`` is evaluated by :mod:`kvstate.core.rules` (what
:func:`kvstate.core.validate.descriptor_problems` runs) and, generated into C, by
``kvs_validate_batch`` in ``ffi/kvs_validate.c``. Over 100,000 generated descriptors
(valid ones, and ones with fields at the edges of every check of every rule) both must
give the same first reason and the same reason for every rule. Every check of every
rule must have been the one that failed at least once, so no invalid class goes
untested, and a fifth of the cases are valid (the C side accepts them too).

A second test runs real :class:`Descriptor` and :class:`Expectation` values through
``descriptor_problems`` and through C (via ``facts_of`` and ``expected_for``), so the
Python validator that importers call is held to C too, not only the rules engine.
"""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path


from kvstate import _native
from kvstate.core import rules
from kvstate.core.handles import HandleKind
from kvstate.core.reasons import RejectReason
from kvstate.core.validate import descriptor_problems, expected_for, facts_of
from kvstate.derive import rules_c
from support import descriptors as kit
from support.rules_cases import cases, changed, run_c

ROOT = Path(__file__).resolve().parents[2]
CASES, BATCH = 100_000, 10_000
CODES = {reason: rules_c.reason_code(reason) for reason in RejectReason}


def python_verdict(rs: rules.RuleSet, d: dict[str, object], e: dict[str, object]) -> tuple[int, list[int]]:
    per_rule = dict((r.id, CODES[reason]) for r, reason in rules.broken(d, e))
    codes = [per_rule.get(r.id, 0) for r in rs.rules]
    return next((c for c in codes if c), 0), codes


def failing_check(rs: rules.RuleSet, rule: rules.Rule, d: dict[str, object], e: dict[str, object]) -> int:
    return next(k for k, c in enumerate(rule.checks) if not rules.compile_test(rs, c.test)(d, e))


def test_module_runs_the_declared_rules() -> None:
    """The compiled module was generated from the installed declaration (a stale build
    would be compared against other rules)."""
    assert _native.lib.kvs_validate_digest() == rules_c.digest(rules.rules())


def test_cffi_reads_the_generated_header() -> None:
    """cffi's declarations of the rules come from the generated header itself; the codes
    stay out of the module (Python takes them from the declaration, C from the codes header)."""
    spec = importlib.util.spec_from_file_location("_kvs_build_rules", ROOT / "ffi" / "build_host.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    header = (ROOT / rules_c.PUBLIC_HEADER).read_text(encoding="utf-8")
    assert build.CDEF_VALIDATE == build.cdef_from_header(header, "KVS_VALIDATE_H")
    assert "kvs_validate_descriptor(" in build.CDEF_VALIDATE and "#define" not in build.CDEF_VALIDATE
    assert not any(n.startswith("KVS_REJECT_") for n in dir(_native.lib))


def test_100k_descriptors_same_verdict_and_reason() -> None:
    rs = rules.rules()
    start = time.perf_counter()
    drawn = cases(seed=28, n=CASES, rs=rs)
    generated = time.perf_counter()
    c_verdicts = [v for i in range(0, CASES, BATCH) for v in run_c(_native, drawn[i:i + BATCH], rs)]
    c_done = time.perf_counter()
    broken_checks: set[tuple[str, int]] = set()
    first_reasons: dict[int, int] = {}
    for i, ((d, e), c) in enumerate(zip(drawn, c_verdicts)):
        py = python_verdict(rs, d, e)
        assert c == py, (f"case {i}: C {c} != Python {py}\nfacts {d}\nexpect {e}")
        first_reasons[py[0]] = first_reasons.get(py[0], 0) + 1
        for rule, code in zip(rs.rules, py[1]):
            if code:
                broken_checks.add((rule.id, failing_check(rs, rule, d, e)))
    done = time.perf_counter()
    every_check = {(r.id, k) for r in rs.rules for k in range(len(r.checks))}
    assert every_check - broken_checks == set(), "checks never broken: the generator misses an invalid class"
    assert first_reasons[0] >= CASES // 10, "too few valid descriptors"
    print(f"\n{CASES} descriptors: generated {generated - start:.2f} s, C {c_done - generated:.2f} s, "
          f"Python and comparison {done - c_done:.2f} s; first reasons {sorted(first_reasons.items())}")


def _descriptor_case(rng: random.Random) -> tuple[object, object]:
    tp = rng.choice([1, 2, 4, 8])
    e = kit.expectation(check_socket=False, handle_kinds=frozenset({HandleKind.MEMFD, HandleKind.NIXL}))
    return changed(rng, kit.descriptor(rank=rng.randrange(tp), tp=tp), e)


def test_descriptor_problems_agree_with_c() -> None:
    """What importers run (descriptor_problems on real descriptors) gives, rule by rule,
    the reasons C gives for the same descriptor."""
    rs, rng = rules.rules(), random.Random(2804)
    pairs = [_descriptor_case(rng) for _ in range(3000)]
    batch = [(facts_of(d), expected_for(d.rank, e)) for d, e in pairs]  # type: ignore[attr-defined]
    seen = set()
    for (d, e), (first, per_rule) in zip(pairs, run_c(_native, batch, rs)):
        want = [CODES[p.reason] for p in descriptor_problems(d, e)]  # type: ignore[arg-type]
        assert [c for c in per_rule if c] == want, (d, e)
        assert first == (want[0] if want else 0)
        seen.update(want or [0])
    assert len(seen) >= 10, seen
