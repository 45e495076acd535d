"""`kvstate bench --quick`: a seconds-long smoke run that writes the table and the plot.

Not a timing test: it asserts that every suite ran or said why not, that kvstate's
own rows are measured (a row that cannot run says skipped, never a number), and that the files exist.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_quick_bench_writes_table_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    r = subprocess.run([sys.executable, "-m", "kvstate", "bench", "--quick", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    table = (tmp_path / "bench.md").read_text()
    for suite in ("B1", "B2", "B3", "B4"):
        assert f"**{suite}:" in table
    for row in ("kvstate whole-group import tp=1", "kvstate whole-group import tp=8", "kvstate per-rank import tp=8",
                "floor: SCM_RIGHTS + mmap, whole group tp=8", "floor: SCM_RIGHTS + mmap, per rank tp=8",
                "bound: floor + rules + machines, whole group tp=8", "bound: floor + rules + machines, per rank tp=8",
                "kvstate op engine gather", "kvstate Group.load (paged scatter)",
                "kvstate first layer usable", "kvstate Bank.store (same pages)"):  # measured, not skipped
        assert f"| {row} |" in table and f"| {row} | skipped |" not in table
    assert "| contiguous memcpy |" in table and "| numpy gather |" in table
    # NIXL's rows run where NIXL is installed, and say skipped where it is not.
    assert "| NIXL register + metadata load tp=8 |" in table
    assert "| NIXL register + metadata load + a round trip tp=8 |" in table
    assert "| readiness check tp=4 |" in table
    assert "FAILED" not in table
    # B1's comparisons: each kvstate row as a multiple of the floor and of each peer, with the goals.
    assert "| kvstate per-rank import tp=8 | floor: SCM_RIGHTS + mmap, per rank tp=8 |" in table
    # bench.json: every row (suite, name, median, p10, p90, ratio) and every comparison.
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = {(r["suite"], r["name"]): r for r in doc["rows"]}
    assert {s for s, _ in rows} == {"B1", "B2", "B3", "B4"}
    group8 = rows[("B1", "kvstate whole-group import tp=8")]
    assert group8["p10"] <= group8["median"] <= group8["p90"] and 0 < group8["ratio"]
    assert group8["reference"] == "floor: SCM_RIGHTS + mmap, whole group tp=8"
    assert all(set(r) >= {"suite", "name", "median", "p10", "p90", "ratio"} for r in doc["rows"])
    goals = [c for c in doc["comparisons"] if c["goal"] is not None]
    assert goals and all(c["times"] > 0 and c["met"] == (c["times"] <= c["goal"]) for c in goals)
    png = (tmp_path / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    # The summary picture, drawn from this bench.json (no vLLM rows here: its panels say so).
    assert f"wrote {tmp_path / 'summary.png'}" in r.stdout
    assert (tmp_path / "summary.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_plot_is_skipped_with_a_message_without_matplotlib(tmp_path: Path) -> None:
    hide = ("import sys, importlib.abc\n"
            "class H(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'matplotlib':\n"
            "            raise ModuleNotFoundError(name=name)\n"
            "sys.meta_path.insert(0, H())\n"
            "from kvstate.commands.cli import main\n"
            f"sys.exit(main(['bench', '--quick', '--suite', 'B3', '--out', {str(tmp_path)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plot skipped: matplotlib is not installed (pip install -e '.[bench]')" in r.stdout
    assert "summary skipped: matplotlib is not installed (pip install -e '.[bench]')" in r.stdout
    assert (tmp_path / "bench.md").is_file() and not (tmp_path / "bench.png").exists()
    assert not (tmp_path / "summary.png").exists()


def test_json_flag_prints_every_row_as_json(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvstate", "bench", "--quick", "--suite", "B3", "--json", "--no-plot",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)  # stdout is the JSON document alone; the table went to stderr
    assert doc == json.loads((tmp_path / "bench.json").read_text())
    names = [row["name"] for row in doc["rows"]]
    assert "readiness check tp=1" in names and all(row["suite"] == "B3" for row in doc["rows"])
    assert all(row["median"] > 0 and row["p10"] <= row["median"] <= row["p90"] for row in doc["rows"])
