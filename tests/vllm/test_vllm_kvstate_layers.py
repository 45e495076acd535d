"""Per-layer loads between real engines (``layer_loads``): vLLM's CPU model runner calls
the connector's ``wait_for_layer_load`` in every layer's attention (vLLM's
``maybe_transfer_kv_layer`` wraps ``unified_attention_with_output``, which the CPU backend
runs), so the prefill request runs in the step its load is ordered and each layer waits
for its own KV only. The counters show that every layer of every load waited; the tokens
are the decode engine's; noise in the decode bank changes them (the negative control)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.engines import evidence
from support.engines import kvstate_kit as kit
from support.engines.memory import MemorySampler
from support.engines.runner import Engine, start_all
from support.engines.suite import MAX_TOKENS, Engines, prompts
from support.engines.tiny_llama import CONFIG

LENGTHS = (100, 140, 600)
LAYERS = CONFIG["num_hidden_layers"]


@pytest.fixture(scope="module")
def pair(model_dir: Path, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[Engine, Engine]]:
    work = tmp_path_factory.mktemp("kvstate-layers")
    sockets = kit.socket_dir(work)
    box = Engines(work, memory)
    try:
        decode, prefill = start_all([
            box.make("decode-layers", kit.spec(str(model_dir), "kv_producer", sockets, source="d-layers")),
            box.make("prefill-layers", kit.spec(str(model_dir), "kv_consumer", sockets, policy=kit.POLICY_ON,
                                                sources=["d-layers"], layer_loads=True)),
        ])
        yield decode, prefill
    finally:
        leaks = box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    assert not leaks, leaks


def test_every_layer_waits_for_its_own_kv_and_the_tokens_are_the_decode_engines(pair: tuple[Engine, Engine]) -> None:
    decode, prefill = pair
    batch = prompts(LENGTHS, seed=71)
    reference = kit.produce(decode, batch, MAX_TOKENS)
    assert prefill.reset_prefix_cache()
    got = prefill.generate(batch, MAX_TOKENS)
    c = kit.reused(got, reference, LENGTHS)
    assert not evidence.reuse(got).recovered
    assert c.get("hits") == len(batch) and c.get("loads_ok") == len(batch), c
    assert c.get("layer_waits") == LAYERS * len(batch), c   # vLLM called wait_for_layer_load per layer
    assert not any(k.startswith(("loads_failed", "rejections", "misses")) for k in c), c


def test_a_corrupted_bank_changes_the_tokens(pair: tuple[Engine, Engine]) -> None:
    decode, prefill = pair
    batch = prompts(LENGTHS, seed=72)
    reference = kit.produce(decode, batch, MAX_TOKENS)
    assert kit.corrupt_banks(decode) > 0
    assert prefill.reset_prefix_cache()
    got = prefill.generate(batch, MAX_TOKENS)
    assert evidence.reuse(got).external_problems(kit.loadable(LENGTHS)) == []
    for mine, theirs in zip(got.tokens, reference.tokens):
        assert mine != theirs
