"""cffi builder of ``kvstate._native``: API mode, out of line, abi3.

``pip install`` runs this through ``setup.py``'s ``cffi_modules``. The declarations are
derived from ``kvs.h`` itself (:func:`cdef_from_header`), so the header is their one
source, and cffi's API mode compiles them against that same header: a declaration the C
compiler disagrees with fails the build instead of corrupting memory at run time. The
build needs only cffi and a C compiler.

``builder(module, defines)`` also serves the planted-bug self-test, which compiles a
separate test-only module with ``KVS_PLANT_RELEASE_IGNORES_PINS``; the installed module is
always built by the module-level ``ffibuilder`` without it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = ("kvs_slots.c", "kvs_host.c", "kvs_ops.c", "kvs_op_table.c", "kvs_reports.c", "kvs_copy.c", "kvs_machine.c", "kvs_machines.c", "kvs_cuda_load.c",
           "kvs_cuda_mem.c", "kvs_cuda_ops.c")
SOURCES += ("kvs_link.c", "kvs_renew.c")  # the importer's request links and renewal thread
SOURCES += ("kvs_attach.c",)  # the importer's native attach (phase 2 on the host backend)
SOURCES += ("kvs_import.c",)  # the importer's native phase 1 (lease, checks, renewal) and attach
# The exporter's lease server (its rules, its thread, its request reader).
SOURCES += ("kvs_serve.c", "kvs_lease.c", "kvs_lease_answer.c", "kvs_lease_thread.c", "kvs_lease_tcp.c", "kvs_lease_inventory.c", "kvs_blake2b.c", "kvs_json.c", "kvs_inventory.c")
SOURCES += ("kvs_index.c", "kvs_index_thread.c")  # the decode index's lookups, off the GIL
SOURCES += ("kvs_validate.c",)  # the descriptor rules, generated from spec/rules.toml
DEPENDS = ("kvs.h", "kvs_slots.h", "kvs_engine.h", "kvs_cuda.h", "kvs_cuda_driver.h", "kvs_op_table.h",
           "kvs_validate.h", "kvs_validate_codes.h", "kvs_validate_rules.h", "kvs_machine.h", "kvs_machines.h",
           "kvs_bank_table.h", "kvs_part_table.h", "kvs_link.h", "kvs_lease.h", "kvs_json.h", "kvs_inventory.h",
           "kvs_index.h", "kvs_index_state.h",
           *SOURCES)

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_DEFINE = re.compile(r"#define\s+(\w+)(\s+\S.*)?$")


def cdef_from_header(text: str, guard: str = "KVS_H") -> str:
    """The cffi declarations of ``kvs.h``: the header without comments, include guards and
    includes, with every ``#define NAME value`` turned into ``#define NAME ...`` (cffi
    then takes the value from the compiled header). Anything else a preprocessor would
    have to evaluate (conditionals other than the guard, function-like macros) is refused,
    so the header stays something cffi can read whole."""
    out: list[str] = []
    for line in _COMMENT.sub("", text).splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            if stripped:
                out.append(line.rstrip())
            continue
        if stripped.startswith("#include") or stripped in (f"#ifndef {guard}", "#endif"):
            continue
        m = _DEFINE.match(stripped)
        if m is None or (m.group(2) is None and m.group(1) != guard):
            raise ValueError(f"{guard}: cannot declare {stripped!r} to cffi")
        if m.group(1) != guard:
            out.append(f"#define {m.group(1)} ...")
    return "\n".join(out) + "\n"


CDEF = cdef_from_header((HERE / "kvs.h").read_text(encoding="utf-8"))
# The descriptor rules' header is generated (kvstate generate), so it is read apart.
CDEF_VALIDATE = cdef_from_header((HERE / "kvs_validate.h").read_text(encoding="utf-8"), "KVS_VALIDATE_H")
# The decode index's mirror has a header of its own (kvs_index.h).
CDEF_INDEX = cdef_from_header((HERE / "kvs_index.h").read_text(encoding="utf-8"), "KVS_INDEX_H")


def builder(module: str = "kvstate._native", defines: Sequence[tuple[str, str | None]] = (),
            src_dir: Path | None = None) -> FFI:
    ffi = FFI()
    ffi.cdef(CDEF + CDEF_VALIDATE + CDEF_INDEX)
    # setuptools wants source paths relative to the project (pip runs this from there);
    # a test-only variant build passes the absolute directory of its copied sources.
    root = src_dir if src_dir is not None else Path("ffi") if Path("ffi/kvs.h").is_file() else HERE
    ffi.set_source(
        module,
        '#include "kvs.h"\n#include "kvs_validate.h"\n#include "kvs_index.h"\n',
        sources=[str(root / s) for s in SOURCES],
        include_dirs=[str(root)],
        depends=[str(root / d) for d in DEPENDS],
        define_macros=list(defines),
        extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"],
        libraries=["pthread", "dl"],
        py_limited_api=True,
    )
    return ffi


ffibuilder = builder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
