"""Generated artifacts are fresh: docs/spec must equal what the tables render."""

from __future__ import annotations

from pathlib import Path

from kvstate.derive import docs as render
from kvstate.commands.cli import main
from kvstate.core.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def test_committed_spec_docs_are_fresh() -> None:
    for name, text in render.pages(load_spec()).items():
        committed = ROOT / "docs" / "spec" / name
        assert committed.is_file(), f"missing {committed}; run `kvstate spec render`"
        assert committed.read_text(encoding="utf-8") == text, f"{committed} is stale; run `kvstate spec render`"


def test_spec_check_command_detects_staleness(tmp_path: Path) -> None:
    assert main(["spec", "render", "--out", str(tmp_path)]) == 0
    assert main(["spec", "check", "--out", str(tmp_path)]) == 0
    (tmp_path / "group.md").write_text("edited by hand\n")
    assert main(["spec", "check", "--out", str(tmp_path)]) == 1


def test_pages_carry_mermaid_and_every_transition() -> None:
    spec = load_spec()
    for name, m in spec.machines.items():
        page = render.pages(spec)[f"{name}.md"]
        assert "```mermaid\nstateDiagram-v2" in page
        assert page.count("\n| `") >= len(m.transitions)
