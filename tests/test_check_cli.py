"""`kvstate check` refuses what it cannot check, and never passes a search pan did not finish.

Pan's output is read here from text as pan prints it (no Spin needed); tests/test_models.py
runs Spin into its memory bound for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.commands.cli import main
from kvstate.harness import modelcheck

#: What pan 6.5.2 prints when its -DMEMLIM bound stops it before the first state
#: (`kvstate check --memlim 1`), cut to the lines read.
MEMLIM_STOP = """pan: reached -DMEMLIM bound
\t0 bytes used
\t5.60002e+07 bytes more needed
\t1.04858e+06 bytes limit

(Spin Version 6.5.2 -- 6 December 2019)
Warning: Search not completed
\t+ Partial Order Reduction

State-vector 0 byte, depth reached 0, errors: 0
        0 states, stored
pan: elapsed time 1.72e+07 seconds
"""
COMPLETE = """(Spin Version 6.5.2 -- 6 December 2019)
\t+ Partial Order Reduction

State-vector 60 byte, depth reached 403, errors: 0
     3740 states, stored
pan: elapsed time 0.01 seconds
"""
VIOLATION = """pan:1: assertion violated 0 (at depth 23)
pan: wrote per_rank_tp2.pml.trail

(Spin Version 6.5.2 -- 6 December 2019)
Warning: Search not completed

State-vector 60 byte, depth reached 23, errors: 1
"""


def test_a_search_pan_did_not_complete_is_a_problem() -> None:
    assert modelcheck._problem(COMPLETE, 0) is None
    assert modelcheck._problem(MEMLIM_STOP, 0) == "pan: reached -DMEMLIM bound"
    # an early stop pan words in a way not listed still fails, on its closing warning
    unlisted = MEMLIM_STOP.replace("pan: reached -DMEMLIM bound", "pan: something new")
    assert modelcheck._problem(unlisted, 0) == "search not completed: pan stopped before exploring every state"
    assert modelcheck._problem(VIOLATION, 1) == "pan:1: assertion violated 0 (at depth 23)"


def _result(problem: str | None, incomplete: bool) -> modelcheck.CheckResult:
    return modelcheck.CheckResult(
        model="per_rank", tp=2, mode="safety", ok=problem is None, problem=problem, states_stored=0,
        transitions=0, depth=0, memory_mb=0.0, pan_seconds=0.0, wall_seconds=0.0, trace=None, output="",
        incomplete=incomplete)


def test_an_incomplete_search_reads_as_such() -> None:
    stopped = _result("pan: reached -DMEMLIM bound", incomplete=True).report()
    assert stopped.startswith("per_rank tp=2 safety: INCOMPLETE (pan: reached -DMEMLIM bound)")
    assert "nothing is verified; raise the memory bound" in stopped
    assert _result("pan:1: assertion violated", incomplete=False).verdict == "VIOLATION"
    assert _result(None, incomplete=False).verdict == "OK"


@pytest.mark.parametrize(("args", "message"), [
    (["--tp", "0"], "argument --tp: must be between 1 and 64"),
    (["--tp", "-3"], "argument --tp: must be between 1 and 64"),
    (["--tp", "100000"], "argument --tp: must be between 1 and 64"),
    (["--tp", "two"], "argument --tp: 'two' is not an integer"),
    (["--memlim", "0"], "argument --memlim: must be between 1 and 1048576"),
    (["--memlim", "-5"], "argument --memlim: must be between 1 and 1048576"),
    (["--memlim", str(1 << 30)], "argument --memlim: must be between 1 and 1048576"),
])
def test_out_of_range_arguments_are_usage_errors(args: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--tp", "5"], "--tp: range: the per_rank model is checked at tp 2..4, not 5"),
    (["--tp", "1"], "the per_rank model is checked at tp 2..4, not 1"),
    (["--model", "coordinator", "--tp", "9"], "the coordinator model is checked at tp 1..8, not 9"),
    (["--model", "counting", "--liveness"], "liveness: range: the liveness property"),
])
def test_a_tp_the_model_does_not_take_is_one_line(args: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstate check: error: ") and message in err and err.count("\n") == 1, err


def test_a_spec_directory_that_cannot_be_read_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    for spec, why in [(tmp_path / "missing", "No such file or directory"), (tmp_path / "file", "Not a directory")]:
        assert main(["check", "--spec", str(spec)]) == 2
        err = capsys.readouterr().err
        assert err == f"kvstate check: error: {spec / 'bank.toml'}: file: cannot read the table: {why}\n"
