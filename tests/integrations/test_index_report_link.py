"""A decode rank's report link (issue 28, item 5): the index's native thread takes each
rank's ``stored`` reports and advertises a block once every rank reported it, before the
index's Python (its table) hears of them. Real sockets, a served index, this process and
a child process as the ranks' processes.

What must hold: a block is findable only once every rank reported it stored (never after
one rank, never after a failure on another, however often a rank repeats itself); the
table's account follows; a link opens only from the process that said the rank's hello,
and a link that sends anything but its own rank's well-formed ``stored`` is closed with
nothing counted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.waiting import wait_until

from kvstate import channel as chan
from kvstate.core.errors import ChannelError
from kvstate.core.identity import Deployment
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.hashing import Compat, block_key
from kvstate.integrations.vllm.index import DecodeIndex
from kvstate.integrations.vllm.index_client import Found, IndexClient
from kvstate.integrations.vllm.slots import SlotTable

pytestmark = [pytest.mark.native]

DEPLOYMENT = Deployment("report-link", bytes(range(32)))
COMPAT = Compat(model="tiny", dtype="bf16", block_size=4, head_dim=8, kv_heads=2, layers=("l.0", "l.1"), tp=2,
                isa="vec", engine="test")
PREFIX = [bytes([0x20 + i]) * 16 for i in range(3)]
KEYS = [block_key(DEPLOYMENT, h, slot) for slot, h in enumerate(PREFIX)]  # a fresh table's reservation


class Decode:
    """A served tp=2 index whose two ranks are this process (main links said hello)."""

    def __init__(self, sockets: Path) -> None:
        self.path = sockets / "index.sock"
        self.table = SlotTable(16, 2, lambda h, s: block_key(DEPLOYMENT, h, s))
        self.index = DecodeIndex(self.path, COMPAT, self.table)
        self.index.start()
        self.ranks = [self._hello(r) for r in range(2)]
        assert wait_until(self.index.ready, 10), "the ranks never reached the index"
        self.client = IndexClient(self.path, DEPLOYMENT, 5.0)

    def _hello(self, rank: int) -> chan.Channel:
        ch = chan.connect(self.path, timeout=5.0, limits=wire.LIMITS)
        ch.send(wire.encode("hello", rank=rank, tp=2, pid=os.getpid(), epoch=1, compat=COMPAT.as_dict()))
        with ch.recv(timeout=5.0) as m:
            wire.decode(m.payload, "welcome")
        ch.send(wire.encode("advertised", rank=rank, descriptor=b"d%d" % rank, generation=1))
        return ch

    def link(self, rank: int) -> chan.Channel:
        ch = chan.connect(self.path, timeout=5.0, limits=wire.LIMITS)
        ch.send(wire.encode("report_link", rank=rank))
        with ch.recv(timeout=5.0) as m:
            assert wire.decode(m.payload, "linked")["rank"] == rank
        return ch

    def found(self) -> int:
        got = self.client.lookup(COMPAT, PREFIX)
        assert isinstance(got, Found), got
        return got.blocks

    def settled(self, what: str, cond: Callable[[], object]) -> None:
        assert wait_until(cond, 10), what

    def close(self) -> None:
        self.client.close()
        for ch in self.ranks:
            ch.close()
        self.index.close()


@pytest.fixture
def decode(short_sockets: Path) -> Iterator[Decode]:
    d = Decode(short_sockets)
    try:
        yield d
    finally:
        d.close()


def _closed(ch: chan.Channel) -> bool:
    """The index closed ``ch`` (its next receive ends in EOF, not a timeout)."""
    try:
        with ch.recv(timeout=5.0):
            return False
    except ChannelError as exc:
        return exc.reason.value != "timeout"


def _stored(rank: int, keys: list[int], failed: list[int] | None = None) -> bytes:
    return wire.encode("stored", rank=rank, keys=keys, failed=failed or [])


def test_a_block_is_found_once_every_rank_reported_it_before_the_table_hears(decode: Decode) -> None:
    held = decode.index.reserve(PREFIX)
    keys = [r.key for r in held]
    links = [decode.link(0), decode.link(1)]
    with decode.table._lock:  # the index's Python cannot take the reports in meanwhile
        links[0].send(_stored(0, keys))
        links[0].send(_stored(0, keys))  # a rank saying it twice is still one rank
        links[1].send(_stored(1, keys[:2]))
        decode.settled("rank 1's report never counted", lambda: decode.found() == 2)
        links[0].send(_stored(0, keys[2:]))
        time.sleep(0.05)
        assert decode.found() == 2  # the third block: one rank only
        links[1].send(_stored(1, keys[2:]))
        decode.settled("the last report never counted", lambda: decode.found() == 3)
        assert decode.index.mirror.advertised_here == 3
    decode.settled("the table never took the reports", lambda: decode.table.counts()["stored"] == 3)
    assert decode.index.mirror.advertised() == 3
    for ch in links:
        ch.close()


def test_a_store_that_failed_on_one_rank_is_never_found(decode: Decode) -> None:
    (held,) = decode.index.reserve(PREFIX[:1])
    links = [decode.link(0), decode.link(1)]
    links[0].send(_stored(0, [held.key]))
    links[1].send(_stored(1, [], failed=[held.key]))
    decode.settled("the table never took the failure", lambda: decode.table.counts()["evicting"] == 1)
    links[1].send(_stored(1, [held.key]))  # late, after the table settled the block
    links[0].send(_stored(0, [held.key]))
    decode.settled("the late reports never reached the table", lambda: decode.table.counts()["evicting"] == 1)
    time.sleep(0.05)
    assert decode.found() == 0 and decode.index.mirror.advertised() == 0 and decode.index.mirror.advertised_here == 0
    for ch in links:
        ch.close()


CHILD = textwrap.dedent("""
    import sys
    from kvstate import channel as chan
    from kvstate.core.errors import ChannelError
    from kvstate.integrations.vllm import wire
    ch = chan.connect(sys.argv[1], timeout=5.0, limits=wire.LIMITS)
    ch.send(wire.encode("report_link", rank=0))
    try:
        with ch.recv(timeout=5.0) as m:
            print(wire.decode(m.payload)["kind"])
    except ChannelError as exc:
        print("closed" if exc.reason.value != "timeout" else "timeout")
""")


def test_a_report_link_opens_only_from_the_process_that_is_the_rank(decode: Decode) -> None:
    other = subprocess.run([sys.executable, "-c", CHILD, str(decode.path)], capture_output=True, text=True,
                           timeout=60)
    assert other.stdout.strip() == "closed", other
    stranger = chan.connect(decode.path, timeout=5.0, limits=wire.LIMITS)
    stranger.send(wire.encode("report_link", rank=7))  # no such rank
    assert _closed(stranger)
    stranger.close()
    # A rank whose main link ended is no rank: its open report link counts nothing more.
    (held,) = decode.index.reserve(PREFIX[:1])
    link = decode.link(0)
    decode.ranks[0].close()
    decode.settled("the index never saw rank 0 go", lambda: not decode.index.ready())
    link.send(_stored(0, [held.key]))
    assert _closed(link)
    link.close()
    assert decode.index.mirror.advertised() == 0 and decode.index.mirror.advertised_here == 0


@pytest.mark.parametrize("payload", [
    _stored(1, KEYS),                                                  # another rank's
    wire.encode("removed", rank=0, keys=KEYS, busy=[]),                # not a store
    chan.encode({"kind": "stored", "rank": 0, "keys": [*KEYS, "1"], "failed": []}),
    chan.encode({"kind": "stored", "rank": 0, "keys": [*KEYS, -1], "failed": []}),
    chan.encode({"kind": "stored", "rank": 0, "keys": [*KEYS, 1.5], "failed": []}),
    chan.encode({"kind": "stored", "rank": 0, "keys": KEYS, "failed": [], "more": 1}),
    chan.encode({"kind": "stored", "rank": 0, "keys": KEYS}),
    chan.encode({"kind": "stored", "rank": 0, "keys": KEYS, "failed": ["x"]}),
    b"{not json",
], ids=["other-rank", "removed", "str-key", "negative-key", "float-key", "extra-field", "missing-field", "bad-failed",
       "not-json"])
def test_anything_but_the_rank_s_own_stored_report_closes_the_link(decode: Decode, payload: bytes) -> None:
    held = decode.index.reserve(PREFIX)
    assert [r.key for r in held] == KEYS
    link = decode.link(0)
    link.send(payload)
    assert _closed(link)
    link.close()
    # and nothing was counted for rank 0: rank 1 alone cannot make a block whole
    other = decode.link(1)
    other.send(_stored(1, KEYS))
    time.sleep(0.05)
    assert decode.found() == 0 and decode.index.mirror.advertised_here == 0
    other.close()


def test_while_python_s_queue_is_full_a_link_waits_and_loses_nothing(decode: Decode) -> None:
    """Python's queue of reports holds 4,096. While Python takes none (its handoff thread
    held at the queue here), the thread fills the queue, then stops reading the link: the
    report sent after stays in the socket, uncounted, even once the link's peer hung up.
    Once Python drains the queue, the thread reads the link again and takes it in."""
    held = decode.index.reserve(PREFIX)
    links = [decode.link(0), decode.link(1)]
    links[1].send(_stored(1, KEYS))
    decode.settled("rank 1's report never reached the table", lambda: decode.index.mirror.advertised_here == 0
                   and decode.table._entry(KEYS[0]) is not None and decode.table._entry(KEYS[0]).stored == {1})
    mirror, go = decode.index.mirror, threading.Event()
    take = mirror.reports

    def held_back() -> list[bytes]:
        go.wait()
        return take()

    mirror.reports = held_back  # type: ignore[method-assign]
    try:
        for i in range(4096):  # exactly fills the queue
            links[0].send(_stored(0, [1_000_000 + i]), timeout=10.0)
        links[0].send(_stored(0, [r.key for r in held]), timeout=10.0)  # waits in the socket
        links[0].close()  # hung up with a report unread
        time.sleep(0.5)  # two of the thread's ticks: a paused link stays paused
        assert decode.found() == 0 and decode.index.mirror.advertised_here == 0
    finally:
        go.set()
    decode.settled("the paused link was never read again", lambda: decode.found() == 3)
    decode.settled("the table never took every report", lambda: decode.table.counts()["stored"] == 3)
    assert decode.index.mirror.advertised_here == 3
    links[1].close()
