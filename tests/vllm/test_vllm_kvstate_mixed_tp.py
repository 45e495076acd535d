"""Heterogeneous TP between real engines: a decode engine at one TP size serves a prefill
engine at another (``source_tp``). The tiny Llama has 2 KV heads: at tp=2 each rank holds
one, at tp=1 the one rank holds both. Decode tp=2 -> prefill tp=1: the prefill rank imports
both decode banks (two parts) and scatters each head into its pages. Decode tp=1 -> prefill
tp=2: both prefill ranks lease the one decode bank, each reading its own head.

In float32, where the engines agree on greedy tokens across TP sizes (the reference is the
decode engine's own output). Each pair runs in its own class, one pair alive at a time:
reuse with identical tokens, then a corrupted decode bank (the negative control: the tokens
change), then a decode worker killed while the prefill engine loads (recomputed, the same
tokens, no kvstate mapping left in the prefill workers)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
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

LENGTHS = (100, 140, 600)


@dataclass
class Pair:
    decode: Engine
    prefill: Engine
    decode_tp: int
    prefill_tp: int

    def fresh(self, batch: list[list[int]]) -> Generation:
        assert self.prefill.reset_prefix_cache()
        return self.prefill.generate(batch, MAX_TOKENS)


def _pair(model_dir: Path, memory: MemorySampler, work: Path, decode_tp: int, prefill_tp: int) -> Iterator[Pair]:
    sockets = kit.socket_dir(work)
    box = Engines(work, memory)
    source = f"decode{decode_tp}"
    try:
        decode, prefill = start_all([
            box.make(f"decode-tp{decode_tp}", kit.spec(str(model_dir), "kv_producer", sockets, tp=decode_tp,
                                                       dtype="float32", source=source)),
            box.make(f"prefill-tp{prefill_tp}", kit.spec(str(model_dir), "kv_consumer", sockets, tp=prefill_tp,
                                                         dtype="float32", policy=kit.POLICY_ON, sources=[source],
                                                         source_tp=decode_tp)),
        ])
        yield Pair(decode, prefill, decode_tp, prefill_tp)
    finally:
        leaks = box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    assert not leaks, leaks


def _no_bank_left(engine: Engine) -> list[str]:
    return [f"{pid}: {m}" for pid in kit.worker_pids(engine) for m in kit.bank_mappings(pid)] + \
        [f"{pid}: {fd}" for pid in kit.worker_pids(engine) for fd in kit.bank_fds(pid)]


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["decode_tp2-prefill_tp1", "decode_tp1-prefill_tp2"])
def pair(request: pytest.FixtureRequest, model_dir: Path, memory: MemorySampler,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One pair at a time: pytest runs every test on the first before it starts the second."""
    decode_tp, prefill_tp = request.param
    yield from _pair(model_dir, memory, tmp_path_factory.mktemp(f"kvstate-tp{decode_tp}-tp{prefill_tp}"), decode_tp,
                     prefill_tp)


def test_every_prefill_rank_loads_its_heads_and_the_tokens_are_the_decode_engines(pair: Pair) -> None:
    batch = prompts(LENGTHS, seed=51)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    got = pair.fresh(batch)
    c = kit.reused(got, reference, LENGTHS)
    expected = kit.loadable(LENGTHS)
    assert c.get("hits") == len(batch) and c.get("tokens_matched") == sum(expected), c
    # loads_ok counts per prefill rank: each rank loaded every slice it has.
    assert c.get("loads_ok") == pair.prefill_tp * len(batch), c
    assert not any(k.startswith(("loads_failed", "rejections", "misses")) for k in c), c

def test_a_corrupted_decode_bank_changes_the_tokens(pair: Pair) -> None:
    batch = prompts(LENGTHS, seed=52)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    victim = sorted(kit.worker_pids(pair.decode))[-1]
    assert kit.corrupt_banks(pair.decode, pids=[victim]) > 0  # one decode rank's heads only
    got = pair.fresh(batch)
    assert evidence.reuse(got).external_problems(kit.loadable(LENGTHS)) == []
    for mine, theirs in zip(got.tokens, reference.tokens):
        assert mine != theirs

def test_a_decode_worker_killed_during_the_load_means_recompute(pair: Pair) -> None:
    batch = prompts((600,), seed=53)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    victim = sorted(kit.worker_pids(pair.decode))[-1]
    stop_process(victim)                         # the index answers; this rank's exporter does not
    out: dict[str, Generation] = {}
    t = threading.Thread(target=lambda: out.setdefault("g", pair.fresh(batch)))
    t.start()
    time.sleep(3.0)
    os.kill(victim, signal.SIGKILL)
    t.join(300)
    got = out["g"]
    assert got.tokens == reference.tokens
    c = kit.counters(got)
    assert c.get("hits") == len(batch), c         # promised...
    assert "loads_ok" not in c and c.get("loads_failed", 0) >= 1, c  # ...and recomputed
    assert evidence.reuse(got).recovered
    assert _no_bank_left(pair.prefill) == []
