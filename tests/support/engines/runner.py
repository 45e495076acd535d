"""Real vLLM engines, each in its own process, driven from the test process.

An :class:`Engine` is ``python -m support.engines.child`` plus the processes vLLM starts under
it (``VLLM::EngineCore``, one ``VLLM::Worker`` per TP rank). Running each engine in its
own process lets a test keep two engines alive at once, SIGKILL one and watch the other.

- Every wait has a timeout, and a dead engine process is noticed at once (its log tail
  is in the error).
- An engine's processes are found by its process group (the child starts a new session)
  and by ``KVSTATE_ENGINE_TAG=<uuid>`` in their environment, so :meth:`Engine.close`
  finds and kills every one of them, including any that outlived their parent.
- Each engine gets its own ``TMPDIR`` and log file under its work dir, and its /dev/shm
  mappings are recorded while it runs, so that :mod:`~support.engines.leftovers` can say which
  leftovers are vLLM's and which would be kvstate's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from support.engines import leftovers

#: The tree this kvstate comes from: engine processes import the same one, and this kit
#: (``support.engines``, under tests/) for the engine child and the probe connectors.
SOURCE_ROOT = Path(__file__).resolve().parents[3]
KIT_ROOT = SOURCE_ROOT / "tests"
TAG_VAR = "KVSTATE_ENGINE_TAG"
#: NIXL named as vLLM's NixlConnector imports it (see the package's docstring)
NIXL_NAME = Path(__file__).resolve().parent / "nixl_name"

START_TIMEOUT = float(os.environ.get("KVSTATE_VLLM_START_TIMEOUT", "420"))
COMMAND_TIMEOUT = float(os.environ.get("KVSTATE_VLLM_COMMAND_TIMEOUT", "180"))
STOP_TIMEOUT = 60.0
KILL_WAIT_S = 30.0


class EngineError(RuntimeError):
    """An engine failed, died or did not answer in time; the message has its log tail."""


@dataclass(frozen=True)
class EngineSpec:
    """How to start one engine. The defaults are the CPU settings that matter (see
    tests/vllm/README.md): each was measured, and most fail or mislead without it."""

    model: str
    tp: int = 1
    # Eager: init measured 53-58 s against 80-106 s compiled; generation differs by
    # < 0.5 s per call (tests/vllm/README.md).
    enforce_eager: bool = True
    block_size: int = 32                       # CPU attention needs a multiple of 32
    kv_cache_memory_bytes: int = 128 << 20     # else vLLM wants 92% of the NUMA node
    max_model_len: int = 8192
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"               # "fp8", "fp8_e4m3", "fp8_e5m2": FP8 KV (uint8 tensors on CPU)
    attention_backend: str | None = None       # vLLM's choice for the CPU; a name pins one (e.g. "CPU_MLA")
    seed: int = 0
    kv_transfer: dict[str, Any] | None = None  # kv_configs
    env: dict[str, str] = field(default_factory=dict)
    #: a command that runs the engine elsewhere, e.g. ``ip netns exec NS`` (netns.TwoHosts)
    prefix: tuple[str, ...] = ()

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "load_format": "safetensors",      # real (seeded) weights, never "dummy"
            "skip_tokenizer_init": True,       # no tokenizer: token-id prompts only
            "dtype": self.dtype,
            "block_size": self.block_size,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_model_len": self.max_model_len,
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            "disable_log_stats": False,        # else get_metrics() has no prefix-cache counters
            "tensor_parallel_size": self.tp,
        }
        if self.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = self.kv_cache_dtype
        if self.attention_backend is not None:
            kwargs["attention_backend"] = self.attention_backend
        if self.tp > 1:
            kwargs["distributed_executor_backend"] = "mp"
        return kwargs

    def process_env(self, tag: str, tmpdir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        # It overrides kv_cache_memory_bytes when set (whole GiB).
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env[TAG_VAR] = tag
        env["TMPDIR"] = str(tmpdir)
        # tests/vllm for its sitecustomize: kvstate's INFO records in the engine's log.
        paths = [SOURCE_ROOT, KIT_ROOT, KIT_ROOT / "vllm"]
        if (self.kv_transfer or {}).get("kv_connector") == "NixlConnector":
            paths.append(NIXL_NAME)
        env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths]
                                            + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["PYTHONUNBUFFERED"] = "1"
        if self.tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # vLLM's automatic binding wants one NUMA node per rank; give each rank a core.
            ncpu = os.cpu_count() or 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % ncpu) for r in range(self.tp))
        env.update(self.env)
        return env


@dataclass(frozen=True)
class Generation:
    """One ``generate`` call's outcome; ``metrics`` are cumulative after it, ``log`` is
    what the engine logged during it."""

    tokens: list[list[int]]
    num_cached_tokens: list[int]
    finish_reasons: list[str | None]
    seconds: float
    metrics: dict[str, float]
    metrics_before: dict[str, float]
    log: str
    transfer: list[dict[str, Any] | None] = field(default_factory=list)  # each output's kv_transfer_params


def _stat(pid: str) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks) of a process, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[2]), int(fields[19])


def _has_tag(pid: str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def engine_pids(tag: str, group: tuple[int, int] | None = None) -> list[int]:
    """Live (non-zombie) processes of an engine: those carrying ``tag`` in their
    environment, and, with ``group=(pgid, start)``, the members of that process group
    started no earlier than ``start``. The group is needed because vLLM sets process
    titles (``VLLM::EngineCore``, ``VLLM::Worker``), which overwrites the memory that
    /proc/<pid>/environ reads; the start time keeps a reused pgid from matching."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(entry)
        if st is None or st[0] == "Z":
            continue
        in_group = group is not None and st[1] == group[0] and st[2] >= group[1]
        if in_group or _has_tag(entry, needle):
            pids.append(int(entry))
    return pids


class Engine:
    """One vLLM engine in its own process. Use :meth:`start`, then :meth:`wait_ready`
    (two engines can start together), the commands, and finally :meth:`close`."""

    def __init__(self, spec: EngineSpec, workdir: Path, name: str) -> None:
        self.spec, self.name = spec, name
        self.workdir = workdir / name
        self.tmpdir = self.workdir / "tmp"
        self.log_path = self.workdir / "engine.log"
        self.tag = uuid.uuid4().hex
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.startup: dict[str, Any] = {}
        self.metrics: dict[str, float] = {}
        self.shm_seen: set[str] = set()
        self.killed = False
        self._shm_before: set[str] = set()
        self._closed: leftovers.Leftovers | None = None
        self._group: tuple[int, int] | None = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> Engine:
        self.tmpdir.mkdir(parents=True)
        self._shm_before = leftovers.shm_names()
        ours, theirs = socket.socketpair()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*self.spec.prefix, sys.executable, "-m", "support.engines.child", str(theirs.fileno())],
                cwd=self.workdir, env=self.spec.process_env(self.tag, self.tmpdir), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        st = _stat(str(self.proc.pid))
        if st is not None:  # the child leads its own session, so its group is the engine's
            self._group = (self.proc.pid, st[2])
        self.conn = Connection(ours.detach())
        self.conn.send({"llm": self.spec.llm_kwargs(), "kv_transfer": self.spec.kv_transfer})
        self._t_start = time.monotonic()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Engine:
        reply = self._receive(timeout, "start")
        self.metrics = reply.get("metrics", {})  # what the first generate's counters grow from
        self.startup = {k: v for k, v in reply.items() if k not in ("ok", "metrics")}
        self.startup["wall_s"] = time.monotonic() - self._t_start
        self._note_shm()
        return self

    def close(self) -> leftovers.Leftovers:
        """Stop the engine (cleanly if it still answers, else SIGKILL), make sure none of
        its processes survive, and classify what it left; vLLM's leftovers are removed."""
        if self._closed is not None:
            return self._closed
        if self.alive() and self.conn is not None:
            try:
                self._request({"op": "shutdown"}, STOP_TIMEOUT)
                assert self.proc is not None
                self.proc.wait(STOP_TIMEOUT)
            except (EngineError, OSError, EOFError, subprocess.TimeoutExpired):  # a child whose start failed hangs up
                pass
        # A clean shutdown ends every process; anything left is reported, then killed.
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = self.pids()
        self._kill_all()
        if self.conn is not None:
            self.conn.close()
        found = leftovers.collect(self.tmpdir, self.shm_seen, self._shm_before, survivors)
        leftovers.remove_vllm_leftovers(found)
        self._closed = found
        return found

    def kill(self) -> None:
        """SIGKILL every process of the engine at once, as a crash would."""
        self._note_shm()
        self.killed = True
        self._kill_all()

    def _kill_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # A SIGKILLed process still has to be scheduled to exit and unmap its memory. On 2
        # cores, one bound to a core where another engine's worker spins on sched_yield
        # took 7 s to go, so the check waits up to KILL_WAIT_S before calling it a survivor.
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if self.proc is not None:
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        remaining = self.pids()
        if remaining:
            raise EngineError(f"{self.name}: processes {remaining} survive SIGKILL")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        return engine_pids(self.tag, self._group)

    # -- commands -------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, timeout: float = COMMAND_TIMEOUT, *,
                 transfer: list[dict[str, Any] | None] | None = None) -> Generation:
        """``transfer``: each request's ``kv_transfer_params``, as a router passes them."""
        before, mark = dict(self.metrics), self.log_size()
        msg: dict[str, Any] = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens}
        if transfer is not None:
            msg["transfer"] = transfer
        reply = self._request(msg, timeout)
        self.metrics = reply["metrics"]
        self._note_shm()
        return Generation(reply["tokens"], reply["num_cached_tokens"], reply["finish_reasons"], reply["seconds"],
                          reply["metrics"], before, self.log_since(mark), reply.get("transfer", []))

    def submit_and_abort(self, prompt: list[int], delay_s: float, max_tokens: int = 16,
                         timeout: float = COMMAND_TIMEOUT) -> str:
        """One request, aborted ``delay_s`` after it was submitted; its request id."""
        return str(self._request({"op": "submit_and_abort", "prompt": prompt, "max_tokens": max_tokens,
                                  "delay_s": delay_s}, timeout)["request_id"])

    def reset_prefix_cache(self, timeout: float = COMMAND_TIMEOUT) -> bool:
        return bool(self._request({"op": "reset_prefix_cache"}, timeout)["reset"])

    def refresh_metrics(self, timeout: float = COMMAND_TIMEOUT) -> dict[str, float]:
        self.metrics = self._request({"op": "metrics"}, timeout)["metrics"]
        return self.metrics

    # -- log ------------------------------------------------------------------------

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_since(self, mark: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode("utf-8", "replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_since(0).splitlines()[-lines:])

    # -- plumbing -------------------------------------------------------------------

    def _note_shm(self) -> None:
        self.shm_seen |= leftovers.shm_mapped(self.pids())

    def _request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.conn is None or not self.alive():
            raise EngineError(f"{self.name} is not running\n{self.log_tail()}")
        self.conn.send(msg)
        return self._receive(timeout, str(msg["op"]))

    def _receive(self, timeout: float, what: str) -> dict[str, Any]:
        assert self.conn is not None and self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if self.proc.poll() is not None and not self.conn.poll(0):
                raise EngineError(f"{self.name}: engine process exited ({self.proc.returncode}) during {what}\n"
                                  f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise EngineError(f"{self.name}: no answer to {what} within {timeout:.0f} s\n{self.log_tail()}")
        try:
            reply: dict[str, Any] = self.conn.recv()
        except EOFError:
            raise EngineError(f"{self.name}: pipe closed during {what}\n{self.log_tail()}") from None
        if not reply.get("ok"):
            raise EngineError(f"{self.name}: {what} failed in the engine:\n{reply.get('error')}")
        return reply


def start_all(engines: list[Engine], timeout: float = START_TIMEOUT) -> list[Engine]:
    """Start engines together (their inits overlap), then wait for each."""
    for e in engines:
        e.start()
    for e in engines:
        e.wait_ready(timeout)
    return engines
