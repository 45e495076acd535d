"""The engine process: one vLLM ``LLM``, driven by the runner over a pipe.

Started by :class:`support.engines.runner.Engine` as ``python -m support.engines.child FD``. vLLM
starts its EngineCore and Worker processes with multiprocessing *spawn*, which imports
the main module again in each child: everything here therefore runs under
``if __name__ == "__main__"``, or vLLM fails with "An attempt has been made to start a
new process before the current process has finished its bootstrapping phase".

Protocol (pickled dicts over a ``multiprocessing.connection.Connection``): the runner
sends the engine's settings; the child answers ``{"ok": True, ...}`` once the engine is
up (with ``metrics``: the baseline of the first command's counters), or ``{"ok": False,
"error": traceback}``. Then, per command, one answer:

- ``{"op": "generate", "prompts": [[ids]], "max_tokens": n, "transfer": [params]}`` ->
  ``tokens``, ``num_cached_tokens``, ``finish_reasons``, ``transfer`` (each output's
  ``kv_transfer_params``), ``metrics`` (cumulative, after the call), ``seconds``;
  ``transfer`` (optional, one dict or None per prompt) is each request's
  ``kv_transfer_params``;
- ``{"op": "reset_prefix_cache"}`` -> ``reset`` (vLLM's bool);
- ``{"op": "metrics"}`` -> ``metrics``;
- ``{"op": "shutdown"}`` -> answered, then the engine is shut down and the process exits.

End of file on the pipe (the runner died) also shuts the engine down.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # If pytest is killed, this process gets SIGKILL; the runner's cleanup reaches the
    # engine's own processes by their tag.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def metrics_snapshot(llm: Any) -> dict[str, float]:
    """vLLM's Prometheus metrics as ``{"name{label=value,...}": value}`` (model and
    engine labels dropped; histograms as ``name:count`` and ``name:sum``)."""
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("model_name", "engine"))
        key = f"{m.name}{{{labels}}}" if labels else m.name
        if isinstance(m, (Counter, Gauge)):
            out[key] = out.get(key, 0.0) + float(m.value)
        elif isinstance(m, Histogram):
            out[key + ":count"] = out.get(key + ":count", 0.0) + float(m.count)
            out[key + ":sum"] = out.get(key + ":sum", 0.0) + float(m.sum)
        elif isinstance(m, Vector):
            out[key] = out.get(key, 0.0) + float(sum(m.values))
    return out


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int,
              transfer: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # Greedy, fixed length (no tokenizer: no EOS to stop at), no detokenization; a
    # request's kv_transfer_params ride in its extra_args, as vLLM's OpenAI server puts them.
    def params(i: int) -> Any:
        extra = None if transfer is None or transfer[i] is None else {"kv_transfer_params": transfer[i]}
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                              extra_args=extra)
    t0 = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], [params(i) for i in range(len(prompts))],
                        use_tqdm=False)
    seconds = time.monotonic() - t0
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "transfer": [o.kv_transfer_params for o in outs],
        "seconds": seconds,
        "metrics": metrics_snapshot(llm),
    }


def _submit_and_abort(llm: Any, prompt: list[int], max_tokens: int, delay_s: float) -> dict[str, Any]:
    """Submit one request and abort it ``delay_s`` later, without stepping the front end in
    between (a step waits for outputs, which a request that is loading does not make)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    req_id = f"aborted-{time.monotonic_ns()}"
    llm.llm_engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), params)
    time.sleep(delay_s)
    llm.llm_engine.abort_request([req_id])
    return {"request_id": req_id}


def _llm(settings: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs = dict(settings["llm"])
    transfer = settings.get("kv_transfer")
    if transfer is not None:
        from support.engines.kv_configs import build

        kwargs["kv_transfer_config"] = build(transfer)
    return LLM(**kwargs)


def _warm_up(llm: Any, settings: dict[str, Any]) -> float:
    """One short request before the engine counts as up, at tp > 1; returns its seconds.
    Why: its first forward pass compiles vLLM's masked lookup of the vocabulary-parallel
    embedding (``torch.compile``, used only at tp > 1), and that took 10.4 to 22.5 s here
    (issue 28: the unexplained 10 s silence of a tp=2 prefill engine), so the first test
    to load into such an engine timed out. vLLM's own warm-up pass does not run for these
    engines: its CPU worker skips it for an eager engine with ``kv_cache_memory_bytes``
    set (``cpu_worker._should_warm_up_model``, vLLM 0.32). An engine test measures
    kvstate, not that compile. The prompt is shorter than a block:
    nothing is stored, looked up or cached (a consumer counts a miss, before the baseline
    of the counters)."""
    if settings["llm"].get("tensor_parallel_size", 1) <= 1:
        return 0.0
    t0 = time.monotonic()
    _generate(llm, [[1, 2, 3]], 1)
    return time.monotonic() - t0


def _shutdown(llm: Any) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    _die_with_parent()
    settings = conn.recv()
    t0 = time.monotonic()
    try:
        import vllm  # noqa: F401  (timed apart: the import alone takes seconds)

        t_import = time.monotonic() - t0
        llm = _llm(settings)
    except BaseException:
        conn.send({"ok": False, "error": traceback.format_exc()})
        return 1
    t_init = time.monotonic() - t0 - t_import
    try:
        t_warm = _warm_up(llm, settings)
    except BaseException:
        conn.send({"ok": False, "error": traceback.format_exc()})
        return 1
    conn.send({"ok": True, "import_s": t_import, "init_s": t_init, "warm_s": t_warm,
               "metrics": metrics_snapshot(llm)})
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        op = msg.get("op")
        try:
            if op == "generate":
                reply = _generate(llm, msg["prompts"], msg["max_tokens"], msg.get("transfer"))
            elif op == "submit_and_abort":
                reply = _submit_and_abort(llm, msg["prompt"], msg["max_tokens"], msg["delay_s"])
            elif op == "reset_prefix_cache":
                reply = {"reset": bool(llm.reset_prefix_cache())}
            elif op == "metrics":
                reply = {"metrics": metrics_snapshot(llm)}
            elif op == "shutdown":
                conn.send({"ok": True})
                break
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception:
            conn.send({"ok": False, "error": traceback.format_exc()})
        else:
            conn.send({"ok": True, **reply})
    _shutdown(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
