"""A prefill scheduler's questions are answered while the decode index's process holds its
GIL (issue 28, item 5): that process (vLLM's EngineCore) busy-polls holding it, so the
index's lookups and descriptor requests are served natively (ffi/kvs_index*.c). The index's
process holds its GIL in one C call (ctypes.PyDLL) that ends only on this test's word,
written once both answers came (tests/support/index_gil_hostile.py); the test asserts on
the order of events, never on wall-clock time."""

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
from kvstate.integrations.vllm.index import Found, IndexClient

pytestmark = [pytest.mark.native, pytest.mark.multiproc]

TESTS = Path(__file__).resolve().parents[1]
RUN = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from support.index_gil_hostile import main; main(int(sys.argv[1]))"


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
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(r)], pass_fds=(r,), stdout=subprocess.PIPE, text=True)
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
