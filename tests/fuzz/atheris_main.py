"""Coverage-guided fuzzing of one target with atheris (libFuzzer), seeded from the corpus.

    PYTHONPATH=tests python -m fuzz.atheris_main TARGET -runs=N [libFuzzer flags]
    PYTHONPATH=tests python -m fuzz.atheris_main all [RUNS_PER_TARGET]

(``make fuzz`` runs it so; the tests directory on PYTHONPATH is where ``fuzz`` and
``support`` import from, as under pytest.)

TARGET is a directory name under ``tests/fuzz/corpus`` (its files are the seed inputs,
in the same format the corpus replay uses). An untyped exception or a hang (the targets'
SIGALRM watchdog; libFuzzer's own timer is off so the two do not share SIGALRM) stops the
run with libFuzzer's crash report and the input saved. ``all`` runs every target in turn
and prints the cases each ran and the total.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["kvstate"]):
    from fuzz import targets

HERE = Path(__file__).resolve().parent


def _json(fn: Callable[[object], object]) -> Callable[[bytes], object]:
    def go(data: bytes) -> object:
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            return None  # not JSON: the corpus format of this target is JSON
        return fn(value)
    return go


TARGETS: dict[str, Callable[[bytes], object]] = {
    "descriptor": targets.descriptor_wire,
    "descriptor_body": targets.descriptor_body,
    "frame": lambda raw: targets.frame(raw[1:], raw[0] % 7) if raw else None,
    "message": targets.message,
    "settings_mapping": _json(lambda v: targets.settings_mapping(v) if isinstance(v, dict) else None),
    "settings_env": _json(lambda v: targets.settings_env({str(k): str(x) for k, x in v.items()})
                          if isinstance(v, dict) else None),
    "settings_cli": _json(lambda v: targets.settings_cli([str(x) for x in v]) if isinstance(v, list) else None),
    "capabilities": targets.capabilities_json,
}


def fuzz_one(name: str, argv: list[str]) -> None:
    """Run libFuzzer on one target (in this process; it exits when done)."""
    work = Path(tempfile.mkdtemp(prefix=f"kvstate-atheris-{name}-"))
    atheris.Setup([sys.argv[0], "-timeout=0", *argv, str(work), str(HERE / "corpus" / name)], TARGETS[name])
    atheris.Fuzz()


def fuzz_all(runs: int) -> int:
    """Every target in its own process; prints the runs of each and the total."""
    total = 0
    for name in TARGETS:
        proc = subprocess.run([sys.executable, "-m", "fuzz.atheris_main", name, f"-runs={runs}", "-max_len=8192"],
                              capture_output=True, text=True, timeout=3600)
        done = re.search(r"^Done (\d+) runs", proc.stderr, re.M)
        if proc.returncode != 0 or done is None:
            print(proc.stderr[-4000:], file=sys.stderr)
            print(f"FAILED: {name}", file=sys.stderr)
            return 1
        total += int(done.group(1))
        print(f"{name}: {done.group(1)} cases, no crash, no hang", flush=True)
    print(f"fuzz cases: {total} (atheris, {len(TARGETS)} targets)")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "all":
        raise SystemExit(fuzz_all(int(sys.argv[2]) if len(sys.argv) > 2 else 25_000))
    fuzz_one(sys.argv[1], sys.argv[2:])
