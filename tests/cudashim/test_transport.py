"""CudaTransport on the C engine over the shim driver: the VMM shape, pins and ops."""

from __future__ import annotations

import pytest

from support.errors import raises

from cudashim.conftest import mapped, unmapped
from cudashim.shim import Shim
from kvstate.core import errors
from kvstate.core.reasons import ArgumentReason, BusyReason, TransitionReason
from kvstate.core.errors import Busy, TransitionError
from kvstate.core.capabilities import Access
from kvstate.core.handles import HandleKind
from kvstate.transport.cuda import CudaTransport
from kvstate.transport.cuda.objects import DeviceBuffer


def pattern(n: int, salt: int = 0) -> bytes:
    unit = bytes((salt * 7 + i) % 251 for i in range(251))
    return (unit * (n // 251 + 1))[:n]


def test_a_gather_copies_blocks_and_pins_until_the_device_is_done(cuda: CudaTransport, shim: Shim) -> None:
    g = cuda.granularity()
    src = mapped(cuda, Access.READ_WRITE)
    data = pattern(g, 1)
    cuda.write(src, data)
    dst = cuda.alloc_buffer(g)
    shim.stall(True)
    op = cuda.submit_gather(src, dst, [(4096, 0, 1000), (0, 1000, 24), (8192, 2048, 4096)])
    st = cuda.stats(src)
    assert (st.pins, st.inflight) == (1, 1)
    with raises(Busy, BusyReason.PINNED):
        cuda.unmap(src)
    with raises(TransitionError, TransitionReason.ILLEGAL):
        op.cancel()
    assert not op.wait(0.05)
    shim.stall(False)
    info = op.result(5.0)
    assert (info.bytes, info.state, info.error) == (1000 + 24 + 4096, "done", 0)
    st = cuda.stats(src)
    assert (st.pins, st.inflight, st.completed, st.bytes) == (0, 0, 1, 5120)
    got = cuda.read(dst, 2048 + 4096)
    assert got[:1000] == data[4096:5096] and got[1000:1024] == data[:24] and got[2048:] == data[8192:12288]
    cuda.free_buffer(dst)
    unmapped(cuda, src)


@pytest.mark.parametrize("direction", ["into", "out of"])
def test_a_device_buffer_is_not_freed_under_a_copy(cuda: CudaTransport, shim: Shim, direction: str) -> None:
    """The one pin rule for device buffers: an op in flight that reads or writes a buffer of
    alloc_buffer pins it, and free_buffer refuses until the device finished (issue 29)."""
    m = mapped(cuda, Access.READ_WRITE)
    buf = cuda.alloc_buffer(8192)
    inner = DeviceBuffer(buf.ptr + 4096, 1024)  # an end inside the buffer pins it too
    shim.stall(True)
    op = cuda.submit_copy(m, inner, 1024) if direction == "into" else cuda.submit_copy(inner, m, 1024)
    with pytest.raises(errors.Busy) as pinned:
        cuda.free_buffer(buf)
    assert pinned.value.reason is BusyReason.PINNED
    shim.stall(False)
    assert op.result(5.0).state == "done"
    assert shim.violations().count == 0, shim.violations()
    cuda.free_buffer(buf)  # the device is done: now it goes
    with pytest.raises(errors.ArgumentInvalid) as gone:
        cuda.free_buffer(buf)
    assert gone.value.reason is ArgumentReason.UNKNOWN_OBJECT
    unmapped(cuda, m)


def test_caller_memory_is_not_kvstates_to_pin(cuda: CudaTransport, shim: Shim) -> None:
    """Memory kvstate did not allocate (a tensor's data_ptr) names no buffer: nothing to refuse."""
    m = mapped(cuda, Access.READ_WRITE)
    a, b = cuda.alloc_buffer(4096), cuda.alloc_buffer(4096)
    shim.stall(True)
    op = cuda.submit_copy(m, a, 4096)
    cuda.free_buffer(b)  # another buffer: not touched by the op
    shim.stall(False)
    assert op.result(5.0).state == "done"
    cuda.free_buffer(a)
    unmapped(cuda, m)


def test_no_access_refuses_the_op_before_anything_is_pinned(cuda: CudaTransport, shim: Shim) -> None:
    m = mapped(cuda, Access.NONE)
    dst = cuda.alloc_buffer(4096)
    with raises(TransitionError, TransitionReason.GUARD):
        cuda.submit_copy(m, dst, 16)
    assert cuda.stats(m).pins == 0 and shim.calls("cuMemcpyAsync") == 0
    cuda.set_access(m, Access.READ)
    with raises(TransitionError, TransitionReason.GUARD):
        cuda.submit_copy(dst, m, 16)  # a destination needs read-write
    cuda.free_buffer(dst)
    unmapped(cuda, m)


def test_vmm_posix_fd_export_import_in_one_process(cuda: CudaTransport) -> None:
    g = cuda.granularity()
    a = mapped(cuda)
    cuda.write(a, pattern(g, 3))
    h = cuda.export(a.allocation, HandleKind.POSIX_FD)
    assert h.fd is not None
    imp = cuda.import_(cuda.receive_handle(HandleKind.POSIX_FD, h.identity, [h.fd]), g)
    m = cuda.map(cuda.reserve(g), 0, imp)
    cuda.set_access(m, Access.READ)
    assert cuda.read(m, g) == pattern(g, 3)
    with raises(Busy, BusyReason.MAPPED):
        cuda.release(imp)
    unmapped(cuda, m)
    unmapped(cuda, a)


def test_close_refuses_while_objects_live(cuda: CudaTransport) -> None:
    a = cuda.create(cuda.granularity())
    with raises(Busy, BusyReason.ENGINE):
        cuda.close()
    cuda.release(a)
