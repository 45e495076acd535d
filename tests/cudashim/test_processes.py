"""Device memory shared between two processes through the shim, with the real Exporter here
and the real Importer in a peer process (tests/cudashim/peer.py).

Legacy IPC lifetime: the driver keeps no count of other processes' opens, so the exporter
must never free the memory while an importer has it open. The bank holds a pin for every
importer that may have it open, dropped only when that importer returns its lease after
closing, or its connection closes; a lease that merely expires keeps its hold. The shim
sees every process's opens (in the allocation's header page) and records a cuMemFree while
another live process has the memory open as a violation: a planted bank without holds is
caught by it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.errors import raises

from cudashim.conftest import UUID
from cudashim.shim import Shim
from kvstate.core.errors import Busy, TimedOut
from kvstate.core.reasons import BusyReason, TimeoutReason
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.transport.cuda import CudaTransport
from support.waiting import stop_process, wait_until

HERE = Path(__file__).resolve().parent
DEPLOYMENT = Deployment("cudashim-processes", bytes(32))
GEOMETRY = Geometry.uniform(layers=2, kv_heads=2, head_dim=16, block_tokens=8, dtype=DType.BF16,
                    layout=Layout.LAYER_MAJOR, num_blocks=16)


def pattern(n: int) -> bytes:
    return bytes((i * 7 + 3) % 251 for i in range(n))


def expected_digest() -> str:
    data = pattern(GEOMETRY.nbytes)
    gathered = b"".join(data[o:o + n] for b in range(GEOMETRY.num_blocks) for o, n in GEOMETRY.block_extents(b))
    return hashlib.sha256(gathered).hexdigest()


class Peer:
    """The importer process: stdin commands, stdout reports."""

    def __init__(self, kind: HandleKind, descriptor: bytes) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "peer.py"), "importer", kind.value, DEPLOYMENT.name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE.parent)
        self.send(descriptor.hex())

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line.startswith(word), f"peer said {line!r}, expected {word!r} (exit {self.proc.poll()})"
        return line

    def finish(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(30)


def exporter(t: CudaTransport, kind: HandleKind, lease_timeout_s: float) -> Exporter[Any, Any, Any, Any, Any]:
    d = Path(tempfile.mkdtemp(prefix="kvs-shim-"))
    os.chmod(d, 0o700)
    ex: Exporter[Any, Any, Any, Any, Any] = Exporter(
        ExportConfig(DEPLOYMENT, d / "sock", os.urandom(16), 1, handle_kind=kind, lease_timeout_s=lease_timeout_s), t)
    bank = ex.add_bank(0, GEOMETRY)
    bank.register()
    t.write(bank.mapped(), pattern(GEOMETRY.nbytes))
    bank.advertise()
    ex.start()
    return ex


@pytest.fixture
def legacy(shim: Shim) -> Iterator[CudaTransport]:
    t = CudaTransport(UUID, kind=HandleKind.CUDA_IPC, legacy_ipc=True)
    yield t
    t.close()



def test_the_exporter_never_frees_legacy_ipc_memory_an_importer_has_open(legacy: CudaTransport, shim: Shim) -> None:
    """The lease expires while the importer still has the memory open (its process is
    stopped, so it cannot renew): the bank drains but is never released (no cuMemFree),
    release itself refuses, until the importer closed."""
    ex = exporter(legacy, HandleKind.CUDA_IPC, lease_timeout_s=0.3)
    bank = ex.banks[0]
    peer = Peer(HandleKind.CUDA_IPC, ex.descriptor(0))
    try:
        assert peer.expect("mapped").split()[1] == expected_digest()
        stop_process(peer.proc.pid)  # a stuck importer: no renewal
        try:
            assert wait_until(lambda: bank.state == "draining"), "the lease did not expire"
            assert all(lease.expired for lease in bank.leases.values())  # kept until returned
            assert len(bank.holds) == 1 and bank.pins() == 1, "the expired lease's hold must stay"
            with raises(TimedOut, TimeoutReason.DRAIN, match="1 hold"):
                ex.drain(0.3)
            assert bank.state == "draining"
            with raises(Busy, BusyReason.PINNED):
                legacy.release(bank.allocation)
            assert shim.calls("cuMemFree") == 0, "freed while another process had it open"
        finally:
            peer.proc.send_signal(signal.SIGCONT)
        peer.send("close")
        peer.expect("closed")  # cuIpcCloseMemHandle, then the lease returned: the hold drops
        assert wait_until(lambda: not bank.holds)
        ex.drain(5.0)
        assert bank.state == "released" and shim.calls("cuMemFree") == 1
    finally:
        ex.stop()
        assert peer.finish() == 0


def test_the_importers_death_drops_its_hold(legacy: CudaTransport, shim: Shim) -> None:
    ex = exporter(legacy, HandleKind.CUDA_IPC, lease_timeout_s=30.0)
    bank = ex.banks[0]
    peer = Peer(HandleKind.CUDA_IPC, ex.descriptor(0))
    try:
        peer.expect("mapped")
        assert bank.holds and bank.pins() == 1
        peer.proc.send_signal(signal.SIGKILL)
        peer.proc.wait(10)
        assert wait_until(lambda: not bank.holds and not bank.leases), "peer death did not end the hold"
        ex.drain(5.0)
        assert bank.state == "released"
    finally:
        ex.stop()
        if peer.proc.stdin is not None:
            peer.proc.stdin.close()


def test_a_stopped_exporter_waits_for_the_importers_process_to_exit(legacy: CudaTransport, shim: Shim) -> None:
    """Stopping closes the connections from this side: that is no evidence the importer
    closed the memory, so the hold stays until the importer's process exits."""
    ex = exporter(legacy, HandleKind.CUDA_IPC, lease_timeout_s=30.0)
    bank = ex.banks[0]
    peer = Peer(HandleKind.CUDA_IPC, ex.descriptor(0))
    try:
        peer.expect("mapped")
        ex.stop()
        assert not bank.leases and len(bank.holds) == 1
        with raises(TimedOut, TimeoutReason.DRAIN, match="1 hold"):
            ex.drain(0.3)
        assert shim.calls("cuMemFree") == 0
        peer.send("close")
        peer.expect("closed")
        assert peer.finish() == 0  # the importer's process exits
        ex.drain(5.0)
        assert bank.state == "released" and not bank.holds
    finally:
        ex.stop()
        if peer.proc.poll() is None:
            peer.finish()


def test_a_bank_without_holds_is_caught_freeing_memory_an_importer_has_open(legacy: CudaTransport,
                                                                            shim: Shim) -> None:
    """Self-test: a planted exporter that takes no hold releases the bank once the lease
    ended (this side stopped serving), with the importer's open still live; the shim
    records the cuMemFree."""
    ex = exporter(legacy, HandleKind.CUDA_IPC, lease_timeout_s=30.0)
    bank = ex.banks[0]
    bank.uncounted = False  # the planted bug: the memory is treated as reference-counted
    peer = Peer(HandleKind.CUDA_IPC, ex.descriptor(0))
    try:
        peer.expect("mapped")
        ex.stop()  # the connections close from this side: the lease ends, the open does not
        assert wait_until(lambda: not bank.leases)
        ex.drain(5.0)  # nothing holds it: released under the importer
        assert bank.state == "released"
        caught = shim.violations()
        assert caught.count == 1 and "cuMemFree" in caught.text and "has it open by IPC" in caught.text
        shim.reset()
        peer.send("close")
        peer.expect("closed")
    finally:
        ex.stop()
        assert peer.finish() == 0


def test_vmm_posix_fd_memory_between_two_processes(shim: Shim) -> None:
    """POSIX-fd handles: the fd crosses by SCM_RIGHTS, the driver counts references, so an
    expired lease ends without a hold and the exporter may release; the importer's
    mapping stays valid (the memory lives until its last handle goes)."""
    t = CudaTransport(UUID)
    ex = exporter(t, HandleKind.POSIX_FD, lease_timeout_s=30.0)
    bank = ex.banks[0]
    peer = Peer(HandleKind.POSIX_FD, ex.descriptor(0))
    try:
        assert peer.expect("mapped").split()[1] == expected_digest()
        assert not bank.holds and bank.leases
        peer.send("close")
        peer.expect("closed")
        ex.drain(5.0)
        assert bank.state == "released"
    finally:
        ex.stop()
        assert peer.finish() == 0
        t.close()
