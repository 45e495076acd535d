"""A prefill scheduler's questions are answered, and a decode rank's stores become
findable, while the decode index's process holds its GIL (issue 28, item 5): that process
(vLLM's EngineCore) busy-polls holding it, so the index's lookups, descriptor requests and
the ranks' ``stored`` reports are served natively (ffi/kvs_index*.c). The index's process
holds its GIL in one C call (ctypes.PyDLL) that ends only on this test's word, written once
the answers came (tests/support/index_gil_hostile.py); the tests assert on the order of
events, never on wall-clock time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvstate import channel as chan
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.index_client import Found, IndexClient

pytestmark = [pytest.mark.native, pytest.mark.multiproc]

TESTS = Path(__file__).resolve().parents[1]
RUN = ("import sys; sys.path.insert(0, {tests!r}); from support import index_gil_hostile as m; "
       "getattr(m, sys.argv[2])(int(sys.argv[1]))").format(tests=str(TESTS))


def _line(p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, f"the index's process ended early (rc {p.poll()})"
    out: dict[str, Any] = json.loads(line)
    return out


def test_an_index_holding_its_gil_still_answers_lookups_and_descriptors() -> None:
    sys.path.insert(0, str(TESTS))
    from support.index_gil_hostile import COMPAT, DEPLOYMENT, DESCRIPTOR, EPOCH, GENERATION, PREFIX

    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(r), "main"], pass_fds=(r,), stdout=subprocess.PIPE,
                            text=True)
    os.close(r)
    client = None
    word = "failed: nothing asked"
    try:
        holding = _line(proc)
        assert holding["event"] == "holding"
        # From here the index's process is inside one C call with its GIL held, until the
        # word below is written. A question that needed its Python times out (Refusal).
        client = IndexClient(holding["path"], DEPLOYMENT, 10.0)
        found = client.lookup(COMPAT, [*PREFIX, b"\xee" * 16])
        with chan.connect(holding["path"], timeout=10.0, limits=wire.LIMITS) as ch:
            ch.send(wire.encode("descriptors", compat=COMPAT.as_dict()))
            with ch.recv(timeout=10.0) as msg:
                described = wire.decode(msg.payload)
        word = "done"
        # The answers can come in well under a millisecond; a hold that let Python run
        # must have the time to show it (one tick per 0.5 ms), so it lasts 50 ms more.
        time.sleep(0.05)
    finally:
        os.write(w, word.encode())
        os.close(w)
        if client is not None:
            client.close()
        returned = _line(proc)
        assert proc.wait(timeout=60) == 0
    # Both answers came while the hold lasted: it returned with the word already there,
    # and no Python ran in the index's process meanwhile (one switch may land at each edge).
    assert returned["event"] == "hold returned" and returned["word"] == "done", returned
    assert returned["ticks_during_hold"] <= 2, returned
    assert found == Found(3, tuple(holding["slots"]), tuple(holding["keys"]), (EPOCH,), GENERATION), found
    assert described == {"kind": "descriptor_set", "descriptors": [DESCRIPTOR]}, described


def test_a_store_reported_on_the_rank_s_link_is_found_while_the_index_holds_its_gil() -> None:
    """This process is the decode rank: it says hello and advertises (the index's Python
    takes those before its hold), opens its report link, and once the index's process
    holds its GIL with the prefix reserved, reports the prefix stored on that link, as its
    op engine would. A lookup must then find the whole prefix, during the hold: the native
    thread counted the store. Without the report link (the report on the main link, which
    the index's Python reads) the lookup finds nothing until the hold ends."""
    sys.path.insert(0, str(TESTS))
    from support.index_gil_hostile import COMPAT, DEPLOYMENT, DESCRIPTOR, GENERATION, PREFIX

    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(r), "main_stores"], pass_fds=(r,),
                            stdout=subprocess.PIPE, text=True)
    os.close(r)
    rank = reports = client = None
    word = "failed: nothing asked"
    try:
        serving = _line(proc)
        assert serving["event"] == "serving"
        rank = chan.connect(serving["path"], timeout=10.0, limits=wire.LIMITS)
        rank.send(wire.encode("hello", rank=0, tp=1, pid=os.getpid(), epoch=5, compat=COMPAT.as_dict()))
        with rank.recv(timeout=10.0) as welcome:
            assert wire.decode(welcome.payload, "welcome")["tp"] == 1
        rank.send(wire.encode("advertised", rank=0, descriptor=DESCRIPTOR, generation=GENERATION))
        reports = chan.connect(serving["path"], timeout=10.0, limits=wire.LIMITS)
        reports.send(wire.encode("report_link", rank=0))
        with reports.recv(timeout=10.0) as linked:
            assert wire.decode(linked.payload, "linked")["rank"] == 0
        holding = _line(proc)
        assert holding["event"] == "holding"
        # From here the index's process runs no Python until the word below is written.
        client = IndexClient(serving["path"], DEPLOYMENT, 10.0)
        assert client.lookup(COMPAT, PREFIX) == Found(0, (), (), (5,), GENERATION)  # reserved, not stored
        reports.send(wire.encode("stored", rank=0, keys=holding["keys"], failed=[]))
        found = client.lookup(COMPAT, PREFIX)
        give_up = time.monotonic() + 10  # not a timing goal: without the native count this never ends
        while isinstance(found, Found) and found.blocks < len(PREFIX) and time.monotonic() < give_up:
            found = client.lookup(COMPAT, PREFIX)  # the thread reads the link, then answers
        word = "done"
        time.sleep(0.05)  # a hold that let Python run must have the time to show it (see above)
    finally:
        os.write(w, word.encode())
        os.close(w)
        for c in (client, reports, rank):
            if c is not None:
                c.close()
        returned = _line(proc)
        assert proc.wait(timeout=60) == 0
    assert returned["event"] == "hold returned" and returned["word"] == "done", returned
    assert returned["ticks_during_hold"] <= 2, returned
    assert found == Found(3, tuple(holding["slots"]), tuple(holding["keys"]), (5,), GENERATION), found
    assert returned["advertised_here"] == len(PREFIX), returned
