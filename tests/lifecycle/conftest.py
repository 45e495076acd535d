"""Fixtures for lifecycle tests: a real exporter serving on a real socket, in this process."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstate.share.exporter import Exporter

from kvstate.share.export_config import ExportConfig
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.identity import Deployment
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostTransport
from support.reuse import REUSE_ON
from backends import CudaBackend, HostBackend

DEPLOYMENT = Deployment("lifecycle-tests", bytes(range(32)))
GEOMETRY = Geometry.uniform(layers=2, kv_heads=2, head_dim=16, block_tokens=8, dtype=DType.BF16,
                    layout=Layout.LAYER_MAJOR, num_blocks=32)
GRANULARITY = 64 * 1024


def pattern(rank: int, nbytes: int, salt: int = 0) -> bytes:
    """Deterministic KV bytes of one rank: every block differs from every other."""
    unit = bytes((rank * 37 + salt * 11 + i) % 251 for i in range(251))
    return (unit * (nbytes // len(unit) + 1))[:nbytes]


def make_exporter(tp: int, transport: object, name: str = "exporter", lease_timeout_s: float = 30.0,
                  source: bytes | None = None, socket_dir: Path | None = None,
                  backend: HostBackend | CudaBackend | None = None) -> Exporter:
    """``backend`` says how to fill a bank and which handles to export (default: host)."""
    if socket_dir is None:
        d = Path(tempfile.mkdtemp(prefix="kvs-life-"))
        os.chmod(d, 0o700)
        socket_dir = d / "sock"
    kind = backend.handle_kind if backend is not None else HostBackend.handle_kind
    ex = Exporter(ExportConfig(DEPLOYMENT, socket_dir, source or os.urandom(16), tp,
                               lease_timeout_s=lease_timeout_s, handle_kind=kind), transport, name=name)  # type: ignore[arg-type]
    for r in range(tp):
        bank = ex.add_bank(r, GEOMETRY)
        bank.fire("register")
        if backend is None:
            bank.view()[:GEOMETRY.nbytes] = pattern(r, GEOMETRY.nbytes)
        else:
            backend.fill(bank, pattern(r, GEOMETRY.nbytes))
        bank.fire("advertise")
    ex.start()
    _created.append(ex)
    return ex


_created: list[Exporter] = []


@pytest.fixture(autouse=True)
def release_exporters() -> Iterator[None]:
    """Every exporter a test made is drained (its leases ended by then) and stopped."""
    yield
    while _created:
        ex = _created.pop()
        ex.stop()
        for bank in ex.banks.values():
            for lease in list(bank.leases.values()):
                lease.channel.close()
        ex.drain(5.0)


@pytest.fixture
def transport() -> HostTransport:
    return HostTransport(granularity=GRANULARITY)


@pytest.fixture
def importer(transport: HostTransport) -> Iterator[Importer]:
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), transport)
    yield im
    im.close()


def expected_blocks(rank: int, blocks: list[int]) -> bytes:
    data = pattern(rank, GEOMETRY.nbytes)
    return b"".join(data[o:o + n] for b in blocks for o, n in GEOMETRY.block_extents(b))
