"""kvstate's connector between two real tp=2 engines: every rank is its own vLLM worker
process, and a group is ready only once both ranks' parts are imported.

In float32, so that the engines agree to the bit (see the tp_pair fixture). The tests run
in file order on one set of engines: reuse, then a corrupted bank on either worker (the
negative controls: each rank's part is what that rank computes with), then one decode
worker stopped (its rank's lease cannot be granted: no rank loads anything)."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.engines import evidence
from support.engines import kvstate_kit as kit
from support.engines.memory import MemorySampler
from support.engines.runner import Engine, Generation, start_all
from support.engines.suite import MAX_TOKENS, Engines, prompts
from support.waiting import stop_process

TP = 2
LENGTHS = (100, 140, 600)


@dataclass
class Pair:
    decode: Engine
    prefill: Engine

    def fresh(self, batch: list[list[int]]) -> Generation:
        assert self.prefill.reset_prefix_cache()
        return self.prefill.generate(batch, MAX_TOKENS)


@pytest.fixture(scope="module")
def tp2(model_dir: Path, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("kvstate-tp2")
    sockets = kit.socket_dir(work)
    box = Engines(work, memory)
    try:
        decode, prefill = start_all([
            box.make("decode-tp2", kit.spec(str(model_dir), "kv_both", sockets, tp=TP, dtype="float32")),
            box.make("prefill-tp2", kit.spec(str(model_dir), "kv_consumer", sockets, tp=TP, dtype="float32",
                                             policy=kit.POLICY_ON)),
        ])
        yield Pair(decode, prefill)
    finally:
        leaks = box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    assert not leaks, leaks


def test_both_ranks_load_and_the_tokens_are_the_decode_engines(tp2: Pair) -> None:
    batch = prompts(LENGTHS, seed=21)
    reference = kit.produce(tp2.decode, batch, MAX_TOKENS)
    got = tp2.fresh(batch)
    c = kit.reused(got, reference, LENGTHS)
    expected = kit.loadable(LENGTHS)
    assert c.get("hits") == len(batch) and c.get("tokens_matched") == sum(expected), c
    # loads_ok and tokens_loaded count per rank: each of the two workers loaded its part.
    assert c.get("loads_ok") == TP * len(batch) and c.get("tokens_loaded") == TP * sum(expected), c
    assert not any(k.startswith(("loads_failed", "rejections", "misses")) for k in c), c


@pytest.mark.parametrize("victim", [0, 1])
def test_a_corrupted_bank_on_either_worker_changes_the_tokens(tp2: Pair, victim: int) -> None:
    batch = prompts(LENGTHS, seed=30 + victim)
    reference = kit.produce(tp2.decode, batch, MAX_TOKENS)
    workers = sorted(kit.worker_pids(tp2.decode))
    assert len(workers) == TP, workers
    assert kit.corrupt_banks(tp2.decode, pids=[workers[victim]]) > 0  # one rank's KV heads only
    got = tp2.fresh(batch)
    assert evidence.reuse(got).external_problems(kit.loadable(LENGTHS)) == []
    for mine, theirs in zip(got.tokens, reference.tokens):
        assert mine != theirs


def test_a_stopped_decode_worker_means_no_rank_loads(tp2: Pair) -> None:
    batch = prompts(LENGTHS, seed=40)
    reference = kit.produce(tp2.decode, batch, MAX_TOKENS)
    stopped = sorted(kit.worker_pids(tp2.decode))[1]
    stop_process(stopped)                             # its exporter cannot answer a lease
    try:
        got = tp2.fresh(batch)
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert got.tokens == reference.tokens
    assert evidence.reuse(got).recovered              # vLLM recomputed the promised tokens
    c = kit.counters(got)
    assert c.get("hits") == len(batch), c             # promised, then refused on both ranks:
    assert "loads_ok" not in c and c.get("loads_failed") == TP * len(batch), c
    assert sum(v for k, v in c.items() if k.startswith("rejections")) == len(batch), c
    left = [f"{pid}: {m}" for pid in kit.worker_pids(tp2.prefill) for m in kit.bank_mappings(pid)]
    assert left == []                                 # the other rank opened nothing it kept
