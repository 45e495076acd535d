"""ffi/kvs_cuda_driver.h against an installed cuda.h: the C engine declares the driver's
calls, structs and constants itself (it must build without CUDA), so this test compiles
those declarations next to cuda.h and checks them exactly, where a CUDA toolkit's headers
are installed (``$CUDA_HOME`` or /usr/local/cuda*): every struct's size and field offsets,
every constant, and every call's function type against cuda.h's own ``PFN_`` typedef of
the version kvs_cuda_load asks cuGetProcAddress for (the newest at or below it).

Types are compared after naming each ``kcu_`` type by the cuda.h type it stands for, so
an argument out of order, of the wrong width, a pointer for a value or a missing argument
is a compile error; two planted mismatches show that it is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

FFI = Path(__file__).resolve().parents[2] / "ffi"
HEADER = FFI / "kvs_cuda_driver.h"

#: kcu_ type -> the cuda.h type it stands for.
TYPES = {
    "kcu_result": "CUresult", "kcu_device": "CUdevice", "kcu_deviceptr": "CUdeviceptr",
    "kcu_mem_handle": "CUmemGenericAllocationHandle", "kcu_flags": "unsigned long long", "kcu_context": "CUcontext",
    "kcu_stream": "CUstream", "kcu_event": "CUevent", "kcu_device_attribute": "CUdevice_attribute",
    "kcu_pointer_attribute": "CUpointer_attribute", "kcu_handle_type": "CUmemAllocationHandleType",
    "kcu_granularity_flags": "CUmemAllocationGranularity_flags", "kcu_access_flags": "CUmemAccess_flags",
    "kcu_location_type": "CUmemLocationType", "kcu_allocation_type": "CUmemAllocationType",
    "kcu_memory_type": "CUmemorytype", "kcu_access_order": "CUmemcpySrcAccessOrder",
    "kcu_proc_status": "CUdriverProcAddressQueryResult", "kcu_array": "CUarray", "kcu_uuid": "CUuuid",
    "kcu_ipc_mem_handle": "CUipcMemHandle", "kcu_fabric_handle": "CUmemFabricHandle",
    "kcu_allocation_prop": "CUmemAllocationProp", "kcu_access_desc": "CUmemAccessDesc",
    "kcu_memcpy2d": "CUDA_MEMCPY2D", "kcu_memcpy_attributes": "CUmemcpyAttributes",
}

#: kcu struct -> (cuda.h struct, [(our field, theirs)]).
STRUCTS = {
    "kcu_uuid": ("CUuuid", [("bytes", "bytes")]),
    "kcu_ipc_mem_handle": ("CUipcMemHandle", [("reserved", "reserved")]),
    "kcu_fabric_handle": ("CUmemFabricHandle", [("data", "data")]),
    "kcu_mem_location": ("CUmemLocation", [("type", "type"), ("id", "id")]),
    "kcu_allocation_prop": ("CUmemAllocationProp", [
        ("type", "type"), ("requested_handle_types", "requestedHandleTypes"), ("location", "location"),
        ("win32_handle_meta_data", "win32HandleMetaData"), ("alloc_flags", "allocFlags"),
        ("alloc_flags.compression_type", "allocFlags.compressionType"),
        ("alloc_flags.gpu_direct_rdma_capable", "allocFlags.gpuDirectRDMACapable"),
        ("alloc_flags.usage", "allocFlags.usage")]),
    "kcu_access_desc": ("CUmemAccessDesc", [("location", "location"), ("flags", "flags")]),
    "kcu_memcpy2d": ("CUDA_MEMCPY2D", [
        ("src_x_in_bytes", "srcXInBytes"), ("src_y", "srcY"), ("src_memory_type", "srcMemoryType"),
        ("src_host", "srcHost"), ("src_device", "srcDevice"), ("src_array", "srcArray"), ("src_pitch", "srcPitch"),
        ("dst_x_in_bytes", "dstXInBytes"), ("dst_y", "dstY"), ("dst_memory_type", "dstMemoryType"),
        ("dst_host", "dstHost"), ("dst_device", "dstDevice"), ("dst_array", "dstArray"), ("dst_pitch", "dstPitch"),
        ("width_in_bytes", "WidthInBytes"), ("height", "Height")]),
    "kcu_memcpy_attributes": ("CUmemcpyAttributes", [
        ("src_access_order", "srcAccessOrder"), ("src_loc_hint", "srcLocHint"), ("dst_loc_hint", "dstLocHint"),
        ("flags", "flags")]),
}

#: KCU_ constant -> the cuda.h name of its value, where it is not KCU_X -> CU_X (CUDA_ERROR_X).
CONSTANT_NAMES = {"KCU_SUCCESS": "CUDA_SUCCESS", "KCU_IPC_HANDLE_SIZE": "CU_IPC_HANDLE_SIZE"}

_CALL = re.compile(r"X\((\w+),\s*(\d+),\s*\d,\s*\((.*?)\)\)", re.S)
_PFN = re.compile(r"\*PFN_(\w+?)_v(\d+)\)")


def cuda_include() -> Path | None:
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(map(str, Path("/usr/local").glob("cuda-*")))]
    for root in roots:
        if root and (Path(root) / "include" / "cuda.h").is_file() and (Path(root) / "include" / "cudaTypedefs.h").is_file():
            return Path(root) / "include"
    return None


INCLUDE = cuda_include()
needs_cuda_h = pytest.mark.skipif(INCLUDE is None or shutil.which("cc") is None,
                                  reason="no CUDA toolkit headers here (cuda.h): the driver ABI is checked where they are")


def _cuda_name(kcu: str) -> str:
    if kcu in CONSTANT_NAMES:
        return CONSTANT_NAMES[kcu]
    return "CUDA" + kcu[3:] if kcu.startswith("KCU_ERROR_") else "CU" + kcu[3:]


def calls(header: str) -> list[tuple[str, str, str]]:
    """(name, version, parameters) of each entry of KCU_CALLS."""
    found: list[tuple[str, str, str]] = _CALL.findall(header.replace("\\\n", " "))
    return found


def check_source(header: str, typedefs: str) -> str:
    """The C that holds ``header`` (kvs_cuda_driver.h's text) to cuda.h."""
    pfns: dict[str, list[int]] = {}
    for name, version in _PFN.findall(typedefs):
        pfns.setdefault(name, []).append(int(version))
    lines = ["#include <stddef.h>", "#include <cuda.h>", "#include <cudaTypedefs.h>", '#include "kvs_cuda_driver.h"',
             "#define SAME(a, b, what) _Static_assert(__builtin_types_compatible_p(a, b), what)",
             "#define EQ(a, b, what) _Static_assert((a) == (b), what)"]
    for kcu, cu in TYPES.items():
        lines.append(f'EQ(sizeof({kcu}), sizeof({cu}), "size of {kcu} is not that of {cu}");')
    for kcu, (cu, fields) in STRUCTS.items():
        for ours, theirs in fields:
            lines.append(f'EQ(offsetof({kcu}, {ours}), offsetof({cu}, {theirs}), "{kcu}.{ours} is not at {cu}.{theirs}");')
    for name in re.findall(r"#define (KCU_\w+) ", header):
        lines.append(f'EQ({name}, {_cuda_name(name)}, "{name} is not {_cuda_name(name)}");')
    for name, version, params in calls(header):
        known = [v for v in pfns.get(name, []) if v <= int(version)]
        assert known, f"cuda.h has no PFN_{name} at or below version {version}"
        theirs = " ".join(params.split())
        for kcu, cu in sorted(TYPES.items(), key=lambda kv: -len(kv[0])):
            theirs = re.sub(rf"\b{kcu}\b", cu, theirs)
        lines.append(f"typedef CUresult (*check_{name})({theirs});")
        lines.append(f'SAME(check_{name}, PFN_{name}_v{max(known)}, "{name} is not PFN_{name}_v{max(known)}");')
    for kcu, cu in (("kcu_pfn_cuInit", "PFN_cuInit_v2000"), ("kcu_pfn_cuGetProcAddress", "PFN_cuGetProcAddress_v12000")):
        lines.append(f'EQ(sizeof({kcu}), sizeof({cu}), "{kcu}");')
    lines.append('SAME(CUresult, unsigned int, "CUresult is not unsigned int (kcu_result)");')
    return "\n".join(lines) + "\n"


def compile_check(tmp: Path, header: str) -> subprocess.CompletedProcess[str]:
    assert INCLUDE is not None
    (tmp / "kvs_cuda_driver.h").write_text(header, encoding="utf-8")
    src = tmp / "abi.c"
    src.write_text(check_source(header, (INCLUDE / "cudaTypedefs.h").read_text(encoding="utf-8")), encoding="utf-8")
    return subprocess.run(["cc", "-std=gnu11", "-fsyntax-only", f"-I{tmp}", f"-I{INCLUDE}", str(src)],
                          capture_output=True, text=True, timeout=60)


@needs_cuda_h
def test_the_driver_declarations_are_cuda_h_s(tmp_path: Path) -> None:
    out = compile_check(tmp_path, HEADER.read_text(encoding="utf-8"))
    assert out.returncode == 0, out.stderr[-4000:]
    checked = (tmp_path / "abi.c").read_text()
    assert checked.count("SAME(check_") == len(calls(HEADER.read_text())) == HEADER.read_text().count("    X(") >= 35


@needs_cuda_h
@pytest.mark.parametrize(("old", "new", "named"), [
    ("X(cuMemAlloc, 12000, 1, (kcu_deviceptr *dptr, size_t size))",
     "X(cuMemAlloc, 12000, 1, (kcu_deviceptr *dptr, unsigned int size))", "cuMemAlloc is not PFN_cuMemAlloc"),
    ("    kcu_handle_type requested_handle_types;\n    kcu_allocation_type type;",
     "    kcu_allocation_type type;\n    kcu_handle_type requested_handle_types;", None),
    ("#define KCU_ERROR_NOT_READY 600u", "#define KCU_ERROR_NOT_READY 601u", "KCU_ERROR_NOT_READY is not"),
])
def test_a_planted_mismatch_fails_to_compile(tmp_path: Path, old: str, new: str, named: str | None) -> None:
    header = HEADER.read_text(encoding="utf-8")
    if named is None:  # swap two fields: planted the other way round
        old, new = new, old
    assert header.count(old) == 1, old
    out = compile_check(tmp_path, header.replace(old, new))
    assert out.returncode != 0
    assert (named or "kcu_allocation_prop.") in out.stderr, out.stderr[-2000:]
