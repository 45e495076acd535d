"""The cuda backend on a real GPU: devices by UUID, VMM and legacy IPC across processes (a
tp=1 group through its whole lifecycle each), pins and ops, gather and scatter, a kill
during a copy, the FABRIC trial. The same suite runs on the CPU shim driver in CI
(tests/cudashim/test_gpucheck.py), so its control flow is exercised everywhere."""

from __future__ import annotations

import pytest

from support.errors import raises

from kvstate.core import errors
from kvstate.core.reasons import (
    ArgumentReason, BackendReason, ImportReason, ImportDefect, BusyReason, TransitionReason,
)
from kvstate.core.errors import ArgumentInvalid, BackendUnavailable, ImportFailed, Busy, TransitionError

from kvstate.harness import gpucheck
from kvstate.core.handles import HandleKind
from kvstate.core.capabilities import FabricTrial
from kvstate.core.capabilities import Access
from kvstate.transport.cuda import CudaTransport, visible_devices
from kvstate.transport.cuda.rules import format_uuid


def test_devices_are_chosen_by_uuid_never_ordinal(device: bytes) -> None:
    uuids = visible_devices()
    assert len(set(uuids)) == len(uuids) and all(len(u) == 16 for u in uuids)
    t = CudaTransport(format_uuid(device))
    assert t.device_uuid() == device
    t.close()
    unknown = bytes(16) if device != bytes(16) else b"\xff" * 16
    with raises(BackendUnavailable, BackendReason.NO_DEVICE):
        CudaTransport(unknown)


def test_granularity_and_sizes(device: bytes) -> None:
    t = CudaTransport(device)
    g = t.granularity()
    assert g > 0 and g & (g - 1) == 0 and g % t.min_granularity == 0
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        t.create(g + 1)
    t.close()


def test_vmm_posix_fd_across_two_processes(device: bytes) -> None:
    r = gpucheck.two_process_import(device, HandleKind.POSIX_FD, rounds=3)
    assert r["ok"] and r["load_ok"] and r["exporter"]["bank_state"] == "released" and r["exporter_exit"] == 0, r


def test_legacy_ipc_across_two_processes_and_its_lifetime(device: bytes) -> None:
    """The exporter's drain refuses while this process still has the memory open, even
    after the lease expired; it releases once this side closed."""
    r = gpucheck.two_process_import(device, HandleKind.CUDA_IPC, rounds=1)
    assert r["ok"] and r["exporter_refused_while_open"]["refused"], r


def test_gather_and_scatter_bit_for_bit(device: bytes) -> None:
    r = gpucheck.gather_scatter(device, mib=8, block_kib=64, repeats=2)
    assert r["gather_ok"] and r["scatter_ok"], r


def test_a_kill_during_a_copy_leaves_the_exporter_able_to_drain(device: bytes) -> None:
    r = gpucheck.kill_during_copy(device, delay_us=2000)
    assert r["ok"], r


def test_legacy_ipc_only_on_request_and_only_for_cumemalloc_memory(device: bytes) -> None:
    t = CudaTransport(device)
    a = t.create(t.granularity())
    with raises(ArgumentInvalid, ArgumentReason.RANGE):
        t.export(a, HandleKind.CUDA_IPC)
    with raises(ArgumentInvalid, ArgumentReason.STATE):
        CudaTransport(device, kind=HandleKind.CUDA_IPC)
    t.release(a)
    t.close()


def test_no_unmap_or_release_while_pinned_or_mapped_and_ops_report_into_pins(device: bytes) -> None:
    """INV-NO-UNMAP-PINNED and INV-OP-PINS on the Python-side pin table."""
    t = CudaTransport(device)
    size = t.granularity()
    a = t.create(size)
    r = t.reserve(size)
    m = t.map(r, 0, a)
    dst = t.alloc_buffer(size)
    with raises(TransitionError, TransitionReason.GUARD):  # no access yet: ops are refused
        t.submit_copy(m, dst, 16)
    t.set_access(m, Access.READ_WRITE)
    t.write(m, gpucheck.pattern(size, 5))
    t.pin(m)
    with raises(Busy, BusyReason.PINNED):
        t.unmap(m)
    with raises(Busy, BusyReason.PINNED):
        t.set_access(m, Access.READ)
    t.unpin(m)
    op = t.submit_gather(m, dst, [(0, size // 2, size // 2), (size // 2, 0, size // 2)])
    with raises(TransitionError, TransitionReason.ILLEGAL):
        op.cancel()
    info = op.result(30.0)
    assert info.bytes == size
    st = t.stats(m)
    assert (st.pins, st.inflight, st.completed, st.bytes) == (0, 0, 1, size)
    src = gpucheck.pattern(size, 5)
    assert t.read(dst, size) == src[size // 2:] + src[:size // 2]
    with raises(Busy, BusyReason.MAPPED):
        t.release(a)
    with raises(Busy, BusyReason.MAPPED):
        t.free(r)
    t.unmap(m)
    t.free(r)
    t.release(a)
    t.free_buffer(dst)
    t.close()


def test_fabric_only_after_a_passing_trial(device: bytes) -> None:
    t = CudaTransport(device, fabric=True)
    assert t.fabric_trial in (FabricTrial.PASSED, FabricTrial.FAILED), t.fabric_decision
    t.close()
    if t.fabric_trial is FabricTrial.FAILED:
        with raises(BackendUnavailable, BackendReason.FABRIC):
            CudaTransport(device, kind=HandleKind.FABRIC)
        return
    f = CudaTransport(device, kind=HandleKind.FABRIC)
    size = f.granularity()
    a = f.create(size)
    h = f.export(a, HandleKind.FABRIC)
    assert h.fd is None and len(h.identity) == 64
    b = f.import_(f.receive_handle(HandleKind.FABRIC, h.identity, []), size)
    f.release(b)
    f.release(a)
    f.close()
