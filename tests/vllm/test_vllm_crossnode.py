"""kvstate's connector between vLLM engines on two 'hosts': each engine in its own network
namespace (support.engines.netns), joined only by a veth link with 192.0.2.1 (decode) and
192.0.2.2 (prefill). The decode engine exports its banks through NIXL and serves its index
and leases over TCP (``transport: nixl``, ``listen``); the prefill engine names it by
address (``sources: [tcp://192.0.2.1:PORT]``), with a socket directory of its own, and
UCX runs over TCP on the veth only. So every control message crosses the link over the
authenticated TCP channel, and the KV bytes cross it as NIXL READs.

``make test-crossnode`` runs this file with ``KVSTATE_REQUIRE_NETNS=1``: namespaces that
cannot be made fail every test; without it they skip with a reason starting ``NO NETNS``.
The namespaces are removed when the module ends, on failure too, and the last test checks
that none is left. The tests run in file order on one pair of engines."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.engines import evidence
from support.engines import kvstate_kit as kit
from support.engines.memory import MemorySampler
from support.engines.netns import NetnsUnavailable, TwoHosts, leftover
from support.engines.runner import Engine, EngineSpec, Generation, start_all
from support.engines.suite import MAX_TOKENS, PROMPT_LENGTHS, Engines, prompts
from support.waiting import stop_process

REQUIRE = os.environ.get("KVSTATE_REQUIRE_NETNS") == "1"
#: The decode engine's index port (its ranks' lease ports follow it).
PORT = 47100 + random.Random(os.getpid()).randrange(0, 800, 10)
LOAD_TIMEOUT_S = 10.0
LEASE_TIMEOUT_S = 6.0


@dataclass
class Hosts:
    net: TwoHosts
    box: Engines
    model: str
    sockets: dict[str, Path]
    decode: Engine
    prefill: Engine
    plain: list[list[int]]      # a plain engine's greedy tokens for prompts()

    def fresh(self, engine: Engine, batch: list[list[int]]) -> Generation:
        assert engine.reset_prefix_cache()
        return engine.generate(batch, MAX_TOKENS)

    def decode_spec(self) -> EngineSpec:
        return on(self.net, "a", kit.spec(self.model, "kv_both", self.sockets["a"], transport="nixl",
                                          listen=f"{self.net.addr['a']}:{PORT}", lease_timeout_s=LEASE_TIMEOUT_S))

    def exporter(self) -> dict[str, Any]:
        """The decode rank's exporter as `kvstate status` shows it (asked over its node's
        socket, from the test process: the socket directory is on the shared filesystem)."""
        from kvstate.share.status import node_status

        found = [s for s in node_status([self.sockets["a"]])["endpoints"] if s.get("kind") == "exporter"]
        assert len(found) == 1, found
        return found[0]


def on(net: TwoHosts, host: str, spec: EngineSpec) -> EngineSpec:
    """``spec`` run on ``host``: in its namespace, with UCX on its veth only."""
    return dataclasses.replace(spec, prefix=tuple(net.prefix(host)), env={**spec.env, **net.env(host)})


@pytest.fixture(scope="module")
def net() -> Iterator[TwoHosts]:
    try:
        hosts = TwoHosts().__enter__()
    except NetnsUnavailable as exc:
        if REQUIRE:
            pytest.fail(f"KVSTATE_REQUIRE_NETNS=1 but the namespaces cannot be made: {exc}", pytrace=False)
        pytest.skip(f"NO NETNS: the cross-node tests need two network namespaces: {exc}")
    try:
        yield hosts
    finally:
        hosts.down()


@pytest.fixture(scope="module")
def pair(net: TwoHosts, model_dir: Path, memory: MemorySampler, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Hosts]:
    work = tmp_path_factory.mktemp("xnode")
    sockets = {h: kit.socket_dir(work / f"s{h}") for h in ("a", "b")}
    box = Engines(work, memory)
    try:
        hosts = Hosts(net, box, str(model_dir), sockets, None, None, [])  # type: ignore[arg-type]
        prefill_spec = on(net, "b", kit.spec(
            str(model_dir), "kv_consumer", sockets["b"], policy=kit.POLICY_ON, transport="nixl",
            sources=[f"tcp://{net.addr['a']}:{PORT}"], load_timeout_s=LOAD_TIMEOUT_S))
        # The plain engine (no connector) starts with the pair and gives its tokens, then
        # goes: one engine start instead of the session's plain pair (two more).
        hosts.decode, hosts.prefill, plain = start_all([box.make("decode", hosts.decode_spec()),
                                                        box.make("prefill", prefill_spec),
                                                        box.make("plain", EngineSpec(str(model_dir)))])
        hosts.plain = plain.generate(prompts(), MAX_TOKENS).tokens
        assert plain.close().leaks == []
        yield hosts
    finally:
        leaks = box.close_all()
        for d in sockets.values():
            shutil.rmtree(d, ignore_errors=True)
    assert not leaks, leaks


def _rx_bytes(net: TwoHosts, host: str) -> int:
    import subprocess

    out = subprocess.run([*net.prefix(host), "cat", f"/sys/class/net/{net.dev[host]}/statistics/rx_bytes"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return int(out)


def test_reuse_across_nodes_gives_a_plain_engines_tokens(pair: Hosts) -> None:
    batch = prompts()
    kit.produce(pair.decode, batch, MAX_TOKENS)
    before = _rx_bytes(pair.net, "b")
    got = pair.fresh(pair.prefill, batch)
    received = _rx_bytes(pair.net, "b") - before
    assert got.tokens == pair.plain
    expected = kit.loadable(PROMPT_LENGTHS)
    assert evidence.reuse(got).external_problems(expected) == []
    c = kit.counters(got)
    assert c.get("hits") == len(batch) and c.get("loads_ok") == len(batch), c
    assert c.get("tokens_loaded") == sum(expected), c
    computed = evidence.reuse(got).by_source["local_compute"]
    assert computed == sum(PROMPT_LENGTHS) - sum(expected), computed
    # The bytes came over the link (the one path between the namespaces), not a memfd.
    assert received >= c["bytes_loaded"] > 0, (received, c)
    for pid in kit.worker_pids(pair.prefill):
        assert kit.bank_fds(pid) == [] and kit.bank_mappings(pid) == []


def test_with_the_policy_off_nothing_is_asked_or_loaded(pair: Hosts) -> None:
    got = pair.fresh(pair.decode, prompts())
    assert got.tokens == pair.plain
    assert evidence.reuse(got).none_problems() == []
    c = kit.counters(got)
    assert c.get("misses{reason=reuse_disabled}") == len(PROMPT_LENGTHS), c
    assert "lookups" not in c and "hits" not in c, c


def test_a_corrupted_remote_bank_changes_the_tokens(pair: Hosts) -> None:
    """The negative control: the bytes READ from the other node are what the prefill
    engine computes with."""
    batch = prompts((100, 75, 140), seed=3)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    assert kit.corrupt_banks(pair.decode) > 0
    got = pair.fresh(pair.prefill, batch)
    assert evidence.reuse(got).external_problems(kit.loadable((100, 75, 140))) == []
    for mine, theirs in zip(got.tokens, reference.tokens):
        assert mine != theirs


def _generate_in_thread(engine: Engine, batch: list[list[int]]) -> tuple[threading.Thread, dict[str, Generation]]:
    out: dict[str, Generation] = {}
    t = threading.Thread(target=lambda: out.setdefault("g", engine.generate(batch, MAX_TOKENS)))
    t.start()
    return t, out


def _quiet_exporter(pair: Hosts, timeout: float) -> dict[str, Any]:
    """The decode exporter once no lease is left (or its last snapshot after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = pair.exporter()
        banks = snap["banks"]  # none for a moment while the decode rank replaces a drained bank
        if (banks and banks[0]["lease_count"] == 0) or time.monotonic() > deadline:
            assert banks, f"the decode exporter has no bank: {snap}"
            return snap
        time.sleep(0.5)


def test_thirty_percent_packet_loss_never_gives_wrong_tokens(pair: Hosts) -> None:
    batch = prompts((100, 140, 600), seed=23)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    pair.net.shape(loss=0.3)
    try:
        got = pair.fresh(pair.prefill, batch)
    finally:
        pair.net.unshape()
    c = kit.counters(got)
    for i, (mine, theirs) in enumerate(zip(got.tokens, reference.tokens)):
        assert mine == theirs, (i, c)
    # every prompt either loaded or was computed, each failure with its reason
    assert c.get("loads_ok", 0) + c.get("loads_failed", 0) + sum(
        v for k, v in c.items() if k.startswith("misses")) >= len(batch), c
    assert sum(v for k, v in c.items() if k.startswith("rejections")) == c.get("loads_failed", 0), c


def test_decode_killed_during_the_load_then_restarted_twice(pair: Hosts) -> None:
    batch = prompts((600,), seed=6)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    assert pair.prefill.reset_prefix_cache()
    workers = kit.worker_pids(pair.decode)
    assert workers
    for pid in workers:                                # its index still answers; its exporter does not
        stop_process(pid)
    t, out = _generate_in_thread(pair.prefill, batch)
    time.sleep(3.0)
    pair.decode.kill()
    t.join(300)
    got = out["g"]
    assert got.tokens == reference.tokens
    c = kit.counters(got)
    assert c.get("hits") == 1 and "loads_ok" not in c and c.get("loads_failed", 0) >= 1, c
    assert sum(v for k, v in c.items() if k.startswith("rejections")) == c["loads_failed"], c
    for pid in kit.worker_pids(pair.prefill):
        assert kit.bank_fds(pid) == [] and kit.bank_mappings(pid) == []

    # A new incarnation at the same address; the failed load dropped the cached descriptors,
    # so its first load fetches the new ones and loads.
    assert pair.decode.close().leaks == []             # nothing of kvstate's, no process left
    pair.decode = start_all([pair.box.make("decode-2", pair.decode_spec())])[0]
    batch = prompts((140,), seed=5)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    got = pair.fresh(pair.prefill, batch)
    assert got.tokens == reference.tokens and kit.counters(got).get("loads_ok") == 1, kit.counters(got)

    # Killed while idle and restarted again: the prefill engine still holds the previous
    # incarnation's descriptors, and the new exporter refuses them as stale.
    pair.decode.kill()
    assert pair.decode.close().leaks == []
    pair.decode = start_all([pair.box.make("decode-3", pair.decode_spec())])[0]
    batch = prompts((140,), seed=7)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    stale = pair.fresh(pair.prefill, batch)
    assert stale.tokens == reference.tokens
    c = kit.counters(stale)
    rejected = {k: v for k, v in c.items() if k.startswith("rejections")}
    assert c.get("loads_failed", 0) >= 1 and rejected == {"rejections{reason=stale_incarnation}": c["loads_failed"]}, c
    t0 = time.monotonic()
    again = pair.fresh(pair.prefill, batch)
    print("the load after the stale refusal took", time.monotonic() - t0, "s:", kit.counters(again))
    assert again.tokens == reference.tokens
    assert evidence.reuse(again).external_problems(kit.loadable((140,))) == []


def test_the_link_cut_mid_load_fails_the_load_and_the_exporter_reclaims(pair: Hosts) -> None:
    """The link goes down while a 4,096-token prefix is being READ (the link slowed so the
    READ takes seconds): the load fails within its timeout and vLLM recomputes; on the
    decode side the lease runs out (nobody renews it; spec/bank.toml then drains the bank)
    and keepalive ends the connection, so the bank is left with no lease, hold, pin or
    store (nothing keeps its memory), though the prefill never said goodbye. The decode
    rank then replaces the drained bank with a new one, advertised (docs/vllm.md, Limits)."""
    batch = prompts((4096,), seed=21)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    assert pair.prefill.reset_prefix_cache()
    pair.net.shape(rate="4mbit")                      # 4 MiB of KV: about 8 s on the link
    try:
        t, out = _generate_in_thread(pair.prefill, batch)
        deadline = time.monotonic() + 30
        while pair.exporter()["banks"][0]["lease_count"] == 0:   # the lease is granted: READs follow
            assert time.monotonic() < deadline, "no lease was granted"
            time.sleep(0.1)
        time.sleep(1.0)
        cut_at = time.monotonic()
        pair.net.cut()
        t.join(LOAD_TIMEOUT_S + 120)
        assert not t.is_alive()
        snap = _quiet_exporter(pair, LEASE_TIMEOUT_S + 30)
        reclaimed_s = time.monotonic() - cut_at
    finally:
        pair.net.restore()
    got = out["g"]
    assert got.tokens == reference.tokens
    c = kit.counters(got)
    assert c.get("hits") == 1 and "loads_ok" not in c and c.get("loads_failed", 0) >= 1, c
    assert sum(v for k, v in c.items() if k.startswith("rejections")) == c["loads_failed"], c
    bank = snap["banks"][0]                           # drained (spec/bank.toml), and nothing holds it
    assert bank["lease_count"] == 0 and bank["holds"] == 0 and bank["pins"] == 0, (bank, reclaimed_s)
    # drained and not yet replaced; being replaced (the old one released, or the new one
    # allocated or registered but not yet advertised: CI caught it there); or replaced
    assert bank["state"] in ("draining", "quiescent", "released", "allocated", "registered", "advertised") \
        and bank["stores"] == 0, bank
    # Nothing holds the drained bank: the decode rank replaces it with a new one, advertised.
    deadline = time.monotonic() + 60
    while not (banks := pair.exporter()["banks"]) or (now := banks[0])["state"] != "advertised":
        assert time.monotonic() < deadline, f"the drained bank was not replaced: {banks}"
        time.sleep(0.5)  # no bank at all for a moment: the old one is released, the new one not yet added
    assert (now["generation"] > bank["generation"] or bank["state"] == "advertised") and now["lease_count"] == 0, \
        (bank, now)
    # The prefill engine keeps serving over the restored link (a load there may fail and be
    # recomputed: after the cut, UCX's endpoint to the decode agent may be gone for good).
    batch = prompts((600,), seed=22)
    reference = kit.produce(pair.decode, batch, MAX_TOKENS)
    again = pair.fresh(pair.prefill, batch)
    assert again.tokens == reference.tokens
    print("after the cut:", kit.counters(again))


def test_no_namespace_is_left_after_the_module(net: TwoHosts) -> None:
    """Runs last: the namespaces exist now, and the fixture removes them; the removal
    itself is checked by a fresh pair made and removed here."""
    assert len(leftover(net.tag)) == 2
    with TwoHosts() as other:
        assert len(leftover(other.tag)) == 2
    assert leftover(other.tag) == []
