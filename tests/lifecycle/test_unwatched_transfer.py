"""A load that cannot be watched for a reason other than an OS error (no thread for the
dispatcher) leaves nothing in flight either: its ops are aborted before it raises, and
the group drains (found by a review; the syscall failure test covers the OS errors)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import GEOMETRY, make_exporter
from kvstate.core.errors import TransferFailed
from kvstate.core.reasons import TransferFailReason
from kvstate.share import transfer
from kvstate.share.importer import Importer
from kvstate.transport.host import HostTransport

pytestmark = [pytest.mark.native]


def test_a_load_whose_dispatcher_cannot_start_aborts_its_ops(transport: HostTransport, importer: Importer,
                                                             monkeypatch: Any) -> None:
    ex = make_exporter(1, transport, name="unwatched")
    group = importer.import_group([ex.descriptor(0)])

    def no_thread(handle: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(transfer._dispatcher, "register", no_thread)
    dst = bytearray(2 * GEOMETRY.block_bytes)
    with pytest.raises(TransferFailed) as failed:
        group.load_prefix([0, 1], {0: dst}, timeout=10.0)
    assert failed.value.reason is TransferFailReason.LOAD and "cannot be watched" in str(failed.value)
    monkeypatch.undo()
    assert all(p.pins() == 0 for p in group.parts)  # nothing of it is in flight
    group.drain(10.0)
    assert group.state == "closed"
