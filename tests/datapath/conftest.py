"""An exporter and an importer of one rank group in this process, over the host backend,
for any geometry; everything a test makes is drained and released after it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvstate.core.geometry import Geometry
from kvstate.core.identity import Deployment
from kvstate.share.bank import Bank
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.share.importer import Group, ImportConfig, Importer
from kvstate.transport.host import HostTransport
from support.reuse import REUSE_ON

DEPLOYMENT = Deployment("datapath-tests", bytes(range(32)))
GRANULARITY = 64 * 1024


@attrs.define
class World:
    exporter: Exporter
    importer: Importer
    banks: list[Bank]

    def group(self, **expect: Any) -> Group:
        return self.importer.import_group([self.exporter.descriptor(b.rank) for b in self.banks], **expect)


def socket_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvs-dp-"))
    d.chmod(0o700)
    return d / "sock"


@pytest.fixture
def make_world() -> Iterator[Callable[..., World]]:
    made: list[World] = []

    def make(geometry: Geometry, tp: int = 1, *, transport: Any = None, advertise: bool = True,
             fill: Callable[[Bank], None] | None = None, observers: tuple[Any, ...] = ()) -> World:
        ex = Exporter(ExportConfig(DEPLOYMENT, socket_dir(), os.urandom(16), tp),
                      HostTransport(granularity=GRANULARITY))
        banks = []
        for r in range(tp):
            bank = ex.add_bank(r, geometry)
            bank.fire("register")
            if fill is not None:
                fill(bank)
            if advertise:
                bank.fire("advertise")
            banks.append(bank)
        ex.start()
        im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), transport or HostTransport(granularity=GRANULARITY),
                      observers=observers)
        w = World(ex, im, banks)
        made.append(w)
        return w

    yield make
    for w in made:
        for g in list(w.importer.groups):
            if g.state in ("ready", "draining"):
                g.drain(10.0)
        w.importer.close()
        w.exporter.stop()
        w.exporter.drain(10.0)
