"""`kvstate generate --check` is the one freshness check of every file derived from spec/:
the C headers (the op table, and the bank and part tables of the native executor), the
Promela models and the spec docs (whose rows link to the code).

The check is shown to work both ways: an unchanged copy of the tables reports nothing
stale (a check that always reports staleness could not fail), and a changed table reports
exactly the files that derive from it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvstate.commands.cli import main
from kvstate.core.spec import load_spec
from kvstate.derive import generate
from support.variants import PLANTED, ROOT, replace, source_tree, variant

MODELS = [f"models/{name}" for name in ("per_rank_tp2.pml", "per_rank_tp3.pml", "per_rank_tp4.pml",
                                        "counting.pml")]
PER_RANK = MODELS[:3]
COORD_MODELS = ["models/coordinator_tp2.pml", "models/coordinator_sym_tp3.pml", "models/coordinator_sym_tp4.pml"]
MACHINES = ("bank", "group", "part", "op", "coordinator", "rank")
#: generated from spec/rules.toml (the descriptor rules in C, and their page)
RULES = ["ffi/kvs_validate.h", "ffi/kvs_validate_codes.h", "ffi/kvs_validate_rules.h", "docs/spec/rules.md",
         "kvstate/core/rules_table.py"]


def test_every_generated_file_is_fresh() -> None:
    """The single freshness check (what CI runs through `make test`)."""
    stale = generate.stale(ROOT)
    assert not stale, "stale generated files; run `kvstate generate`:\n" + "\n".join(
        f"  {path}: {why}" for path, why in stale)


def test_every_artifact_is_produced_and_listed_once() -> None:
    paths = [path for path, _ in generate.ARTIFACTS]
    assert len(paths) == len(set(paths))
    assert set(paths) == {"ffi/kvs_op_table.h", "ffi/kvs_bank_table.h", "ffi/kvs_part_table.h", *MODELS, *COORD_MODELS, "docs/spec/index.md",
                          *(f"docs/spec/{m}.md" for m in MACHINES), *RULES}


def test_an_unchanged_copy_of_the_tables_is_fresh(tmp_path: Path) -> None:
    """Negative control: generation depends on what the tables say, not where they are."""
    assert generate.stale(ROOT, load_spec(variant(tmp_path))) == []


OP_CANCEL_WHEN_RUNNING = (("op.toml", 'trigger = "cancel"\nsource = "queued"', 'trigger = "cancel"\nsource = "running"'),)
RANK_LOAD_EARLY = (("rank.toml", 'trigger = "load"\nsource = "ready"', 'trigger = "load"\nsource = "imported"'),)


@pytest.mark.parametrize(("patch", "extra", "expected"), [
    ("spec_ready_missing_part.toml", (), [*MODELS, "docs/spec/group.md"]),        # group: both models
    ("spec_quiesce_unguarded.toml", (), [*PER_RANK, "docs/spec/bank.md", "ffi/kvs_bank_table.h"]),  # bank: C too
    (None, OP_CANCEL_WHEN_RUNNING, ["ffi/kvs_op_table.h", *MODELS, "docs/spec/op.md"]),  # op: C too
    (None, RANK_LOAD_EARLY, [*COORD_MODELS, "docs/spec/rank.md"]),               # rank: coordinator models
], ids=["group", "bank", "op", "rank"])
def test_a_changed_table_makes_exactly_its_derived_files_stale(
        patch: str | None, extra: tuple[tuple[str, str, str], ...], expected: list[str], tmp_path: Path) -> None:
    spec = load_spec(variant(tmp_path, PLANTED / patch if patch else None, extra))
    assert sorted(path for path, _ in generate.stale(ROOT, spec)) == sorted(expected)


def _edit(path: Path) -> None:
    path.write_text(path.read_text(encoding="utf-8").replace("\n", "\n ", 1), encoding="utf-8")


@pytest.mark.slow  # copies the source tree and generates it twice per case: make test runs it
@pytest.mark.parametrize(("plant", "stale"), [
    (lambda t: _edit(t / "ffi" / "kvs_op_table.h"), "ffi/kvs_op_table.h"),
    (lambda t: _edit(t / "ffi" / "kvs_part_table.h"), "ffi/kvs_part_table.h"),
    (lambda t: _edit(t / "models" / "counting.pml"), "models/counting.pml"),
    (lambda t: (t / "docs" / "spec" / "part.md").unlink(), "docs/spec/part.md"),
    (lambda t: (t / "docs" / "spec" / "retired.md").write_text("old page\n"), "docs/spec/retired.md"),
    # the code moved: the bank page links its rows to the function that implements them
    (lambda t: replace(t / "kvstate" / "share", [("bank.py", "def _release(", "def _free_all(")]),
     "docs/spec/bank.md"),
], ids=["header", "machine-header", "model", "missing-page", "leftover-page", "renamed-effect"])
def test_check_command_names_each_stale_file_and_generate_fixes_it(
        plant: Callable[[Path], object], stale: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = source_tree(tmp_path)
    assert main(["generate", "--check", "--root", str(tree)]) == 0
    plant(tree)
    assert main(["generate", "--check", "--root", str(tree)]) == 1
    err = capsys.readouterr().err
    assert [line.split(": ")[1] for line in err.splitlines() if line.startswith("stale: ")] == [stale]
    assert main(["generate", "--root", str(tree)]) == 0
    assert main(["generate", "--check", "--root", str(tree)]) == 0


def test_check_writes_nothing(tmp_path: Path) -> None:
    tree = source_tree(tmp_path)
    (tree / "models" / "counting.pml").unlink()
    before = sorted(p.relative_to(tree) for p in tree.rglob("*"))
    assert main(["generate", "--check", "--root", str(tree)]) == 1
    assert sorted(p.relative_to(tree) for p in tree.rglob("*")) == before
