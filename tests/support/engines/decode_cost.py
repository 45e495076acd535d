"""What kvstate's connector costs a decode engine (issue 28, "engine cost"), for
``kvstate bench --suite vllm``: decode throughput with the connector storing every
finished request's full blocks, against the same engine without a connector, in one run.

Both engines run side by side; samples alternate between them, each timed only after
both stopped burning CPU (:mod:`support.engines.quiet`). One sample is one ``generate``
of ``BATCH`` prompts the engine never saw, ``MAX_TOKENS`` new tokens each, timed in the
engine process; its figure is seconds per generated token (the tokens actually
generated: a request may stop early at its end-of-sequence token). The kvstate engine
stores every full block of every finished request (``kv_producer``: its stores run on
the op engine, their reports natively); its ``stores_ok`` counter must grow by the
batch size, or the row says the stores did not happen.

``python -m support.engines.decode_cost`` (with ``PYTHONPATH=tests``, vLLM's interpreter)
runs the same measure on its own: ``--hooks`` runs kvstate's connector as
:class:`~support.engines.probe.ProbeTimedKvStateConnector` and prints what each step hook
cost per engine step, and ``--model small`` uses :data:`SMALL`, a model whose decode
step computes for tens of milliseconds here (the tiny one's step, a few milliseconds for a
batch, is nearly all vLLM's Python).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from support.engines import kv_configs, kvstate_kit, quiet, tiny_llama
from support.engines.memory import MemorySampler
from support.engines.runner import Engine, EngineSpec, start_all
from support.engines.suite import Engines

BATCH, PROMPT, MAX_TOKENS = 8, 256, 64

#: A Llama of about 60M parameters (tiny_llama's shapes grown): its decode step is tens
#: of milliseconds on 2 cores, closer to a real engine's step than the tiny model's.
SMALL: dict[str, Any] = {**tiny_llama.CONFIG, "hidden_size": 1024, "intermediate_size": 2816,
                         "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8,
                         "vocab_size": 8192}


#: The models the engine cost is measured on: the test model, whose decode step (a few
#: milliseconds for a batch here) is nearly all vLLM's Python, and :data:`SMALL`.
MODELS = ("tiny", "small")


def model_for(name: str, workdir: Path) -> tuple[str | None, int | None]:
    """(model folder, decode bank bytes) of the engine-cost model ``name``, written under
    ``workdir``; None for either: :func:`measure`'s own (the test model, the kit's bank)."""
    if name == "tiny":
        return None, None
    if name == "small":  # its blocks are 8x the tiny model's: a bank that holds every batch
        return str(tiny_llama.write_model(workdir / "model", seed=0, config=SMALL)), 512 << 20
    raise ValueError(f"no engine-cost model {name!r}: one of {', '.join(MODELS)}")


@dataclass
class Cost:
    kvstate_s: list[float] = field(default_factory=list)  # seconds per generated token, connector storing
    plain_s: list[float] = field(default_factory=list)    # the same, no connector
    stored: int = 0                                        # requests whose stores the kvstate engine counted
    requests: int = 0                                      # requests it finished
    #: With hooks timed: per step hook, (calls, nanoseconds, CPU nanoseconds) over the whole
    #: run, and the tokens generated
    hooks: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    tokens: int = 0

    def ratio(self) -> float | None:
        """The kvstate engine's tokens/s as a fraction of the plain engine's (medians)."""
        if not self.kvstate_s or not self.plain_s:
            return None
        return statistics.median(self.plain_s) / statistics.median(self.kvstate_s)


def same_cores(spec: EngineSpec) -> EngineSpec:
    """``spec`` with the CPU reservation vLLM gives an engine without a connector. vLLM
    reserves one more core per rank for the engine's other processes when any
    ``kv_transfer_config`` is set (for NIXL's threads, vllm/utils/ompmultiprocessing.py);
    on 2 cores that leaves nothing to reserve, so the connector's engine would compute on
    both cores, against its own scheduler, and the two rows would time two layouts."""
    return replace(spec, env={**spec.env, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})


def _batch(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, tiny_llama.CONFIG["vocab_size"]) for _ in range(PROMPT)] for _ in range(BATCH)]


def _sample(engine: Engine, batch: list[list[int]], settle: tuple[Engine, ...]) -> tuple[float, Any]:
    if not quiet.settle(lambda: [p for e in settle for p in e.pids()]):
        print(f"warning: engines still busy after {quiet.LIMIT_S} s; timing anyway")
    g = engine.generate(batch, MAX_TOKENS)
    return g.seconds / max(1, sum(len(t) for t in g.tokens)), g


def measure(workdir: Path, repeats: int = 3, progress: Any = print, model: str | None = None,
            hooks: bool = False, retain_bytes: int | None = None) -> Cost:
    """``hooks``: kvstate's engine runs the timed probe connector, and ``Cost.hooks`` has
    what its step hooks took. ``retain_bytes``: the decode bank's size (else the kit's)."""
    model = model or str(tiny_llama.write_model(workdir / "model", seed=0))
    cost = Cost()
    sockets = kvstate_kit.socket_dir(workdir)
    probes = workdir / "hooks" if hooks else None
    if probes is not None:
        probes.mkdir(parents=True, exist_ok=True)
    box = Engines(workdir / "cost", MemorySampler())
    try:
        progress("starting 2 engines: kvstate decode (storing every finished block), plain (no connector)")
        extra: dict[str, Any] = {} if retain_bytes is None else {"retain_bytes": retain_bytes}
        kv = kvstate_kit.spec(model, "kv_producer", sockets, probe_dir=probes, probe="ProbeTimedKvStateConnector",
                              **extra)
        decode, plain = start_all([box.make("decode", same_cores(kv)), box.make("plain", same_cores(EngineSpec(model)))])
        for e in (decode, plain):  # warm-up, untimed (the decode engine stores its blocks too)
            e.generate(_batch(7), 4)
        cost.requests = BATCH
        both = (decode, plain)
        for r in range(repeats):
            # Alternate which engine goes first, so neither always follows the other's spin.
            order = (decode, plain) if r % 2 == 0 else (plain, decode)
            for engine in order:
                per_token, g = _sample(engine, _batch(100 + 2 * r + (engine is plain)), both)
                if engine is decode:
                    cost.kvstate_s.append(per_token)
                    cost.requests += BATCH
                    cost.tokens += sum(len(t) for t in g.tokens)
                else:
                    cost.plain_s.append(per_token)
        cost.stored = _stored(decode, cost.requests)
        if probes is not None:
            cost.hooks = hook_times(probes)
        ratio = cost.ratio()
        progress(f"  decode: kvstate {statistics.median(cost.kvstate_s) * 1e3:.2f} ms/token, plain "
                 f"{statistics.median(cost.plain_s) * 1e3:.2f} ms/token"
                 + (f", kvstate at {ratio:.1%} of plain tokens/s" if ratio is not None else ""))
    finally:
        box.close_all()
    return cost


def hook_times(probes: Path) -> dict[str, tuple[int, int, int]]:
    """Per step hook, (calls, nanoseconds, CPU nanoseconds), summed over the files the
    timed probe wrote (one per engine process; the last flush, every 64 steps)."""
    import json

    out: dict[str, tuple[int, int, int]] = {}
    for f in sorted(probes.glob(kv_configs.HOOK_TIMES + "-*.json")):
        for name, (calls, ns, cpu_ns) in json.loads(f.read_text()).items():
            c, t, u = out.get(name, (0, 0, 0))
            out[name] = (c + calls, t + ns, u + cpu_ns)
    return out


def hooks_table(cost: Cost) -> str:
    """Each hook's calls per step, microseconds per call (wall and the thread's CPU) and per
    step (steps: build_connector_meta's calls, one per engine step), and the totals per step
    and per generated token."""
    steps = cost.hooks.get("build_connector_meta", (0, 0, 0))[0]
    if not steps:
        return "no step timed (no hook-times file)"
    rows = ["| hook | calls per step | µs per call | CPU µs per call | µs per step | CPU µs per step |",
            "|---|---|---|---|---|---|"]
    total = total_cpu = 0
    for name, (calls, ns, cpu_ns) in sorted(cost.hooks.items(), key=lambda kv: -kv[1][1]):
        if calls:
            total += ns
            total_cpu += cpu_ns
            rows.append(f"| {name} | {calls / steps:.2f} | {ns / calls / 1e3:.1f} | {cpu_ns / calls / 1e3:.1f} | "
                        f"{ns / steps / 1e3:.1f} | {cpu_ns / steps / 1e3:.1f} |")
    rows.append(f"| all ({steps} steps) | | | | {total / steps / 1e3:.1f} | {total_cpu / steps / 1e3:.1f} |")
    per_token = total / cost.tokens / 1e3 if cost.tokens else float("nan")
    return "\n".join(rows) + f"\n\nall hooks per generated token (timed batches' tokens): {per_token:.1f} µs"


def _stored(engine: Engine, want: int, timeout_s: float = 30.0) -> int:
    """The engine's stores counted, once ``want`` are or after ``timeout_s`` (the front end
    takes in later steps' stats with its next request: one-token requests, too short to
    store anything)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        got = int(engine.generate([[5, 6, 7]], 1).metrics.get(kvstate_kit.PREFIX + "stores_ok", 0.0))
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m support.engines.decode_cost", description=__doc__)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--hooks", action="store_true", help="time kvstate's step hooks (the timed probe)")
    ap.add_argument("--model", choices=MODELS, default="tiny")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvstate-decode-cost-") as d:
        model, retain = model_for(args.model, Path(d))
        cost = measure(Path(d), repeats=args.repeats, model=model, hooks=args.hooks, retain_bytes=retain)
    ratio = cost.ratio()
    print(f"model {args.model}: kvstate {statistics.median(cost.kvstate_s) * 1e3:.3f} ms/token, plain "
          f"{statistics.median(cost.plain_s) * 1e3:.3f} ms/token (medians of {len(cost.kvstate_s)}), "
          f"ratio {ratio:.1%}, stores counted {cost.stored} of {cost.requests}")
    print("kvstate samples ms/token:", " ".join(f"{x * 1e3:.3f}" for x in cost.kvstate_s))
    print("plain samples ms/token:  ", " ".join(f"{x * 1e3:.3f}" for x in cost.plain_s))
    if args.hooks:
        print(hooks_table(cost))


if __name__ == "__main__":
    main()
