"""The mutation harness (`make mutants`, tests/support/mutants.py) works, and the planted
mutants under tests/mutants/ still plant something.

The harness is itself a checker, so it is shown to catch what it must: an obviously
broken function is KILLED, an untested change SURVIVES, a snippet that no longer matches
is STALE and stops the run, an import error and a hang are not kills, and the tree it was
given is never written. These run on a tiny tree of their own in a temporary directory,
so they take about a second each. The full mutant run is `make mutants` (minutes).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support import mutants, tiers
from support.mutants import (KILLED, KILLED_TIMEOUT, NOT_RUN, SURVIVED, TIMEOUT, ERROR, Mutant, MutantError,
                             Replace)

CALC = "def add(a, b):\n    return a + b\n\n\ndef untested(a):\n    return a * 2\n"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A tree of one module and one test, under git (the harness copies what git lists)."""
    root = tmp_path / "tiny"
    (root / "tests").mkdir(parents=True)
    (root / "calc.py").write_text(CALC)
    (root / "tests" / "test_calc.py").write_text(TEST)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def mutant(old: str, new: str, *, file: str = "calc.py", timeout_s: float = 60, timeout_kills: bool = False,
           name: str = "m", tests: tuple[str, ...] = ("tests/test_calc.py",)) -> Mutant:
    return Mutant(name, "validate", "a test mutant", tests, (Replace(file, old, new),), timeout_s, timeout_kills)


def outcome(tiny: Path, m: Mutant, baseline: bool = False) -> mutants.Result:
    [result] = mutants.run([m], root=tiny, check_baseline=baseline, echo=False)
    assert (tiny / "calc.py").read_text() == CALC  # the tree it was given is never written
    return result


@pytest.mark.multiproc
def test_an_obvious_mutant_is_killed_and_an_untested_one_survives(tiny: Path) -> None:
    killed = outcome(tiny, mutant("return a + b", "return a - b"), baseline=True)
    assert killed.outcome == KILLED and "test_add (assert" in killed.killer
    survived = outcome(tiny, mutant("return a * 2", "return a * 3"))
    assert survived.outcome == SURVIVED
    assert mutants.score([killed, survived]) == (1, 2)
    assert "SURVIVED" in mutants.table([killed, survived])


@pytest.mark.multiproc
def test_an_import_error_is_not_a_kill(tiny: Path) -> None:
    """A mutant that breaks collection makes every test error, none fail: not killed."""
    result = outcome(tiny, mutant("def add(a, b):", "raise ImportError('planted')\n\n\ndef add(a, b):"))
    assert result.outcome == ERROR


@pytest.mark.multiproc
def test_a_hang_is_a_timeout_unless_the_mutant_says_a_hang_is_its_symptom(tiny: Path) -> None:
    hang = ("return a + b", "while True:\n        pass")
    assert outcome(tiny, mutant(*hang, timeout_s=1)).outcome == TIMEOUT
    assert outcome(tiny, mutant(*hang, timeout_s=1, timeout_kills=True)).outcome == KILLED_TIMEOUT


@pytest.mark.multiproc
def test_a_vllm_suite_mutant_runs_with_the_vllm_interpreter_or_is_not_run(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A selection in tests/vllm runs with the vLLM suite's interpreter, and is killed there.
    Without that interpreter it is NOT RUN: listed, out of the score, never a kill or a
    survivor; and an error when the run requires it."""
    import sys
    (tiny / "tests" / "vllm").mkdir()
    (tiny / "tests" / "vllm" / "test_engine.py").write_text(TEST)
    used = tmp_path / "used"
    wrapper = tmp_path / "vllm-python"
    wrapper.write_text(f"#!/bin/sh\ntouch {used}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    engine = mutant("return a + b", "return a - b", tests=("tests/vllm/test_engine.py",))
    monkeypatch.setenv("KVSTATE_VLLM_PYTHON", str(wrapper))
    killed = outcome(tiny, engine, baseline=True)
    assert killed.outcome == KILLED and "test_add (assert" in killed.killer and used.exists()
    monkeypatch.setenv("KVSTATE_VLLM_PYTHON", str(tmp_path / "absent"))
    plain = mutant("return a + b", "return a - b", name="plain")
    results = mutants.run([plain, engine], root=tiny, check_baseline=False, echo=False)
    assert [(r.mutant.id, r.outcome) for r in results] == [("plain", KILLED), ("m", NOT_RUN)]
    assert "no vLLM interpreter" in results[1].killer
    assert mutants.score(results) == (1, 1)
    with pytest.raises(MutantError, match="no vLLM interpreter"):
        mutants.run([plain, engine], root=tiny, check_baseline=False, echo=False, require_vllm=True)


@pytest.mark.unit
def test_a_stale_mutant_stops_the_run_loudly(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A snippet that no longer occurs exactly once is STALE: the run refuses to start,
    so a mutant never counts as killed for planting nothing."""
    stale = mutant("return a ** b", "return a")
    with pytest.raises(MutantError, match="STALE m: its snippet occurs 0 times in calc.py"):
        mutants.run([stale, mutant("return a + b", "return a - b")], root=tiny, echo=False)
    twice = mutant("return a", "return b")  # occurs in add and in untested
    assert "occurs 2 times" in mutants.stale([twice], tiny)[0]
    assert mutants.stale([mutant("return a + b", "return b")], tiny) == []


@pytest.mark.unit
def test_mutant_files_are_checked_for_shape(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('family = "policy"\nwhy = "one line"\ntests = ["tests/test_policy.py"]\n'
                    '[[replace]]\nfile = "a.py"\nold = "x"\nnew = "y"\n')
    assert mutants.load(good).replaces == (Replace("a.py", "x", "y"),)
    for text, problem in [
        ('family = "moon"\nwhy = "w"\ntests = ["tests/t.py"]\n[[replace]]\nfile = "a"\nold = "x"\nnew = "y"\n',
         "family"),
        ('family = "policy"\nwhy = "w"\ntests = []\n[[replace]]\nfile = "a"\nold = "x"\nnew = "y"\n', "tests"),
        ('family = "policy"\nwhy = "w"\ntests = ["tests/t.py"]\n', "no \\[\\[replace\\]\\]"),
        ('family = "policy"\nwhy = "w"\ntests = ["tests/t.py"]\n[[replace]]\nfile = "a"\nold = "x"\nnew = "x"\n',
         "must change"),
        ('family = "policy"\nwhy = "w"\ntests = ["tests/t.py", "tests/vllm/t.py"]\n[[replace]]\nfile = "a"\n'
         'old = "x"\nnew = "y"\n', "all in tests/vllm/"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(MutantError, match=problem):
            mutants.load(bad)


# -- the planted mutants of this tree ---------------------------------------------------


@pytest.mark.unit
def test_no_planted_mutant_is_stale() -> None:
    """Every mutant under tests/mutants/ still finds its snippet exactly once: a change to
    the code a mutant plants into fails here, in the normal suite, not only in `make mutants`."""
    planted = mutants.load_all()
    assert mutants.stale(planted) == []


@pytest.mark.unit
def test_planted_mutants_span_every_family_and_spec_rows_meet_spin_or_stateful_tests() -> None:
    """At least 30 mutants, every family of the issue among them; a spec-row mutant is
    selected only against Spin or stateful tests (a unit test alone must not be what
    catches a table bug), and every selected test file exists."""
    planted = mutants.load_all()
    assert len(planted) >= 30
    assert {m.family for m in planted} == set(mutants.FAMILIES)
    root = mutants.ROOT
    for m in planted:
        for node in m.tests:
            path = node.split("::")[0]
            assert (root / path).is_file(), f"{m.id}: {path} does not exist"
            if m.family == "spec":
                kinds = set(tiers.defaults(path.removeprefix("tests/")))
                assert kinds & {"models", "stateful"}, f"{m.id}: {path} is neither a Spin nor a stateful test"
