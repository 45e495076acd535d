"""The backends the lifecycle tests run over: the host backend (memfds) and the cuda backend
on the C engine over the CPU shim driver (tests/cudashim). Each says how a test fills a
bank, gives a load a destination and reads it back, and holds the engine's work (a paused
worker pool, a stalled device), so one test body runs over both."""

from __future__ import annotations

from typing import Any

from kvstate.core.handles import HandleKind
from kvstate.transport.host import HostTransport

GRANULARITY = 64 * 1024


class HostBackend:
    name = "host"
    handle_kind = HandleKind.MEMFD

    def __init__(self) -> None:
        self.transport: Any = HostTransport(granularity=GRANULARITY)

    def fill(self, bank: Any, data: bytes) -> None:
        bank.view()[:len(data)] = data

    def destination(self, nbytes: int) -> Any:
        return bytearray(nbytes)

    def read(self, dst: Any, nbytes: int) -> bytes:
        return bytes(dst[:nbytes])

    def free(self, dst: Any) -> None:
        pass

    def hold(self, on: bool) -> None:
        """Queued work waits (True) or runs (False)."""
        self.transport.native.pause(on)

    def violations(self) -> str:
        return ""

    def close(self) -> None:
        pass


class CudaBackend:
    """POSIX-fd VMM memory on the shim: exporter and importer in this process."""

    name = "cuda"
    handle_kind = HandleKind.POSIX_FD

    def __init__(self) -> None:
        from cudashim.conftest import UUID
        from cudashim.shim import use
        from kvstate.transport.cuda import CudaTransport

        self.shim = use()
        self.transport = CudaTransport(UUID)
        assert self.transport.granularity() == GRANULARITY

    def fill(self, bank: Any, data: bytes) -> None:
        self.transport.write(bank.mapped(), data)

    def destination(self, nbytes: int) -> Any:
        return self.transport.alloc_buffer(nbytes)

    def read(self, dst: Any, nbytes: int) -> bytes:
        data: bytes = self.transport.read(dst, nbytes)
        return data

    def free(self, dst: Any) -> None:
        self.transport.free_buffer(dst)

    def hold(self, on: bool) -> None:
        self.shim.stall(on)

    def violations(self) -> str:
        """What the shim saw that would be undefined on a GPU (an unmap under a queued copy...)."""
        v = self.shim.violations()
        return v.text if v.count else ""

    def close(self) -> None:
        self.shim.stall(False)
        self.transport.close()
