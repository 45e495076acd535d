"""The decode index's process of the GIL-hostile lookup test
(tests/integrations/test_index_gil_hostile.py).

It serves a tp=1 decode index and is its own decode rank (``hello``, ``advertised``, then
``stored`` for a three-block prefix, over the index's socket, as a decode worker would).
Once the native mirror advertises the blocks, it prints what a lookup must find, then
holds its GIL in one C call, ``read()`` on the pipe the test writes when its questions
are answered, made through ``ctypes.PyDLL`` (which keeps the GIL for the whole call). A
Python ticker thread counts while the GIL is free, so the count before and after the
hold says whether any Python ran during it. The hold ends only on the test's word: if the
answers needed this process's Python, the test's questions would time out instead.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvstate import channel as chan
from kvstate.core.identity import Deployment
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.hashing import Compat, block_key
from kvstate.integrations.vllm.index import DecodeIndex
from kvstate.integrations.vllm.slots import SlotTable

DEPLOYMENT = Deployment("index-gil-hostile", bytes(range(32)))
COMPAT = Compat(model="tiny", dtype="bf16", block_size=4, head_dim=8, kv_heads=2, layers=("l.0", "l.1"), tp=1,
                isa="vec", engine="test")
PREFIX = [bytes([0x10 + i]) * 16 for i in range(3)]
DESCRIPTOR = b"rank 0's descriptor"
EPOCH, GENERATION = 77, 3


def say(**what: object) -> None:
    print(json.dumps(what), flush=True)


def main(pipe_r: int) -> None:
    d = Path(tempfile.mkdtemp(prefix="kvs-idx-"))
    os.chmod(d, 0o700)
    table = SlotTable(16, 1, lambda h, s: block_key(DEPLOYMENT, h, s))
    index = DecodeIndex(d / "index.sock", COMPAT, table)
    index.start()
    rank = chan.connect(d / "index.sock", limits=wire.LIMITS)
    rank.send(wire.encode("hello", rank=0, tp=1, pid=os.getpid(), epoch=EPOCH, compat=COMPAT.as_dict()))
    with rank.recv(timeout=10) as welcome:
        assert wire.decode(welcome.payload)["kind"] == "welcome"
    rank.send(wire.encode("advertised", rank=0, descriptor=DESCRIPTOR, generation=GENERATION))
    deadline = time.monotonic() + 30
    while not index.ready():
        assert time.monotonic() < deadline, "the rank's descriptor never reached the index"
        time.sleep(0.005)
    held = index.reserve(PREFIX)
    rank.send(wire.encode("stored", rank=0, keys=[r.key for r in held], failed=[]))
    while index.mirror.advertised() < len(PREFIX):
        assert time.monotonic() < deadline, "the stored report never reached the mirror"
        time.sleep(0.005)
    ticks = [0]
    stop = threading.Event()

    def ticker() -> None:  # runs only while this process's GIL is free
        while not stop.wait(0.0005):
            ticks[0] += 1

    threading.Thread(target=ticker, daemon=True).start()
    while ticks[0] < 3:  # the ticker runs before the hold
        stop.wait(0.001)
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held for the whole call
    libc.read.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    libc.read.restype = ctypes.c_ssize_t
    buf = ctypes.create_string_buffer(256)
    say(event="holding", path=str(d / "index.sock"), slots=[r.slot for r in held], keys=[r.key for r in held])
    # A long switch interval keeps the edges of the call nearly free of GIL switches; a
    # switch the ticker had already asked for can still land there (one tick each side).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    before = ticks[0]
    n = libc.read(pipe_r, buf, 255)  # returns once the test wrote its word
    during = ticks[0] - before
    sys.setswitchinterval(interval)
    stop.set()
    say(event="hold returned", word=buf.raw[:max(n, 0)].decode(errors="replace"), ticks_during_hold=during)
    rank.close()
    index.close()
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


if __name__ == "__main__":
    main(int(sys.argv[1]))
