"""The two processes of the GIL-hostile lease test (tests/lifecycle/test_gil_hostile.py).

``exporter``: a tp=2 exporter over host memory, each bank filled with its rank's pattern.
It prints its descriptors, then holds its GIL (:func:`support.gil_hold.hold_gil`) until
the importer writes its word, so the test needs no clock: if leases needed this process's
Python, the importer could not lease and would write ``failed`` instead.

``importer``: leases, maps and loads the group from the descriptors, verifies the bytes,
and writes ``done`` (or ``failed: why``) to the pipe.

With ``blocks``, the exporter keeps a retained inventory (blocks 11, 12, 13 of group
``prefix``), and the importer's leases name two of them, as the vLLM connector's do: the
native lease server re-validates and pins them without the exporter's Python.

With ``tcp``, the exporter exports NIXL handles and listens on TCP (loopback), as for
importers on other nodes, and ``tcp_importer`` speaks the control protocol over it as a
remote part does: per rank a connection (the deployment key's handshake), a lease, a
``mapped`` notice, two renewals and a release. Every step is served by the exporter's
native lease thread (``ffi/kvs_lease_tcp.c``) while its Python is frozen.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from kvstate.core.descriptor import decode
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.identity import Deployment
from kvstate.reuse.inventory import Inventory
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.share.importer import BlockRequest, ImportConfig, Importer
from kvstate.transport.host import HostTransport
from support.gil_hold import hold_gil, say
from support.reuse import REUSE_ON

DEPLOYMENT = Deployment("gil-hostile", bytes(range(32)))
GEOMETRY = Geometry.uniform(layers=2, kv_heads=2, head_dim=16, block_tokens=8, dtype=DType.BF16,
                            layout=Layout.LAYER_MAJOR, num_blocks=32)
TP = 2
BLOCKS = [5, 0, 31, 2]
GROUP, HELD, NAMED = "prefix", (11, 12, 13), (11, 13)


def pattern(rank: int, nbytes: int) -> bytes:
    unit = bytes((rank * 37 + i) % 251 for i in range(251))
    return (unit * (nbytes // len(unit) + 1))[:nbytes]


def expected(rank: int) -> bytes:
    data = pattern(rank, GEOMETRY.nbytes)
    return b"".join(data[o:o + n] for b in BLOCKS for o, n in GEOMETRY.block_extents(b))


def exporter(pipe_r: int, mode: str) -> None:
    d = Path(tempfile.mkdtemp(prefix="kvs-gil-"))
    os.chmod(d, 0o700)
    inventory = None
    if mode == "blocks":
        inventory = Inventory(8)
        inventory.store(GROUP, HELD)
    if mode in ("tcp", "tcp-short"):  # tcp-short: one-second leases (an importer's renewals are the test)
        from kvstate.core.handles import HandleKind
        from kvstate.transport.nixl import NixlTransport
        from kvstate.transport.nixl.exporting import NixlExportingHost

        config = ExportConfig(DEPLOYMENT, d / "sock", os.urandom(16), TP, handle_kind=HandleKind.NIXL,
                              tcp_listen=("127.0.0.1", 0), lease_timeout_s=1.0 if mode == "tcp-short" else 30.0)
        ex = Exporter(config, NixlExportingHost(HostTransport(granularity=64 * 1024), NixlTransport()))
    else:
        ex = Exporter(ExportConfig(DEPLOYMENT, d / "sock", os.urandom(16), TP), HostTransport(), inventory=inventory)
    for r in range(TP):
        bank = ex.add_bank(r, GEOMETRY)
        bank.fire("register")
        bank.view()[:GEOMETRY.nbytes] = pattern(r, GEOMETRY.nbytes)
        bank.fire("advertise")
    ex.start()
    word, during = hold_gil(pipe_r, descriptors=[ex.descriptor(r).hex() for r in range(TP)],
                            epoch=None if inventory is None else inventory.epoch(GROUP))
    states_after = [b.state for b in ex.banks.values()]
    say(event="hold returned", word=word, ticks_during_hold=during, bank_states=states_after)
    if inventory is not None:  # the importer drained: its leases ended natively, and their pins
        say(event="pins", leased=[inventory.busy(GROUP, h)[1] for h in HELD])
    ex.stop()
    for b in ex.banks.values():
        for lease in list(b.leases.values()):
            lease.channel.close()
    ex.drain(10.0)
    say(event="released", bank_states=[b.state for b in ex.banks.values()])


def importer(pipe_w: int, epoch: str, descriptors: list[str]) -> None:
    word = "failed: nothing ran"
    try:
        im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, request_timeout_s=5.0), HostTransport())
        blocks = None if epoch == "-" else BlockRequest(GROUP, (int(epoch),) * TP, NAMED)
        group = im.import_group([bytes.fromhex(d) for d in descriptors], blocks=blocks)
        dst = [bytearray(len(BLOCKS) * GEOMETRY.block_bytes) for _ in range(TP)]
        group.load_prefix(BLOCKS, dst)
        ok = all(bytes(dst[r]) == expected(r) for r in range(TP))
        word = "done" if ok and group.state == "ready" else f"failed: bytes {ok}, group {group.state}"
        group.drain()
        im.close()
    except Exception as exc:  # reported through the pipe: the exporter's hold must end either way
        word = f"failed: {type(exc).__name__}: {exc}"
    finally:
        os.write(pipe_w, word.encode()[:255])
    say(word=word)


def tcp_importer(pipe_w: int, descriptors: list[str]) -> None:
    from kvstate import channel as chan
    from kvstate.channel.tcp import connect_tcp
    from kvstate.share.part import lease_request

    word = "failed: nothing ran"
    steps: list[str] = []
    chans = []
    try:
        for hexed in descriptors:
            desc = decode(bytes.fromhex(hexed), DEPLOYMENT)
            ch = connect_tcp(desc.socket_path, DEPLOYMENT, timeout=5.0)  # tcp://: the native handshake
            chans.append(ch)

            def ask(payload: bytes) -> dict[str, object]:
                ch.send(payload, timeout=5.0)
                with ch.recv(timeout=5.0) as msg:
                    answer: dict[str, object] = chan.decode(msg.payload)
                return answer

            grant = ask(lease_request(desc, None))
            assert grant.get("ok") is True and type(grant.get("lease")) is int, grant
            lease = grant["lease"]
            steps.append(f"leased {desc.rank}")
            # A notice, never answered: the renewal behind it must be the next answer.
            ch.send(chan.encode({"op": "mapped", "rank": desc.rank, "lease": lease}), timeout=5.0)
            for _ in range(2):
                renewed = ask(chan.encode({"op": "renew", "rank": desc.rank, "lease": lease}))
                assert renewed.get("ok") is True, renewed
                steps.append(f"renewed {desc.rank}")
            released = ask(chan.encode({"op": "release", "rank": desc.rank, "lease": lease}))
            assert released.get("ok") is True, released
            steps.append(f"released {desc.rank}")
        word = "done"
    except Exception as exc:  # reported through the pipe: the exporter's hold must end either way
        word = f"failed: {type(exc).__name__}: {exc}"
    finally:
        for c in chans:
            c.close()
        os.write(pipe_w, word.encode()[:255])
    say(word=word, steps=steps)


def main() -> None:
    role, fd = sys.argv[1], int(sys.argv[2])
    if role == "exporter":
        exporter(fd, sys.argv[3] if sys.argv[3:] else "bank")
    elif role == "tcp_importer":
        tcp_importer(fd, sys.argv[3:])
    else:
        importer(fd, sys.argv[3], sys.argv[4:])


if __name__ == "__main__":
    main()
