"""The native attach on a rank worker's own part (kvstate.share.attach.open_part): each
worker of a coordinated group opens its share in one native call, the exporter hears the
`mapped` note, and the bytes load (INV-LOAD-BYTES). The in-process native tests are
tests/native/test_attach.py."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import DEPLOYMENT, GEOMETRY, expected_blocks, make_exporter
from kvstate.share import attach
from kvstate.transport.host import HostTransport
from support import coordinated
from support.waiting import wait_until


def test_each_rank_worker_opens_its_part_in_one_native_call(transport: HostTransport,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The plain host transport (the counting one is a wrapper, which keeps the Python path).
    monkeypatch.setattr(coordinated, "CountingTransport", lambda **kw: HostTransport(**kw))
    calls: list[int] = []
    real = attach._call
    monkeypatch.setattr(attach, "_call", lambda lib, arr, n, *a: calls.append(n) or real(lib, arr, n, *a))
    ex = make_exporter(2, transport)
    p: Any = coordinated.Prefill(DEPLOYMENT, 2, granularity=64 * 1024, config={"heartbeat_s": 0.05})
    try:
        group = p.coordinator.import_group([ex.descriptor(r) for r in range(2)])
        assert group.state == "ready"
        assert calls == [1, 1], "each worker's part: one native call of one part"
        # The mapped note reached the exporter: each bank left importing.
        assert wait_until(lambda: all(b.state == "ready" for b in ex.banks.values()))
        for w in p.workers:
            share = w.wait(group.gid, ("ready",), 5.0)
            assert share is not None and share.state == "ready"
            dst = bytearray(2 * GEOMETRY.block_bytes)
            share.load_prefix([3, 1], dst)
            assert bytes(dst) == expected_blocks(w.config.rank, [3, 1])
        group.drain(5.0)
        assert group.state == "closed"
    finally:
        p.close()
