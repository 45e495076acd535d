"""docs/guide.md and the README's usage snippet run as written: every Python block, in
order, in one fresh process (each name they use is defined in an earlier block)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_guide_runs_from_top_to_bottom() -> None:
    code = blocks(ROOT / "docs" / "guide.md")
    assert len(code) >= 8
    r = run("\n".join(code) + "\nprint('guide ok')\n")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.rstrip().endswith("guide ok")
    assert "decision: reuse (chosen)" in r.stdout and "block_ids dst_block_ids[3]" in r.stdout
    assert "Exception ignored" not in r.stderr and "ResourceWarning" not in r.stderr, r.stderr[-3000:]


def test_the_readme_snippet_runs_and_tears_down() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    section = text.split("## Using it in an engine", 1)[1].split("\n## ", 1)[0]
    code = BLOCK.findall(section)
    assert len(code) == 1
    r = run(code[0] + "\nprint('readme ok')\n")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.rstrip().endswith("readme ok")


def test_a_broken_block_fails_the_check() -> None:
    """Negative control: the harness sees a failure in any block."""
    code = blocks(ROOT / "README.md")
    r = run("\n".join([*code[:1], "undefined_name_in_a_doc_block"]))
    assert r.returncode != 0 and "NameError" in r.stderr


def test_the_coordinator_example_runs_and_tears_down() -> None:
    """docs/coordinator.md: a coordinator and a worker per rank (threads standing in for
    processes), each worker loading only its own rank."""
    code = blocks(ROOT / "docs" / "coordinator.md")
    assert len(code) == 1
    r = run(code[0] + "\nprint('coordinator ok')\n")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.rstrip().endswith("coordinator ok")
    assert "Exception ignored" not in r.stderr and "ResourceWarning" not in r.stderr, r.stderr[-3000:]
