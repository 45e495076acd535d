"""The importer process of test_native_renewal: imports a group, then holds its own GIL.

Reads one JSON line (deployment, wire descriptors, expected bytes, whether renewal is
native, how long to hold) from stdin; prints one JSON line when imported, one when the
hold is over (the group's state, the events it saw, the renewals granted meanwhile, and
whether the load returned the exporter's bytes), then waits for a line on stdin before it
drains and exits. ``sleep`` is called through ``ctypes.PyDLL``, which keeps the GIL held
for the whole call: no Python thread of this process runs meanwhile.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

from kvstate.core.errors import KvStateError
from kvstate.core.identity import Deployment
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostTransport
from support.reuse import REUSE_ON


def say(**msg: Any) -> None:
    print(json.dumps(msg), flush=True)


def renewals(importer: Importer, group: Any) -> list[int]:  # type: ignore[type-arg]
    if importer.renewal is None:
        return []
    out = []
    for part in group.parts:
        state = importer.renewal.state(part.renewal_key) if part.renewal_key is not None else None
        out.append(-1 if state is None else state.renewals)
    return out


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    transport = HostTransport(granularity=cfg["granularity"])
    deployment = Deployment(cfg["deployment"], bytes.fromhex(cfg["key"]))
    importer: Importer = Importer(ImportConfig(deployment, reuse=REUSE_ON,  # type: ignore[type-arg]
                                               native_renewal=cfg["native"]), transport)
    group = importer.import_group([bytes.fromhex(w) for w in cfg["wire"]])
    events: list[str] = []
    group.observe(lambda change: events.append(change.event))
    before = renewals(importer, group)
    say(imported=group.state, renewals=before)
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
    libc.sleep.argtypes = [ctypes.c_uint]
    libc.sleep(cfg["hold_s"])
    after = renewals(importer, group)
    state, during = group.state, list(events)
    blocks = cfg["blocks"]
    dst = [bytearray(len(bytes.fromhex(e))) for e in cfg["expected"]]
    try:
        group.load_prefix(blocks, dst)
        verified = [bytes(d) == bytes.fromhex(e) for d, e in zip(dst, cfg["expected"])]
        load_error = None
    except KvStateError as exc:
        verified, load_error = [], str(exc)
    say(state=state, during=during, events=events, renewals=after, before=before, verified=verified, load_error=load_error)
    sys.stdin.readline()
    try:
        group.drain(10.0)
    except KvStateError:
        pass
    importer.close()
    say(final=group.state)


if __name__ == "__main__":
    main()
