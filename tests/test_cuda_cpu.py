"""The cuda backend without a GPU and without a driver: what it decides on its own, and
how it refuses when the driver is absent.

The backend's driver calls run in CI against the shim driver (``tests/cudashim``); the
GPU suite is ``tests/cuda`` and skips loudly without a GPU. cuda-python (cuda-bindings, a
test dependency only) supplies the driver's own enum values to check kvstate's against.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import subprocess
import sys
import textwrap

import pytest

from support.errors import raises

from kvstate.core.reasons import NativeReason
from kvstate.core.errors import ArgumentInvalid, BackendUnavailable, ImportFailed
from kvstate.core import errors
from kvstate.core.reasons import ArgumentReason, BackendReason, ImportReason, ImportDefect
from kvstate.core.capabilities import FabricTrial
from kvstate.core.handles import HANDLE_BYTES, HandleKind
from kvstate.transport.cuda import rules

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
        with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.SIZE):
            rules.check_received(kind, bytes(n), fds)
    for wrong in {0, 1, 2} - {fds}:
        with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FDS):
            rules.check_received(kind, bytes(exact), wrong)


def test_fabric_and_ipc_handles_are_exactly_64_bytes_and_posix_handles_are_fd_identities() -> None:
    assert HANDLE_BYTES[HandleKind.FABRIC] == HANDLE_BYTES[HandleKind.CUDA_IPC] == 64
    assert HANDLE_BYTES[HandleKind.POSIX_FD] == 16


@pytest.mark.parametrize("kind", [HandleKind.MEMFD, HandleKind.NIXL])
def test_other_backends_kinds_are_refused(kind: HandleKind) -> None:
    with raises(ImportFailed, ImportReason.HANDLE):
        rules.check_received(kind, bytes(16), 1)


def test_abi_constants_match_cuda_python() -> None:
    """The driver-free module's CUresults, and the handle types the C layer passes to the
    driver, are cuda.h's as cuda-python spells them (tests/native/test_cuda_abi.py checks
    the C declarations against cuda.h itself where one is installed)."""
    from kvstate.transport.native import default

    r = driver.CUresult
    for name in [n for n in dir(rules) if n == "CUDA_SUCCESS" or n.startswith("CUDA_ERROR_")]:
        assert int(getattr(r, name)) == getattr(rules, name), name
    lib = default().lib
    types = driver.CUmemAllocationHandleType
    assert lib.KVS_CUDA_POSIX_FD == int(types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    assert lib.KVS_CUDA_FABRIC == int(types.CU_MEM_HANDLE_TYPE_FABRIC)
    assert lib.KVS_CUDA_HANDLE_BYTES == HANDLE_BYTES[HandleKind.CUDA_IPC] == 64


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

@pytest.mark.parametrize("code,reason", [
    (rules.CUDA_ERROR_INVALID_VALUE, NativeReason.CUDA_INVALID),
    (rules.CUDA_ERROR_INVALID_HANDLE, NativeReason.CUDA_INVALID),
    (rules.CUDA_ERROR_OUT_OF_MEMORY, NativeReason.CUDA_MEMORY),
    (rules.CUDA_ERROR_NOT_SUPPORTED, NativeReason.CUDA_UNSUPPORTED),
    (rules.CUDA_ERROR_NOT_PERMITTED, NativeReason.CUDA_NOT_PERMITTED),
    (rules.CUDA_ERROR_INVALID_CONTEXT, NativeReason.CUDA_CONTEXT),
    (rules.CUDA_ERROR_NOT_INITIALIZED, NativeReason.CUDA_CONTEXT),
    (rules.CUDA_ERROR_ILLEGAL_ADDRESS, NativeReason.CUDA_FAULT),
    (999, NativeReason.CUDA),
])
def test_cuda_results_become_typed_kvstate_errors(code: int, reason: NativeReason) -> None:
    name = driver.CUresult(code).name
    err = rules.cuda_error("cuMemMap", code, name, "at 0x1000")
    assert type(err) is errors.NativeError and err.reason is reason
    assert (err.call, err.result, err.name) == ("cuMemMap", code, name)
    assert name in str(err) and "at 0x1000" in str(err)


def test_success_is_not_an_error() -> None:
    with pytest.raises(ValueError):
        rules.cuda_error("cuInit", 0)


# -- device UUIDs ---------------------------------------------------------------------------

def test_device_uuid_text_round_trip() -> None:
    u = bytes(range(16))
    text = rules.format_uuid(u)
    assert text == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert rules.parse_uuid(text) == rules.parse_uuid(text.upper().replace("GPU-", "MIG-")) == u
    for bad, reason in (("0", ArgumentReason.ENCODING), ("GPU-0001", ArgumentReason.ENCODING),
                        (b"\0" * 15, ArgumentReason.LENGTH)):
        with raises(ArgumentInvalid, reason):
            rules.parse_uuid(bad)


# -- no driver --------------------------------------------------------------------------------

def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVSTATE_")} | env
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env=full)


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.native
@pytest.mark.multiproc
def test_importing_the_cuda_backend_loads_neither_native_code_nor_cuda() -> None:
    out = _run("""
        import sys
        import kvstate.transport.cuda, kvstate.transport.cuda.transport, kvstate.transport.cuda.rules
        print(sorted(m for m in sys.modules if m.split('.')[0] == 'cuda' or m == 'kvstate._native'))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


UNAVAILABLE = """
    import json
    from kvstate.core.errors import BackendUnavailable, ImportFailed
    from kvstate.transport.cuda import CudaTransport, load_driver, visible_devices
    whys = []
    for attempt in (load_driver, visible_devices, lambda: CudaTransport(bytes(16))):
        try:
            attempt()
        except BackendUnavailable as e:
            whys.append([e.backend, e.detail])
    print(json.dumps(whys))
"""


@pytest.mark.native
@pytest.mark.multiproc
def test_without_the_driver_library_the_backend_is_unavailable() -> None:
    """The module builds and imports without CUDA (it never links libcuda); asking for the
    backend then refuses with BackendUnavailable naming what dlopen said."""
    out = _run(UNAVAILABLE, KVSTATE_LIBCUDA="/nonexistent/libcuda.so.1")
    assert out.returncode == 0, out.stderr
    whys = json.loads(out.stdout)
    assert len(whys) == 3 and all(b == "cuda" and w.startswith("no CUDA driver library: cannot load "
                                                               "/nonexistent/libcuda.so.1") for b, w in whys), whys


@pytest.mark.native
@pytest.mark.multiproc
@pytest.mark.skipif(_driver_present(), reason="a CUDA driver is installed here: the no-driver path is not reachable")
def test_on_this_machine_libcuda_is_absent_and_the_backend_says_so() -> None:
    out = _run(UNAVAILABLE)
    assert out.returncode == 0, out.stderr
    assert all("libcuda.so.1" in w for _, w in json.loads(out.stdout))


@pytest.mark.native
@pytest.mark.multiproc
def test_a_library_that_is_not_a_driver_is_refused() -> None:
    import _cffi_backend

    out = _run(UNAVAILABLE, KVSTATE_LIBCUDA=_cffi_backend.__file__)
    assert out.returncode == 0, out.stderr
    assert all("has no cuInit" in w for _, w in json.loads(out.stdout)), out.stdout


def test_bad_constructor_arguments_are_refused_before_the_driver_is_touched() -> None:
    from kvstate.transport.cuda import CudaTransport

    with raises(ArgumentInvalid, ArgumentReason.ENCODING):
        CudaTransport("GPU-not-a-uuid")
    with raises(ArgumentInvalid, ArgumentReason.STATE):
        CudaTransport(bytes(16), kind=HandleKind.CUDA_IPC)
    with raises(ArgumentInvalid, ArgumentReason.RANGE):
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
    """Bank.view() needs HostView; device memory has none (BackendUnavailable (UNSUITABLE))."""
    from kvstate.transport.protocol import HostView
    from kvstate.transport.cuda import CudaTransport
    from kvstate.transport.host import HostTransport

    assert issubclass(HostTransport, HostView) and not issubclass(CudaTransport, HostView)


# -- the host backend's side of the generalised hand-off ------------------------------------

def test_host_receive_handle_checks_kind_and_fd_count() -> None:
    """The host's receive_handle checks kind, fd count, and (issue 14, class 3: so phase 1
    refuses a wrong fd before any rank opens) that the fd is the sealed memfd named."""
    from kvstate.transport.host import HostHandle, HostTransport, fd_identity_of

    t = HostTransport(granularity=64 * 1024)
    a = t.create(64 * 1024)
    try:
        h = t.export(a, HandleKind.MEMFD)
        assert t.receive_handle(HandleKind.MEMFD, h.identity, [h.fd]) == HostHandle(h.fd, h.identity)
        with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.KIND):
            t.receive_handle(HandleKind.POSIX_FD, h.identity, [h.fd])
        for fds in ([], [h.fd, h.fd]):
            with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FDS):
                t.receive_handle(HandleKind.MEMFD, h.identity, fds)
        with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_IDENTITY):
            t.receive_handle(HandleKind.MEMFD, b"x" * 16, [h.fd])
        unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
        r, w = os.pipe()
        try:
            with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_UNSEALED):
                t.receive_handle(HandleKind.MEMFD, fd_identity_of(unsealed), [unsealed])
            with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_NOT_MEMFD):
                t.receive_handle(HandleKind.MEMFD, fd_identity_of(r), [r])
        finally:
            for fd in (unsealed, r, w):
                os.close(fd)
    finally:
        t.release(a)


# -- the GPU suite and the GPU check skip loudly here ------------------------------------------

@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.skipif(_driver_present(), reason="a CUDA driver is installed here: the GPU suite really runs")
def test_gpu_suite_and_check_skip_loudly_never_pass_without_a_gpu() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                            os.path.join(root, "tests", "cuda")], capture_output=True, text=True, timeout=120,
                           cwd=root, env={k: v for k, v in os.environ.items() if k != "KVSTATE_LIBCUDA"})
    assert suite.returncode == 0, suite.stdout + suite.stderr
    summary = suite.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    assert "NO GPU: the GPU suite did not run" in suite.stdout
    env = {k: v for k, v in os.environ.items() if k != "KVSTATE_LIBCUDA"}
    for cmd in ([os.path.join(root, "benchmarks", "gpu_check.py")], ["-m", "kvstate", "gpucheck"]):
        check = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=120, env=env)
        assert check.returncode == 2, check.stderr
        assert json.loads(check.stdout)["ok"] is False and "no CUDA driver library" in json.loads(check.stdout)["not_run"]
        assert check.stderr.startswith("GPU CHECK NOT RUN: transport backend 'cuda' is unavailable")
