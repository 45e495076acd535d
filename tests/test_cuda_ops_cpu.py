"""The cuda backend's op engine (kvstate/transport/cuda/ops.py) on CPU: its ops step through
spec/op.toml (pins taken on submit, dropped only when the event reports completion or a
fault), driven here by a stand-in for the few driver calls it makes, with host memory as
"device" memory so the copies are checked byte for byte.

This machine has no GPU, so the real driver cannot run here; the GPU suite (tests/cuda)
runs the same engine on the real driver. Issue 19 replaces this engine (and this stand-in)
with the C engine and a shim driver library.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kvstate.core import errors
from kvstate.core.capabilities import Access
from kvstate.core.handles import HandleKind
from kvstate.transport.cuda import rules
from kvstate.transport.cuda.driver import check
from kvstate.transport.cuda.objects import CudaAllocation, CudaMapping, CudaReservation, DeviceBuffer
from kvstate.transport.cuda.ops import CudaOps
from kvstate.transport.optable import OPS

SIZE = 1 << 16


class StandInDriver:
    """The driver calls CudaOps makes. Copies happen at enqueue; an event stays NOT_READY
    until the test completes it (with 0 or a CUresult)."""

    CUdeviceptr = int
    CUevent_flags = SimpleNamespace(CU_EVENT_DISABLE_TIMING=SimpleNamespace(value=2))
    CUmemorytype = SimpleNamespace(CU_MEMORYTYPE_DEVICE=2)
    CUDA_MEMCPY2D = SimpleNamespace

    def __init__(self) -> None:
        self.events: dict[int, int] = {}
        self._ids = itertools.count(1)
        self.record_result = 0

    def cuEventCreate(self, flags: int) -> tuple[int, int]:
        event = next(self._ids)
        self.events[event] = rules.CUDA_ERROR_NOT_READY
        return 0, event

    def cuMemcpyDtoDAsync(self, dst: int, src: int, n: int, stream: object) -> tuple[int]:
        ctypes.memmove(dst, src, n)
        return (0,)

    def cuMemcpy2DAsync(self, p: Any, stream: object) -> tuple[int]:
        for row in range(p.Height):
            ctypes.memmove(p.dstDevice + row * p.dstPitch, p.srcDevice + row * p.srcPitch, p.WidthInBytes)
        return (0,)

    def cuEventRecord(self, event: int, stream: object) -> tuple[int]:
        return (self.record_result,)

    def cuStreamSynchronize(self, stream: object) -> tuple[int]:
        return (0,)

    def cuEventQuery(self, event: int) -> tuple[int]:
        return (self.events[event],)

    def cuEventDestroy(self, event: int) -> tuple[int]:
        del self.events[event]
        return (0,)

    def cuGetErrorName(self, err: int) -> tuple[int, bytes]:
        return 0, b"CUDA_ERROR_STAND_IN"

    def complete(self, result: int = 0) -> None:
        for event in self.events:
            self.events[event] = result


class Device:
    def __init__(self) -> None:
        self.driver = StandInDriver()
        self.buffers: list[Any] = []
        self.mappings: set[int] = set()

        def call(name: str, *args: Any) -> Any:
            res = getattr(self.driver, name)(*args)
            check(self.driver, name, res[0])  # type: ignore[arg-type]
            return res[1] if len(res) == 2 else None

        def live(m: CudaMapping, what: str) -> None:
            if m.region not in self.mappings:
                raise errors.UnknownNativeObject(what, -1, f"region {m.region} is not mapped")

        self.ops = CudaOps(self.driver, object(), 1 << 20, threading.RLock(), call=call,  # type: ignore[arg-type]
                           enter=lambda: None, live=live)

    def memory(self, fill: int) -> int:
        buf = ctypes.create_string_buffer(bytes([fill]) * SIZE, SIZE)
        self.buffers.append(buf)
        return ctypes.addressof(buf)

    def mapping(self, region: int, access: Access, fill: int = 0) -> CudaMapping:
        addr = self.memory(fill)
        m = CudaMapping(region, addr, SIZE, CudaAllocation(region, SIZE, HandleKind.POSIX_FD, imported=True),
                        CudaReservation(region, addr, SIZE), access=access)
        self.mappings.add(region)
        return m

    def buffer(self) -> DeviceBuffer:
        return DeviceBuffer(self.memory(0), SIZE)


def read(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


def test_a_gather_pins_until_its_event_completes_and_copies_the_blocks() -> None:
    dev = Device()
    src, dst = dev.mapping(1, Access.READ, fill=7), dev.buffer()
    ctypes.memmove(src.addr + 4096, b"abcd" * 256, 1024)
    op = dev.ops.submit_gather(src, dst, [(4096, 0, 1024), (0, 1024, 16)])
    assert (src.inflight, src.pins) == (1, 1) and not op.poll()
    with pytest.raises(errors.IllegalTransition) as cancel:
        op.cancel()  # work on a stream cannot be withdrawn: the table has no cancel there
    assert cancel.value.event == "cancel" and cancel.value.state == op.state
    with pytest.raises(errors.IllegalTransition):
        op.reap()
    assert not op.wait(0.01) and src.pins == 1
    dev.driver.complete(0)
    info = op.result(1.0)
    assert info.bytes == 1040 and not OPS.faulted(info.state)
    assert (src.pins, src.completed, src.bytes, src.failed) == (0, 1, 1040, 0)
    assert read(dst.ptr, 1040) == b"abcd" * 256 + bytes([7]) * 16
    assert dev.driver.events == {}, "the reaped op's event was destroyed"
    with pytest.raises(errors.IllegalTransition):
        op.reap()  # once


def test_the_regions_mapped_guard_refuses_before_anything_is_pinned() -> None:
    dev = Device()
    no_access, read_only = dev.mapping(1, Access.NONE), dev.mapping(2, Access.READ)
    with pytest.raises(errors.GuardRejected) as info:
        dev.ops.submit_gather(no_access, dev.buffer(), [(0, 0, 64)])
    assert info.value.failed == ("regions_mapped",)
    with pytest.raises(errors.GuardRejected):
        dev.ops.submit_gather(dev.buffer(), read_only, [(0, 0, 64)])  # a destination needs read-write
    assert no_access.pins == read_only.pins == 0 and dev.driver.events == {}


def test_a_device_fault_fails_the_op_and_drops_its_pins() -> None:
    dev = Device()
    src, dst = dev.mapping(1, Access.READ), dev.mapping(2, Access.READ_WRITE)
    op = dev.ops.submit_gather(src, dst, [(0, 0, 64)])
    assert src.pins == dst.pins == 1
    dev.driver.complete(rules.CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(errors.OpFailed):
        op.result(1.0)
    assert (src.pins, src.failed, dst.pins, dst.failed) == (0, 1, 0, 1)


def test_a_failed_event_record_fails_the_op_at_once() -> None:
    dev = Device()
    dev.driver.record_result = rules.CUDA_ERROR_LAUNCH_FAILED
    src = dev.mapping(1, Access.READ_WRITE)
    op = dev.ops.submit_gather(src, src, [(0, 4096, 64)])
    assert op.poll() and src.pins == 0 and src.failed == 1, "the same mapping is pinned once, as in C"
    with pytest.raises(errors.OpFailed):
        op.result(0.0)


def test_close_refuses_while_an_op_is_in_flight() -> None:
    dev = Device()
    src = dev.mapping(1, Access.READ)
    dev.ops.submit_gather(src, dev.buffer(), [(0, 0, 64)])
    with pytest.raises(errors.EngineBusy):
        dev.ops.close()
    dev.driver.complete(0)
    dev.ops.close()
    assert dev.driver.events == {} and src.pins == 0


def test_a_mapping_that_is_gone_is_refused() -> None:
    dev = Device()
    src = dev.mapping(1, Access.READ)
    dev.mappings.discard(1)
    with pytest.raises(errors.UnknownNativeObject):
        dev.ops.submit_gather(src, dev.buffer(), [(0, 0, 64)])
