"""The docs match the tree: the README's layout table names exactly the packages under
kvstate/ (and the top-level folders), docs/architecture.md's layer picture has every
package and every import between packages follows its arrows, and the module paths the
README and docs name exist. Each check is also shown to catch a planted mismatch."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvstate"
#: the rows of the layout table besides one per package under kvstate/
TOP_FOLDERS = {"ffi/", "spec/", "models/", "docs/", "tests/", "benchmarks/"}


def packages(root: Path = PACKAGE) -> set[str]:
    """``kvstate/<name>/`` for every package directly under kvstate/ (what ``ls kvstate`` shows)."""
    return {f"kvstate/{p.name}/" for p in root.iterdir() if (p / "__init__.py").is_file()}


def layout_rows(readme: str) -> list[str]:
    """The first column (one backticked path) of each row of the README's Layout table."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", section, re.M)]


def layout_problems(rows: list[str], pkgs: set[str], root: Path = ROOT) -> list[str]:
    problems = [f"{r} appears {rows.count(r)} times" for r in sorted(set(rows)) if rows.count(r) > 1]
    named = {r for r in rows if r.startswith("kvstate/")}
    problems += [f"package {p} is not in the table" for p in sorted(pkgs - named)]
    problems += [f"the table names {p}, which is not a package under kvstate/" for p in sorted(named - pkgs)]
    others = set(rows) - named
    problems += [f"the table lacks {f}" for f in sorted(TOP_FOLDERS - others)]
    problems += [f"the table names {f}, which is not one of {sorted(TOP_FOLDERS)}" for f in sorted(others - TOP_FOLDERS)]
    problems += [f"{f} does not exist" for f in sorted(others & TOP_FOLDERS) if not (root / f).is_dir()]
    return problems


def test_readme_layout_table_matches_the_tree() -> None:
    rows = layout_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    assert layout_problems(rows, packages()) == []


def test_layout_check_catches_a_missing_and_a_stale_row() -> None:
    rows = layout_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    missing = [r for r in rows if r != "kvstate/reuse/"]
    assert layout_problems(missing, packages()) == ["package kvstate/reuse/ is not in the table"]
    stale = [*rows, "kvstate/exporter/"]
    assert layout_problems(stale, packages()) == [
        "the table names kvstate/exporter/, which is not a package under kvstate/"]
    assert layout_problems(rows, packages() | {"kvstate/plugins/"}) == [
        "package kvstate/plugins/ is not in the table"]


# -- the layer picture -------------------------------------------------------------------


def picture() -> tuple[set[str], set[tuple[str, str]]]:
    """Nodes and solid arrows (``a --> b``) of the first Mermaid flowchart in docs/architecture.md."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    chart = doc.split("```mermaid\nflowchart", 1)[1].split("```", 1)[0]
    nodes = set(re.findall(r"^\s*(\w+)\[", chart, re.M))
    edges = set(re.findall(r"^\s*(\w+)\s*-->\s*(\w+)\s*$", chart, re.M))
    return nodes, edges


def imports_between_packages(root: Path = PACKAGE) -> dict[tuple[str, str], str]:
    """(importer, imported) package pairs under kvstate/, each with one file that does it.
    Function-level imports count; the top-level facade (kvstate/__init__, __main__) does not."""
    found: dict[tuple[str, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) < 2:
            continue
        src = rel.parts[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "kvstate" else [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "kvstate" and len(parts) > 1 and parts[1] != src and (root / parts[1]).is_dir():
                    found.setdefault((src, parts[1]), str(path.relative_to(root.parent)))
    return found


def closure(edges: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    reach = set(edges)
    while True:
        more = {(a, d) for a, b in reach for c, d in reach if b == c} - reach
        if not more:
            return reach
        reach |= more


def layer_problems(nodes: set[str], edges: set[tuple[str, str]], pkgs: set[str],
                   imports: Mapping[tuple[str, str], str]) -> list[str]:
    problems = [f"package {p} is not in the picture" for p in sorted(pkgs - nodes)]
    allowed = closure(edges)
    problems += [f"{src} imports {dst} ({where}), against the arrows" for (src, dst), where in sorted(imports.items())
                 if (src, dst) not in allowed]
    return problems


def test_architecture_picture_matches_the_tree_and_the_imports() -> None:
    nodes, edges = picture()
    pkgs = {p.split("/")[1] for p in packages()}
    assert layer_problems(nodes, edges, pkgs, imports_between_packages()) == []
    assert ("core", "share") not in closure(edges)  # the core imports nothing above it


def test_layer_check_catches_an_upward_import_and_a_missing_package() -> None:
    nodes, edges = picture()
    pkgs = {p.split("/")[1] for p in packages()}
    imports = {**imports_between_packages(), ("core", "share"): "kvstate/core/planted.py"}
    assert layer_problems(nodes, edges, pkgs, imports) == [
        "core imports share (kvstate/core/planted.py), against the arrows"]
    assert layer_problems(nodes - {"reuse"}, edges, pkgs, {}) == ["package reuse is not in the picture"]


# -- module paths named in prose ---------------------------------------------------------

PROSE = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def resolves(dotted: str) -> bool:
    """Whether ``kvstate.a.b.C`` names a module, or an attribute of the longest module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            obj: object = importlib.import_module(module) if i < len(parts) else None
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def stale_names(text: str) -> list[str]:
    dotted = set(re.findall(r"\bkvstate(?:\.[A-Za-z_]\w*)+", text))
    paths = set(re.findall(r"\bkvstate/[\w/]+(?:\.py)?", text))
    return sorted({d for d in dotted if not resolves(d)} | {p for p in paths if not (ROOT / p).exists()})


def test_module_paths_named_in_readme_and_docs_exist() -> None:
    stale = {str(p.relative_to(ROOT)): stale_names(p.read_text(encoding="utf-8")) for p in PROSE}
    assert {k: v for k, v in stale.items() if v} == {}


def test_stale_name_check_catches_old_module_paths() -> None:
    assert stale_names("see `kvstate.native.default()` and `kvstate/exporter.py`, "
                       "`kvstate.share.exporter.Exporter`, `kvstate.NoSuchError`") == [
        "kvstate.NoSuchError", "kvstate.native.default", "kvstate/exporter.py"]


# -- the package stands without the checkout ----------------------------------------------

#: what only a source checkout has (benchmarks/, tests/support/), and the one module that
#: may import it: `kvstate bench`, which first checks that it runs from a checkout
CHECKOUT_ONLY = ("benchmarks", "support")
MAY_IMPORT_CHECKOUT = {"kvstate/commands/bench.py"}


def checkout_imports(root: Path = PACKAGE) -> list[str]:
    """``file: module`` for each import of checkout-only code under kvstate/."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            found += [f"{rel}: {n}" for n in names
                      if n.split(".")[0] in CHECKOUT_ONLY and rel not in MAY_IMPORT_CHECKOUT]
    return found


def test_the_package_imports_no_checkout_only_code(tmp_path: Path) -> None:
    """The wheel ships kvstate/ alone: nothing in it may need benchmarks/ or tests/support/."""
    assert checkout_imports() == []
    planted = tmp_path / "kvstate" / "harness"
    planted.mkdir(parents=True)
    (planted / "cluster.py").write_text("def f():\n    from support.engines import runner\n")
    assert checkout_imports(tmp_path / "kvstate") == ["kvstate/harness/cluster.py: support.engines"]
