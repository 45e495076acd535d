"""The C sources' structure: the memory side (kvs_host.c) and the op engine (kvs_ops.c,
with its completion reports in kvs_reports.c and its copy loops in kvs_copy.c) each build on the shared slot-and-pin table (kvs_slots.c) and on nothing of each other;
the CUDA backend (kvs_cuda_*.c) builds on the slot table and on the engine's face for
other backends (kvs_engine.h) only, and neither host side takes anything from it; the
lifecycle executor (kvs_machine.c) and its table registry (kvs_machines.c) build on the
generated tables only and take nothing from, nor give anything to, the rest;
includes form no cycle, and every file compiles clean under -Wall -Wextra -Werror.
The dependency check is shown to catch a planted call across."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

FFI = Path(__file__).resolve().parents[2] / "ffi"
SOURCES = ("kvs_slots.c", "kvs_host.c", "kvs_ops.c", "kvs_op_table.c", "kvs_reports.c", "kvs_copy.c", "kvs_machine.c", "kvs_machines.c", "kvs_cuda_load.c",
           "kvs_cuda_mem.c", "kvs_cuda_ops.c")
MACHINES = ("kvs_machine.c", "kvs_machines.c")
ENGINE = ("kvs_ops.c", "kvs_op_table.c", "kvs_reports.c", "kvs_copy.c")
CUDA = ("kvs_cuda_load.c", "kvs_cuda_mem.c", "kvs_cuda_ops.c")
#: What the CUDA backend may take from the op engine: kvs_engine.h, and the public reap.
ENGINE_FACE = {"kvs_engine_lock", "kvs_engine_unlock", "kvs_op_external", "kvs_op_drop", "kvs_op_step",
               "kvs_op_stepped", "kvs_reap"}
FLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden", "-c"]

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("nm") is None,
                                reason="needs a C compiler and nm (the native module is built with them)")


def includes(path: Path) -> list[str]:
    return re.findall(r'^#include "([^"]+)"', path.read_text(encoding="utf-8"), re.M)


def test_local_includes_form_no_cycle_and_the_two_sides_share_only_the_slot_table() -> None:
    graph = {p.name: includes(p) for p in FFI.glob("kvs*.[ch]")}
    assert includes(FFI / "kvs_host.c") == ["kvs_slots.h"]
    assert [includes(FFI / c) for c in ENGINE] == [["kvs_copy.h", "kvs_op.h"], ["kvs_op.h"], ["kvs_engine.h"],
                                                   ["kvs_copy.h"]]
    assert includes(FFI / "kvs_op.h") == ["kvs_engine.h"]
    assert includes(FFI / "kvs_engine.h") == ["kvs_slots.h"]
    assert includes(FFI / "kvs_cuda.h") == ["kvs_cuda_driver.h", "kvs_slots.h"]
    assert [includes(FFI / c) for c in CUDA] == [["kvs_cuda.h"], ["kvs_cuda.h"], ["kvs_cuda.h", "kvs_engine.h"]]
    assert includes(FFI / "kvs_machine.c") == ["kvs.h", "kvs_machines.h"]
    assert includes(FFI / "kvs_machines.c") == ["kvs.h", "kvs_machines.h", "kvs_bank_table.h", "kvs_part_table.h"]
    assert includes(FFI / "kvs_machines.h") == ["kvs_machine.h"]
    assert all(includes(FFI / f"kvs_{m}_table.h") == ["kvs_machine.h"] for m in ("bank", "part"))
    seen: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"include cycle: {' -> '.join((*path, name))}"
        if name in seen:
            return
        seen.add(name)
        for child in graph.get(name, []):
            visit(child, (*path, name))

    for name in graph:
        visit(name, ())


def _objects(src_dir: Path, out: Path) -> dict[str, tuple[set[str], set[str]]]:
    """Per source: (kvs symbols it defines, kvs symbols it uses but does not define)."""
    symbols = {}
    for src in SOURCES:
        obj = out / src.replace(".c", ".o")
        done = subprocess.run(["cc", *FLAGS, "-I", str(src_dir), str(src_dir / src), "-o", str(obj)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{src} does not compile clean:\n{done.stderr}"
        listing = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
        defined, undefined = set(), set()
        for line in listing.splitlines():
            parts = line.split()
            if parts and parts[-1].startswith("kvs_"):
                (undefined if parts[-2] == "U" else defined).add(parts[-1])
        symbols[src] = (defined, undefined)
    return symbols


def cross_uses(symbols: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """Symbols one of kvs_host.c and kvs_ops.c takes from the other, either takes from the
    CUDA backend, or the CUDA backend takes from them beyond the engine's face."""
    found = []
    pairs = [(side, "kvs_host.c") for side in ENGINE] + [("kvs_host.c", side) for side in ENGINE]
    pairs += [(host, cuda) for host in ("kvs_host.c", *ENGINE) for cuda in CUDA]
    pairs += [(cuda, "kvs_host.c") for cuda in CUDA]
    for user, provider in pairs:
        found += [f"{user} uses {s} of {provider}" for s in sorted(symbols[user][1] & symbols[provider][0])]
    for cuda in CUDA:
        for side in ENGINE:
            found += [f"{cuda} uses {s} of {side}" for s in sorted((symbols[cuda][1] & symbols[side][0]) - ENGINE_FACE)]
    return found


def test_memory_side_and_op_engine_take_nothing_from_each_other(tmp_path: Path) -> None:
    symbols = _objects(FFI, tmp_path)
    assert cross_uses(symbols) == []
    slots_defined = symbols["kvs_slots.c"][0]
    engine_defined = set().union(*(symbols[c][0] for c in ENGINE))
    assert symbols["kvs_host.c"][1] <= slots_defined, f"kvs_host.c uses {symbols['kvs_host.c'][1] - slots_defined}"
    for src in ENGINE:  # the engine's two halves use each other and the slot table only
        extra = symbols[src][1] - slots_defined - engine_defined
        assert not extra, f"{src} uses {extra}"
    machine_defined = set().union(*(symbols[c][0] for c in MACHINES))
    for src in MACHINES:
        extra = symbols[src][1] - machine_defined
        assert not extra, f"{src} uses {extra}"
    for src in set(SOURCES) - set(MACHINES):
        assert not symbols[src][1] & machine_defined, f"{src} uses the lifecycle executor"
    cuda_defined = set().union(*(symbols[c][0] for c in CUDA))
    for src in CUDA:
        extra = symbols[src][1] - slots_defined - cuda_defined - ENGINE_FACE
        assert not extra, f"{src} uses {extra}"


def test_the_dependency_check_catches_a_planted_call_across(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(FFI, src, ignore=shutil.ignore_patterns("__pycache__", "*.o", "*.so"))
    with open(src / "kvs_host.c", "a", encoding="utf-8") as f:
        f.write("\nint kvs_planted_cross(void) { return kvs_engine_pause(0); }\n")
    with open(src / "kvs_cuda_mem.c", "a", encoding="utf-8") as f:
        f.write("\nint kvs_planted_engine(void) { return kvs_engine_configure(2); }\n")
    (tmp_path / "out").mkdir()
    assert cross_uses(_objects(src, tmp_path / "out")) == ["kvs_host.c uses kvs_engine_pause of kvs_ops.c",
                                                           "kvs_cuda_mem.c uses kvs_engine_configure of kvs_ops.c"]
