"""Per-layer loads overlap the forward pass, shown without a clock: the connector's real
per-layer path (vLLM's ``Scheduler`` and model-runner connector mixin, a real source
engine, the native op engine; contract_harness.py) with the copy of the last layer held
in the op engine. The op engine is paused and allowed exactly one op, the first of the
load's ops in submit order, which are one per layer in layer order: layer 0's copy runs,
the last layer's stays queued, provably not started. The "model" calls
``wait_for_layer_load`` before each layer's attention, as vLLM's does: the wait for layer
0 returns with layer 0's pages loaded while the last layer's pages are still empty; the
hold is then released and the wait for the last layer returns with its pages loaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import contract_harness as h
from contract_harness import BS, LAYERS, Engine
from kvstate.transport.native import Native, default

PROMPT = list(range(100, 100 + 3 * BS + 5))  # 3 full blocks and 5 tokens


class LayeredEngine(Engine):
    """A consumer whose model waits for each layer's load before reading that layer, and
    records what the pages of the loaded blocks held when each wait returned."""

    def __init__(self, *args: Any, native: Native, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.native = native
        self.seen: list[tuple[str, list[float], list[float]]] = []  # (layer waited, first layer, last layer)

    def _forward(self, so: Any) -> dict[str, list[int]]:
        if "hit" in so.num_scheduled_tokens:
            (pages,) = self.scheduler.kv_cache_manager.get_block_ids("hit")
            loaded = pages[:len(PROMPT) // BS]
            for layer in LAYERS:
                self.worker.wait_for_layer_load(layer)
                self.seen.append((layer, [float(self.caches[LAYERS[0]][p].max()) for p in loaded],
                                  [float(self.caches[LAYERS[-1]][p].max()) for p in loaded]))
                if layer == LAYERS[0]:
                    self.native.pause(False)  # release the last layer's copy
        return super()._forward(so)

    def violations(self) -> list[str]:
        # A per-layer load belongs to its step (vLLM never waits for it), so it is never
        # reported in finished_recving: the harness's count of those does not apply.
        return [v for v in super().violations() if not v.startswith("finished_recving != loads ordered")]


@pytest.fixture
def made() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    try:
        yield made
    finally:
        default().pause(False)
        for e in reversed(made):
            e.close()


def test_the_wait_for_layer_0_returns_while_the_last_layer_is_still_loading(made: list[Engine],
                                                                             model_dir: Path) -> None:
    assert len(LAYERS) >= 2
    sockets = h.socket_dir()
    native = default()
    src = Engine("src", "kv_producer", model_dir, sockets)
    made.append(src)
    src.add("seed", PROMPT)
    h.run_all([src])
    assert src.sending["seed"] == 1
    want = [h.fill(PROMPT[:(b + 1) * BS]) for b in range(len(PROMPT) // BS)]
    eng = LayeredEngine("eng", "kv_consumer", model_dir, sockets, sources=("src",), native=native,
                        extra={"layer_loads": True, "load_timeout_s": 60.0})
    made.append(eng)
    # Ordered at once, before the rank's connect thread may have joined the coordinator:
    # start_layers waits for the worker (else the load would be recomputed as not ready).
    eng.add("hit", PROMPT + [1, 2])
    native.pause(True)
    native.allow(1)  # the load's first op: layer 0's copy
    h.run_all([eng, src])
    first, last = LAYERS[0], LAYERS[-1]
    assert [s[0] for s in eng.seen] == list(LAYERS)
    assert eng.seen[0] == (first, want, [0.0] * len(want))  # layer 0 loaded, the last layer not yet
    assert eng.seen[-1] == (last, want, want)
    assert eng.loads_ordered["hit"] == 1 and eng.recving["hit"] == 0 and not eng.bad_reads
    problems = {e.name: e.violations() for e in made}
    assert not any(problems.values()), problems
