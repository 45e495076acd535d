"""CUDA ops in the one C op engine, on the shim: the generated table, pins, ordering, faults.

A CUDA op is an op of the same engine as a host op: same ids, same kvs_wait/kvs_reap, same
counters, stepped through the same ffi/kvs_op_table.h. Its pins drop only when the driver
reported its event complete, so unmap and release refuse until the device is done
(INV-OP-PINS, INV-NO-UNMAP-PINNED); the shim records an unmap under a queued copy as a
violation, and a planted build that drops pins at enqueue is caught by it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.errors import raises
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudashim.conftest import UUID, mapped, unmapped
from cudashim.shim import Shim
from kvstate.core import errors
from kvstate.core.reasons import (
    ArgumentReason, ImportReason, ImportDefect, BusyReason, NativeReason, TransitionReason,
)
from kvstate.core.errors import ArgumentInvalid, ImportFailed, Busy, NativeError, TransitionError
from kvstate.core.capabilities import Access
from kvstate.core.handles import HandleKind
from kvstate.transport.cuda import CudaTransport
from kvstate.transport.host import HostTransport
from kvstate.transport.native import Native, default
from kvstate.transport.optable import OPS

ROOT = Path(__file__).resolve().parents[2]


def test_a_cuda_op_follows_the_generated_table(cuda: CudaTransport, shim: Shim) -> None:
    """submit and start at once (work on a stream cannot be withdrawn), finish when the
    event completes, reap once; every other event is refused by the table, naming it."""
    m = mapped(cuda)
    buf = cuda.alloc_buffer(4096)
    before = default().stats()
    shim.stall(True)
    op = cuda.submit_copy(m, buf, 4096)
    assert op.info().state == "running" and OPS.may("running", "finish")
    for attempt, event in ((op.cancel, "cancel"), (op.reap, "reap")):
        with raises(TransitionError, TransitionReason.ILLEGAL) as info:
            attempt()
        assert (info.value.machine, info.value.state, info.value.event) == ("op", "running", event)
    mid = default().stats()
    assert (mid.submitted - before.submitted, mid.ops_running - before.ops_running, mid.ops_live - before.ops_live) == \
        (1, 1, 1)
    shim.stall(False)
    assert op.wait(5.0) and op.info().state == "done"
    info = op.reap()
    assert info.state == "done" and info.bytes == 4096 and info.error == 0
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
        op.reap()
    after = default().stats()
    assert (after.completed - before.completed, after.ops_live, after.ops_running) == (1, before.ops_live, 0)
    cuda.free_buffer(buf)
    unmapped(cuda, m)


def test_host_and_cuda_ops_live_in_one_engine_table(cuda: CudaTransport, shim: Shim) -> None:
    """One engine for both: a host op (queued: the worker pool is paused) and a CUDA op
    (running: the stalled shim holds its stream) in flight together, with distinct ids of
    one sequence, one set of counters, one kvs_wait and kvs_reap; each steps through the
    same generated table (cancel applies to the queued host op, not the running CUDA op)."""
    host = HostTransport()
    nat = default()
    assert host.native is nat and cuda.native is nat
    g = host.granularity()
    hm = host.map(host.reserve(g), 0, host.create(g))
    host.set_access(hm, Access.READ_WRITE)
    m = mapped(cuda)
    buf = cuda.alloc_buffer(4096)
    before = nat.stats()
    nat.pause(True)
    shim.stall(True)
    try:
        h_op = host.submit_gather(hm, hm, [(0, 8192, 4096)])
        c_op = cuda.submit_copy(m, buf, 4096)
        assert h_op.id != c_op.id
        mid = nat.stats()
        assert (mid.ops_live - before.ops_live, mid.ops_queued - before.ops_queued,
                mid.ops_running - before.ops_running, mid.submitted - before.submitted) == (2, 1, 1, 2)
        assert (h_op.info().state, c_op.info().state) == ("queued", "running")
        assert OPS.may("queued", "cancel") and not OPS.may("running", "cancel")
        h_op.cancel()
        with raises(TransitionError, TransitionReason.ILLEGAL) as info:
            c_op.cancel()
        assert (info.value.machine, info.value.state) == ("op", "running")
        assert h_op.poll() and not c_op.poll()
    finally:
        shim.stall(False)
        nat.pause(False)
    assert c_op.wait(5.0)
    assert (h_op.reap().state, c_op.reap().state) == ("cancelled", "done")
    after = nat.stats()
    assert (after.ops_live, after.submitted - before.submitted, after.cancelled - before.cancelled,
            after.completed - before.completed) == (before.ops_live, 2, 1, 1)
    cuda.free_buffer(buf)
    unmapped(cuda, m)
    host.unmap(hm)
    host.free(hm.reservation)
    host.release(hm.allocation)


def test_no_unmap_release_or_lower_access_before_the_streams_event(cuda: CudaTransport, shim: Shim) -> None:
    """Ordering: the source stays mapped until the driver reported the op's event; only
    then does the pin drop and unmap go through (the journal shows the order)."""
    m = mapped(cuda)
    buf = cuda.alloc_buffer(8192)
    shim.stall(True)
    op = cuda.submit_gather(m, buf, [(0, 0, 4096), (8192, 4096, 4096)])
    for refused in (lambda: cuda.unmap(m), lambda: cuda.release(m.allocation), lambda: cuda.set_access(m, Access.READ)):
        with raises(Busy, BusyReason.PINNED):
            refused()
    assert cuda.stats(m).pins == 1, "quiescence is what the C layer reports: not while the device works"
    assert shim.calls("cuMemUnmap") == 0
    shim.stall(False)
    op.result(5.0)
    assert cuda.stats(m).pins == 0
    unmapped(cuda, m)
    journal = shim.journal()
    done = max(i for i, line in enumerate(journal) if line.startswith(("cuEventSynchronize -> 0", "cuEventQuery -> 0")))
    assert done < next(i for i, line in enumerate(journal) if line.startswith("cuMemUnmap -> 0"))
    cuda.free_buffer(buf)


def test_an_owned_device_mapping_is_unmapped_and_its_access_changed_only_by_its_owner(cuda: CudaTransport,
                                                                                      shim: Shim) -> None:
    """The host backend's owner rule on the device: unmap and set_access refuse without
    the owner's token, and the driver is never asked (no cuMemUnmap, no cuMemSetAccess)."""
    m = mapped(cuda)
    cuda.own(m, 11)
    unmaps, accesses = shim.calls("cuMemUnmap"), shim.calls("cuMemSetAccess")
    for refused in (lambda: cuda.unmap(m), lambda: cuda.set_access(m, Access.READ), lambda: cuda.own(m, 12),
                    lambda: cuda.disown(m, 12)):
        with raises(Busy, BusyReason.OWNED):
            refused()
    assert (shim.calls("cuMemUnmap"), shim.calls("cuMemSetAccess")) == (unmaps, accesses)
    cuda.disown(m, 11)
    unmapped(cuda, m)


def test_a_device_fault_fails_the_op_with_its_curesult_and_drops_its_pins(cuda: CudaTransport, shim: Shim) -> None:
    m = mapped(cuda)
    buf = cuda.alloc_buffer(4096)
    shim.fail("async", 1, 700)  # CUDA_ERROR_ILLEGAL_ADDRESS on the device
    op = cuda.submit_copy(m, buf, 4096)
    with raises(NativeError, NativeReason.OP_FAILED) as info:
        op.result(5.0)
    assert "CUresult 700 (CUDA_ERROR_ILLEGAL_ADDRESS)" in str(info.value)
    st = cuda.stats(m)
    assert (st.pins, st.failed, st.completed) == (0, 1, 0)
    cuda.free_buffer(buf)
    unmapped(cuda, m)


def test_the_op_flag_injects_a_failure_in_cuda_ops_too(cuda: CudaTransport) -> None:
    m = mapped(cuda)
    buf = cuda.alloc_buffer(4096)
    op = cuda.native.submit_cuda(cuda.device, (m.region, 0, 0), (0, buf.ptr, buf.nbytes), [(0, 0, 64)], fail=True)
    with raises(NativeError, NativeReason.OP_FAILED, match="injected failure"):
        op.result(5.0)
    assert cuda.stats(m).pins == 0
    cuda.free_buffer(buf)
    unmapped(cuda, m)


def test_ranges_regions_of_another_device_and_bad_blocks_are_refused_before_any_pin(cuda: CudaTransport,
                                                                                    shim: Shim) -> None:
    m = mapped(cuda)
    buf = cuda.alloc_buffer(4096)
    for blocks in ([(0, 0, 4097)], [(cuda.granularity(), 0, 1)], [(0, 0, 0)], []):
        with raises(ArgumentInvalid, (ArgumentReason.OUT_OF_RANGE, ArgumentReason.NATIVE)):
            cuda.submit_gather(m, buf, blocks)
    other = CudaTransport(UUID)  # another opened device: its regions are not this one's
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
        other.submit_copy(m, buf, 16)
    other.close()
    assert cuda.stats(m).pins == 0 and shim.calls("cuMemcpyAsync") == shim.calls("cuMemcpyBatchAsync") == 0
    cuda.free_buffer(buf)
    unmapped(cuda, m)


def test_a_process_never_opens_a_legacy_handle_it_exported(shim: Shim) -> None:
    t = CudaTransport(UUID, kind=HandleKind.CUDA_IPC, legacy_ipc=True)
    a = t.create(t.granularity())
    h = t.export(a, HandleKind.CUDA_IPC)
    with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.LEGACY_IPC):
        t.import_(t.receive_handle(HandleKind.CUDA_IPC, h.identity, []), t.granularity())
    assert shim.calls("cuIpcOpenMemHandle") == 0, "refused before the driver was asked"
    t.release(a)
    t.close()


def test_legacy_ipc_only_on_request_and_vmm_memory_is_not_exported_as_ipc(cuda: CudaTransport) -> None:
    a = cuda.create(cuda.granularity())
    with raises(ArgumentInvalid, ArgumentReason.RANGE):  # a wrong call, on every backend
        cuda.export(a, HandleKind.CUDA_IPC)
    with raises(ArgumentInvalid, ArgumentReason.STATE):
        CudaTransport(UUID, kind=HandleKind.CUDA_IPC)
    cuda.release(a)


UNIT = 256
SOURCE = bytes((i * 31 + 7) % 251 for i in range(64 * UNIT))


def reference(blocks: list[tuple[int, int, int]], n: int) -> bytes:
    out = bytearray(n)
    for s, d, ln in blocks:
        out[d:d + ln] = SOURCE[s:s + ln]
    return bytes(out)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(1, 4), st.booleans()), min_size=1, max_size=24))
def test_a_gather_moves_exactly_the_bytes_of_its_blocks(cuda: CudaTransport, spec: list[tuple[int, int, bool]]) -> None:
    """Any block list (sources anywhere, overlapping or not; destinations back to back, or
    with a gap) moves exactly its bytes: contiguous runs merged, the rest batched."""
    m = mapped(cuda)
    cuda.write(m, SOURCE)
    blocks, pos = [], 0
    for start, units, gap in spec:
        ln = min(units, 64 - start) * UNIT
        blocks.append((start * UNIT, pos, ln))
        pos += ln + (UNIT if gap else 0)
    buf = cuda.alloc_buffer(pos)
    try:
        cuda.write(buf, bytes(pos))
        info = cuda.submit_gather(m, buf, blocks).result(5.0)
        assert info.bytes == sum(b[2] for b in blocks)
        assert cuda.read(buf, pos) == reference(blocks, pos)
    finally:
        cuda.free_buffer(buf)
        unmapped(cuda, m)


def test_the_module_has_no_link_time_dependency_on_libcuda() -> None:
    native = next((ROOT / "kvstate").glob("_native*.so"))
    assert b"libcuda" not in native.read_bytes(), "the driver is loaded at run time, never linked"


# -- the planted bug: pins dropped when the copies are enqueued --------------------------------


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Native]:
    from native.helpers import build_variant

    nat = build_variant(Path(tmp_path_factory.mktemp("planted_cuda")), "kvs_planted_cuda",
                        defines=[("KVS_PLANT_CUDA_EARLY_UNPIN", None)])
    assert nat.planted_bug
    yield nat


def test_the_shim_catches_an_engine_that_unpins_before_the_event(planted: Native, shim: Shim) -> None:
    """Self-test of the ordering check: with the planted build, unmap goes through while
    the copy is still queued, and the shim records it (the real engine refuses: above)."""
    t = CudaTransport(UUID, native=planted)
    m = mapped(t)
    buf = t.alloc_buffer(4096)
    shim.stall(True)
    op = t.submit_copy(m, buf, 4096)
    assert t.stats(m).pins == 0, "the planted build dropped the pin at once"
    t.unmap(m)  # the bug: nothing refuses
    shim.stall(False)
    op.wait(5.0)
    op.reap()
    deadline = time.monotonic() + 5
    while shim.live()["queued_work"] and time.monotonic() < deadline:  # the planted op did not wait for it
        time.sleep(0.001)
    caught = shim.violations()
    assert caught.count >= 1 and "cuMemUnmap" in caught.text and "still queued" in caught.text
    shim.reset()  # the planted violations are this test's finding, not a failure of the fixture
    t.free(m.reservation)
    t.release(m.allocation)
    t.free_buffer(buf)
    t.close()


def test_production_module_has_no_planted_bug() -> None:
    assert default().planted_bug is False


def test_gpucheck_cleanup_waits_for_a_pinned_buffer_and_never_hides_the_checks_error(
        cuda: CudaTransport, shim: Shim, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpucheck's cleanup after an op timed out: free_buffer is Busy while the op pins the
    buffer. The cleanup waits for the pin to go and frees; past its wait it leaves the
    buffer rather than raising Busy over the check's own failure."""
    import threading

    from kvstate.harness import gpucheck

    m = mapped(cuda)
    buf = cuda.alloc_buffer(8192)
    shim.stall(True)
    op = cuda.submit_gather(m, buf, [(0, 0, 4096)])
    monkeypatch.setattr(gpucheck, "TIMEOUT_S", 0.05)
    gpucheck._free_buffer(cuda, buf)  # still pinned past the wait: no Busy escapes
    with raises(Busy, BusyReason.PINNED):
        cuda.free_buffer(buf)  # the buffer was left, not freed under the op
    monkeypatch.setattr(gpucheck, "TIMEOUT_S", 30.0)
    threading.Timer(0.2, shim.stall, (False,)).start()
    gpucheck._free_buffer(cuda, buf)  # waits until the device lets go, then frees
    op.result(5.0)
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
        cuda.free_buffer(buf)  # gone: a second free is refused
    unmapped(cuda, m)
