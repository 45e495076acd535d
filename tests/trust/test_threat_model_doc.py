"""docs/threat-model.md names the tests that show each check: every one of them exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names |= set(re.findall(r"^(?:def|async def) (test_\w+)", path.read_text(encoding="utf-8"), re.M))
        names |= set(re.findall(r"^def (\w+)\(", path.read_text(encoding="utf-8"), re.M))
    return names


def test_every_test_the_threat_model_names_exists() -> None:
    doc = (ROOT / "docs" / "threat-model.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(?:[\w/]+\.py::)?(test_\w+|leak_check)`", doc))
    named |= set(re.findall(r"(?<![\w`/])(test_\w+)`", doc))
    assert len(named) >= 20
    missing = sorted(named - _defined_tests())
    assert missing == []
    for path in set(re.findall(r"`(tests/[\w/]+\.py)", doc)):
        assert (ROOT / path).is_file(), path
