"""The decode index's process of the GIL-hostile index tests
(tests/integrations/test_index_gil_hostile.py).

It serves a tp=1 decode index. In :func:`main` it is its own decode rank (``hello``,
``advertised``, then ``stored`` for a three-block prefix, over the index's socket, as a
decode worker would); once the native mirror advertises the blocks, it prints what a
lookup must find. In :func:`main_stores` the test's process is the rank: this process
waits for its ``hello`` and descriptor, reserves the prefix, and prints the keys the
rank must report stored. Either way it then holds its GIL
(:func:`support.gil_hold.hold_gil`) until the test writes its word: if what the test
asks for needed this process's Python, its questions would time out instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvstate import channel as chan
from kvstate.core.identity import Deployment
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.hashing import Compat, block_key
from kvstate.integrations.vllm.index import DecodeIndex
from kvstate.integrations.vllm.slots import SlotTable
from support.gil_hold import hold_gil, say
from support.waiting import wait_until

DEPLOYMENT = Deployment("index-gil-hostile", bytes(range(32)))
COMPAT = Compat(model="tiny", dtype="bf16", block_size=4, head_dim=8, kv_heads=2, layers=("l.0", "l.1"), tp=1,
                isa="vec", engine="test")
PREFIX = [bytes([0x10 + i]) * 16 for i in range(3)]
DESCRIPTOR = b"rank 0's descriptor"
EPOCH, GENERATION = 77, 3


@contextlib.contextmanager
def _serving() -> Iterator[DecodeIndex]:
    """A tp=1 decode index served from a private directory, closed and removed after."""
    d = Path(tempfile.mkdtemp(prefix="kvs-idx-"))
    os.chmod(d, 0o700)
    index = DecodeIndex(d / "index.sock", COMPAT, SlotTable(16, 1, lambda h, s: block_key(DEPLOYMENT, h, s)))
    index.start()
    try:
        yield index
    finally:
        index.close()
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def main(pipe_r: int) -> None:
    with _serving() as index:
        rank = chan.connect(index.path, limits=wire.LIMITS)
        rank.send(wire.encode("hello", rank=0, tp=1, pid=os.getpid(), epoch=EPOCH, compat=COMPAT.as_dict()))
        with rank.recv(timeout=10) as welcome:
            assert wire.decode(welcome.payload)["kind"] == "welcome"
        rank.send(wire.encode("advertised", rank=0, descriptor=DESCRIPTOR, generation=GENERATION))
        assert wait_until(index.ready, 30), "the rank's descriptor never reached the index"
        held = index.reserve(PREFIX)
        rank.send(wire.encode("stored", rank=0, keys=[r.key for r in held], failed=[]))
        assert wait_until(lambda: index.mirror.advertised() == len(PREFIX), 30), "the report never reached the mirror"
        word, during = hold_gil(pipe_r, path=str(index.path), slots=[r.slot for r in held],
                                keys=[r.key for r in held])
        say(event="hold returned", word=word, ticks_during_hold=during)
        rank.close()


def main_stores(pipe_r: int) -> None:
    with _serving() as index:
        say(event="serving", path=str(index.path))
        assert wait_until(index.ready, 30), "the test's rank never said hello and advertised"
        held = index.reserve(PREFIX)
        word, during = hold_gil(pipe_r, slots=[r.slot for r in held], keys=[r.key for r in held])
        # the table's own account follows once the hold ended
        assert wait_until(lambda: index.table.counts()["stored"] == len(PREFIX), 30), "the table never took the reports"
        say(event="hold returned", word=word, ticks_during_hold=during, advertised_here=index.mirror.advertised_here)


if __name__ == "__main__":
    main(int(sys.argv[1]))
