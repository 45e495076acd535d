"""Copies of the source tree's spec/ (and of the tree itself) with planted changes."""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLANTED = ROOT / "tests" / "planted"


def variant(tmp_path: Path, patch: Path | None = None, extra: tuple[tuple[str, str, str], ...] = ()) -> Path:
    """A copy of spec/ with the patch's replacements applied (each must match exactly once)."""
    out = tmp_path / "spec"
    shutil.copytree(ROOT / "spec", out)
    rules = [(r["file"], r["old"], r["new"]) for r in tomllib.loads(patch.read_text()).get("replace", [])] \
        if patch else []
    replace(out, [*rules, *extra], str(patch))
    return out


def replace(directory: Path, rules: list[tuple[str, str, str]], what: str = "") -> None:
    for file, old, new in rules:
        text = (directory / file).read_text()
        assert text.count(old) == 1, f"{what}: {old!r} must occur exactly once in {file}"
        (directory / file).write_text(text.replace(old, new))


def source_tree(tmp_path: Path) -> Path:
    """A copy of what the generator reads and writes: kvstate/ (sources only), ffi/, spec/,
    models/ and docs/spec/."""
    out = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for d in ("kvstate", "ffi", "spec", "models", "docs/spec"):
        shutil.copytree(ROOT / d, out / d, ignore=skip)
    return out


def registry(patch: Path, base: Mapping[tuple[str, str, str], str]) -> dict[tuple[str, str, str], str]:
    """``base`` with the patch's ``[[registry]]`` entries: Promela meanings of guards and
    effects replaced, for bugs of an implementation that the tables cannot express."""
    out = dict(base)
    for entry in tomllib.loads(patch.read_text()).get("registry", []):
        key = (entry["machine"], entry["kind"], entry["name"])
        assert key in out, f"{patch}: no registry entry {key} to replace"
        out[key] = entry["text"]
    return out
