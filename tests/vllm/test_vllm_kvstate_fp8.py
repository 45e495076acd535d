"""FP8 KV between real engines: ``kv_cache_dtype`` "fp8_e4m3" and "fp8_e5m2" on vLLM's CPU
backend (uint8 cache tensors holding the FP8 bits; the attention kernel quantizes with one
K and one V scale per layer, 1 here: the tiny Llama's checkpoint sets none). A decode and a
prefill engine run with the same FP8 format: reuse gives the decode engine's tokens, and
noise in the decode bank changes them (the negative control: the loaded FP8 bits are what
the prefill engine computes with). One pair per format, one at a time."""

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

LENGTHS = (100, 140, 600)


@pytest.fixture(scope="module", params=["fp8_e4m3", "fp8_e5m2"])
def pair(request: pytest.FixtureRequest, model_dir: Path, memory: MemorySampler,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    fmt = request.param
    work = tmp_path_factory.mktemp(f"kvstate-{fmt}")
    sockets = kit.socket_dir(work)
    box = Engines(work, memory)
    try:
        yield tuple(start_all([  # type: ignore[misc]
            box.make(f"decode-{fmt}", kit.spec(str(model_dir), "kv_producer", sockets, dtype="float32",
                                               kv_cache_dtype=fmt, source=f"d-{fmt}")),
            box.make(f"prefill-{fmt}", kit.spec(str(model_dir), "kv_consumer", sockets, dtype="float32",
                                                kv_cache_dtype=fmt, policy=kit.POLICY_ON, sources=[f"d-{fmt}"])),
        ]))
    finally:
        leaks = box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    assert not leaks, leaks


def test_fp8_kv_is_reused_with_the_decode_engines_tokens(pair: tuple[Engine, Engine]) -> None:
    decode, prefill = pair
    batch = prompts(LENGTHS, seed=61)
    reference = kit.produce(decode, batch, MAX_TOKENS)
    assert prefill.reset_prefix_cache()
    got = prefill.generate(batch, MAX_TOKENS)
    c = kit.reused(got, reference, LENGTHS)
    expected = kit.loadable(LENGTHS)
    assert c.get("loads_ok") == len(batch) and c.get("tokens_loaded") == sum(expected), c
    assert not any(k.startswith(("loads_failed", "rejections", "misses")) for k in c), c


def test_a_corrupted_fp8_bank_changes_the_tokens(pair: tuple[Engine, Engine]) -> None:
    decode, prefill = pair
    batch = prompts(LENGTHS, seed=62)
    reference = kit.produce(decode, batch, MAX_TOKENS)
    assert kit.corrupt_banks(decode) > 0
    assert prefill.reset_prefix_cache()
    got = prefill.generate(batch, MAX_TOKENS)
    assert evidence.reuse(got).external_problems(kit.loadable(LENGTHS)) == []
    for mine, theirs in zip(got.tokens, reference.tokens):
        assert mine != theirs
