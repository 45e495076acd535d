"""A decode rank's stored blocks reach its index without the rank's Python (issue 28,
item 5): the op engine sends the ``stored`` report itself as the store's last op ends.

The rank runs in a child process whose GIL is then held for seconds by one long C call
(``ctypes.PyDLL``, which keeps the GIL, as vLLM's busy-polling worker nearly does). The
test observes the store's completion from outside that process, in the bank's memfd
(the stored bytes have all landed), waits 50 ms more, and only then asks the index from
this process: the block must be found. Before, the report waited for the rank's
completion callback and link thread, so the lookup missed for as long as the GIL was held."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstate.integrations.vllm import config as cfgmod
from kvstate.integrations.vllm.decode_rank import DecodeRank
from kvstate.integrations.vllm.layout import INVENTORY_GROUP
from kvstate.integrations.vllm.orders import StoreOrder
from kvstate.integrations.vllm.stats import Tally
from kvstate.transport.host import HostTransport
from kvstate.integrations.vllm.hashing import Compat, block_key
from kvstate.integrations.vllm.index import DecodeIndex
from kvstate.integrations.vllm.index_client import Found, IndexClient
from kvstate.integrations.vllm.slots import SlotTable

BS, HD, HEADS, PAGES = 4, 8, 2, 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
ENV = {cfgmod.KEY_ENV: bytes(range(32)).hex()}
HOLD_S = 3.0  # how long the rank's GIL is held after its store is submitted

#: The decode rank: connect, report, then on "go" store page 3 into bank block 0 and hold
#: the GIL. It prints its bank memfd's fd number and the stored block's nonzero byte count.
CHILD = textwrap.dedent("""
    import ctypes, os, sys, torch
    from kvstate.integrations.vllm import config as cfgmod
    from kvstate.integrations.vllm.decode_rank import DecodeRank
    from kvstate.integrations.vllm.hashing import Compat
    from kvstate.integrations.vllm.orders import StoreOrder
    from kvstate.integrations.vllm.stats import Tally
    BS, HD, HEADS, PAGES = {BS}, {HD}, {HEADS}, {PAGES}
    LAYERS = {LAYERS!r}
    cfg = cfgmod.parse({{"retain_bytes": 16 * 2 * HEADS * BS * 2 * HD * 2, "socket_dir": sys.argv[1]}}, "kv_producer",
                       {ENV!r})
    compat = Compat(model="tiny", dtype="bf16", block_size=BS, head_dim=HD, kv_heads=HEADS, layers=LAYERS, tp=1,
                    isa="vec", engine="test")
    g = torch.Generator().manual_seed(1)
    caches = {{n: (torch.rand(PAGES, HEADS, BS, 2 * HD, generator=g) + 1).to(torch.bfloat16) for n in LAYERS}}
    rank = DecodeRank(cfg, compat, 0, caches, Tally())
    def memfd(f):
        try:
            return os.readlink("/proc/self/fd/" + f).startswith("/memfd:kvstate")
        except OSError:
            return False  # the listing's own fd
    fd = [f for f in os.listdir("/proc/self/fd") if memfd(f)]
    nonzero = sum(int((caches[n][3].view(torch.uint8) != 0).sum()) for n in LAYERS)
    print(fd[0], nonzero, flush=True)
    key = int(sys.stdin.readline())
    rank.store(StoreOrder("req", (3,), (0,), (key,)))
    ctypes.PyDLL(None).usleep(int({HOLD_S} * 1e6))  # the GIL stays held: no Python thread runs here
    print("released", flush=True)
    sys.stdin.readline()
    rank.close()
""")


@pytest.mark.multiproc
def test_a_lookup_50_ms_after_a_store_completed_finds_it_while_the_ranks_gil_is_held(short_sockets: Path) -> None:
    sockets = short_sockets
    cfg = cfgmod.parse({"socket_dir": str(sockets)}, "kv_producer", ENV)
    compat = Compat(model="tiny", dtype="bf16", block_size=BS, head_dim=HD, kv_heads=HEADS, layers=LAYERS, tp=1,
                    isa="vec", engine="test")
    table = SlotTable(16, 1, lambda h, s: block_key(cfg.deployment, h, s))
    index = DecodeIndex(cfg.index_path(cfg.source), compat, table)
    index.start()
    code = CHILD.format(BS=BS, HD=HD, HEADS=HEADS, PAGES=PAGES, LAYERS=LAYERS, ENV=ENV, HOLD_S=HOLD_S)
    child = subprocess.Popen([sys.executable, "-c", code, str(sockets)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    client = IndexClient(cfg.index_path(cfg.source), cfg.deployment, 2.0)
    try:
        assert child.stdout is not None and child.stdin is not None
        fd, nonzero = (int(x) for x in child.stdout.readline().split())
        deadline = time.monotonic() + 30
        while not index.ready():                       # the rank connected and advertised
            assert time.monotonic() < deadline, "the rank never reached the index"
            time.sleep(0.01)
        block = b"\x01" * 16
        (reservation,) = index.reserve([block])
        assert reservation.slot == 0
        with open(f"/proc/{child.pid}/fd/{fd}", "rb") as f:
            bank = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            child.stdin.write(f"{reservation.key}\n")
            child.stdin.flush()
            # The completion, seen from outside the rank: every stored byte is in the bank.
            while sum(1 for b in bank if b) < nonzero:
                assert time.monotonic() < deadline, "the store never landed in the bank"
                time.sleep(0.001)
            completed = time.monotonic()
        finally:
            bank.close()
        time.sleep(0.05)
        asked = time.monotonic()
        got = client.lookup(compat, [block])
        answered = time.monotonic()
        assert asked - completed >= 0.05
        assert answered - completed < HOLD_S, "the rank's GIL was released before the answer: nothing shown"
        assert isinstance(got, Found) and got.blocks == 1 and got.slots == (0,) and got.keys == (reservation.key,), got
        assert child.stdout.readline().strip() == "released"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0
    finally:
        client.close()
        if child.poll() is None:
            child.kill()
            child.wait()
        index.close()


class _Decode:
    """An index and one decode rank in this process (the rank's link may start later)."""

    def __init__(self, sockets: Path) -> None:
        self.cfg = cfgmod.parse({"retain_bytes": 16 * 2 * HEADS * BS * 2 * HD * 2, "socket_dir": str(sockets)},
                                "kv_producer", ENV)
        self.compat = Compat(model="tiny", dtype="bf16", block_size=BS, head_dim=HD, kv_heads=HEADS, layers=LAYERS,
                             tp=1, isa="vec", engine="test")
        self.table = SlotTable(16, 1, lambda h, s: block_key(self.cfg.deployment, h, s))
        self.index = DecodeIndex(self.cfg.index_path(self.cfg.source), self.compat, self.table)
        g = torch.Generator().manual_seed(2)
        caches = {n: torch.randn(PAGES, HEADS, BS, 2 * HD, generator=g).to(torch.bfloat16) for n in LAYERS}
        self.rank = DecodeRank(self.cfg, self.compat, 0, caches, Tally())
        self.client = IndexClient(self.cfg.index_path(self.cfg.source), self.cfg.deployment, 2.0)

    def wait(self, cond: object, what: str) -> None:
        deadline = time.monotonic() + 20
        while not cond():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    def close(self) -> None:
        self.client.close()
        self.rank.close()
        self.index.close()


@pytest.fixture
def decode(short_sockets: Path) -> Iterator[_Decode]:
    d = _Decode(short_sockets)
    try:
        yield d
    finally:
        d.close()


@pytest.mark.native
def test_a_store_made_before_the_link_is_up_is_reported_by_the_rank_once_it_is(decode: _Decode) -> None:
    """No link, no native report: the rank sends the outcome itself when it connects."""
    (r,) = decode.table.reserve([b"\x02" * 16])      # the scheduler's reservation (the index is not up yet)
    decode.rank.store(StoreOrder("req", (3,), (r.slot,), (r.key,)))
    decode.wait(lambda: decode.rank.finished({"req"}) == {"req"}, "the store")
    assert decode.table.counts()["storing"] == 1     # nobody told the index yet
    decode.index.start()
    decode.wait(decode.index.ready, "the rank's link")
    decode.wait(lambda: decode.table.counts()["stored"] == 1, "the rank's own report")
    got = decode.client.lookup(decode.compat, [b"\x02" * 16])
    assert isinstance(got, Found) and got.keys == (r.key,), got
    assert r.key in decode.rank.inventory.hashes(INVENTORY_GROUP)


@pytest.mark.native
def test_a_cancelled_store_is_reported_failed_and_leaves_the_inventory(decode: _Decode) -> None:
    """The op engine sends the failed report; the index never advertises the block and
    frees it; the rank drops the key it took at submit."""
    decode.index.start()
    decode.wait(decode.index.ready, "the rank's link")
    (r,) = decode.index.reserve([b"\x03" * 16])
    native = HostTransport().native
    native.pause(True)
    try:
        decode.rank.store(StoreOrder("req", (3,), (r.slot,), (r.key,)))
        assert r.key in decode.rank.inventory.hashes(INVENTORY_GROUP)   # taken at submit
        (handle,) = decode.rank._handles
        handle.cancel()
    finally:
        native.pause(False)
    decode.wait(lambda: decode.table.counts()["free"] == 16, "the failed report to free the block")
    decode.wait(lambda: decode.rank.finished({"req"}) == {"req"}, "the store's end")
    assert handle.report_status == "sent_failed"
    got = decode.client.lookup(decode.compat, [b"\x03" * 16])
    assert isinstance(got, Found) and got.blocks == 0, got
    assert r.key not in decode.rank.inventory.hashes(INVENTORY_GROUP)


@pytest.mark.native
def test_a_store_that_ends_before_bank_store_returns_is_still_reported_by_the_op_engine(decode: _Decode) -> None:
    """The race that armed the report too late: here every op of the store has ended, and
    kvstate's dispatcher has finished the handle, before ``Bank.store`` returns to the
    rank. The report was armed inside the submit, so the op engine sent it anyway (when
    armed after the submit, it could no longer be, and the rank's Python had to send it)."""
    decode.index.start()
    decode.wait(decode.index.ready, "the rank's link")
    real = decode.rank.bank.store

    def store_then_finish(*args: object, **kwargs: object) -> object:
        handle = real(*args, **kwargs)  # type: ignore[arg-type]
        assert handle.wait(20)  # the dispatcher finished it: ops reaped, callbacks run
        return handle

    decode.rank.bank.store = store_then_finish  # type: ignore[method-assign]
    (r,) = decode.index.reserve([b"\x04" * 16])
    decode.rank.store(StoreOrder("req", (3,), (r.slot,), (r.key,)))
    (handle,) = decode.rank._handles
    assert handle.done() and handle.report_status == "sent_ok"
    decode.wait(lambda: decode.table.counts()["stored"] == 1, "the engine's report")
    got = decode.client.lookup(decode.compat, [b"\x04" * 16])
    assert isinstance(got, Found) and got.keys == (r.key,), got
