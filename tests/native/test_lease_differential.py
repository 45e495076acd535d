"""The native lease handler (ffi/kvs_lease_answer.c, on ffi/kvs_lease.c) against the Python
reference it replaced (tests/support/lease_reference.py): the same random sequences of
frames (grants, batches, renewals, releases, mapped notes single and batched, hang-ups,
expiry ticks, max_leases pressure, drains, re-advertisements, malformed frames) go to
both, and after every step the answers (ok, code, lease ids, fd counts, batch shapes),
the banks' states and the lease tables must agree. Details (free text) and remaining
terms (clocks) are not compared; a term must be within the lease timeout.

Leases naming inventory blocks too: the native server re-validates and pins them in its
mirror of the exporter's inventory; the reference pinned them in a Python inventory. Both
inventories see the same stores, removals and clears (whose refusals, a leased block,
must agree), and after every step the same blocks, epochs and lease counts per block."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvstate.core.errors import Busy
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.identity import Deployment
from kvstate.reuse.inventory import Inventory
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.transport.host import HostTransport
from support.lease_reference import RefBank, RefServer

pytestmark = [pytest.mark.native]

DEPLOYMENT = Deployment("lease-differential", bytes(range(32)))
GEOMETRY = Geometry.uniform(layers=1, kv_heads=1, head_dim=8, block_tokens=4, dtype=DType.BF16,
                            layout=Layout.LAYER_MAJOR, num_blocks=4)
TP, MAX_LEASES, TIMEOUT_S = 3, 3, 30.0
SEQUENCES, STEPS = 120, 40
GROUPS, HASHES = ("g", "h"), range(8)


class Pair:
    """One native exporter (not listening: requests go through its handler directly) and
    the reference over banks in the same states."""

    def __init__(self, transport: HostTransport) -> None:
        d = Path(tempfile.mkdtemp(prefix="kvs-ldiff-"))
        os.chmod(d, 0o700)
        self.inventories = (Inventory(64), Inventory(64))  # native, reference (no eviction: see agree)
        self.ex = Exporter(ExportConfig(DEPLOYMENT, d / "sock", os.urandom(16), TP, max_leases=MAX_LEASES,
                                        lease_timeout_s=TIMEOUT_S), transport, inventory=self.inventories[0])
        self.ref_banks = {r: RefBank(r, MAX_LEASES, TIMEOUT_S) for r in range(TP)}
        for r in range(TP):
            self.ex.add_bank(r, GEOMETRY).fire("register")
            self.ref_banks[r].fire("register")
            self.advertise(r)
        self.ref = RefServer(self.ref_banks, self.ex.incarnation.value.hex(),
                             lambda b: self.ex.banks[b.rank].lease_report(),
                             lambda b: self.ex.banks[b.rank].exported().fd, self.inventories[1],
                             lambda b: (self.ex.banks[b.rank].block_epochs.fd, GEOMETRY.num_blocks))
        self.conns: list[int] = []
        self.granted: list[int] = [0]

    def advertise(self, rank: int) -> None:
        self.ex.banks[rank].fire("advertise")
        self.ref_banks[rank].fire("advertise")

    def connect(self) -> int:
        conn = self.ex.lease_server.open_connection(os.getpid())
        self.conns.append(conn)
        return conn

    def close(self) -> None:
        for conn in self.conns:
            self.ex.lease_server.close_connection(conn, importer_closed=True)
        for bank in self.ex.banks.values():
            if bank.may("drain"):
                bank.fire("drain")
        self.ex.drain(5.0)


def normal(reply: dict[str, Any] | None, nfds: int) -> Any:
    if reply is None:
        return None
    out = {k: v for k, v in reply.items() if k not in ("detail", "expires_in_s")}
    if "expires_in_s" in reply:
        assert 0 <= reply["expires_in_s"] <= TIMEOUT_S, reply
    if "grants" in reply:
        out["grants"] = [normal(g, 0)[0] for g in reply["grants"]]
    return out, nfds


def blocks(rng: random.Random, p: Pair) -> Any:
    """What a lease names of the inventory: mostly well formed (held, or not quite), some not."""
    group = rng.choice(GROUPS + ("nope",))
    epoch = p.inventories[0].epoch(group)
    held = sorted(p.inventories[0].hashes(group)) if epoch is not None else []
    hashes = rng.sample(held, rng.randint(1, len(held))) if held and rng.random() < 0.7 else \
        rng.sample(list(HASHES), rng.randint(1, 3))
    want: dict[str, Any] = {"group": group, "epoch": epoch if epoch is not None and rng.random() < 0.85
                            else rng.choice([0, 1, 10 ** 30]), "hashes": hashes}
    roll = rng.random()
    if roll < 0.06:
        return rng.choice(["x", 3, [1], True])
    if roll < 0.12:
        del want[rng.choice(list(want))]
    elif roll < 0.22:
        want[rng.choice(list(want))] = rng.choice([None, -1, 1.5, True, "", "1", [], {}, {"a": 1}, [True], [-1],
                                                   [2 ** 64], [2 ** 64 - 1], [1, 1], [1.0], 10 ** 30, -10 ** 30])
    return want


def request(rng: random.Random, p: Pair) -> bytes:
    """One frame: mostly well formed, some subtly or grossly not."""
    ex = p.ex
    rank = rng.choice([0, 1, 2, 2, 7, -1])
    lease = rng.choice(p.granted[-6:] + [0, 99])
    gen = ex.banks[rank].generation if rank in ex.banks and rng.random() < 0.8 else rng.choice([0, 5])
    inc = ex.incarnation.value.hex() if rng.random() < 0.9 else "00" * 16
    kind = rng.randrange(14)
    if kind < 3:
        obj: Any = {"op": "lease", "rank": rank, "generation": gen, "incarnation": inc}
        if rng.random() < 0.5:
            obj["blocks"] = blocks(rng, p)
    elif kind == 3:
        ranks = rng.sample(range(TP), rng.randint(1, TP))
        obj = {"op": "leases", "items": [{"rank": r, "generation": ex.banks[r].generation if rng.random() < 0.85
                                           else 9, "incarnation": inc} for r in ranks]}
        for item in obj["items"]:
            if rng.random() < 0.5:
                item["blocks"] = blocks(rng, p)
        if rng.random() < 0.1:
            obj["items"].append(rng.choice([{"rank": rank, "blocks": blocks(rng, p)}, {"blocks": blocks(rng, p)},
                                            {"rank": "1", "blocks": blocks(rng, p)}, 7]))
    elif kind < 6:
        obj = {"op": "renew", "rank": rank, "lease": lease}
    elif kind < 8:
        obj = {"op": "release", "rank": rank, "lease": lease}
    elif kind == 8:
        obj = {"op": rng.choice(["mapped", "block_epochs"]), "rank": rank, "lease": lease}
    elif kind == 9:
        obj = {"op": "mapped", "items": [{"rank": r, "lease": rng.choice(p.granted[-4:])} for r in range(TP)][
            :rng.randint(0, TP)]}
    elif kind == 10:  # a field of the wrong type, or a big int
        obj = {"op": rng.choice(["lease", "renew", "release"]), "rank": rank, "lease": lease, "generation": gen,
               "incarnation": inc}
        key = rng.choice(["op", "rank", "lease", "generation", "incarnation"])
        obj[key] = rng.choice([None, True, 1.5, "x", [1], {"a": 1}, 10 ** 30, 3])
    elif kind == 11:  # batches of the wrong shape
        obj = rng.choice([{"op": "leases"}, {"op": "leases", "items": []}, {"op": "leases", "items": "x"},
                          {"op": "leases", "items": [{"rank": 0, "op": "lease"}]},
                          {"op": "leases", "items": [{"rank": 0}, {"rank": 0}]},
                          {"op": "leases", "items": [{"rank": "0"}]}, {"op": "leases", "items": [1]},
                          {"op": "leases", "items": [{"rank": 0}], "x": 1},
                          {"op": "leases", "items": [{"rank": r} for r in range(TP + 1)]},
                          {"op": "mapped", "items": [{"rank": 0}]}, {"op": "mapped", "items": [{"rank": 0, "lease":
                                                                                                  lease, "x": 1}]}])
    elif kind == 12:
        obj = rng.choice([{"op": "nonsense", "rank": rank, "lease": lease}, {"rank": rank}, {}, {"op": "lease"},
                          {"op": "status", "x": 1}])
    else:  # not JSON, or not an object
        return rng.choice([b"", b"{", b"[1,2]", b"42", b'{"op":"lease",}', b"\xff\xfe", b'{"a":1,"a":2}',
                           b'{"op":NaN}', b"null", b'{"op":"renew","rank":01}'])
    return json.dumps(obj, separators=(",", ":")).encode()


def agree(p: Pair, where: str) -> None:
    native, ref = p.inventories
    for g in GROUPS:
        assert (native.epoch(g), native.hashes(g)) == (ref.epoch(g), ref.hashes(g)), f"{where}: group {g}"
        busy = [(native.busy(g, h), ref.busy(g, h)) for h in HASHES]
        assert all(a == b for a, b in busy), f"{where}: group {g} pins and leases {busy}"
    for r in range(TP):
        nb, rb = p.ex.banks[r], p.ref_banks[r]
        assert nb.state == rb.state, f"{where}: rank {r} state {nb.state} vs {rb.state}"
        native = {i: (x.channel.id, x.expired) for i, x in nb.leases.items()}
        ref = {i: (x.conn, x.expired) for i, x in rb.leases.items()}
        assert native == ref, f"{where}: rank {r} leases {native} vs {ref}"


def step(rng: random.Random, p: Pair, n: int) -> None:
    roll = rng.random()
    if roll < 0.05 and p.conns:  # hang-up
        conn = p.conns.pop(rng.randrange(len(p.conns)))
        p.ex.lease_server.close_connection(conn, importer_closed=True)
        p.ref.hang_up(conn)
        where = f"step {n}: hang-up of {conn}"
    elif roll < 0.09:  # every live lease runs out
        p.ex.lease_server.expire(TIMEOUT_S + 1)
        p.ref.expire(TIMEOUT_S + 1)
        where = f"step {n}: expiry tick"
    elif roll < 0.11:
        r = rng.randrange(TP)
        if p.ex.banks[r].may("advertise"):
            p.advertise(r)
        where = f"step {n}: advertise {r}"
    elif roll < 0.12:
        r = rng.randrange(TP)
        if p.ex.banks[r].may("drain"):
            p.ex.banks[r].fire("drain")
            p.ref_banks[r].fire("drain")
        where = f"step {n}: drain {r}"
    elif roll < 0.24:  # the engine changes its inventory: both refuse the same removals
        group, hashes = rng.choice(GROUPS), rng.sample(list(HASHES), rng.randint(1, 4))
        what = rng.choice(["store", "store", "remove", "clear"])
        outcomes = []
        for inv in p.inventories:
            try:
                if what == "store":
                    inv.store(group, hashes)
                elif what == "remove":
                    inv.remove(group, hashes)
                else:
                    inv.clear(group)
                outcomes.append("ok")
            except Busy:
                outcomes.append("busy")
        where = f"step {n}: {what} {group} {hashes}"
        assert outcomes[0] == outcomes[1], f"{where}: native {outcomes[0]}, reference {outcomes[1]}"
    else:
        if not p.conns or rng.random() < 0.1:
            p.connect()
        conn = rng.choice(p.conns)
        frame = request(rng, p)
        reply, fds = p.ex.lease_server.handle(conn, frame)
        native = None if reply is None else json.loads(reply)
        ref, ref_fds = p.ref.serve(conn, frame)
        where = f"step {n}: {frame!r:.200} on {conn}"
        assert normal(native, len(fds)) == normal(ref, len(ref_fds)), f"{where}: {native} vs {ref}"
        for answer in [native] + (native or {}).get("grants", []):
            if isinstance(answer, dict) and answer.get("ok") and "lease" in answer:
                p.granted.append(answer["lease"])
    agree(p, where)


def test_native_lease_handler_answers_as_the_python_reference() -> None:
    transport = HostTransport()
    for seed in range(SEQUENCES):
        rng = random.Random(seed)
        p = Pair(transport)
        try:
            agree(p, "start")
            for n in range(STEPS):
                step(rng, p, n)
        finally:
            p.close()
