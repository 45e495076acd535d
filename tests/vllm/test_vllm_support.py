"""The suite's own checkers, each shown to catch what it is for (no engine needed)."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from support.engines import kv_configs, tiny_deepseek, tiny_llama
from support.engines.evidence import reuse
from support.engines.leftovers import SHM, collect, owner_of, remove_vllm_leftovers, shm_mapped, shm_names
from support.engines.memory import MemorySampler
from support.engines.runner import TAG_VAR, Generation, engine_pids
from support.engines.suite import Engines


def test_leftovers_are_attributed_by_name() -> None:
    assert owner_of("vllm_dist_" + "ab" * 16) == "vllm"
    assert owner_of("vllm_dist_" + "ab" * 16 + "-tp:0-[0-1]-cpushm_0") == "vllm"
    assert owner_of("psm_1f2e3d4c") == "vllm"
    assert owner_of(str(uuid.uuid4())) == "vllm"
    assert owner_of("kvstate-bank-3") == "kvstate" and owner_of(".kvstate.sock") == "kvstate"
    assert owner_of("core.1234") == "unattributed"


def test_collect_reports_planted_kvstate_and_unattributed_leftovers(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    for name in ("vllm_dist_" + "cd" * 16, "kvstate-channel.sock", "stray.bin"):
        (tmpdir / name).touch()
    before = shm_names()
    tag = uuid.uuid4().hex[:12]
    planted = {"kvstate": SHM / f"kvstate-test-{tag}", "mapped": SHM / f"psm_{tag}",
               "foreign": SHM / f"someone-else-{tag}"}
    try:
        for p in planted.values():
            p.write_bytes(b"x")
        found = collect(tmpdir, {planted["mapped"].name}, before, [])
        assert found.kvstate == [str(tmpdir / "kvstate-channel.sock"), str(planted["kvstate"])]
        assert found.unattributed == [str(tmpdir / "stray.bin")]
        assert found.vllm == [str(tmpdir / ("vllm_dist_" + "cd" * 16)), str(planted["mapped"])]
        assert len(found.leaks) == 3  # the foreign /dev/shm entry is not the engine's
        remove_vllm_leftovers(found)
        assert not planted["mapped"].exists() and planted["kvstate"].exists()
        assert sorted(p.name for p in tmpdir.iterdir()) == ["kvstate-channel.sock", "stray.bin"]
    finally:
        for p in planted.values():
            p.unlink(missing_ok=True)


def test_shm_mapped_sees_this_process_mapping() -> None:
    path = SHM / f"kvstate-maptest-{uuid.uuid4().hex[:12]}"
    try:
        with open(path, "w+b") as f:
            f.truncate(4096)
            with mmap.mmap(f.fileno(), 4096):
                assert path.name in shm_mapped([os.getpid()])
        assert path.name not in shm_mapped([os.getpid()])
    finally:
        path.unlink(missing_ok=True)


def test_engine_processes_are_found_by_tag_and_by_group_and_reported() -> None:
    tag = uuid.uuid4().hex
    tagged = subprocess.Popen(["sleep", "60"], env={**os.environ, TAG_VAR: tag})
    # A group leader and a child of it with no tag (as vLLM's retitled processes look).
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        with open(f"/proc/{leader.pid}/stat", "rb") as f:
            start = int(f.read().rsplit(b")", 1)[1].split()[19])
        deadline = time.monotonic() + 10
        while len(engine_pids("no-such-tag", (leader.pid, start))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        group = engine_pids("no-such-tag", (leader.pid, start))
        assert leader.pid in group and len(group) == 2
        assert engine_pids("no-such-tag", (leader.pid, start + 10**9)) == []  # a reused pgid
        assert engine_pids(tag) == [tagged.pid]
        found = collect(Path("/nonexistent"), set(), shm_names(), engine_pids(tag))
        assert found.leaks == [f"engine process {tagged.pid} still alive"]
    finally:
        tagged.kill()
        tagged.wait()
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
    deadline = time.monotonic() + 10  # the orphaned sleep exits on its own schedule
    while engine_pids("no-such-tag", (leader.pid, start)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_pids(tag) == [] and engine_pids("no-such-tag", (leader.pid, start)) == []


def _generation(cached: list[int], external: float, by_source: float, log: str = "") -> Generation:
    after = {"vllm:external_prefix_cache_hits": 100.0 + external, "vllm:prefix_cache_hits": 5.0,
             "vllm:prompt_tokens_by_source{source=external_kv_transfer}": 10.0 + by_source}
    before = {"vllm:external_prefix_cache_hits": 100.0, "vllm:prefix_cache_hits": 5.0,
              "vllm:prompt_tokens_by_source{source=external_kv_transfer}": 10.0}
    return Generation([[1]] * len(cached), cached, ["length"] * len(cached), 0.1, after, before, log)


def test_evidence_accepts_consistent_reuse_and_names_each_problem() -> None:
    assert reuse(_generation([96, 64], 160, 160)).external_problems([96, 64]) == []
    recovered = ("INFO [scheduler.py:3427] Recovered from KV load failure: 1 request(s) rescheduled "
                 "(96 tokens affected).\n")
    problems = {
        "load failures": _generation([96, 64], 160, 160, recovered),
        "reused nothing": _generation([96, 0], 96, 96),
        "expected": _generation([64, 64], 128, 128),
        "external_prefix_cache_hits grew": _generation([96, 64], 96, 160),
        "external_kv_transfer": _generation([96, 64], 160, 0),
    }
    for words, g in problems.items():
        found = reuse(g).external_problems([96, 64])
        assert any(words in p for p in found), (words, found)
    assert reuse(_generation([0, 0], 0, 0)).none_problems() == []
    assert reuse(_generation([0, 0], 0, 0, recovered)).none_problems() != []


def test_kv_transfer_configs_are_accepted_by_vllm(tmp_path: Path) -> None:
    cfg = kv_configs.build(kv_configs.kvstate("kv_consumer", {"reuse": True}))
    assert (cfg.kv_connector, cfg.kv_connector_module_path) == ("KvStateConnector", "kvstate.integrations.vllm")
    assert cfg.kv_load_failure_policy == "recompute" and cfg.is_kv_consumer and not cfg.is_kv_producer
    assert cfg.get_from_extra_config("reuse", False) is True
    for made in (kv_configs.example(tmp_path), kv_configs.probe_example(tmp_path, tmp_path, "kv_producer"),
                 kv_configs.probe_only(tmp_path)):
        assert kv_configs.build(made).kv_load_failure_policy == "recompute"
    nixl = kv_configs.build(kv_configs.nixl())
    assert (nixl.kv_connector, nixl.kv_buffer_device, nixl.kv_load_failure_policy) == ("NixlConnector", "cpu",
                                                                                       "recompute")
    with pytest.raises(ValueError, match="kv_role"):
        kv_configs.kvstate("consumer")


def test_the_nixlconnector_engines_find_nixl_by_the_name_vllm_imports() -> None:
    """vLLM's NixlConnector imports ``nixl._api``; the runner puts the folder that names
    the venv's nixl_cu12 so on the path of NixlConnector engines, and only theirs."""
    import subprocess
    import sys

    from support.engines.runner import NIXL_NAME, EngineSpec

    def path(spec: EngineSpec) -> list[str]:
        return spec.process_env("t", Path("/tmp"))["PYTHONPATH"].split(os.pathsep)
    assert str(NIXL_NAME) in path(EngineSpec("m", kv_transfer=kv_configs.nixl()))
    assert str(NIXL_NAME) not in path(EngineSpec("m", kv_transfer=kv_configs.kvstate("kv_both")))
    probe = ("import torch; from vllm.distributed import nixl_utils as n; "
             "print(n.NixlWrapper.__module__, n.nixlXferTelemetry.__module__)")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(NIXL_NAME)},
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["nixl_cu12._api", "nixl_cu12._bindings"], out.stderr[-2000:]


def test_seeded_weights_are_reproducible_and_scaled(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    a = tiny_llama.write_model(tmp_path / "a", seed=0) / "model.safetensors"
    b = tiny_llama.write_model(tmp_path / "b", seed=0) / "model.safetensors"
    c = tiny_llama.write_model(tmp_path / "c", seed=1) / "model.safetensors"
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    w = load_file(str(a))
    assert {k: tuple(v.shape) for k, v in w.items()} == tiny_llama.weight_shapes()
    assert abs(w["model.embed_tokens.weight"].float().std().item() - 1.0) < 0.02
    assert abs(w["model.layers.0.self_attn.k_proj.weight"].float().std().item() - 0.1) < 0.005
    assert torch.equal(w["model.norm.weight"].float(), torch.ones(256))


def test_the_tiny_deepseek_has_the_latent_cpu_mla_needs_and_seeded_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = tiny_deepseek.write_model(tmp_path / "a", seed=0) / "model.safetensors"
    b = tiny_deepseek.write_model(tmp_path / "b", seed=0) / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()
    w = load_file(str(a))
    assert {k: tuple(v.shape) for k, v in w.items()} == tiny_deepseek.weight_shapes()
    assert tiny_deepseek.LATENT == 576  # CPU_MLA's decode kernel has no other size
    assert w["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape[0] == tiny_deepseek.LATENT
    cfg = tiny_deepseek.CONFIG
    assert cfg["first_k_dense_replace"] >= cfg["num_hidden_layers"]  # every MLP dense: no MoE weights


def test_geometry_comparison_names_what_changed() -> None:
    import copy
    import json

    from kv_geometry import FIXTURE, differences

    want = json.loads(FIXTURE.read_text())
    got = copy.deepcopy(want)
    assert differences(want, got) == []
    layer = got["runs"]["tp2-float32"][1]["layers"]["model.layers.1.self_attn.attn"]
    layer["stride"][0] *= 2
    del layer["contiguous"]
    got["runs"]["tp1-bfloat16"][0]["attn_isa"] = "amx"
    assert differences(want, got) == [
        "/runs/tp1-bfloat16[0]/attn_isa: fixture 'vec', now 'amx'",
        "/runs/tp2-float32[1]/layers/model.layers.1.self_attn.attn/contiguous: missing now",
        "/runs/tp2-float32[1]/layers/model.layers.1.self_attn.attn/stride[0]: fixture 4096, now 8192",
    ]


def test_the_fixture_for_an_amx_host_differs_only_in_the_bfloat16_attention_isa(tmp_path: Path) -> None:
    import json

    from kv_geometry import FIXTURE, differences, for_this_host, host_has_amx

    want = json.loads(FIXTURE.read_text())
    assert for_this_host(want, amx=False) == want
    assert differences(want, for_this_host(want, amx=True)) == [
        f"/runs/tp1-bfloat16[{i}]/attn_isa: fixture 'vec', now 'amx'" for i in range(len(want["runs"]["tp1-bfloat16"]))]
    assert want["runs"]["tp1-bfloat16"][0]["attn_isa"] == "vec"  # the input is left as it was
    flags = tmp_path / "cpuinfo"
    flags.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile amx_int8\n")
    assert host_has_amx(str(flags))
    flags.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f\n")
    assert not host_has_amx(str(flags)) and not host_has_amx(str(tmp_path / "missing"))


def test_close_all_closes_every_engine_then_raises(tmp_path: Path) -> None:
    """An engine that fails to close does not leave the ones after it running."""
    closed: list[str] = []

    class Stub:
        def __init__(self, name: str, fails: bool) -> None:
            self.name, self.fails = name, fails

        def close(self) -> object:
            closed.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} would not close")
            return type("Found", (), {"leaks": [f"{self.name}-file"]})()

    box = Engines(tmp_path, MemorySampler())
    box.started = [Stub("a", True), Stub("b", False), Stub("c", True)]  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="a would not close") as err:
        box.close_all()
    assert closed == ["a", "b", "c"]
    assert any("c would not close" in note for note in err.value.__notes__)
    box.started = [Stub("d", False)]  # type: ignore[list-item]
    assert box.close_all() == ["d: d-file"]


def test_the_timed_probe_counts_every_call_and_the_hooks_table_sums_its_files(tmp_path: Path) -> None:
    """The engine-cost diagnosis (``decode_cost --hooks``): each timed hook call is counted
    with its time, a raising one too; the files of two processes add up, per step."""
    import json

    from support.engines import decode_cost, probe

    totals = {name: [0, 0, 0] for name in probe.STEP_HOOKS}
    flushed: list[int] = []

    def hook(x: int) -> int:  # tens of microseconds: the two clocks' skew (about 1 us a read) is noise
        return sum(range(2000)) * 0 + x * 2

    step = probe._timed("build_connector_meta", hook, totals, lambda: flushed.append(1))
    assert [step(i) for i in range(128)][-1] == 254
    assert totals["build_connector_meta"][0] == 128 and totals["build_connector_meta"][1] > 0
    # thread CPU time within the wall time (a sub-microsecond hook read 1.7x once: the
    # thread clock and the monotonic clock are read apart)
    assert 0 < totals["build_connector_meta"][2] <= totals["build_connector_meta"][1] * 1.5
    assert len(flushed) == 2  # every 64 steps

    def boom() -> None:
        raise ValueError("hook failed")
    failing = probe._timed("get_finished", boom, totals, lambda: None)
    with pytest.raises(ValueError):
        failing()
    assert totals["get_finished"][0] == 1

    (tmp_path / f"{kv_configs.HOOK_TIMES}-1.json").write_text(json.dumps(
        {"build_connector_meta": [10, 20_000, 10_000], "get_finished": [10, 50_000, 20_000]}))
    (tmp_path / f"{kv_configs.HOOK_TIMES}-2.json").write_text(json.dumps({"get_finished": [10, 30_000, 20_000]}))
    cost = decode_cost.Cost(hooks=decode_cost.hook_times(tmp_path), tokens=100)
    assert cost.hooks == {"build_connector_meta": (10, 20_000, 10_000), "get_finished": (20, 80_000, 40_000)}
    table = decode_cost.hooks_table(cost)
    assert "| get_finished | 2.00 | 4.0 | 2.0 | 8.0 | 4.0 |" in table
    assert "| all (10 steps) | | | | 10.0 | 5.0 |" in table and "1.0 µs" in table


def test_the_step_hooks_unpin_only_to_hand_kvstate_work(cpus: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's step hooks widen its CPU mask (for the threads kvstate may start) only
    while they hand kvstate a store or a load: on the other steps the mask is left alone,
    no syscall (unpinning cost a tenth of a decode step; affinity, "Cost"). The connector's
    own hooks, on a connector object whose ranks record what they are handed."""
    from kvstate.integrations.vllm import connector as conn
    from kvstate.integrations.vllm.orders import StepOrders, StoreOrder

    seen: list[tuple[str, list[int]]] = []

    class Rank:  # the ranks' side of the hooks: each records the mask it ran under
        def __init__(self) -> None:
            self.loads: list[object] = []

        def store(self, order: object) -> None:
            seen.append(("store", sorted(os.sched_getaffinity(0))))

        def load(self, order: object) -> None:
            self.loads.append(order)
            seen.append(("load", sorted(os.sched_getaffinity(0))))

        def busy(self) -> bool:
            return bool(self.loads)

        def progress(self) -> None:
            seen.append(("progress", sorted(os.sched_getaffinity(0))))

        def finished(self, *ids: object) -> object:
            seen.append(("finished", sorted(os.sched_getaffinity(0))))
            return set() if ids else (set(), set())

    c = object.__new__(conn.KvStateConnector)
    c._decode, c._prefill, c._load_errors = Rank(), Rank(), set()
    c._cfg = type("Cfg", (), {"layer_loads": False})()
    calls: list[object] = []
    real_set = os.sched_setaffinity
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, mask: (calls.append(mask), real_set(pid, mask)))
    own = os.sched_getaffinity(0)
    real_set(0, {cpus[0]})  # as vLLM binds a CPU worker's thread
    try:
        c.bind_connector_metadata(conn.KvStateMetadata(StepOrders()))
        c.start_load_kv(None)
        c.get_finished(set())
        bound = [cpus[0]]
        assert calls == [] and seen == [("finished", bound), ("finished", bound)], (calls, seen)
        seen.clear()
        store = StoreOrder("r", (1,), (2,), (3,))
        orders = StepOrders(stores=(store,), loads=("order",))  # type: ignore[arg-type]  # the rank records it
        c.bind_connector_metadata(conn.KvStateMetadata(orders))
        c.start_load_kv(None)
        c.get_finished(set())
        wide = sorted(cpus)
        assert seen == [("store", wide), ("load", wide), ("progress", wide), ("finished", wide),
                        ("finished", wide)], seen
        assert os.sched_getaffinity(0) == {cpus[0]}  # the worker's binding, back after each hook
    finally:
        real_set(0, own)

