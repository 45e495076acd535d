"""Mutation score: planted mutants of the real sources, each with the tests that must kill it.

Each ``tests/mutants/*.toml`` is one mutant::

    family = "validate"                     # the area it plants into (FAMILIES)
    why = "one line: what the bug is and why the tests must see it"
    tests = ["tests/test_x.py::test_y"]     # the selection that must kill it (pytest node ids)
    timeout_s = 240                         # optional; default DEFAULT_TIMEOUT_S
    timeout_kills = false                   # optional; true: a hang is the expected symptom

    [[replace]]                             # one or more
    file = "kvstate/core/geometry.py"
    old = '''exact original text'''         # must occur exactly once, else the mutant is STALE
    new = '''its replacement'''

Snippets, not line numbers: a mutant survives unrelated edits of its file and goes stale
(loudly: the run stops before testing anything) only when the code it plants into
changed. :func:`run` copies the tree to a scratch directory once (the working tree is
never written), checks every selection passes there unmutated (the baseline), then per
mutant writes the mutated files, rebuilds the C extension when ``ffi/`` changed, runs the
selection with a timeout, and restores the files.

A selection in ``tests/vllm`` runs with the vLLM suite's interpreter (``.venv-vllm``, which
``make test-vllm`` builds; ``KVSTATE_VLLM_PYTHON`` names another): such a mutant plants a bug
that only real engines can show. Without that interpreter those mutants are NOT RUN: listed,
and left out of the score (``--require-vllm`` makes that an error instead).

A mutant is *killed* only when a test fails (a failed test, or a failed check in a test's
teardown such as the leak check). A collection or import error, a setup error, a build
error or a selection that ran nothing is an ERROR, and a timeout is TIMEOUT; neither
counts as killed, unless the mutant says ``timeout_kills = true`` (then KILLED-TIMEOUT).

Run: ``make mutants`` (``PYTHONPATH=tests python -m support.mutants [--only ID..] [--check]``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "tests" / "mutants"
DEFAULT_TIMEOUT_S = 240
#: Selections here run with the vLLM suite's interpreter (vllm_python), never with this one.
VLLM_TESTS = "tests/vllm/"
FAMILIES = ("spec", "machine", "validate", "descriptor", "identity", "native", "exporter", "importer",
            "policy", "framing", "connector", "coordinator")

KILLED, KILLED_TIMEOUT, SURVIVED, TIMEOUT, ERROR, STALE, NOT_RUN = (
    "killed", "killed-timeout", "SURVIVED", "TIMEOUT", "ERROR", "STALE", "NOT RUN")
KILLS = (KILLED, KILLED_TIMEOUT)


class MutantError(Exception):
    """A mutant file that is malformed or stale: the run stops, loudly."""


@attrs.frozen
class Replace:
    file: str
    old: str
    new: str


@attrs.frozen
class Mutant:
    id: str
    family: str
    why: str
    tests: tuple[str, ...]
    replaces: tuple[Replace, ...]
    timeout_s: float = DEFAULT_TIMEOUT_S
    timeout_kills: bool = False

    @property
    def native(self) -> bool:
        return any(r.file.startswith("ffi/") for r in self.replaces)

    @property
    def vllm(self) -> bool:
        """Its selection is in the vLLM suite (load() refuses a mixed one)."""
        return in_vllm_suite(self.tests)


def in_vllm_suite(selection: Sequence[str]) -> bool:
    """Whether a selection is the vLLM suite's (all of it: load() refuses a mixed one)."""
    return selection[0].startswith(VLLM_TESTS)


def vllm_python() -> Path:
    """The vLLM suite's interpreter: KVSTATE_VLLM_PYTHON, or this checkout's .venv-vllm."""
    return Path(os.environ.get("KVSTATE_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def python_for(selection: Sequence[str]) -> str:
    """The interpreter a selection runs with: the vLLM suite's for tests/vllm, else this one."""
    return str(vllm_python()) if in_vllm_suite(selection) else sys.executable


@attrs.frozen
class Result:
    mutant: Mutant
    outcome: str
    killer: str        # the first failing test, or why not killed
    seconds: float


def load(path: Path) -> Mutant:
    """One mutant file, checked for shape (not yet against a tree)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise MutantError(f"{path.name}: {exc}") from None
    unknown = set(data) - {"family", "why", "tests", "replace", "timeout_s", "timeout_kills"}
    if unknown:
        raise MutantError(f"{path.name}: unknown keys {sorted(unknown)}")
    family, why, tests = data.get("family"), data.get("why"), data.get("tests")
    if family not in FAMILIES:
        raise MutantError(f"{path.name}: family {family!r} is not one of {FAMILIES}")
    if not isinstance(why, str) or not why.strip() or "\n" in why.strip():
        raise MutantError(f"{path.name}: `why` must be one line")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.startswith("tests/")
                                                           for t in tests):
        raise MutantError(f"{path.name}: `tests` must list pytest node ids under tests/")
    if len({t.startswith(VLLM_TESTS) for t in tests}) != 1:
        raise MutantError(f"{path.name}: `tests` is either all in {VLLM_TESTS} (the vLLM suite's "
                          "interpreter) or none of it")
    rules = data.get("replace")
    if not isinstance(rules, list) or not rules:
        raise MutantError(f"{path.name}: no [[replace]]")
    replaces = []
    for r in rules:
        if set(r) != {"file", "old", "new"} or not all(isinstance(v, str) for v in r.values()):
            raise MutantError(f"{path.name}: each [[replace]] has exactly file, old and new (strings)")
        if not r["old"] or r["old"] == r["new"]:
            raise MutantError(f"{path.name}: a replacement must change a non-empty snippet")
        replaces.append(Replace(r["file"], r["old"], r["new"]))
    return Mutant(path.stem, family, why.strip(), tuple(tests), tuple(replaces),
                  float(data.get("timeout_s", DEFAULT_TIMEOUT_S)), bool(data.get("timeout_kills", False)))


def load_all(directory: Path = MUTANTS, only: Iterable[str] = ()) -> list[Mutant]:
    wanted = set(only)
    found = [load(p) for p in sorted(directory.glob("*.toml"))]
    missing = wanted - {m.id for m in found}
    if missing:
        raise MutantError(f"no such mutants: {sorted(missing)}")
    return [m for m in found if not wanted or m.id in wanted]


def mutated(mutant: Mutant, tree: Path) -> dict[str, str]:
    """file -> its mutated text in ``tree``; MutantError (STALE) when a snippet does not
    occur exactly once, so a mutant never silently plants nothing."""
    texts: dict[str, str] = {}
    for r in mutant.replaces:
        path = tree / r.file
        if r.file not in texts:
            if not path.is_file():
                raise MutantError(f"{STALE} {mutant.id}: {r.file} does not exist")
            texts[r.file] = path.read_text(encoding="utf-8")
        count = texts[r.file].count(r.old)
        if count != 1:
            raise MutantError(f"{STALE} {mutant.id}: its snippet occurs {count} times in {r.file} "
                              f"(must be once): {r.old.strip().splitlines()[0][:80]!r}")
        texts[r.file] = texts[r.file].replace(r.old, r.new)
    return texts


def stale(mutants: Sequence[Mutant], tree: Path = ROOT) -> list[str]:
    """Why each stale mutant is stale, against the files of ``tree``."""
    out = []
    for m in mutants:
        try:
            mutated(m, tree)
        except MutantError as exc:
            out.append(str(exc))
    return out


# -- the scratch tree ------------------------------------------------------------------


def scratch_copy(dest: Path, root: Path = ROOT) -> Path:
    """What git tracks plus untracked files it does not ignore, as they are in the working
    tree now, and the built C extension."""
    listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = root / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for so in (root / "kvstate").glob("_native*.so"):
        shutil.copy2(so, dest / "kvstate" / so.name)
    # the editable install maps kvstate.tables to <root>/spec; in the copy it must be the
    # copy's own spec/ (a spec-row mutant is invisible otherwise)
    if (dest / "kvstate").is_dir() and (dest / "spec").is_dir():
        (dest / "kvstate" / "tables").symlink_to(Path("..") / "spec")
    return dest


def build_native(tree: Path, timeout_s: float = 300) -> str | None:
    """Rebuild kvstate._native in ``tree`` from its ffi/; the error text, or None."""
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'ffi'); import build_host; "
                           "build_host.ffibuilder.compile(tmpdir='.', verbose=False)"],
                          cwd=tree, capture_output=True, text=True, timeout=timeout_s)
    return None if proc.returncode == 0 else (proc.stderr or proc.stdout)[-2000:]


def imports_the_copy(tree: Path, python: str = sys.executable) -> None:
    """The copy's tests must import the copy's kvstate (and its tables), never the
    installed working tree: otherwise every mutant would silently survive."""
    if not (tree / "kvstate").is_dir():
        return
    probe = ("import kvstate, kvstate.tables, sys; "
             "print(kvstate.__file__); print(list(kvstate.tables.__path__)[0])")
    out = subprocess.run([python, "-c", probe], cwd=tree, env=_env(tree), capture_output=True,
                         text=True, timeout=60)
    paths = [Path(p).resolve() for p in out.stdout.split()]
    if out.returncode != 0 or len(paths) != 2 or not all(p.is_relative_to(tree.resolve()) for p in paths):
        raise MutantError(f"the scratch copy does not import its own kvstate: {out.stdout or out.stderr}")


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    # child processes the tests start (peers, workers) import the copy too
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "tests"),
                                         *filter(None, [env.get("PYTHONPATH")])])
    env.pop("CI", None)  # CI turns a missing Spin into failures: that must not count as a kill
    env.update(PYTHONDONTWRITEBYTECODE="1", HYPOTHESIS_PROFILE="ci", PYTHONHASHSEED="0")
    return env


@attrs.frozen
class Run:
    rc: int | None            # None: timed out
    failed: tuple[str, ...]   # tests that failed in their call or teardown
    errors: tuple[str, ...]   # collection and setup errors
    ran: int                  # tests that ran (not skipped)
    output: str


AUTOGROUP = Path("/proc/self/autogroup")


def _autogroup_nice() -> int:
    """This process's scheduling group's nice value (Linux autogroups; 0 without them)."""
    try:
        return int(AUTOGROUP.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return 0


def _join_nice(nice: int) -> Callable[[], None]:
    def set_nice() -> None:  # in the child, after setsid made its new group
        try:
            AUTOGROUP.write_text(str(nice))
        except OSError:
            pass
    return set_nice


def pytest_run(tree: Path, selection: Sequence[str], timeout_s: float, *, stop_first: bool = True) -> Run:
    """The selection, run by pytest in ``tree``, in its own process group (killed whole on
    timeout)."""
    fd, name = tempfile.mkstemp(prefix="kvstate-mutant-", suffix=".xml")
    os.close(fd)
    report = Path(name)
    cmd = [python_for(selection), "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={report}", *(["-x"] if stop_first else []), *selection]
    # A new session is a new scheduling group at nice 0: a run started at a low weight
    # (beside a vLLM suite, say) hands that weight on to its selections.
    nice = _autogroup_nice()
    proc = subprocess.Popen(cmd, cwd=tree, env=_env(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=_join_nice(nice) if nice else None)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    try:
        failed, errors, ran = _junit(report)
    finally:
        report.unlink(missing_ok=True)
    return Run(rc, failed, errors, ran, out or "")


def _junit(report: Path) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    if not report.exists() or report.stat().st_size == 0:
        return (), (), 0
    failed: list[str] = []
    errors: list[str] = []
    ran = 0
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("skipped") is None:
            ran += 1
        failure = case.find("failure")
        if failure is not None:  # with its message's first line: the kill's reason, not only its place
            message = (failure.get("message") or "").strip().splitlines()
            failed.append(f"{name} ({message[0][:160]})" if message else name)
        for err in case.findall("error"):
            message = err.get("message") or ""
            # a check in teardown (the leak check) failing is the test failing; an error
            # before the test body ran (collection, import, fixture setup) is not
            (failed if "teardown" in message else errors).append(name)
    return tuple(failed), tuple(errors), ran


def classify(mutant: Mutant, run: Run) -> tuple[str, str]:
    if run.rc is None:
        return (KILLED_TIMEOUT, "timed out (labelled)") if mutant.timeout_kills else (TIMEOUT, "timed out")
    if run.failed and run.rc == 1:
        return KILLED, run.failed[0]
    if run.errors or run.rc not in (0, 1):
        return ERROR, f"pytest rc {run.rc}: " + (", ".join(run.errors[:2]) or _last_line(run.output))
    if run.ran == 0:
        return ERROR, "the selection ran no test (all skipped or deselected)"
    return SURVIVED, f"{run.ran} tests passed"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:160] if lines else "no output"


def run_one(mutant: Mutant, tree: Path) -> Result:
    started = time.monotonic()
    texts = mutated(mutant, tree)
    originals = {f: (tree / f).read_text(encoding="utf-8") for f in texts}
    natives = {so: so.read_bytes() for so in (tree / "kvstate").glob("_native*.so")} if mutant.native else {}
    try:
        for f, text in texts.items():
            (tree / f).write_text(text, encoding="utf-8")
        if mutant.native:
            problem = build_native(tree)
            if problem is not None:
                return Result(mutant, ERROR, "the mutated C does not build: " + _last_line(problem),
                              time.monotonic() - started)
        outcome, killer = classify(mutant, pytest_run(tree, mutant.tests, mutant.timeout_s))
        return Result(mutant, outcome, killer, time.monotonic() - started)
    finally:
        for f, text in originals.items():
            (tree / f).write_text(text, encoding="utf-8")
        for so, data in natives.items():
            so.write_bytes(data)


def baseline(mutants: Sequence[Mutant], tree: Path) -> list[str]:
    """Every selection must pass on the unmutated copy, or a kill would mean nothing: one
    run per interpreter."""
    red: list[str] = []
    for vllm in (False, True):
        group = [m for m in mutants if m.vllm == vllm]
        if not group:
            continue
        selection = list(dict.fromkeys(t for m in group for t in m.tests))
        run = pytest_run(tree, selection, timeout_s=max(900.0, sum(m.timeout_s for m in group) / 4),
                         stop_first=False)
        if run.rc == 0 and run.ran > 0:
            continue
        if run.rc is None:
            red.append(f"the unmutated baseline timed out ({python_for(selection)})")
        else:
            red += [*run.failed, *run.errors] or [f"pytest rc {run.rc}: {_last_line(run.output)}"]
    return red


def table(results: Sequence[Result]) -> str:
    rows = [("mutant", "family", "outcome", "seconds", "killer / why not")]
    rows += [(r.mutant.id, r.mutant.family, r.outcome, f"{r.seconds:.0f}", r.killer) for r in results]
    width = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:4], width)) + "  " + row[4] for row in rows)


def score(results: Sequence[Result]) -> tuple[int, int]:
    """(killed, run): a mutant NOT RUN is in neither."""
    ran = [r for r in results if r.outcome != NOT_RUN]
    return sum(r.outcome in KILLS for r in ran), len(ran)


def run(mutants: Sequence[Mutant], *, root: Path = ROOT, check_baseline: bool = True,
        echo: bool = True, require_vllm: bool = False) -> list[Result]:
    """Every mutant against a scratch copy of ``root``. MutantError if any is stale, or if
    ``require_vllm`` and a vLLM-suite mutant has no interpreter to run with."""
    problems = stale(mutants, root)
    if problems:
        raise MutantError("\n".join(problems))
    not_run: list[Result] = []
    if any(m.vllm for m in mutants) and not vllm_python().is_file():
        why = f"no vLLM interpreter at {vllm_python()} (make test-vllm builds it)"
        if require_vllm:
            raise MutantError(why)
        not_run = [Result(m, NOT_RUN, why, 0.0) for m in mutants if m.vllm]
        mutants = [m for m in mutants if not m.vllm]
    with tempfile.TemporaryDirectory(prefix="kvstate-mutants-") as scratch:
        tree = scratch_copy(Path(scratch) / "tree", root)
        for python in dict.fromkeys(python_for(m.tests) for m in mutants):
            imports_the_copy(tree, python)
        if check_baseline and mutants:
            started = time.monotonic()
            red = baseline(mutants, tree)
            if red:
                raise MutantError("the selections fail without any mutant: " + "; ".join(red[:5]))
            if echo:
                print(f"baseline: every selection passes unmutated ({time.monotonic() - started:.0f} s)", flush=True)
        results = []
        for i, m in enumerate(mutants, 1):
            r = run_one(m, tree)
            if echo:
                print(f"[{i}/{len(mutants)}] {m.id}: {r.outcome} ({r.seconds:.0f} s) {r.killer}", flush=True)
            results.append(r)
        for r in not_run:
            if echo:
                print(f"{r.mutant.id}: {NOT_RUN}: {r.killer}", flush=True)
        return results + not_run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mutants", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--only", nargs="*", default=(), help="mutant ids (file stems) to run")
    ap.add_argument("--check", action="store_true", help="only check that no mutant is stale")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to mutate (default: this one)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selections")
    ap.add_argument("--min-score", type=float, default=0.9, help="fail below this fraction killed")
    ap.add_argument("--require-vllm", action="store_true",
                    help="fail when the vLLM suite's mutants cannot run (no vLLM interpreter)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    started = time.monotonic()
    try:
        mutants = load_all(MUTANTS, args.only)
        if args.check:
            problems = stale(mutants, args.root)
            print("\n".join(problems) or f"{len(mutants)} mutants, none stale")
            return 2 if problems else 0
        results = run(mutants, root=args.root, check_baseline=not args.no_baseline,
                      require_vllm=args.require_vllm)
    except MutantError as exc:
        print(f"mutants: {exc}", file=sys.stderr)
        return 2
    killed, total = score(results)
    print()
    print(table(results))
    survivors = [r.mutant.id for r in results if r.outcome not in (*KILLS, NOT_RUN)]
    not_run = [r.mutant.id for r in results if r.outcome == NOT_RUN]
    print(f"\nscore: {killed}/{total} killed ({100 * killed / max(total, 1):.1f}%); "
          f"not killed: {', '.join(survivors) or 'none'}; "
          + (f"NOT RUN (no vLLM interpreter): {', '.join(not_run)}; " if not_run else "")
          + f"wall {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([{"id": r.mutant.id, "family": r.mutant.family, "outcome": r.outcome,
                                          "killer": r.killer, "seconds": round(r.seconds, 1)}
                                         for r in results], indent=1))
    return 0 if killed >= args.min_score * total else 1


if __name__ == "__main__":
    sys.exit(main())
