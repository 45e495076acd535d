"""The connector across nodes, its halves in this process (as test_vllm_flow.py does for
one node): the decode engine with ``transport: nixl`` and a ``listen`` address exports
its banks through NIXL and serves its index and leases over TCP; the prefill engine names
it only by address, with a socket directory of its own, and READs the blocks over NIXL
(UCX on loopback), then scatters them into its pages. The engines in two network
namespaces run in tests/vllm/test_vllm_crossnode.py (``make test-crossnode``)."""

from __future__ import annotations

import multiprocessing
import random
import socket
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from integrations.test_vllm_flow import BS, LAYERS, POLICY, Engine, finish, load, matched, wait_for
from kvstate.core.errors import ConfigInvalid
from kvstate.integrations.vllm import config as cfgmod
from kvstate.integrations.vllm.index_client import IndexClient, Refusal
from support.need import need_nixl

RETAIN = 16 * 2 * 2 * BS * 2 * 8 * 2


@pytest.fixture(autouse=True)
def _nixl() -> None:
    need_nixl()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(span: int) -> int:
    """A port with ``span`` free ports from it on (the index, then one per rank), below
    the kernel's ephemeral range: the decode child binds them seconds later, and a port
    the kernel hands out as any connection's source port could be taken by then (CI saw
    the child's listen fail so)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, _ephemeral_low() - span)
        held: list[socket.socket] = []
        try:
            for p in range(base, base + span):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
        return base
    raise AssertionError("no free port range")


def _decode_child(conn: Connection, extra: dict[str, Any], tp: int) -> None:
    """A decode engine in a process of its own (one NIXL agent per process): it retains
    what it is told to and answers with the retained pages' bytes, until told to stop."""
    engine = Engine("kv_producer", extra, tp, "decode-engine")
    try:
        conn.send(("ready", engine.cfg.index_address(), [r.exporter.lease_address for r in engine.decode]))
        while True:
            msg = conn.recv()
            if msg[0] == "finish":
                _, req, tokens, pages = msg
                finish(engine, req, tokens, pages)
                conn.send([{n: engine.caches[r][n][pages].clone() for n in LAYERS} for r in range(tp)])
            elif msg[0] == "leases":
                conn.send(sum(len(r.bank.leases) for r in engine.decode))
            else:
                break
    finally:
        engine.close()
        conn.send("closed")


class Decode:
    """The decode child, as the tests drive it."""

    def __init__(self, extra: dict[str, Any], tp: int) -> None:
        self.tp = tp
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_child, args=(theirs, extra, tp), daemon=True)
        self.proc.start()
        theirs.close()
        self.index_address, self.lease_addresses = self._ask(None, "ready")[1:]

    def _ask(self, msg: tuple[Any, ...] | None, what: str, timeout: float = 120.0) -> Any:
        if msg is not None:
            self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise AssertionError(f"the decode child did not answer {what}")
        return self.conn.recv()

    def finish(self, req: str, tokens: list[int], pages: list[int]) -> list[dict[str, torch.Tensor]]:
        out: list[dict[str, torch.Tensor]] = self._ask(("finish", req, tokens, pages), "finish")
        return out

    def leases(self) -> int:
        return int(self._ask(("leases",), "leases"))

    def close(self) -> None:
        try:
            self._ask(("stop",), "stop", 30.0)
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
            self.conn.close()


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Decode, Engine, int]]:
    tp = request.param
    port = free_port(1 + tp)
    decode = Decode({"socket_dir": str(tmp_path / "a"), "retain_bytes": RETAIN, "transport": "nixl",
                     "listen": f"127.0.0.1:{port}"}, tp)
    try:
        prefill = Engine("kv_consumer", {"socket_dir": str(tmp_path / "b"), "retain_bytes": RETAIN,
                                         "sources": [f"tcp://127.0.0.1:{port}"], "policy": POLICY},
                         tp, "prefill-engine")
    except BaseException:
        decode.close()
        raise
    yield decode, prefill, port
    prefill.close()
    decode.close()


# The prefill side's NIXL agent lives as long as this process (one per process, shared by
# the connector's ranks: kvstate.integrations.vllm.nixl_agent), so its fds and threads
# outlive the first test that makes it.
AGENT = pytest.mark.no_leakcheck


@AGENT
def test_blocks_load_over_nixl_from_a_source_named_by_address(pair: tuple[Decode, Engine, int]) -> None:
    decode, prefill, port = pair
    assert prefill.cfg.reads_nixl                         # auto: a source by address reads NIXL
    assert all(r.nixl is not None for r in prefill.prefill)
    assert decode.index_address == f"tcp://127.0.0.1:{port}"
    assert decode.lease_addresses == [f"tcp://127.0.0.1:{port + 1 + r}" for r in range(decode.tp)]
    tokens = list(range(1000, 1019))                       # 4 full blocks and 3 tokens
    src = [9, 3, 40, 17, 22]
    retained = decode.finish("d1", tokens, src)
    prompt = tokens[:18] + [5, 6, 7, 8, 9, 10]
    dst = [30, 31, 2, 60, 61, 62, 63]
    n, failed = load(prefill, "p1", prompt, dst)
    assert (n, failed) == (4 * BS, set())
    for rank in range(decode.tp):
        for layer in LAYERS:
            assert retained[rank][layer][:4].any()
            assert torch.equal(prefill.caches[rank][layer][dst[:4]], retained[rank][layer][:4])
            assert not prefill.caches[rank][layer][dst[4]].any()
    ranks = prefill.tally.take()
    assert ranks["loads_ok"] == decode.tp, ranks
    wait_for(lambda: decode.leases() == 0, "the leases returned")


@AGENT
def test_two_groups_read_one_remote_bank_at_once(pair: tuple[Decode, Engine, int]) -> None:
    """Two requests' loads in flight together, each its own group leasing the same banks:
    the worker process has one NIXL view per bank and generation, shared by both parts,
    and released with the last (the second import failed, "generation 1 is already
    imported", and its blocks were recomputed)."""
    decode, prefill, _ = pair
    a, b = list(range(3000, 3019)), list(range(4000, 4019))
    retained = [decode.finish("da", a, [1, 2, 3, 4, 5]), decode.finish("db", b, [6, 7, 8, 9, 10])]
    for req, tokens, pages in (("pa", a, [10, 11, 12, 13, 14]), ("pb", b, [20, 21, 22, 23, 24])):
        n = matched(prefill.sched, req, tokens, len(tokens), 0, None)
        assert n == 4 * BS
        prefill.sched.allocated(req, pages, n)
    assert len({id(g.group) for g in prefill.sched._groups}) == 2
    loaded: set[str] = set()
    failed: set[int] = set()

    def both() -> bool:
        _, done, f = prefill.step()
        loaded.update(done)
        failed.update(f)
        return loaded >= {"pa", "pb"}
    wait_for(both, "both loads", 60.0)
    assert failed == set(), prefill.said
    for rank in range(decode.tp):
        for layer in LAYERS:
            assert torch.equal(prefill.caches[rank][layer][[10, 11, 12, 13]], retained[0][rank][layer][:4])
            assert torch.equal(prefill.caches[rank][layer][[20, 21, 22, 23]], retained[1][rank][layer][:4])
    for req in ("pa", "pb"):
        prefill.sched.request_done(req)
    wait_for(lambda: decode.leases() == 0, "the leases returned")
    from kvstate.integrations.vllm.nixl_agent import process_agent
    wait_for(lambda: not process_agent()._remotes, "the views retired with their last part")


@AGENT
def test_a_routed_source_is_asked_first(pair: tuple[Decode, Engine, int], tmp_path: Path) -> None:
    decode, prefill, port = pair
    tokens = list(range(2000, 2019))
    decode.finish("d2", tokens, [1, 2, 3, 4, 5])
    # A prefill engine that knows no reachable source but reads NIXL: the route alone finds it.
    routed = Engine("kv_consumer", {"socket_dir": str(tmp_path / "c"), "retain_bytes": RETAIN, "transport": "nixl",
                                    "sources": ["nowhere"], "policy": POLICY}, decode.tp, "routed-engine")
    try:
        assert matched(routed.sched, "r0", tokens, len(tokens), 0, None) == 0      # no route: nobody has it
        assert matched(routed.sched, "r1", tokens, len(tokens), 0, None, decode.index_address) == 4 * BS
        assert list(routed.sched.clients) == ["nowhere", decode.index_address]
        matched(routed.sched, "r2", tokens, len(tokens), 0, None, "tcp://nowhere")  # no port: not followed
        assert routed.sched.tally.take()["routes_ignored"] == {"malformed": 1}
    finally:
        routed.close()


@AGENT
def test_the_index_over_tcp_answers_only_holders_of_the_key(pair: tuple[Decode, Engine, int]) -> None:
    decode, prefill, port = pair
    from kvstate.core.identity import Deployment

    wrong = IndexClient(f"tcp://127.0.0.1:{port}", Deployment("kvstate", bytes(32)), 2.0)
    try:
        answer = wrong.lookup(prefill.compat, [bytes(16)])
    finally:
        wrong.close()
    assert isinstance(answer, Refusal) and answer.reason == "unreachable", answer


@pytest.mark.parametrize("extra, field", [
    ({"transport": "tcp"}, "transport"),
    ({"transport": "nixl"}, "listen"),                         # a decode engine needs an address
    ({"listen": "0.0.0.0:4000"}, "listen"),                    # descriptors would name a wildcard
    ({"listen": "host:70000"}, "listen"),
    ({"listen": "host"}, "listen"),
    ({"sources": ["tcp://host"]}, "sources[0]"),
    ({"sources": ["tcp://host:0"]}, "sources[0]"),
])
def test_cross_node_settings_are_checked_at_start(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigInvalid) as err:
        cfgmod.parse(extra, "kv_both", {cfgmod.KEY_ENV: bytes(range(32)).hex()})
    assert field in str(err.value)


def test_auto_picks_the_transport_by_the_settings() -> None:
    env = {cfgmod.KEY_ENV: bytes(range(32)).hex()}
    assert not cfgmod.parse({}, "kv_both", env).exports_nixl
    assert not cfgmod.parse({}, "kv_both", env).reads_nixl
    both = cfgmod.parse({"listen": "10.0.0.5:4000", "sources": ["local", "tcp://[fe80::1]:4000"]}, "kv_both", env)
    assert both.exports_nixl and both.reads_nixl and both.lease_listen(1) == ("10.0.0.5", 4002)
    assert both.sources == ("local", "tcp://[fe80::1]:4000")
    host = cfgmod.parse({"transport": "host", "listen": "10.0.0.5:4000", "sources": ["tcp://h:1"]}, "kv_both", env)
    assert not host.exports_nixl and not host.reads_nixl and host.index_address() is None



def test_heterogeneous_tp_and_layer_loads_are_refused_across_nodes() -> None:
    """Issue 30 keeps heterogeneous TP same-node: a prefill engine reading other nodes'
    banks refuses a source_tp other than its own, and per-layer loads, by name."""
    env = {cfgmod.KEY_ENV: bytes(range(32)).hex()}
    remote = {"sources": ["tcp://10.0.0.5:4000"]}
    cfgmod.parse(remote, "kv_consumer", env).check_remote(False)      # same TP, asynchronous: served
    cfgmod.parse({"source_tp": 2}, "kv_consumer", env).check_remote(True)  # same node: served
    cfgmod.parse({"layer_loads": True}, "kv_consumer", env).check_remote(False)
    for extra, mixed, field in ((remote, True, "source_tp"), ({**remote, "layer_loads": True}, False, "layer_loads"),
                                ({"transport": "nixl", "source_tp": 2}, True, "source_tp")):
        with pytest.raises(ConfigInvalid) as err:
            cfgmod.parse(extra, "kv_consumer", env).check_remote(mixed)
        assert field in str(err.value) and "same-node only" in str(err.value)


@AGENT
def test_a_restarted_exporter_at_the_same_address_refuses_stale_descriptors_then_loads(tmp_path: Path) -> None:
    """The decode process SIGKILLed while idle and a new one started at the same address:
    the prefill side's cached descriptors of the old incarnation are refused as stale,
    the blocks are recomputed, and the next load leases from the new incarnation."""
    port = free_port(2)
    extra = {"socket_dir": str(tmp_path / "a"), "retain_bytes": RETAIN, "transport": "nixl",
             "listen": f"127.0.0.1:{port}"}
    decode = Decode(extra, 1)
    prefill = Engine("kv_consumer", {"socket_dir": str(tmp_path / "b"), "retain_bytes": RETAIN,
                                     "sources": [f"tcp://127.0.0.1:{port}"], "policy": POLICY}, 1, "prefill-engine")
    try:
        tokens = list(range(2000, 2019))
        decode.finish("d1", tokens, [9, 3, 40, 17, 22])
        assert load(prefill, "p1", tokens[:18] + [5], [30, 31, 2, 60, 61]) == (4 * BS, set())
        assert prefill.tally.take()["loads_ok"] == 1
        decode.proc.kill()                                    # idle: nothing tells the prefill side
        decode.proc.join(30)
        decode.conn.close()
        decode = Decode(extra, 1)                             # a new incarnation, same address
        tokens = list(range(3000, 3019))
        retained = decode.finish("d2", tokens, [9, 3, 40, 17, 22])
        first = load(prefill, "p2", tokens[:18] + [5], [30, 31, 2, 60, 61])
        ranks = prefill.tally.take()
        if first[1]:                                          # the old descriptors: refused as stale
            assert ranks.get("loads_failed") == 1, ranks
        n, failed = load(prefill, "p3", tokens[:18] + [6], [30, 31, 2, 60, 61])
        ranks = prefill.tally.take()
        assert (n, failed) == (4 * BS, set()), ranks
        assert ranks.get("loads_ok") == 1, ranks
        for layer in LAYERS:
            assert torch.equal(prefill.caches[0][layer][[30, 31, 2, 60]], retained[0][layer][:4])
    finally:
        prefill.close()
        decode.close()
