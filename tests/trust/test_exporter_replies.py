"""The exporter is a peer too: whatever a (buggy or hostile) same-uid server answers to a
lease request, the importer fails the group with a typed error, rolls back and keeps
nothing (INV-ROLLBACK-COMPLETE)."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from kvstate import channel as chan
from kvstate.core.descriptor import encode
from kvstate.core.errors import ImportFailed, KvStateError
from kvstate.core.reasons import ImportReason
from kvstate.core.handles import HandleKind
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostTransport

from support.descriptors import DEPLOYMENT, GRANULARITY, descriptor
from support.reuse import REUSE_ON

BAD_GRANTS: list[Any] = [
    {"ok": True},
    {"ok": True, "lease": "1", "expires_in_s": 5},
    {"ok": True, "lease": 1, "expires_in_s": "5"},
    {"ok": True, "lease": 1, "expires_in_s": 1e300},
    {"ok": True, "lease": True, "expires_in_s": 5},
    {"ok": True, "lease": 1, "expires_in_s": -1},
    b'{"ok":true,"lease":1,"expires_in_s":1e999}',  # JSON that parses to infinity
    b"not json",
    b"[1]",
]


def _serve_once(server: chan.Server, reply: Any, fd: int, stop: threading.Event) -> None:
    try:
        with server.accept(timeout=5.0) as ch:
            ch.recv(timeout=5.0).close()
            payload = reply if isinstance(reply, bytes) else chan.encode(reply)
            ch.send(payload, [fd])  # the advertised memfd itself: only the reply is wrong
            while not stop.is_set():  # answer nothing more; the importer gives up or closes
                try:
                    ch.recv(timeout=0.05).close()
                except KvStateError as exc:
                    if isinstance(exc, ChannelError) and exc.reason is ChannelReason.TIMEOUT:
                        continue
                    return
    except KvStateError:
        pass


@pytest.mark.parametrize("reply", BAD_GRANTS, ids=range(len(BAD_GRANTS)))
def test_malformed_grants_fail_the_group_typed(reply: Any) -> None:
    d = Path(tempfile.mkdtemp(prefix="kvs-reply-"))
    d.chmod(0o700)
    server = chan.Server(d / "fake.sock")
    stop = threading.Event()
    exporting = HostTransport(granularity=GRANULARITY)
    size = descriptor().size
    allocation = exporting.create(size)
    handle = exporting.export(allocation, HandleKind.MEMFD)
    t = threading.Thread(target=_serve_once, args=(server, reply, handle.fd, stop))
    t.start()
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, request_timeout_s=1.0), HostTransport(granularity=GRANULARITY))
    try:
        wire = encode(descriptor(socket_path=str(d / "fake.sock"), handle=handle.identity), DEPLOYMENT)
        with pytest.raises(ImportFailed) as info:
            im.import_group([wire], incarnations=None)
        assert info.value.reason is ImportReason.MALFORMED and "failed (malformed): import" not in str(info.value)
        assert im.groups[-1].state == "failed"
        assert all(p.mapping is None for p in im.groups[-1].parts)
    finally:
        stop.set()
        t.join(10)
        server.close()
        im.close()
        exporting.release(allocation)
