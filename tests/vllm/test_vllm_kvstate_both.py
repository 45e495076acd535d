"""kvstate's connector in a real ``kv_both`` engine (issue 32): an engine that loads from a
decode engine and retains its own finished requests survives a request aborted while its
load is in flight, then serves the next 20 requests with the decode engine's tokens.

Before the fix the aborted request's pages (never loaded) were stored and its free
delayed; vLLM freed it when the load reported, the store then reported it finished too,
and vLLM's scheduler failed ``assert req_id in self.requests``: EngineCore died."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.engines import kvstate_kit as kit
from support.engines.memory import MemorySampler
from support.engines.runner import Engine, start_all
from support.engines.suite import MAX_TOKENS, Engines, prompts
from support.waiting import stop_process


@pytest.fixture(scope="module")
def engines_pair(model_dir: Path, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[Engine, Engine]]:
    work = tmp_path_factory.mktemp("kvstate-both")
    sockets = kit.socket_dir(work)
    box = Engines(work, memory)
    try:
        decode, both = start_all([
            box.make("decode", kit.spec(str(model_dir), "kv_both", sockets)),
            box.make("both", kit.spec(str(model_dir), "kv_both", sockets, policy=kit.POLICY_ON, source="both",
                                      sources=["decode"])),
        ])
        yield decode, both
    finally:
        leaks = box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    assert not leaks, leaks


def test_kv_both_survives_an_abort_mid_load_and_serves_the_next_20(engines_pair: tuple[Engine, Engine]) -> None:
    decode, both = engines_pair
    aborted = prompts((600,), seed=31)[0]
    batch = prompts(tuple(100 + 9 * i for i in range(20)), seed=32)
    kit.produce(decode, [aborted], MAX_TOKENS)
    # One request at a time, on both engines: bf16 rounding depends on the step's rows.
    reference = [kit.produce(decode, [p], MAX_TOKENS).tokens[0] for p in batch]

    workers = kit.worker_pids(decode)
    assert workers
    for pid in workers:                  # its index answers, its exporter does not: the load hangs
        stop_process(pid)
    try:
        both.submit_and_abort(aborted, delay_s=2.0)
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    time.sleep(1.0)                      # the load ends, and vLLM frees the aborted request

    got = [both.generate([p], MAX_TOKENS) for p in batch]
    assert both.alive(), both.log_tail()
    assert [g.tokens[0] for g in got] == reference
    c: dict[str, float] = {}
    for g in got:
        for k, v in kit.counters(g).items():
            c[k] = c.get(k, 0) + v
    assert c.get("hits") == 21, c                  # the aborted request's load was ordered (counted after it)
    assert c.get("loads_ok", 0) + c.get("loads_failed", 0) == 21, c   # and it ended, one way or the other
    assert "AssertionError" not in both.log_since(0)
