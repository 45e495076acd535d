"""The CUDA backend over the shim driver: every test here runs the C engine's real CUDA
code path in this process, against tests/cudashim/libcudashim.so (built on first use).

Each test starts with a reset shim (no failure rules, empty journal) and must end with no
violation recorded (nothing unmapped, freed or closed under a queued copy, no copy outside
device memory, no free of memory another process has open) and with every driver object it
made destroyed again."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cudashim.shim import Shim, use
from kvstate.core.capabilities import Access
from kvstate.transport.cuda import CudaTransport
from kvstate.transport.cuda.objects import CudaMapping

#: The shim's first device.
UUID = b"KVSCUDASHIM-dev0"


@pytest.fixture
def shim() -> Iterator[Shim]:
    s = use()
    s.reset()
    before = s.live()
    yield s
    s.stall(False)
    violations = s.violations()
    assert violations.count == 0, violations.text
    assert s.live() == before, f"driver objects left: {before} -> {s.live()}"


@pytest.fixture
def cuda(shim: Shim) -> Iterator[CudaTransport]:
    t = CudaTransport(UUID)
    yield t
    t.close()


def mapped(t: CudaTransport, access: Access = Access.READ_WRITE, size: int | None = None) -> CudaMapping:
    """A created, reserved, mapped allocation with ``access`` (undo with :func:`unmapped`)."""
    n = size or t.granularity()
    m = t.map(t.reserve(n), 0, t.create(n))
    if access is not Access.NONE:
        t.set_access(m, access)
    return m


def unmapped(t: CudaTransport, m: CudaMapping) -> None:
    t.unmap(m)
    t.free(m.reservation)
    t.release(m.allocation)
