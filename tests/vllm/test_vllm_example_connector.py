"""The reuse and negative-control machinery, proven with vLLM's own ExampleConnector.

The producer stored each prompt's KV in files; the consumer, a separate engine alive at
the same time, loads it. In order:

1. reuse: identical tokens, every prompt's prefix counted as external, no load failure;
2. a planted load failure: vLLM recomputes (identical tokens) but still counts the
   tokens as cached, and the evidence check refuses it;
3. the negative control: corrupted stored KV is loaded and changes every prompt's
   tokens, so these weights make tokens depend on the KV;
4. SIGKILL of the producer: the consumer keeps serving, and nothing but vLLM's own
   leftovers remains.
"""

from __future__ import annotations

from pathlib import Path

from support.engines.suite import EXAMPLE_LENGTHS, MAX_TOKENS, ExamplePair, Run, prompts
from support.engines.evidence import reuse
from support.engines.kv_configs import FAIL_NEXT_LOAD

BLOCK = 32
# ExampleConnector loads the whole blocks before the last prompt token, which vLLM
# always computes itself.
LOADED = [(n - 1) // BLOCK * BLOCK for n in EXAMPLE_LENGTHS]


def reference(plain_pair: Run) -> list[list[int]]:
    """The plain engines' tokens for the ExampleConnector prompts (the first ones)."""
    return plain_pair.generations["a"].tokens[:len(EXAMPLE_LENGTHS)]


def stored_prefixes(storage: Path) -> list[Path]:
    return sorted(p for p in storage.iterdir() if p.is_dir())


def test_producer_computes_and_stores(example_pair: ExamplePair, plain_pair: Run) -> None:
    g = example_pair.produced
    assert g.tokens == reference(plain_pair)
    assert reuse(g).none_problems() == []
    assert len(stored_prefixes(example_pair.storage)) == len(EXAMPLE_LENGTHS)


def test_consumer_reuses_stored_kv_with_identical_tokens(example_pair: ExamplePair, plain_pair: Run) -> None:
    g = example_pair.consumer.generate(prompts(EXAMPLE_LENGTHS), MAX_TOKENS)
    assert reuse(g).external_problems(LOADED) == []
    assert g.tokens == reference(plain_pair)
    assert g.log.count("Inject KV cache of") >= len(EXAMPLE_LENGTHS)


def test_recovered_load_failure_is_not_reuse_evidence(example_pair: ExamplePair, plain_pair: Run) -> None:
    consumer = example_pair.consumer
    trigger = example_pair.probe_dirs["consumer"] / FAIL_NEXT_LOAD
    trigger.touch()
    assert consumer.reset_prefix_cache()
    g = consumer.generate(prompts(EXAMPLE_LENGTHS), MAX_TOKENS)
    assert not trigger.exists(), "the planted failure did not fire"
    assert g.tokens == reference(plain_pair)  # recomputed
    evidence = reuse(g)
    assert all(n > 0 for n in evidence.num_cached_tokens)  # vLLM counts them all the same
    assert evidence.recovered, g.log[-3000:]
    assert any("load failures" in p for p in evidence.external_problems(LOADED))


def test_corrupted_kv_changes_every_prompts_tokens(example_pair: ExamplePair, plain_pair: Run) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(example_pair.storage.rglob("*.safetensors"))
    assert len(files) == 2 * len(EXAMPLE_LENGTHS)  # one per layer per prompt
    gen = torch.Generator().manual_seed(7)
    for f in files:
        kv = load_file(str(f))["kv_cache"]
        noise = torch.randn(kv.shape, generator=gen) * kv.float().std()
        save_file({"kv_cache": (kv.float() + noise).to(kv.dtype)}, str(f))
    consumer = example_pair.consumer
    assert consumer.reset_prefix_cache()
    g = consumer.generate(prompts(EXAMPLE_LENGTHS), MAX_TOKENS)
    assert reuse(g).external_problems(LOADED) == []  # the corrupted KV really was loaded
    want = reference(plain_pair)
    assert all(got != w for got, w in zip(g.tokens, want)), (g.tokens, want)


def test_consumer_keeps_serving_after_producer_sigkill(example_pair: ExamplePair) -> None:
    producer, consumer = example_pair.producer, example_pair.consumer
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in producer.pids()}
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= names, names  # comm is cut at 15 bytes
    producer.kill()
    assert producer.pids() == []
    found = producer.close()
    assert found.leaks == []
    # What it did leave is vLLM's own (its ZMQ sockets, after a SIGKILL also its psm_*
    # message queues in /dev/shm), and close() removed it.
    assert found.vllm and not any(Path(p).exists() for p in found.vllm), found
    assert consumer.reset_prefix_cache()
    g = consumer.generate(prompts(EXAMPLE_LENGTHS)[:1], MAX_TOKENS)
    assert consumer.alive() and len(g.tokens[0]) == MAX_TOKENS
