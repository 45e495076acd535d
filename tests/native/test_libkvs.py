"""The typed face of the cffi module (kvstate/transport/libkvs.py) against the compiled module,
and the cffi declarations against ffi/kvs.h, which is their one source.

kvs.h -> ffi/build_host.py derives cffi's declarations -> the compiled module <-> libkvs.Lib,
checked here name by name and parameter by parameter; each check is shown to catch a
planted mismatch.
"""

from __future__ import annotations

import importlib.util
import typing
from pathlib import Path
from typing import Any, Protocol

import pytest

from kvstate.transport import libkvs
from kvstate.transport.libkvs import Lib

FFI_DIR = Path(__file__).resolve().parents[2] / "ffi"

#: How each C type of kvs.h is written in libkvs: integers of every width are ``int``.
_C_TO_PY: dict[str, Any] = {
    **dict.fromkeys(("uint64_t", "int64_t", "uint32_t", "int32_t", "int"), int),
    "void": type(None),
    "char *": libkvs.CharPtr,
    "uint64_t *": libkvs.UInt64Ptr,
    "int32_t *": libkvs.Int32Ptr,
    "int64_t *": libkvs.Int64Ptr,
    "struct kvs_endpoint *": libkvs.EndpointPtr,
    "struct kvs_block *": libkvs.BlockArray,
    "struct kvs_region_info *": libkvs.RegionInfoPtr,
    "struct kvs_global_info *": libkvs.GlobalInfoPtr,
    "struct kvs_op_info *": libkvs.OpInfoPtr,
    "struct kvs_cuda_driver_info *": libkvs.CudaDriverInfoPtr,
    "struct kvs_cuda_device_info *": libkvs.CudaDeviceInfoPtr,
    "struct kvs_machine_inst *": libkvs.MachineInstPtr,
    "struct kvs_fire_result *": libkvs.FireResultPtr,
    "int32_t(*)(void *, int32_t, int32_t)": libkvs.EffectFn,
    "void *": libkvs.VoidPtr,
    "uint8_t *": bytes,  # a request's payload: cffi passes bytes as they are
    "struct kvs_link *": libkvs.LinkPtr,
    "struct kvs_frame *": libkvs.FramePtr,
    "struct kvs_renewer *": libkvs.RenewerPtr,
    "struct kvs_renew_outcome *": libkvs.RenewOutcomePtr,
    "struct kvs_renew_state *": libkvs.RenewStatePtr,
    "struct kvs_lease_server *": libkvs.LeaseServerPtr,
    "struct kvs_lease_server * *": libkvs.LeaseServerOut,
    "uint32_t *": libkvs.UInt32Ptr,
    "struct kvs_lease_info *": libkvs.LeaseInfoArray,
    "struct kvs_hold_info *": libkvs.HoldInfoArray,
    "struct kvs_lease_event *": libkvs.LeaseEventPtr,
    "struct kvs_attach_part *": libkvs.AttachPartArray,
    "struct kvs_import_part *": libkvs.ImportPartArray,
    "struct kvs_vfacts *": libkvs.VFactsArray,
    "struct kvs_vexpect *": libkvs.VExpectArray,
    "struct kvs_index *": libkvs.IndexPtr,
    "struct kvs_index * *": libkvs.IndexOut,
}
_STRUCTS = {"kvs_region_info": libkvs.RegionInfoPtr, "kvs_global_info": libkvs.GlobalInfoPtr,
            "kvs_op_info": libkvs.OpInfoPtr, "kvs_cuda_driver_info": libkvs.CudaDriverInfoPtr,
            "kvs_cuda_device_info": libkvs.CudaDeviceInfoPtr, "kvs_machine_inst": libkvs.MachineInstPtr,
            "kvs_fire_result": libkvs.FireResultPtr, "kvs_frame": libkvs.FramePtr,
            "kvs_renew_outcome": libkvs.RenewOutcomePtr, "kvs_renew_state": libkvs.RenewStatePtr,
            "kvs_lease_info": libkvs.LeaseInfo, "kvs_hold_info": libkvs.HoldInfo,
            "kvs_attach_part": libkvs.AttachPart,
            "kvs_import_part": libkvs.ImportPart,
            "kvs_lease_event": libkvs.LeaseEventPtr}


def _builder() -> Any:
    spec = importlib.util.spec_from_file_location("_kvs_build_host", FFI_DIR / "build_host.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mismatches(proto: type, ffi: Any, lib: Any) -> list[str]:
    """Every way ``proto`` (a Lib Protocol) and the compiled module disagree."""
    found: list[str] = []
    constants = {n for n in typing.get_type_hints(proto) if n.startswith("KVS_")}
    functions = {n for n in dir(proto) if n.startswith("kvs_")}
    built = {n for n in dir(lib) if n.startswith(("kvs_", "KVS_"))}
    found += [f"{n}: in the module, not declared" for n in sorted(built - constants - functions)]
    found += [f"{n}: declared, not in the module" for n in sorted((constants | functions) - built)]
    for n in sorted(constants & built):
        if typing.get_type_hints(proto)[n] is not int or not isinstance(getattr(lib, n), int):
            found.append(f"{n}: not an int constant")
    for n in sorted(functions & built):
        ctype = ffi.typeof(getattr(lib, n))
        hints = typing.get_type_hints(getattr(proto, n))
        result = hints.pop("return")
        params = list(hints.values())
        want = [_C_TO_PY.get(a.cname) for a in ctype.args]
        if params != want:
            found.append(f"{n}: parameters {params}, C says {[a.cname for a in ctype.args]}")
        if result is not _C_TO_PY.get(ctype.result.cname):
            found.append(f"{n}: result {result}, C says {ctype.result.cname}")
    for struct, declared in _STRUCTS.items():
        c_fields = {name for name, _ in ffi.typeof(struct).fields}
        py_fields = set(typing.get_type_hints(declared))
        if c_fields != py_fields:
            found.append(f"{struct}: fields {sorted(py_fields)}, C says {sorted(c_fields)}")
    return found


@pytest.fixture(scope="module")
def module() -> tuple[Any, Any]:
    return libkvs.load()


def test_lib_protocol_is_the_compiled_module(module: tuple[Any, Any]) -> None:
    ffi, lib = module
    assert mismatches(Lib, ffi, lib) == []


def test_the_check_catches_a_planted_mismatch(module: tuple[Any, Any]) -> None:
    ffi, lib = module

    class Planted(Lib, Protocol):
        KVS_E_GONE: int

        def kvs_unmap(self, region: libkvs.UInt64Ptr) -> int: ...  # C takes uint64_t

        def kvs_page_size(self) -> None: ...  # C returns uint64_t

    found = mismatches(Planted, ffi, lib)
    assert any(m.startswith("kvs_unmap: parameters") for m in found), found
    assert any(m.startswith("kvs_page_size: result") for m in found), found
    assert "KVS_E_GONE: declared, not in the module" in found, found


def test_cffi_declarations_are_derived_from_the_header() -> None:
    """One source: every declaration of kvs.h reaches cffi, and each #define keeps its name
    with the value left to the compiler (API mode checks the rest against the header)."""
    build = _builder()
    header = (FFI_DIR / "kvs.h").read_text(encoding="utf-8")
    cdef = build.cdef_from_header(header)
    assert cdef == build.CDEF
    for line in header.splitlines():
        if line.startswith("#define KVS_") and not line.startswith("#define KVS_H"):
            assert f"#define {line.split()[1]} ...\n" in cdef, line
        if line.startswith(("int ", "int32_t ", "uint64_t ", "void ", "const char *")) and "(" in line:
            name = line.split("(")[0].split()[-1].lstrip("*")
            assert f"{name}(" in cdef, name
    assert "/*" not in cdef and "#include" not in cdef and "#ifndef" not in cdef


@pytest.mark.parametrize("line", ["#define KVS_TWICE(x) ((x) * 2)", "#if KVS_X", "#define KVS_EMPTY"])
def test_header_lines_cffi_cannot_read_are_refused(line: str) -> None:
    build = _builder()
    header = (FFI_DIR / "kvs.h").read_text(encoding="utf-8").replace("#endif /* KVS_H */", f"{line}\n#endif")
    with pytest.raises(ValueError, match="cannot declare"):
        build.cdef_from_header(header)
