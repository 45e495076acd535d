"""The decode index's native answers (ffi/kvs_index.c) against Python's DecodeIndex._answer,
the reference: random sequences of reservations, stores that succeed or fail on some
ranks, evictions, removals, new generations and epochs, ranks that go and come back go
to one index, whose table keeps its native mirror up to date; after every step, the same
questions (lookups of known and unknown prefixes, descriptor requests) must get the same
bytes from both. Questions the mirror leaves to Python (another compatibility key,
malformed hashes) must be left to it."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

import pytest

from kvstate import channel as chan
from kvstate.core.identity import Deployment
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.hashing import Compat, block_key
from kvstate.integrations.vllm.index import DecodeIndex, _Rank
from kvstate.integrations.vllm.index_mirror import IndexMirror
from kvstate.integrations.vllm.slots import SlotState, SlotTable

pytestmark = [pytest.mark.native]

DEPLOYMENT = Deployment("index-differential", bytes(range(32)))
SEQUENCES, STEPS = 40, 120


def compat(tp: int, model: str = "tiny") -> Compat:
    return Compat(model=model, dtype="bf16", block_size=4, head_dim=8, kv_heads=2, layers=("l.0", "l.1"), tp=tp,
                  isa="vec", engine="test")


class Decode:
    """One index (not serving: the answers are asked directly) and its ranks' links."""

    def __init__(self, tmp: Path, tp: int, capacity: int) -> None:
        self.tp = tp
        self.table = SlotTable(capacity, tp, lambda h, s: block_key(DEPLOYMENT, h, s))
        self.index = DecodeIndex(tmp / "index.sock", compat(tp), self.table)
        # Real channels for the rank links (nothing is sent on them here).
        self.pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(tp)]
        self.generation = 1

    def connect(self, rank: int, epoch: int, generation: int | None) -> None:
        link = _Rank(rank, os.getpid(), epoch, chan.Channel(self.pairs[rank][0].dup()))
        if generation is not None:
            link.descriptor, link.generation = f"d{rank}g{generation}".encode(), generation
        with self.index._lock:
            old = self.index._ranks.pop(rank, None)
            self.index._ranks[rank] = link
            self.index._publish()
        if old is not None:
            old.channel.close()

    def disconnect(self, rank: int) -> None:
        with self.index._lock:
            old = self.index._ranks.pop(rank, None)
            self.index._publish()
        if old is not None:
            old.channel.close()

    def close(self) -> None:
        for r in list(self.index._ranks):
            self.disconnect(r)
        for a, b in self.pairs:
            a.close()
            b.close()


def ask(d: Decode, payload: bytes) -> tuple[bytes | None, bytes]:
    native = d.index.mirror.answer(payload)
    reference = d.index._answer(wire.decode(payload, "lookup", "descriptors"))
    return native, reference


def step(d: Decode, rng: random.Random, pool: list[bytes]) -> None:
    t = d.table
    roll = rng.random()
    if roll < 0.3:  # a finished request's prefix (touches first, as DecodeIndex.reserve)
        t.touch(d.index.mirror.touched())
        t.reserve(pool[:rng.randrange(1, len(pool) + 1)] if rng.random() < 0.5 else rng.sample(pool, 3))
        t.choose_evictions()
    elif roll < 0.6:  # ranks report stores, some failed
        storing = [e.key for e in t._slots.values() if e.state is SlotState.STORING]
        for key in rng.sample(storing, min(len(storing), rng.randrange(1, 4))):
            rank = rng.randrange(d.tp)
            (t.stored if rng.random() < 0.9 else t.store_failed)(rank, [key])
    elif roll < 0.8:  # ranks removed keys they were asked to
        for key in t.evicting()[:rng.randrange(1, 5)]:
            t.removed(rng.randrange(d.tp), [key])
    elif roll < 0.88:  # a new generation, one rank at a time (not ready in between)
        d.generation += 1
        for r in range(d.tp):
            d.connect(r, rng.randrange(1 << 64), d.generation)
    elif roll < 0.94:  # a rank goes, or comes back without descriptors yet
        r = rng.randrange(d.tp)
        if rng.random() < 0.5:
            d.disconnect(r)
        else:
            d.connect(r, rng.randrange(1 << 40), None if rng.random() < 0.3 else d.generation)
    else:
        t.touch(d.index.mirror.touched())


@pytest.mark.parametrize("tp", [1, 3])
def test_native_answers_equal_the_reference(tmp_path: Path, tp: int) -> None:
    for seq in range(SEQUENCES):
        rng = random.Random(seq * 7 + tp)
        d = Decode(tmp_path, tp, capacity=rng.choice([4, 16, 40]))
        pool = [rng.randbytes(16) for _ in range(24)]
        try:
            for r in range(tp):
                d.connect(r, rng.randrange(1 << 64), d.generation)
            for _ in range(STEPS):
                step(d, rng, pool)
                for _ in range(3):
                    if rng.random() < 0.2:
                        payload = wire.encode("descriptors", compat=compat(tp).as_dict())
                    else:
                        start = rng.randrange(len(pool))
                        hashes = pool[start:start + rng.randrange(0, 8)]
                        if rng.random() < 0.2:
                            hashes = hashes + [rng.randbytes(16)] + pool[:2]
                        payload = wire.encode("lookup", compat=compat(tp).as_dict(), hashes=b"".join(hashes))
                    native, reference = ask(d, payload)
                    assert native == reference, (seq, payload)
                stored = sum(1 for e in d.table._slots.values() if e.state is SlotState.STORED)
                assert d.index.mirror.advertised() == stored
        finally:
            d.close()
    assert d.index.lookups > 0


def test_questions_the_mirror_cannot_answer_are_left_to_python(tmp_path: Path) -> None:
    d = Decode(tmp_path, 1, capacity=4)
    try:
        d.connect(0, 5, 1)
        other = wire.encode("lookup", compat=compat(1, model="other").as_dict(), hashes=b"")
        assert d.index.mirror.answer(other) is None
        assert wire.decode(d.index._answer(wire.decode(other)))["reason"] == "model"
        ragged = chan.encode({"kind": "lookup", "compat": compat(1).as_dict(), "hashes": b"\x01" * 17})
        assert d.index.mirror.answer(ragged) is None
        too_many = wire.encode("lookup", compat=compat(1).as_dict(), hashes=b"\x02" * 16 * (wire.MAX_BLOCKS + 1))
        assert d.index.mirror.answer(too_many) is None
        hello = wire.encode("hello", rank=0, tp=1, pid=1, epoch=1, compat=compat(1).as_dict())
        assert d.index.mirror.answer(hello) is None
        assert d.index.mirror.answer(b"{not json") is None
        # and the well-formed question is answered natively
        ok = wire.encode("lookup", compat=compat(1).as_dict(), hashes=b"\x03" * 16)
        assert d.index.mirror.answer(ok) == d.index._answer(wire.decode(ok))
    finally:
        d.close()


def test_blocks_native_lookups_found_are_evicted_last(tmp_path: Path) -> None:
    """The native finds reach the table's LRU order: without them, the table would evict
    the oldest stored blocks though prefill schedulers keep loading them."""
    d = Decode(tmp_path, 1, capacity=16)
    try:
        d.connect(0, 5, 1)
        chain = [bytes([i]) * 16 for i in range(16)]
        held = d.index.reserve(chain)
        d.table.stored(0, [r.key for r in held])
        found = d.index.mirror.answer(wire.encode("lookup", compat=compat(1).as_dict(), hashes=chain[0]))
        assert found is not None and wire.decode(found)["blocks"] == 1
        d.index.reserve([b"\xff" * 16])  # none free: the two least recently used go
        evicting = {e.block_hash for e in d.table._slots.values() if e.state is SlotState.EVICTING}
        assert evicting == {chain[1], chain[2]}
        assert d.index.mirror.advertised() == 14
    finally:
        d.close()


# -- the ranks' reports: the thread's count against the table's account --------------------


class Served:
    """A mirror served on a real socket (no DecodeIndex: this test takes the thread's
    reports itself and gives them to the table, as DecodeIndex._on_stored does), its table
    attached, and tp report links from this process."""

    def __init__(self, sockets: Path, tp: int, capacity: int) -> None:
        self.tp = tp
        self.table = SlotTable(capacity, tp, lambda h, s: block_key(DEPLOYMENT, h, s))
        index = DecodeIndex(sockets / "index.sock", compat(tp), self.table)  # builds the mirror as the engine does
        self.mirror = index.mirror
        self.server = chan.Server(sockets / "index.sock", limits=wire.LIMITS)
        self.mirror.serve(self.server.fileno())
        self.mirror.ready(wire.encode("descriptor_set", descriptors=[b"d"] * tp), [1] * tp, 1)
        self.links = []
        for r in range(tp):
            self.mirror.rank(r, os.getpid())
            ch = chan.connect(self.server.path, timeout=5.0, limits=wire.LIMITS)
            ch.send(wire.encode("report_link", rank=r))
            with ch.recv(timeout=5.0) as m:
                assert wire.decode(m.payload, "linked")["rank"] == r
            self.links.append(ch)
        self.sent = 0     # reports sent on the links
        self.taken: list[bytes] = []

    def drain(self) -> list[bytes]:
        """Every report sent so far, once the thread took it (in the order sent)."""
        deadline = time.monotonic() + 10
        while len(self.taken) < self.sent:
            assert time.monotonic() < deadline, f"the thread took {len(self.taken)} of {self.sent} reports"
            self.taken += self.mirror.reports()
        new, self.taken = self.taken, []
        self.sent = 0
        return new

    def close(self) -> None:
        for ch in self.links:
            ch.close()
        self.mirror.stop()
        self.server.close()


def found(mirror: IndexMirror, tp: int, h: bytes) -> bool:
    reply = mirror.answer(wire.encode("lookup", compat=compat(tp).as_dict(), hashes=h))
    assert reply is not None
    return bool(wire.decode(reply)["blocks"])


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_the_thread_advertises_a_block_exactly_when_every_rank_reported_it_stored(tp: int) -> None:
    """Random reservations, each rank's one report per block (stored, or now and then
    failed; on its report link, or on its main link: straight to the table), evictions and
    removals. After each step, before the table takes the thread's reports, the mirror
    must find exactly the table's stored blocks and the reserved ones every rank reported
    stored on its link; once the table took them, exactly the table's stored blocks."""
    natively = 0
    for seq in range(12):
        rng = random.Random(seq * 11 + tp)
        d = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
        os.chmod(d, 0o700)
        s = Served(d, tp, capacity=rng.choice([4, 16]))
        pool = [rng.randbytes(16) for _ in range(20)]
        reported: dict[int, set[int]] = {}  # key -> ranks that reported it (either way, either link)
        on_link: dict[int, set[int]] = {}   # key -> ranks that reported it stored on their link
        try:
            for _ in range(60):
                t = s.table
                roll = rng.random()
                if roll < 0.3:
                    for r in t.reserve(rng.sample(pool, rng.randrange(1, 4))):
                        reported[r.key], on_link[r.key] = set(), set()
                    t.choose_evictions()
                elif roll < 0.85:
                    due = [(e.key, rank) for e in t._slots.values() if e.state is SlotState.STORING
                           for rank in range(tp) if rank not in reported[e.key]]
                    for key, rank in rng.sample(due, min(len(due), rng.randrange(1, 5))):
                        reported[key].add(rank)
                        stored = rng.random() < 0.9
                        if rng.random() < 0.8:
                            s.links[rank].send(wire.encode("stored", rank=rank, keys=[key] if stored else [],
                                                           failed=[] if stored else [key]))
                            s.sent += 1
                            if stored:
                                on_link[key].add(rank)
                        else:  # the main link: the table takes it, the thread never sees it
                            (t.stored if stored else t.store_failed)(rank, [key])
                else:
                    for key in t.evicting()[:rng.randrange(1, 4)]:
                        t.removed(rng.randrange(tp), [key])
                taken = s.drain()
                stored = {e.block_hash for e in t._slots.values() if e.state is SlotState.STORED}
                whole = {e.block_hash for e in t._slots.values()
                         if e.state is SlotState.STORING and len(on_link[e.key]) == tp}
                for h in pool:  # before the table takes the thread's reports
                    assert found(s.mirror, tp, h) == (h in stored or h in whole), (seq, h in stored, h in whole)
                for payload in taken:  # as DecodeIndex._on_stored
                    m = wire.decode(payload, "stored")
                    t.stored(m["rank"], m["keys"])
                    t.store_failed(m["rank"], m["failed"])
                stored = {e.block_hash for e in t._slots.values() if e.state is SlotState.STORED}
                for h in pool:
                    assert found(s.mirror, tp, h) == (h in stored), seq
                assert s.mirror.advertised() == len(stored)
            natively += s.mirror.advertised_here
        finally:
            s.close()
            for p in d.iterdir():
                p.unlink()
            d.rmdir()
    assert natively > 0  # the thread, not only the table, advertised blocks
