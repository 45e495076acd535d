"""What the kvstate connector's engine tests share: settings, the bank's memfd inside an
engine's worker, and kvstate's counters as vLLM's Prometheus metrics show them."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from support.engines import evidence, kv_configs
from support.engines.runner import Engine, EngineSpec, Generation

#: The deployment key, given to engines through the environment (never the extra config).
KEY_HEX = bytes(range(32)).hex()

#: Reuse on, with cost figures for this CPU and tiny model: the policy's defaults describe
#: a GPU deployment and would choose recompute here. Its saving estimate charges the whole
#: lookup budget as lookup cost, hence the large per-token figure.
POLICY_ON: dict[str, Any] = {
    "enable_decode_to_prefill_reuse": True,
    "minimum_transfer_prefix_blocks": 1,
    "minimum_estimated_ttft_saving_ms": 0.0,
    "transfer_source_lookup_budget_ms": 2000.0,
    "transfer_source_prefill_token_us": 1e6,
}

PREFIX = "vllm:kvstate_"
MEMFD = "/memfd:kvstate"


def socket_dir(base: Path) -> Path:
    """A short, private directory for the deployment's control sockets (AF_UNIX paths are
    limited to 107 bytes, pytest's temp paths are long)."""
    d = Path(f"/tmp/kvs-{os.getpid()}-{base.name[-12:]}")
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def spec(model: str, role: str, sockets: Path, *, policy: dict[str, Any] | None = None, tp: int = 1,
         dtype: str = "bfloat16", kv_cache_dtype: str = "auto", probe_dir: Path | None = None,
         probe: str = "ProbeKvStateConnector", **extra: Any) -> EngineSpec:
    """With ``probe_dir``, the engine runs kvstate's connector as the probe subclass
    ``probe`` (:mod:`.probe`); by default the one that holds a worker's GIL after stores
    while ``probe_dir/hold-gil-after-store`` exists."""
    # Every timeout is the connector's default (issue 28). KVS_TEST_LOOKUP_S=<seconds> sets
    # lookup_timeout_s, to diagnose (with KVSTATE_TRACE_DIR, a slow lookup logs where each
    # decode index thread stood). Runs AA and AF of the suite, each with one prompt of the
    # mixed-TP file found in no decode index just after kvstate_kit.produce, are why the
    # stores' reports now reach the index natively (docs/native-control-plane.md, "Stores, too").
    cfg: dict[str, Any] = {"socket_dir": str(sockets), "retain_bytes": 64 << 20, **extra}
    if "KVS_TEST_LOOKUP_S" in os.environ:
        cfg["lookup_timeout_s"] = float(os.environ["KVS_TEST_LOOKUP_S"])
    if policy is not None:
        cfg["policy"] = policy
    env = {"KVSTATE_DEPLOYMENT_KEY": KEY_HEX}
    if probe_dir is not None:
        env[kv_configs.PROBE_DIR_ENV] = str(probe_dir)
    return EngineSpec(model, tp=tp, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                      kv_transfer=kv_configs.kvstate(role, cfg, probe=probe_dir is not None and probe), env=env)


#: The engines' block size (vLLM's CPU attention needs a multiple of 32).
BLOCK_TOKENS: int = EngineSpec.block_size


def loadable(lengths: tuple[int, ...]) -> list[int]:
    """Tokens a prefill engine loads per prompt: the full blocks before the last token
    (vLLM computes the last token itself)."""
    return [(n - 1) // BLOCK_TOKENS * BLOCK_TOKENS for n in lengths]


def counters(g: Generation) -> dict[str, float]:
    """kvstate's counters that grew during ``g`` (``name`` or ``name{reason=...}``)."""
    out = {}
    for k, v in g.metrics.items():
        if k.startswith(PREFIX) and not k.startswith(PREFIX + "level"):
            d = v - g.metrics_before.get(k, 0.0)
            if d:
                out[k[len(PREFIX):]] = d
    return out


def reused(got: Generation, reference: Generation, lengths: tuple[int, ...]) -> dict[str, float]:
    """Check that a prefill engine's ``got`` has the decode engine's tokens (``reference``)
    and loaded every loadable block of each prompt from outside; returns its counters."""
    c = counters(got)  # in each message: a miss's or a failed load's reason is among them
    assert got.tokens == reference.tokens, c
    problems = evidence.reuse(got).external_problems(loadable(lengths))
    assert problems == [], (problems, c)
    return c


def worker_pids(engine: Engine) -> list[int]:
    """The engine's worker processes: named as vLLM names them, and not forked by another
    (a process a worker forks keeps its name; stopping or killing one of those instead of
    the worker would leave the worker's exporter serving)."""
    named = {}
    for pid in engine.pids():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            # the parent's pid is the second field after the name, which ends the last ")"
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if comm.startswith("VLLM::Worker"):
            named[pid] = ppid
    return [pid for pid, ppid in named.items() if ppid not in named]


def bank_fds(pid: int) -> list[Path]:
    """The kvstate memfds open in process ``pid``."""
    out = []
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd).startswith(MEMFD):
                    out.append(fd)
            except OSError:
                continue
    except OSError:
        pass
    return out


def bank_mappings(pid: int) -> list[str]:
    """Lines of ``/proc/pid/maps`` that map a kvstate memfd."""
    try:
        return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if MEMFD in line]
    except OSError:
        return []


def corrupt_banks(engine: Engine, seed: int = 7, pids: list[int] | None = None) -> int:
    """Overwrite every kvstate bank the engine's workers (or only ``pids`` of them) hold
    with noise; bytes written. The bank is a memfd without a write seal: any process of
    the same user can open it through /proc, which is exactly what this does."""
    import random

    rng = random.Random(seed)
    written = 0
    for pid in worker_pids(engine) if pids is None else pids:
        for fd in bank_fds(pid):
            with open(fd, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(0)
                chunk = 1 << 20
                for off in range(0, size, chunk):
                    n = min(chunk, size - off)
                    f.write(rng.randbytes(n))
                    written += n
    return written


RECOVERED = re.compile(r"Recovered from KV load failure[^\n]*")


def produce(engine: Engine, batch: list[list[int]], max_tokens: int, timeout: float = 30.0) -> Generation:
    """Generate on a decode engine and wait until its stores of every request finished
    (kvstate's ``stores_ok``): vLLM returns the outputs a step before the stores report,
    and a prefill engine asking sooner finds nothing yet (a miss, rightly). The front end
    takes in the stats of later steps only with its next request, hence the one-token
    requests (too short to retain anything). A rank counts a store only after the op
    engine sent its report to the index (``TransferHandle.report``), so the index knows
    of every store counted here; no wait for the ranks' Python follows.

    Each rank counts its own store of a request (vLLM sums the ranks' counters), and the
    index advertises a block only once every rank stored it: so a tp-rank engine's
    batch is stored once the count grew by tp per request. Waiting for one per request
    could return at tp=2 with one rank's stores still running (found while looking into
    run AA of issue 28, whose miss it does not fully explain)."""
    import time

    g = engine.generate(batch, max_tokens)
    want = g.metrics_before.get(PREFIX + "stores_ok", 0.0) + len(batch) * engine.spec.tp
    deadline = time.monotonic() + timeout
    while engine.generate([[5, 6, 7]], 1).metrics.get(PREFIX + "stores_ok", 0.0) < want:
        if time.monotonic() > deadline:
            raise AssertionError(f"{engine.name}: stores of {len(batch)} request(s) not reported in {timeout} s")
        time.sleep(0.1)
    return g
