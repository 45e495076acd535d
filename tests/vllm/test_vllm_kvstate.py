"""kvstate's connector between real vLLM engines alive at once: a decode engine
(``kv_both`` with reuse off, the default) retains finished requests' KV in its bank and
serves it, and is the plain reference for prompts the session's plain engines did not run
(it never loads); a prefill engine (``kv_consumer``, reuse on) loads it.

The tests run in file order on one set of engines (module fixture): a first forward over
loaded KV, a load 50 ms after a store, reuse, policy off, partial prefix, block order, the
corrupted-bank control, the decode engine killed before a load and restarted (stale
descriptors), and killed during a load. Every prefill generation starts from an empty
local prefix cache, so that any reuse is kvstate's; only the block-order test's second
prompt is served from it, on purpose."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.engines import evidence, kv_configs
from support.engines import kvstate_kit as kit
from support.engines.memory import MemorySampler
from support.engines.runner import Engine, Generation, start_all
from support.engines.suite import MAX_TOKENS, PROMPT_LENGTHS, Engines, Run, prompts
from support.waiting import stop_process

BS = kit.BLOCK_TOKENS
#: How long the decode worker holds its GIL after its stores, in the test of issue 28's 50 ms.
HOLD_S = 4.0


@dataclass
class Pair:
    box: Engines
    sockets: Path
    probes: Path                    # the decode engine's probe dir (kv_configs.HOLD_GIL_AFTER_STORE)
    model: str
    decode: Engine
    prefill: Engine
    produced: dict[str, Generation] = field(default_factory=dict)

    def fresh(self, engine: Engine, batch: list[list[int]]) -> Generation:
        assert engine.reset_prefix_cache()
        return engine.generate(batch, MAX_TOKENS)


@pytest.fixture(scope="module")
def pair(model_dir: Path, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("kvstate")
    sockets = kit.socket_dir(work)
    probes = work / "probes"
    probes.mkdir()
    box = Engines(work, memory)
    try:
        decode, prefill = start_all([
            box.make("decode", kit.spec(str(model_dir), "kv_both", sockets, probe_dir=probes)),
            box.make("prefill", kit.spec(str(model_dir), "kv_consumer", sockets, policy=kit.POLICY_ON)),
        ])
        yield Pair(box, sockets, probes, str(model_dir), decode, prefill)
    finally:
        leaks = box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    assert not leaks, leaks


def test_the_prefill_engines_first_forward_runs_over_loaded_kv(pair: Pair) -> None:
    """The prefill engine's very first request loads 96 tokens and computes 4. On a CPU
    with AMX its worker died of SIGILL here (vLLM's "amx" attention uses tile state the
    worker had not asked for; kvstate.integrations.vllm.amx): it must not."""
    batch = prompts((100,), seed=12)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    got = pair.prefill.generate(batch, MAX_TOKENS)      # nothing computed before in this engine
    assert got.tokens == reference.tokens
    assert evidence.reuse(got).external_problems(kit.loadable((100,))) == []
    c = kit.counters(got)
    assert c.get("loads_ok") == 1 and c.get("tokens_loaded") == kit.loadable((100,))[0], c


def _banks(engine: Engine) -> list[Any]:
    """Read-only views of the kvstate banks in the engine's workers (numpy over the memfds)."""
    import mmap

    import numpy as np

    out = []
    for pid in kit.worker_pids(engine):
        for fd in kit.bank_fds(pid):
            with open(fd, "rb") as f:
                out.append(np.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), np.uint8))
    return out


def test_a_prefill_request_50_ms_after_a_store_completed_loads_it(pair: Pair) -> None:
    """Issue 28: the decode engine's index must know of a store without waiting for the
    decode engine's Python. The decode worker holds its GIL for HOLD_S right after it
    submitted the stores (the probe connector; an engine step's Python, or vLLM's
    busy-polling worker on a loaded machine), and so does its scheduler process (the
    EngineCore, where the index lives) meanwhile. The store's completion is seen
    from outside the engine, in its banks (their bytes changed, then stayed as they were);
    50 ms later, still within both holds, the prefill engine asks, and loads it: the
    worker's op engine reports the store on its report link, the index's native thread
    advertises it and answers the lookup, and the worker's native lease server grants the
    lease. Before, the report waited for the worker's Python, and then for the
    EngineCore's: a miss, and the prefix was computed."""
    import numpy as np

    batch = prompts((100,), seed=21)
    assert pair.prefill.reset_prefix_cache()
    (pair.probes / kv_configs.HOLD_GIL_AFTER_STORE).write_text(str(HOLD_S))
    (pair.probes / kv_configs.HOLD_SCHEDULER_GIL).write_text(str(HOLD_S))
    banks = _banks(pair.decode)
    assert banks
    before = [b.copy() for b in banks]
    out: dict[str, Generation] = {}                           # it may return before or after the hold
    t = threading.Thread(target=lambda: out.setdefault("g", pair.decode.generate(batch, MAX_TOKENS)))
    t.start()
    deadline = time.monotonic() + 60
    while all(np.array_equal(b, old) for b, old in zip(banks, before)):
        assert time.monotonic() < deadline, "the decode engine stored nothing"
        time.sleep(0.001)
    seen = [b.copy() for b in banks]
    while True:                                               # until every region's copy landed
        time.sleep(0.002)
        now = [b.copy() for b in banks]
        if all(np.array_equal(a, c) for a, c in zip(now, seen)):
            break
        seen = now
    completed = time.monotonic()
    time.sleep(0.05)
    assert time.monotonic() - completed >= 0.05
    assert not (pair.probes / kv_configs.HOLD_GIL_AFTER_STORE).exists()  # the hold began with the stores
    while (pair.probes / kv_configs.HOLD_SCHEDULER_GIL).exists():  # the scheduler's hold begins just after
        assert time.monotonic() < deadline, "the decode scheduler never held its GIL"
        time.sleep(0.001)
    asked = time.monotonic()
    got = pair.prefill.generate(batch, MAX_TOKENS)
    t.join(300)
    assert got.tokens == out["g"].tokens
    ended = pair.probes / kv_configs.HOLD_ENDED
    while not ended.exists():
        assert time.monotonic() < deadline + HOLD_S, "the decode worker's hold never ended"
        time.sleep(0.05)
    assert asked < float(ended.read_text()), "the decode worker's Python ran before the prefill engine asked"
    scheduler_ended = pair.probes / kv_configs.SCHEDULER_HOLD_ENDED
    while not scheduler_ended.exists():
        assert time.monotonic() < deadline + HOLD_S, "the decode scheduler's hold never ended"
        time.sleep(0.05)
    assert asked < float(scheduler_ended.read_text()), "the decode scheduler's Python ran before the prefill asked"
    assert evidence.reuse(got).external_problems(kit.loadable((100,))) == []
    c = kit.counters(got)
    assert c.get("loads_ok") == 1 and c.get("tokens_loaded") == kit.loadable((100,))[0], c


def test_reuse_gives_a_plain_engines_tokens_and_computes_only_the_rest(pair: Pair, plain_pair: Run) -> None:
    batch = prompts()
    pair.produced["a"] = kit.produce(pair.decode, batch, MAX_TOKENS)
    got = pair.fresh(pair.prefill, batch)
    assert got.tokens == plain_pair.generations["a"].tokens
    assert got.finish_reasons == ["length"] * len(batch)
    expected = kit.loadable(PROMPT_LENGTHS)
    assert evidence.reuse(got).external_problems(expected) == []
    c = kit.counters(got)
    assert c.get("hits") == len(batch) and c.get("tokens_matched") == sum(expected), c
    assert c.get("loads_ok") == len(batch) and c.get("tokens_loaded") == sum(expected), c
    assert c.get("bytes_loaded", 0) > 0 and c.get("load_ms", 0) > 0, c
    assert not any(k.startswith(("loads_failed", "rejections", "misses")) for k in c), c
    computed = evidence.reuse(got).by_source["local_compute"]
    assert computed == sum(PROMPT_LENGTHS) - sum(expected), computed


def test_with_the_policy_off_nothing_is_asked_or_loaded(pair: Pair, plain_pair: Run) -> None:
    got = pair.fresh(pair.decode, prompts())          # it retained them, and would not load them
    assert got.tokens == plain_pair.generations["a"].tokens
    assert evidence.reuse(got).none_problems() == []
    c = kit.counters(got)
    assert c.get("misses{reason=reuse_disabled}") == len(PROMPT_LENGTHS), c
    assert "lookups" not in c and "hits" not in c, c


def test_a_partly_shared_prefix_loads_only_the_shared_blocks(pair: Pair) -> None:
    a = prompts()
    shared = a[2][:2 * BS + 5]                        # two full blocks of a retained prompt, then a split
    tail = prompts((90,), seed=11)[0]
    batch = [shared + tail]
    got = pair.fresh(pair.prefill, batch)
    reference = pair.fresh(pair.decode, batch)        # after: the decode engine then retains all of it
    assert got.tokens == reference.tokens
    assert evidence.reuse(got).external_problems([2 * BS]) == []
    c = kit.counters(got)
    assert c.get("tokens_loaded") == 2 * BS and c.get("loads_ok") == 1, c


def test_each_loaded_page_holds_its_own_block_for_the_local_prefix_cache(pair: Pair) -> None:
    """Block order. Attention over a prefix the new tokens see whole does not depend on
    the order of its blocks, so a load that put each block into another block's page
    would pass every test above (measured: a reversed load did). vLLM keeps the loaded
    pages in its own prefix cache, and a later prompt that shares only the first blocks
    is served from them and sees just those pages: each must hold its own block."""
    long = prompts((600,), seed=50)
    kit.produce(pair.decode, long, MAX_TOKENS)
    loaded = pair.fresh(pair.prefill, long)
    assert evidence.reuse(loaded).external_problems(kit.loadable((600,))) == []
    shared = 3
    branch = [long[0][:shared * BS] + prompts((40,), seed=51)[0]]  # parts at a block's start
    got = pair.prefill.generate(branch, MAX_TOKENS)    # no reset: the loaded pages serve its prefix
    assert evidence.reuse(got).by_source["local_cache_hit"] == shared * BS
    assert evidence.reuse(got).by_source["external_kv_transfer"] == 0
    reference = pair.fresh(pair.decode, branch)       # computed whole (the decode engine never loads)
    assert got.tokens == reference.tokens


def test_a_corrupted_bank_changes_the_tokens(pair: Pair) -> None:
    """The negative control: the loaded bytes are what the prefill engine computes with."""
    batch = prompts((100, 75, 140), seed=3)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    assert kit.corrupt_banks(pair.decode) > 0
    got = pair.fresh(pair.prefill, batch)
    assert evidence.reuse(got).external_problems(kit.loadable((100, 75, 140))) == []
    for mine, theirs in zip(got.tokens, reference.tokens):
        assert mine != theirs


def _one_prompt(length: int, seed: int) -> list[list[int]]:
    """A batch for a generation whose loads fail. vLLM recomputes a failed load in whichever
    step it notices the failure, and bf16 matmuls round differently with the step's row
    count, which flips near-tie tokens (seen: a 4,096-token prompt recomputed in other
    chunks; a 600-token prompt recomputed beside another whose load failed a step earlier).
    One prompt short enough for one step is recomputed exactly as the decode engine
    computed its reference."""
    return prompts((length,), seed=seed)


def _no_bank_left(engine: Engine, timeout: float = 20.0) -> list[str]:
    """kvstate memfds still open or mapped in the engine's workers once loads drained."""
    deadline = time.monotonic() + timeout
    while True:
        left = [f"{pid}: fd {fd}" for pid in kit.worker_pids(engine) for fd in kit.bank_fds(pid)]
        left += [f"{pid}: {m}" for pid in kit.worker_pids(engine) for m in kit.bank_mappings(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def test_decode_killed_before_the_load_then_restarted(pair: Pair) -> None:
    batch = prompts((100, 140), seed=4)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    pair.decode.kill()
    got = pair.fresh(pair.prefill, batch)              # the source is gone: computed
    assert got.tokens == reference.tokens
    assert evidence.reuse(got).none_problems() == []
    c = kit.counters(got)
    assert c.get("misses{reason=unreachable}") == len(batch), c
    assert _no_bank_left(pair.prefill) == []

    # A new incarnation at the same source name and socket paths.
    pair.decode = start_all([pair.box.make("decode-2", kit.spec(pair.model, "kv_both", pair.sockets))])[0]
    batch = _one_prompt(140, seed=5)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    stale = pair.fresh(pair.prefill, batch)           # with the descriptors of the dead incarnation
    assert stale.tokens == reference.tokens
    c = kit.counters(stale)                           # each failed load's reason came with its pages
    rejected = {k: v for k, v in c.items() if k.startswith("rejections")}
    assert c.get("loads_failed", 0) >= 1 and rejected == {"rejections{reason=stale_incarnation}": c["loads_failed"]}, c
    again = pair.fresh(pair.prefill, batch)           # descriptors fetched anew: loaded
    assert again.tokens == reference.tokens
    assert evidence.reuse(again).external_problems(kit.loadable((140,))) == []
    assert _no_bank_left(pair.prefill) == []


def test_decode_killed_during_the_load(pair: Pair) -> None:
    batch = _one_prompt(600, seed=6)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    more = prompts((100,), seed=12)
    more_reference = pair.fresh(pair.decode, more)
    assert pair.prefill.reset_prefix_cache()
    workers = kit.worker_pids(pair.decode)
    assert workers
    for pid in workers:                                # its index still answers; its exporter does not
        stop_process(pid)
    out: dict[str, Generation] = {}
    t = threading.Thread(target=lambda: out.setdefault("g", pair.prefill.generate(batch, MAX_TOKENS)))
    t.start()
    time.sleep(3.0)
    pair.decode.kill()
    t.join(300)
    got = out["g"]
    assert got.tokens == reference.tokens
    c = kit.counters(got)
    assert c.get("hits") == len(batch), c              # the loads were promised...
    assert "loads_ok" not in c and c.get("loads_failed", 0) >= 1, c   # ...and recomputed
    assert sum(v for k, v in c.items() if k.startswith("rejections")) == c["loads_failed"], c  # each with why
    assert _no_bank_left(pair.prefill) == []
    # The prefill engine keeps serving.
    assert pair.fresh(pair.prefill, more).tokens == more_reference.tokens
