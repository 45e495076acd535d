"""MLA KV between real engines: a tiny DeepSeek-V2-style model (:mod:`support.engines.
tiny_deepseek`, seeded weights) on vLLM's CPU_MLA backend, whose cache is one latent of 576
values per token and layer in blocks of 16 tokens (vLLM forces both). A decode and a
prefill engine run it in bfloat16: the prefill engine loads every full block before each
prompt's last token and computes only the rest; noise in the decode bank changes the
tokens (the negative control).

Which tokens are the reference: CPU_MLA computes a prompt over cached context in two parts
(the context through ``run_prefill_context_chunk``, the new tokens through dense attention,
merged by their log-sum-exp), while a prompt without context is one dense attention; and
its prefill output depends on which prompts share the step (measured: a 140-token prompt's
first token is 419 next to another prompt, 314 alone). A prompt over loaded KV
then gives other greedy tokens than the same prompt recomputed, sometimes from the first
token on (measured, the three prompts in one step: 1 of 3 first tokens differ), with
either connector. So the reference for the prefill engine is vLLM's own
ExampleConnector loading the same prompts' KV on this model, every prompt alone in its
step in both: identical KV in, identical tokens out. In float32 the backend's decode is not
repeatable (one prompt run twice in one engine gives other tokens), so bfloat16 is run.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator

import pytest
from support.engines import evidence, kv_configs, tiny_deepseek
from support.engines import kvstate_kit as kit
from support.engines.memory import MemorySampler
from support.engines.runner import Engine, EngineError, EngineSpec, Generation, start_all
from support.engines.suite import MAX_TOKENS, Engines, prompts

LENGTHS = (100, 140, 600)
BATCH = prompts(LENGTHS, seed=81)
NOISED = prompts(LENGTHS, seed=82)  # the negative control's prompts


def _mla(spec: EngineSpec) -> EngineSpec:
    return dataclasses.replace(spec, block_size=tiny_deepseek.BLOCK_TOKENS, attention_backend=tiny_deepseek.BACKEND)


def _loadable(lengths: tuple[int, ...]) -> list[int]:
    b = tiny_deepseek.BLOCK_TOKENS
    return [(n - 1) // b * b for n in lengths]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_deepseek.write_model(tmp_path_factory.mktemp("tiny-deepseek"), seed=0))


@pytest.fixture(scope="module")
def example(model: str, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """BATCH then NOISED through vLLM's ExampleConnector on one engine, each prompt
    computed and stored, then loaded (the second run, whose tokens these are). Closed
    before the pair starts."""
    work = tmp_path_factory.mktemp("example-mla")
    box = Engines(work, memory)
    try:
        (engine,) = start_all([box.make("example-mla", _mla(EngineSpec(
            model, kv_transfer=kv_configs.example(work / "kv-store"))))])
        _alone(engine, BATCH + NOISED)
        loaded = _alone(engine, BATCH + NOISED)
    finally:
        leaks = box.close_all()
    assert not leaks, leaks
    _loaded_from_outside(loaded)
    return _tokens(loaded)


@pytest.fixture(scope="module")
def pair(model: str, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[Engine, Engine]]:
    work = tmp_path_factory.mktemp("kvstate-mla")
    sockets = kit.socket_dir(work)
    box = Engines(work, memory)
    try:
        yield tuple(start_all([  # type: ignore[misc]
            box.make("decode-mla", _mla(kit.spec(model, "kv_producer", sockets, source="d-mla"))),
            box.make("prefill-mla", _mla(kit.spec(model, "kv_consumer", sockets, policy=kit.POLICY_ON,
                                                  sources=["d-mla"]))),
        ]))
    finally:
        leaks = box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    assert not leaks, leaks


def _alone(engine: Engine, batch: list[list[int]], *, store: bool = False) -> list[Generation]:
    """Each prompt in a step of its own (see the module docstring); ``store``: wait for
    the decode engine's stores of each."""
    return [kit.produce(engine, [p], MAX_TOKENS) if store else engine.generate([p], MAX_TOKENS) for p in batch]


def _tokens(gens: list[Generation]) -> list[list[int]]:
    return [g.tokens[0] for g in gens]


def _loaded_from_outside(gens: list[Generation]) -> None:
    for g, n in zip(gens, LENGTHS + LENGTHS):
        assert evidence.reuse(g).external_problems(_loadable((n,))) == []  # fewer prompt tokens computed


def test_mla_kv_is_reused_with_the_tokens_of_the_same_kv(example: list[list[int]],
                                                          pair: tuple[Engine, Engine]) -> None:
    decode, prefill = pair
    _alone(decode, BATCH, store=True)
    got = _alone(prefill, BATCH)
    assert _tokens(got) == example[:len(BATCH)]  # the same KV, loaded by vLLM's ExampleConnector
    _loaded_from_outside(got)
    for g, n in zip(got, _loadable(LENGTHS)):
        c = kit.counters(g)
        assert c.get("loads_ok") == 1 and c.get("tokens_loaded") == n, c
        assert not any(k.startswith(("loads_failed", "rejections", "misses")) for k in c), c


def test_a_corrupted_mla_bank_changes_the_tokens(example: list[list[int]], pair: tuple[Engine, Engine]) -> None:
    decode, prefill = pair
    _alone(decode, NOISED, store=True)
    assert kit.corrupt_banks(decode) > 0
    got = _alone(prefill, NOISED)
    _loaded_from_outside(got)
    for mine, theirs in zip(_tokens(got), example[len(BATCH):]):
        assert mine != theirs


def test_an_engine_on_amx_mla_is_refused_with_the_way_out(model: str, memory: MemorySampler,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """On a CPU with AMX tiles vLLM runs MLA on AMX_MLA unless told otherwise, and kvstate
    has never run that backend's block layout: the connector refuses it when the worker
    registers its caches, and says to pin CPU_MLA, instead of sharing blocks it cannot
    vouch for."""
    torch = pytest.importorskip("torch")
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX tiles here: vLLM runs MLA on CPU_MLA, which the tests above cover")
    work = tmp_path_factory.mktemp("kvstate-amx-mla")
    sockets = kit.socket_dir(work)
    box = Engines(work, memory)
    try:
        engine = box.make("decode-amx-mla", dataclasses.replace(  # vLLM's own backend choice, in AMX_MLA's blocks
            kit.spec(model, "kv_producer", sockets, source="d-amx"), block_size=2 * tiny_deepseek.BLOCK_TOKENS))
        with pytest.raises(EngineError):
            start_all([engine])
        log = engine.log_path.read_text(errors="replace")
        assert "ConfigInvalid: attention: MLA KV is shared from vLLM's CPU_MLA backend only" in log, log[-4000:]
    finally:
        leaks = box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    assert not leaks, leaks
