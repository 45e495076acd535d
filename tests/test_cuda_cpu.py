"""The cuda backend without a GPU: everything it decides without the driver.

Real cuda-python (cuda-bindings, a test dependency) builds the driver structs here; no
driver is needed for that. The GPU suite is ``tests/cuda`` and skips loudly without one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstate.core import errors
from kvstate.core.errors import BackendUnavailable, HandleFdsMismatch, HandleRefused, HandleWrongSize, OutOfRange
from kvstate.core.handles import HANDLE_BYTES, HandleKind
from kvstate.core.capabilities import FabricTrial
from kvstate.transport.cuda import rules
from kvstate.core.capabilities import Access

driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is a test dependency; install .[test]")


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


# -- handle bytes and shapes ---------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(rules.CUDA_KINDS, key=lambda k: k.value))
def test_received_handle_must_have_its_kinds_exact_size_and_fd_count(kind: HandleKind) -> None:
    exact = HANDLE_BYTES[kind]
    assert exact is not None
    fds = 1 if kind is HandleKind.POSIX_FD else 0
    rules.check_received(kind, bytes(exact), fds)
    for n in (0, exact - 1, exact + 1, 2 * exact):
        with pytest.raises(HandleWrongSize):
            rules.check_received(kind, bytes(n), fds)
    for wrong in {0, 1, 2} - {fds}:
        with pytest.raises(HandleFdsMismatch):
            rules.check_received(kind, bytes(exact), wrong)


def test_fabric_and_ipc_handles_are_exactly_64_bytes_and_posix_handles_are_fd_identities() -> None:
    assert HANDLE_BYTES[HandleKind.FABRIC] == HANDLE_BYTES[HandleKind.CUDA_IPC] == 64
    assert HANDLE_BYTES[HandleKind.POSIX_FD] == 16


@pytest.mark.parametrize("kind", [HandleKind.MEMFD, HandleKind.NIXL])
def test_other_backends_kinds_are_refused(kind: HandleKind) -> None:
    with pytest.raises(HandleRefused):
        rules.check_received(kind, bytes(16), 1)


@pytest.mark.parametrize("cls", ["CUmemFabricHandle", "CUipcMemHandle"])
def test_handle_bytes_round_trip_through_real_driver_structs(cls: str) -> None:
    from kvstate.transport.cuda.driver import struct_bytes as _struct_bytes, struct_from as _struct_from

    data = os.urandom(64)
    obj = _struct_from(getattr(driver, cls), data)
    assert _struct_bytes(obj, 64) == data
    assert ctypes.string_at(int(obj.getPtr()), 64) == data


# -- struct building -----------------------------------------------------------------------


def test_allocation_prop_fields_as_the_driver_reads_them() -> None:
    """CUmemAllocationProp begins {type, requestedHandleTypes, location{type, id}} (cuda.h)."""
    from kvstate.transport.cuda.driver import allocation_prop

    for kind, handle_type in ((HandleKind.POSIX_FD, 1), (HandleKind.FABRIC, 8)):
        prop = allocation_prop(driver, rules.allocation_fields(3, [kind]))
        assert int(prop.type) == int(driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED)
        assert int(prop.location.type) == int(driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE)
        assert prop.location.id == 3
        assert int(prop.requestedHandleTypes) == handle_type
        raw = ctypes.string_at(int(prop.getPtr()), 16)
        assert [int.from_bytes(raw[i:i + 4], "little") for i in range(0, 16, 4)] == [1, handle_type, 1, 3]


@pytest.mark.parametrize("access,flags", [(Access.READ, 1), (Access.READ_WRITE, 3)])
def test_access_desc_fields(access: Access, flags: int) -> None:
    from kvstate.transport.cuda.driver import access_desc

    desc = access_desc(driver, 5, access)
    assert int(desc.flags) == flags == rules.access_flags(access)
    assert int(desc.location.type) == rules.CU_MEM_LOCATION_TYPE_DEVICE and desc.location.id == 5


def test_legacy_ipc_is_not_a_vmm_handle_type_and_ordinals_are_checked() -> None:
    with pytest.raises(HandleRefused):
        rules.vmm_handle_type(HandleKind.CUDA_IPC)
    with pytest.raises(errors.CudaDeviceNotFound):
        rules.allocation_fields(-1, [HandleKind.POSIX_FD])


def test_abi_constants_match_cuda_python() -> None:
    """The driver-free module's numbers are cuda.h's, as cuda-python spells them."""
    r = driver.CUresult
    for name in [n for n in dir(rules) if n == "CUDA_SUCCESS" or n.startswith("CUDA_ERROR_")]:
        assert int(getattr(r, name)) == getattr(rules, name), name
    assert rules.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == int(
        driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    assert rules.CU_MEM_HANDLE_TYPE_FABRIC == int(driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
    assert rules.CU_MEM_ACCESS_FLAGS_PROT_READWRITE == int(driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    assert rules.CU_MEM_ACCESS_FLAGS_PROT_READ == int(driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
    assert rules.CU_MEM_ALLOCATION_TYPE_PINNED == int(driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED)
    assert rules.CU_MEM_LOCATION_TYPE_DEVICE == int(driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE)


# -- FABRIC trial decision table -----------------------------------------------------------

RESULTS = (None, rules.CUDA_SUCCESS, rules.CUDA_ERROR_NOT_SUPPORTED, rules.CUDA_ERROR_NOT_PERMITTED)


def fabric_table_violations(decide: object) -> list[str]:
    """Every input of the decision table where ``decide`` breaks the rule: PASSED exactly
    when requested and the trial export *and* import both returned CUDA_SUCCESS (the
    device attribute alone never suffices); NOT_RUN exactly when not requested."""
    bad = []
    for requested, attribute, exp, imp in itertools.product((False, True), (False, True), RESULTS, RESULTS):
        got = decide(requested=requested, attribute=attribute, export_result=exp,  # type: ignore[operator]
                     import_result=imp).trial
        want = (FabricTrial.NOT_RUN if not requested else
                FabricTrial.PASSED if attribute and exp == 0 and imp == 0 else FabricTrial.FAILED)
        if got is not want:
            bad.append(f"{requested=} {attribute=} {exp=} {imp=}: {got} (want {want})")
    return bad


def test_fabric_passes_only_after_a_successful_trial_export_and_import() -> None:
    assert fabric_table_violations(rules.fabric_decision) == []
    d = rules.fabric_decision(requested=True, attribute=True, export_result=0, import_result=801)
    assert d.trial is FabricTrial.FAILED and "801" in d.why


def test_planted_attribute_only_fabric_decision_is_caught() -> None:
    """Planted bug: trusting the device attribute without the trial must be caught."""
    def trusts_attribute(*, requested: bool, attribute: bool, export_result: int | None,
                         import_result: int | None) -> rules.FabricDecision:
        if not requested:
            return rules.FabricDecision(FabricTrial.NOT_RUN, "")
        return rules.FabricDecision(FabricTrial.PASSED if attribute else FabricTrial.FAILED, "")

    assert fabric_table_violations(trusts_attribute)


# -- CUDA errors -> kvstate errors ---------------------------------------------------------

@pytest.mark.parametrize("code,cls", [
    (rules.CUDA_ERROR_INVALID_VALUE, errors.CudaInvalidArgument),
    (rules.CUDA_ERROR_INVALID_HANDLE, errors.CudaInvalidArgument),
    (rules.CUDA_ERROR_OUT_OF_MEMORY, errors.CudaOutOfMemory),
    (rules.CUDA_ERROR_NOT_SUPPORTED, errors.CudaNotSupported),
    (rules.CUDA_ERROR_NOT_PERMITTED, errors.CudaNotPermitted),
    (rules.CUDA_ERROR_INVALID_CONTEXT, errors.CudaContextError),
    (rules.CUDA_ERROR_NOT_INITIALIZED, errors.CudaContextError),
    (rules.CUDA_ERROR_ILLEGAL_ADDRESS, errors.CudaDeviceFault),
    (999, errors.CudaError),
])
def test_cuda_results_become_typed_kvstate_errors(code: int, cls: type[errors.CudaError]) -> None:
    name = driver.CUresult(code).name
    err = rules.cuda_error("cuMemMap", code, name, "at 0x1000")
    assert type(err) is cls and isinstance(err, errors.KvStateError)
    assert (err.call, err.result, err.name) == ("cuMemMap", code, name)
    assert name in str(err) and "at 0x1000" in str(err)


def test_success_is_not_an_error() -> None:
    with pytest.raises(ValueError):
        rules.cuda_error("cuInit", 0)


# -- gather coalescing ---------------------------------------------------------------------

def test_coalesce_merges_runs_contiguous_on_both_sides_only() -> None:
    assert rules.coalesce([(0, 0, 4), (4, 4, 4), (8, 16, 4), (12, 20, 4), (100, 24, 4)], 128, 64) == [
        (0, 0, 8), (8, 16, 8), (100, 24, 4)]
    for bad in [(-1, 0, 4), (0, -1, 4), (0, 0, 0), (125, 0, 4), (0, 61, 4)]:
        with pytest.raises(OutOfRange):
            rules.coalesce([bad], 128, 64)


@given(st.lists(st.tuples(st.integers(0, 15), st.integers(1, 4)), min_size=1, max_size=20))
def test_coalesced_gather_copies_the_same_bytes(spec: list[tuple[int, int]]) -> None:
    """Applying the merged runs moves exactly the bytes the block list moves."""
    src = bytes(range(256)) * 1
    blocks, pos = [], 0
    for start, n in spec:
        blocks.append((start * 8, pos, n * 4))
        pos += n * 4
    want, got = bytearray(pos), bytearray(pos)
    for s, d, n in blocks:
        want[d:d + n] = src[s:s + n]
    runs = rules.coalesce(blocks, len(src), pos)
    for s, d, n in runs:
        got[d:d + n] = src[s:s + n]
    assert got == want and len(runs) <= len(blocks)


@given(st.lists(st.tuples(st.integers(0, 15), st.integers(1, 4)), min_size=1, max_size=20),
       st.sampled_from([16, 64, 1 << 20]))
def test_copy_plan_moves_the_same_bytes_without_overlapping_rows(spec: list[tuple[int, int]], max_pitch: int) -> None:
    runs, pos = [], 0
    for start, n in spec:
        runs.append((start * 8, pos, n * 4))
        pos += n * 4
    plan = rules.plan_copies(runs, max_pitch)
    assert [r for c in plan for r in c.rows()] == runs
    assert all(c.height == 1 or c.width <= min(c.src_pitch, c.dst_pitch) <= max(c.src_pitch, c.dst_pitch)
               <= max_pitch for c in plan)


def test_a_layer_major_gather_is_one_2d_copy_per_block() -> None:
    from kvstate.core.geometry import DType, Geometry, Layout

    g = Geometry.uniform(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype=DType.BF16,
                 layout=Layout.LAYER_MAJOR, num_blocks=64)
    blocks, pos = [], 0
    for b in (3, 9, 10):
        for off, n in g.block_extents(b):
            blocks.append((off, pos, n))
            pos += n
    plan = rules.plan_copies(rules.coalesce(blocks, g.nbytes, pos))
    layer_block = g.regions[0].block_bytes
    assert [(c.height, c.width, c.src_pitch, c.dst_pitch) for c in plan] == [
        (32, layer_block, 64 * layer_block, layer_block)] * 3


# -- device UUIDs ---------------------------------------------------------------------------

def test_device_uuid_text_round_trip() -> None:
    u = bytes(range(16))
    text = rules.format_uuid(u)
    assert text == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert rules.parse_uuid(text) == rules.parse_uuid(text.upper().replace("GPU-", "MIG-")) == u
    for bad in ("0", "GPU-0001", b"\0" * 15):
        with pytest.raises(errors.CudaDeviceNotFound):
            rules.parse_uuid(bad)


# -- optional dependency discipline ----------------------------------------------------------

def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


@pytest.mark.native
@pytest.mark.multiproc
def test_importing_the_cuda_backend_module_loads_no_cuda() -> None:
    out = _run("""
        import sys
        import kvstate.transport.cuda.transport, kvstate.transport.cuda.rules
        print(sorted(m for m in sys.modules if m.split('.')[0] == 'cuda'))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.native
@pytest.mark.multiproc
def test_without_cuda_python_the_backend_is_unavailable() -> None:
    """cuda-python absent: ``sys.modules['cuda'] = None`` is Python's own way to make an
    import fail with ModuleNotFoundError(name='cuda'), as on a machine without it."""
    out = _run("""
        import sys
        sys.modules['cuda'] = None
        from kvstate.core.errors import BackendUnavailable
        from kvstate.transport.cuda import CudaTransport
        try:
            CudaTransport(bytes(16))
        except BackendUnavailable as e:
            print('UNAVAILABLE', e.backend, e.why)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("UNAVAILABLE cuda cuda.bindings.driver is not installed")


@pytest.mark.native
@pytest.mark.multiproc
def test_other_import_errors_of_cuda_python_propagate() -> None:
    """A broken cuda-python (a module it needs is missing) is a bug, not an absent backend."""
    out = _run("""
        import importlib.abc, sys
        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == 'cuda.bindings.driver':
                    raise ModuleNotFoundError("No module named 'cuda_bindings_internal'",
                                              name='cuda_bindings_internal')
        sys.meta_path.insert(0, Broken())
        from kvstate.core.errors import BackendUnavailable
        from kvstate.transport.cuda.driver import load_driver
        try:
            load_driver()
        except BackendUnavailable:
            print('WRONGLY UNAVAILABLE')
        except ModuleNotFoundError as e:
            print('PROPAGATED', e.name)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "PROPAGATED cuda_bindings_internal"


@pytest.mark.skipif(_driver_present(), reason="a CUDA driver is installed here: the no-driver path is not reachable")
def test_with_cuda_python_but_no_driver_cuinit_makes_the_backend_unavailable() -> None:
    """Real cuda-python, no libcuda: cuInit raises cuda.pathfinder's DynamicLibNotFoundError."""
    from cuda.pathfinder import DynamicLibNotFoundError

    from kvstate.transport.cuda import CudaTransport, load_driver, visible_devices

    with pytest.raises(DynamicLibNotFoundError):
        driver.cuInit(0)
    for attempt in (load_driver, visible_devices, lambda: CudaTransport(bytes(16))):
        with pytest.raises(BackendUnavailable) as info:
            attempt()
        assert info.value.backend == "cuda" and "no CUDA driver library" in info.value.why
        assert isinstance(info.value.__cause__, DynamicLibNotFoundError)


def test_bad_constructor_arguments_are_refused_before_the_driver_is_touched() -> None:
    from kvstate.transport.cuda import CudaTransport

    with pytest.raises(errors.CudaDeviceNotFound):
        CudaTransport("GPU-not-a-uuid")
    with pytest.raises(errors.LegacyIpcRefused):
        CudaTransport(bytes(16), kind=HandleKind.CUDA_IPC)
    with pytest.raises(HandleRefused):
        CudaTransport(bytes(16), kind=HandleKind.MEMFD)


# -- one interface --------------------------------------------------------------------------

def test_cuda_and_host_transports_offer_the_same_operations_with_the_same_parameters() -> None:
    """Both implement every member of MappedTransport (mypy checks the types: each backend
    module assigns itself to the protocol), with the same parameters."""
    import inspect

    from kvstate.transport.protocol import MappedTransport
    from kvstate.transport.cuda import CudaTransport
    from kvstate.transport.host import HostTransport

    members = [n for n in dir(MappedTransport) if not n.startswith("_")]
    assert {"free", "stats", "pin", "unpin", "receive_handle", "submit_gather", "unmap"} <= set(members)
    for n in members:
        h, c = getattr(HostTransport, n), getattr(CudaTransport, n)
        if callable(h):
            assert len(inspect.signature(h).parameters) == len(inspect.signature(c).parameters), n
        else:
            assert isinstance(c, type(h)), n


def test_only_host_memory_has_a_host_view() -> None:
    """Bank.view() needs HostView; device memory has none (TransportUnsuitable)."""
    from kvstate.transport.protocol import HostView
    from kvstate.transport.cuda import CudaTransport
    from kvstate.transport.host import HostTransport

    assert issubclass(HostTransport, HostView) and not issubclass(CudaTransport, HostView)


# -- the host backend's side of the generalised hand-off ------------------------------------

def test_host_receive_handle_checks_kind_and_fd_count() -> None:
    from kvstate.transport.host import HandleKindUnsupported, HostHandle, HostTransport

    t = HostTransport(granularity=64 * 1024)
    assert t.receive_handle(HandleKind.MEMFD, b"x" * 16, [7]) == HostHandle(7, b"x" * 16)
    with pytest.raises(HandleKindUnsupported):
        t.receive_handle(HandleKind.POSIX_FD, b"x" * 16, [7])
    for fds in ([], [7, 8]):
        with pytest.raises(HandleFdsMismatch):
            t.receive_handle(HandleKind.MEMFD, b"x" * 16, fds)


# -- the GPU suite and the GPU check skip loudly here ------------------------------------------

@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.skipif(_driver_present(), reason="a CUDA driver is installed here: the GPU suite really runs")
def test_gpu_suite_and_check_skip_loudly_never_pass_without_a_gpu() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                            os.path.join(root, "tests", "cuda")], capture_output=True, text=True, timeout=120,
                           cwd=root)
    assert suite.returncode == 0, suite.stdout + suite.stderr
    summary = suite.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    assert "NO GPU: the GPU suite did not run" in suite.stdout
    check = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu_check.py")],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 2 and check.stdout == ""
    assert check.stderr.startswith("GPU CHECK NOT RUN: transport backend 'cuda' is unavailable")
