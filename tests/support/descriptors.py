"""Builders of valid descriptors and expectations, for tests to break one rule at a time."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from kvstate.core.descriptor import Descriptor
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment, FabricDomain, FabricKind, host_boot_id
from kvstate.core.validate import Expectation

DEPLOYMENT = Deployment("test-deployment", bytes(range(32)))
GEOMETRY = Geometry.uniform(layers=2, kv_heads=2, head_dim=8, block_tokens=4, dtype=DType.BF16,
                    layout=Layout.BLOCK_MAJOR, num_blocks=16)
GRANULARITY = 4096
SOURCE = b"S" * 16
INCARNATION = b"I" * 16
DEVICE = b"D" * 16


def socket_dir() -> tuple[Path, str]:
    """A real 0700 directory holding a real listening AF_UNIX socket (kept open)."""
    d = Path(tempfile.mkdtemp(prefix="kvs-"))
    d.chmod(0o700)
    path = str(d / "export.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    _keep.append(s)
    return d, path


_keep: list[socket.socket] = []


def descriptor(rank: int = 0, tp: int = 1, socket_path: str = "/nonexistent/export.sock", **changes: Any) -> Descriptor:
    d = Descriptor(
        deployment_id=DEPLOYMENT.id, source_id=SOURCE, fabric=FabricDomain(FabricKind.NODE, "node-a"),
        host_boot_id=host_boot_id(), device_uuid=DEVICE, incarnation=INCARNATION, pid=os.getpid(),
        rank=rank, tp=tp, geometry=GEOMETRY, handle_kind=HandleKind.MEMFD, handle=bytes(16),
        size=GEOMETRY.bank_size(GRANULARITY), granularity=GRANULARITY, generation=3,
        expires_at_ns=time.time_ns() + 60 * 10**9, socket_path=socket_path, inventory_epoch=1,
    )
    return attrs.evolve(d, **changes)


def group(tp: int, socket_path: str, **changes: Any) -> list[Descriptor]:
    return [descriptor(rank=r, tp=tp, socket_path=socket_path, **changes) for r in range(tp)]


def expectation(**changes: Any) -> Expectation:
    e = Expectation(deployment=DEPLOYMENT, now_ns=time.time_ns(), handle_kinds=frozenset({HandleKind.MEMFD}),
                    host_boot_id=host_boot_id(), uid=os.getuid())
    return attrs.evolve(e, **changes)
