"""The connector's two halves end to end without vLLM: a decode engine's scheduler side
(index, slot table) and its ranks (banks, exporters, inventories), a prefill engine's
scheduler side (policy, lookups, coordinator) and its ranks (rank workers, loads), all in
this process on the host transport, with torch tensors in vLLM's CPU layout standing in
for the engines' KV caches. What vLLM itself does around them runs in tests/vllm."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from kvstate.integrations.vllm import config as cfgmod
from kvstate import channel as chan
from kvstate.core.errors import KvStateError
from kvstate.integrations.vllm import index as index_mod
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.index_client import Found, IndexClient, Refusal
from kvstate.integrations.vllm.decode_rank import DecodeRank
from kvstate.integrations.vllm.hashing import Compat
from kvstate.integrations.vllm.orders import LoadFailures, StepOrders
from kvstate.integrations.vllm.prefill_rank import PrefillRank
from kvstate.integrations.vllm.scheduler_side import SchedulerSide
from kvstate.integrations.vllm.stats import Tally
from kvstate.integrations.vllm.tp import source_view
from kvstate.share import part as part_mod
from kvstate.transport.host import HostTransport
from kvstate.core import heads as heads_mod

BS, HD, HEADS, PAGES = 4, 8, 2, 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
ENV = {cfgmod.KEY_ENV: bytes(range(32)).hex()}
POLICY = {"enable_decode_to_prefill_reuse": True, "minimum_transfer_prefix_blocks": 1,
          "minimum_estimated_ttft_saving_ms": 0.0, "transfer_source_lookup_budget_ms": 2000.0,
          "transfer_source_prefill_token_us": 1e6}  # the saving estimate counts the whole budget as lookup cost


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def matched(sched: SchedulerSide, *args: Any) -> int:
    """``sched.match(*args)``, asked again while a decode index's reply is on its way (None),
    as vLLM asks again at its next step."""
    deadline = time.monotonic() + 10.0
    while (n := sched.match(*args)) is None:
        assert time.monotonic() < deadline, "no reply from the decode index in 10 s"
        time.sleep(0.001)
    return n


def caches(seed: int | None, heads: int = HEADS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for name in LAYERS:
        t = torch.randn(PAGES, heads, BS, 2 * HD, generator=g).to(torch.bfloat16)
        out[name] = t if seed is not None else torch.zeros_like(t)
    return out


class Engine:
    """One engine's scheduler side and its ranks."""

    def __init__(self, role: str, extra: dict[str, Any], tp: int, name: str, total_heads: int | None = None,
                 transport: Any = None) -> None:
        """``total_heads``: the model's KV heads (default: HEADS per rank); with
        ``source_tp`` in ``extra`` the engine loads from decode engines of that size.
        ``transport``: the prefill ranks' (default: the host transport)."""
        # A small bank: the default (256 MiB) of these tiny blocks is half a million slots.
        self.cfg = cfgmod.parse({"retain_bytes": 16 * 2 * HEADS * BS * 2 * HD * 2, **extra}, role, ENV)
        total = HEADS * tp if total_heads is None else total_heads
        heads = heads_mod.rank_heads(total, tp, 0)[1]
        self.compat = Compat(model="tiny", dtype="bf16", block_size=BS, head_dim=HD, kv_heads=heads, layers=LAYERS,
                             tp=tp, isa="vec", engine="test")
        self.view = source_view(self.compat, total, self.cfg.source_tp)
        self.sched = SchedulerSide(self.cfg, self.compat, name, self.view)
        self.tally = Tally()
        self.tp = tp
        self._sent: dict[str, int] = {}
        self._loaded: dict[str, int] = {}
        self.said = LoadFailures()  # every reason the ranks sent
        self.caches = [caches(r + 1 if self.cfg.producer else None, heads) for r in range(tp)]
        self.decode: list[DecodeRank] = []
        self.prefill: list[PrefillRank] = []
        if self.cfg.producer:
            self.decode = [DecodeRank(self.cfg, self.compat, r, self.caches[r], self.tally) for r in range(tp)]
            wait_for(lambda: self.sched.index is not None and self.sched.index.ready(), "decode index ready")
        if self.cfg.consumer:
            path = Path(self.sched.coordinator_path)
            self.prefill = [PrefillRank(self.cfg, self.compat, r, self.caches[r], self.tally, path, self.view,
                                        transport or HostTransport) for r in range(tp)]
            assert self.sched.coordinator is not None
            self.sched.coordinator.wait_for_workers(10.0)

    def step(self, finished: set[str] = frozenset()) -> tuple[set[str], set[str], set[int]]:
        """One engine step: orders to every rank, then what every rank finished."""
        orders: StepOrders = self.sched.step_orders()
        for r in self.decode:
            for s in orders.stores:
                r.store(s)
        for p in self.prefill:
            for order in orders.loads:
                p.load(order)
        # As vLLM's KVOutputAggregator: a request is finished once every rank reported it,
        # counted across steps (ranks may report it in different steps).
        sending = [r.finished(set(finished)) for r in self.decode]
        loads = [p.finished() for p in self.prefill]
        all_sent = self._count(self._sent, sending)
        all_loaded = self._count(self._loaded, [d for d, _ in loads])
        failed = set().union(*[f for _, f in loads]) if loads else set()
        why = LoadFailures()
        for p in self.prefill:  # as vLLM merges the ranks' worker metadata
            why = why.merge(p.failures())
        self.said = self.said.merge(why)
        self.sched.worker_output(sorted(all_loaded), failed, why)
        return all_sent, all_loaded, failed

    def _count(self, seen: dict[str, int], reports: list[set[str]]) -> set[str]:
        for report in reports:
            for req in report:
                seen[req] = seen.get(req, 0) + 1
        done = {req for req, n in seen.items() if n == self.tp}
        for req in done:
            del seen[req]
        return done

    def close(self) -> None:
        for p in self.prefill:
            p.close()
        for r in self.decode:
            r.close()
        self.sched.close()


@pytest.fixture
def sockets(tmp_path: Path) -> Path:
    d = tmp_path / "s"
    return d


def finish(decode: Engine, req: str, tokens: list[int], pages: list[int]) -> None:
    assert decode.sched.request_finished(req, tokens, len(tokens), pages, None)
    wait_for(lambda: req in decode.step({req})[0], f"stores of {req}")
    index = decode.sched.index
    assert index is not None
    wait_for(lambda: index.table.counts()["storing"] == 0, "every rank reported its stores")


def load(prefill: Engine, req: str, prompt: list[int], pages: list[int]) -> tuple[int, set[int]]:
    n = matched(prefill.sched, req, prompt, len(prompt), 0, None)
    if n == 0:
        print("miss", prefill.sched.tally.take())
        return 0, set()
    prefill.sched.allocated(req, pages, n)
    return n, step_until_loaded(prefill, req)


def step_until_loaded(prefill: Engine, req: str) -> set[int]:
    """Step ``prefill`` until every rank reported ``req``'s load finished; the pages named
    failed meanwhile."""
    failed: set[int] = set()

    def done() -> bool:
        _, loaded, f = prefill.step()
        failed.update(f)
        return req in loaded
    try:
        wait_for(done, f"load of {req}", 30.0)
    except AssertionError:
        groups = [(g.group.gid, g.group.state, g.group.failure) for g in prefill.sched._groups]
        shares = [(p.worker is not None, p._loads, p.worker and [(s.gid, s.state) for s in p.worker.shares.values()])
                  for p in prefill.prefill]
        raise AssertionError(f"{groups} {shares}") from None
    return failed


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def pair(request: pytest.FixtureRequest, sockets: Path) -> Iterator[tuple[Engine, Engine]]:
    tp = request.param
    common = {"socket_dir": str(sockets), "retain_bytes": 16 * 2 * HEADS * BS * 2 * HD * 2}
    decode = Engine("kv_producer", common, tp, "decode-engine")
    prefill = Engine("kv_consumer", {**common, "policy": POLICY}, tp, "prefill-engine")
    yield decode, prefill
    prefill.close()
    decode.close()


def test_a_finished_requests_blocks_load_into_another_engines_pages(pair: tuple[Engine, Engine]) -> None:
    decode, prefill = pair
    tokens = list(range(1000, 1019))                       # 4 full blocks and 3 tokens
    src = [9, 3, 40, 17, 22]
    finish(decode, "d1", tokens, src)
    prompt = tokens[:18] + [5, 6, 7, 8, 9, 10]             # shares the 4 full blocks
    dst = [30, 31, 2, 60, 61, 62, 63]
    n, failed = load(prefill, "p1", prompt, dst)
    assert (n, failed) == (4 * BS, set())
    for rank in range(len(decode.decode)):
        for layer in LAYERS:
            for s, d in zip(src[:4], dst[:4]):
                assert torch.equal(prefill.caches[rank][layer][d], decode.caches[rank][layer][s])
            assert not prefill.caches[rank][layer][dst[4]].any()   # nothing beyond the shared blocks
    counted = prefill.sched.tally.take()
    assert counted["hits"] == 1 and counted["tokens_matched"] == 4 * BS
    ranks = prefill.tally.take()
    assert ranks["loads_ok"] == len(prefill.prefill) and ranks["tokens_loaded"] == 4 * BS * len(prefill.prefill)


def test_a_rank_that_lost_its_coordinator_reconnects_and_loads_again(pair: tuple[Engine, Engine]) -> None:
    """A prefill rank's worker whose coordinator went away (here: the coordinator
    restarted at the same socket) connects again, counted in ``reconnects``, and the next
    load is served. (It connected once: after the loss every later load timed out as
    not connected, for the life of the engine.)"""
    from kvstate.share.coordinator import Coordinator

    decode, prefill = pair
    tokens = list(range(2000, 2000 + 4 * BS + 1))
    finish(decode, "d-re", tokens, [1, 2, 3, 4, 5])
    assert load(prefill, "p-re1", tokens, [40, 41, 42, 43, 44]) == (4 * BS, set())
    old = prefill.sched.coordinator
    assert old is not None
    workers = [p.worker for p in prefill.prefill]
    old.close()
    wait_for(lambda: all(w is not None and w.coordinator_gone for w in workers), "the ranks saw it go")
    prefill.sched.coordinator = new = Coordinator(old.config)
    new.start()
    new.wait_for_workers(10.0)
    wait_for(lambda: all(p.worker is not None and p.worker not in workers for p in prefill.prefill),
             "every rank on a new worker")
    assert prefill.tally.take().get("reconnects") == len(prefill.prefill)
    assert load(prefill, "p-re2", tokens, [50, 51, 52, 53, 54]) == (4 * BS, set())
    for rank in range(len(decode.decode)):
        for s, d in zip([1, 2, 3, 4], [50, 51, 52, 53]):
            assert torch.equal(prefill.caches[rank][LAYERS[0]][d], decode.caches[rank][LAYERS[0]][s])


def test_a_request_longer_than_one_message_retains_its_first_blocks_and_finishes(
        pair: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished request names at most wire.MAX_BLOCKS blocks in its store report (here
    lowered to 3): it retains its first 3 and vLLM gets its pages back. (Uncapped, the
    report of a longer one could not be encoded inside the store's completion, and the
    request never finished: its pages and bank blocks stayed held.)"""
    decode, prefill = pair
    monkeypatch.setattr(wire, "MAX_BLOCKS", 3)
    tokens = list(range(3000, 3000 + 5 * BS))             # 5 full blocks
    finish(decode, "long", tokens, [11, 12, 13, 14, 15])
    assert decode.sched.index is not None and decode.sched.index.table.counts()["stored"] == 3
    n, failed = load(prefill, "p-long", tokens + [1], [20, 21, 22, 23, 24, 25])
    assert (n, failed) == (3 * BS, set())


def test_a_prompt_longer_than_one_lease_loads_its_first_blocks(pair: tuple[Engine, Engine],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease pins at most part.MAX_REQUEST_HASHES blocks (its request must fit one frame;
    here lowered to 3): a prompt that matched more loads its first 3 and computes the rest,
    instead of failing its lease and loading nothing."""
    decode, prefill = pair
    tokens = list(range(4000, 4000 + 5 * BS))             # 5 full blocks, all stored
    finish(decode, "long-lease", tokens, [11, 12, 13, 14, 15])
    monkeypatch.setattr(part_mod, "MAX_REQUEST_HASHES", 3)
    n, failed = load(prefill, "p-long-lease", tokens + [1], [20, 21, 22, 23, 24, 25])
    assert (n, failed) == (3 * BS, set())
    for rank in range(len(decode.decode)):
        for s, d in zip([11, 12, 13], [20, 21, 22]):
            assert torch.equal(prefill.caches[rank][LAYERS[0]][d], decode.caches[rank][LAYERS[0]][s])


def test_the_index_answers_what_it_knows_and_lets_idle_clients_go(pair: tuple[Engine, Engine],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode index closes a client silent for CLIENT_IDLE_S (idle ones held its
    handler slots for good: 256 of them locked every peer out), and the client reconnects
    on its next question; a server over its connection cap is ``busy`` (it read as a
    protocol error); a refusal reason the client does not know is counted as ``refused``
    (a peer's text became a metric label)."""
    decode, prefill = pair
    index = decode.sched.index
    assert index is not None
    index.client_idle_s = 0.2  # on the native thread's connections too
    client = IndexClient(index.path, decode.cfg.deployment, 2.0)
    try:
        assert isinstance(client.lookup(decode.compat, [bytes(32)]), Found)
        time.sleep(0.6)
        assert client._ch is not None and client._ch.hung_up()      # the index let it go
        assert isinstance(client.lookup(decode.compat, [bytes(32)]), Found)   # and it came back
        # A question the native thread leaves to Python (another compatibility key, which
        # Python names): the connection is handed over, and Python lets it go too.
        client.close()
        other = attrs.evolve(decode.compat, block_size=decode.compat.block_size * 2)
        refused = client.lookup(other, [bytes(32)])
        assert isinstance(refused, Refusal) and refused.reason != "protocol", refused
        assert client._ch is not None and not client._ch.hung_up()
        time.sleep(0.8)
        assert client._ch.hung_up()
    finally:
        client.close()
        index.client_idle_s = index_mod.CLIENT_IDLE_S

    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o700)
        path = Path(d) / "fake.sock"
        server = chan.Server(path, limits=wire.LIMITS, max_connections=1)
        stop = threading.Event()

        def answer(ch: chan.Channel) -> None:
            with ch:  # the handler owns its channel
                while not stop.is_set():
                    try:
                        with ch.recv(timeout=0.05):
                            pass
                    except KvStateError as exc:
                        if isinstance(exc, ChannelError) and exc.reason is ChannelReason.TIMEOUT:
                            continue
                        return
                    ch.send(wire.encode("refused", reason="x" * 300, detail="made up"), timeout=1.0)
        server.serve_in_thread(answer, name="fake-index")
        first, second = IndexClient(path, decode.cfg.deployment, 2.0), IndexClient(path, decode.cfg.deployment, 2.0)
        try:
            assert first.lookup(decode.compat, [bytes(32)]) == Refusal("refused", "made up")
            assert second.lookup(decode.compat, [bytes(32)]).reason == "busy"   # first holds the one slot
        finally:
            stop.set()
            first.close()
            second.close()
            server.close()


def test_only_the_shared_blocks_load_and_the_local_cache_is_respected(pair: tuple[Engine, Engine]) -> None:
    decode, prefill = pair
    tokens = list(range(2000, 2017))
    finish(decode, "d1", tokens, [1, 2, 3, 4, 5])
    prompt = tokens[:8] + [1] * 9                          # two blocks shared
    assert matched(prefill.sched, "p1", prompt, len(prompt), 0, None) == 2 * BS
    assert matched(prefill.sched, "p2", prompt, len(prompt), BS, None) == BS   # block 0 is in the local cache
    assert matched(prefill.sched, "p3", prompt, len(prompt), 2 * BS, None) == 0
    assert prefill.sched.tally.take()["misses"] == {"no_eligible_source": 1}   # the source holds no more


def test_a_failed_loads_reason_is_counted_in_the_step_that_reports_it(pair: tuple[Engine, Engine]) -> None:
    """The ranks' reasons arrive with the failed pages (vLLM's worker metadata): the
    scheduler counts the failure then, with a rank's own cause before a share that merely
    ended, whether or not the coordinator has heard anything yet."""
    decode, prefill = pair
    tokens = list(range(3000, 3017))
    finish(decode, "d1", tokens, [1, 2, 3, 4, 5])
    pages = [10, 11, 12, 13, 14]
    n = matched(prefill.sched, "p1", tokens, len(tokens), 0, None)
    prefill.sched.allocated("p1", pages, n)
    prefill.sched.tally.take()
    last = prefill.tp - 1
    prefill.sched.worker_output(["p1"], {pages[0]}, LoadFailures((("p1", 0, "share_failed"), ("p1", last, "timeout"))))
    assert prefill.sched.tally.take() == {"rejections": {"timeout": 1}}
    assert matched(prefill.sched, "p1", tokens, len(tokens), 0, None) == 0       # computed from now on
    assert prefill.sched.tally.take() == {"misses": {"after_failed_load": 1}}


def _order_without_a_step(prefill: Engine, req: str, prompt: list[int], pages: list[int]) -> int:
    """Match and allocate ``req``, and hand its load orders to the ranks as a step would,
    without the rest of the step (no rank looks at its loads yet); returns the tokens
    matched."""
    n = matched(prefill.sched, req, prompt, len(prompt), 0, None)
    assert n > 0
    prefill.sched.allocated(req, pages, n)
    orders = prefill.sched.step_orders()
    for p in prefill.prefill:
        for order in orders.loads:
            p.load(order)
    return n


def _shares_ready(prefill: Engine) -> bool:
    return all(p.worker is not None and p.worker.shares and all(s.state == "ready" for s in p.worker.shares.values())
               for p in prefill.prefill)


#: load_timeout_s of slow_pair: short, yet longer than a step of these engines on a busy
#: machine (the late-load test needs its second look within it).
SLOW_TIMEOUT_S = 1.0


@pytest.fixture
def slow_pair(sockets: Path) -> Iterator[tuple[Engine, Engine]]:
    """tp=2 engines whose prefill side gives a load SLOW_TIMEOUT_S (load_timeout_s)."""
    common = {"socket_dir": str(sockets), "retain_bytes": 16 * 2 * HEADS * BS * 2 * HD * 2}
    decode = Engine("kv_producer", common, 2, "decode-engine")
    prefill = Engine("kv_consumer", {**common, "policy": POLICY, "load_timeout_s": SLOW_TIMEOUT_S}, 2,
                     "prefill-engine")
    yield decode, prefill
    prefill.close()
    decode.close()


def test_a_load_whose_shares_got_ready_while_the_engine_took_no_step_still_loads(
        slow_pair: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine takes no step for longer than load_timeout_s after ordering a load (issue
    28: a fresh tp=2 prefill engine stood still 10 to 22 s, compiling), and the shares got
    ready meanwhile: the ranks load when they next look, rather than recompute what is
    mapped there. (The late load was started, then cancelled at once unless its copy had
    already ended, and counted as ``load_failed``.)"""
    decode, prefill = slow_pair
    transfers = _slow_loads(monkeypatch, looks=1)  # still copying when the rank first looks
    tokens = list(range(6000, 6000 + 4 * BS + 1))
    finish(decode, "d-late", tokens, [1, 2, 3, 4, 5])
    prefill.tally.take()
    dst = [20, 21, 22, 23, 24]
    assert _order_without_a_step(prefill, "p-late", tokens, dst) == 4 * BS
    ordered = time.monotonic()
    wait_for(lambda: _shares_ready(prefill), "every rank's share ready")
    time.sleep(max(0.0, ordered + SLOW_TIMEOUT_S + 0.1 - time.monotonic()))   # the order's time ran out
    failed = step_until_loaded(prefill, "p-late")
    assert failed == set() and len(transfers) == 2 and not any(t.cancelled for t in transfers)
    for rank in range(2):
        for s, d in zip([1, 2, 3, 4], dst):
            assert torch.equal(prefill.caches[rank][LAYERS[0]][d], decode.caches[rank][LAYERS[0]][s])
    counted = prefill.tally.take()
    assert counted["loads_ok"] == 2 and counted["loads_late"] == 2 and "loads_failed" not in counted, counted


@attrs.define
class _SlowTransfer:
    """A rank's transfer as a slow op engine shows it: not done for its first ``looks``
    looks (None: until cancelled), then it ends as the real transfer did, and one cancelled
    before then fails (a real local copy of these blocks ends in microseconds, before the
    rank first looks)."""

    real: Any
    looks: int | None
    cancelled: bool = False
    closed: bool = False

    def done(self) -> bool:
        if self.cancelled:
            return True
        if self.looks is None or self.looks > 0:
            self.looks = None if self.looks is None else self.looks - 1
            return False
        return bool(self.real.done())

    def cancel(self) -> None:
        self.cancelled = True
        self.real.cancel()

    def result(self) -> Any:
        from kvstate.share.transfer import TransferResult

        r = self.real.result()
        if self.cancelled:
            return TransferResult(r.blocks, 0, r.seconds, frozenset(range(r.blocks)), ("cancelled",))
        return r

    def close(self) -> None:
        self.closed = True
        self.real.close()


def _slow_loads(monkeypatch: pytest.MonkeyPatch, looks: int | None) -> list[_SlowTransfer]:
    """Every rank's loads from now on are :class:`_SlowTransfer` around the real ones."""
    from kvstate.share.rank_share import RankShare

    made: list[_SlowTransfer] = []
    load = RankShare.load

    def slow(self: Any, *args: Any, **kwargs: Any) -> _SlowTransfer:
        made.append(_SlowTransfer(load(self, *args, **kwargs), looks))
        return made[-1]
    monkeypatch.setattr(RankShare, "load", slow)
    return made


def test_a_transfer_that_outlasts_load_timeout_s_is_cancelled_and_counted_as_a_timeout(
        slow_pair: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """A started transfer gets load_timeout_s from its start: then what has not started is
    cancelled, the load fails as ``timeout`` (it was counted as ``load_failed``, a reason
    that says the data was bad), and its pages are named for recompute."""
    decode, prefill = slow_pair
    tokens = list(range(7000, 7000 + 4 * BS + 1))
    finish(decode, "d-slow", tokens, [1, 2, 3, 4, 5])
    transfers = _slow_loads(monkeypatch, looks=None)
    dst = [30, 31, 32, 33, 34]
    _order_without_a_step(prefill, "p-slow", tokens, dst)
    wait_for(lambda: _shares_ready(prefill), "every rank's share ready")
    started = time.monotonic()  # before the transfers start
    prefill.step()
    assert len(transfers) == 2 and not any(t.cancelled for t in transfers)
    failed = step_until_loaded(prefill, "p-slow")
    assert time.monotonic() - started >= SLOW_TIMEOUT_S
    assert all(t.cancelled and t.closed for t in transfers)
    assert failed == set(dst[:4])
    assert {why for _, _, why in prefill.said.reasons} == {"timeout"}


def test_policy_off_asks_nobody(sockets: Path) -> None:
    decode = Engine("kv_producer", {"socket_dir": str(sockets)}, 1, "d")
    prefill = Engine("kv_consumer", {"socket_dir": str(sockets)}, 1, "p")
    try:
        tokens = list(range(100, 117))
        finish(decode, "d1", tokens, [1, 2, 3, 4, 5])
        assert matched(prefill.sched, "p1", tokens, len(tokens), 0, None) == 0
        counted = prefill.sched.tally.take()
        assert counted == {"misses": {"reuse_disabled": 1}}
        assert decode.sched.index is not None and decode.sched.index.lookups == 0
    finally:
        prefill.close()
        decode.close()


def test_heterogeneous_tp_is_refused_by_name(sockets: Path) -> None:
    decode = Engine("kv_producer", {"socket_dir": str(sockets)}, 2, "d")
    prefill = Engine("kv_consumer", {"socket_dir": str(sockets), "policy": POLICY}, 1, "p")
    try:
        tokens = list(range(100, 117))
        finish(decode, "d1", tokens, [1, 2, 3, 4, 5])
        assert matched(prefill.sched, "p1", tokens, len(tokens), 0, None) == 0
        assert prefill.sched.tally.take()["misses"] == {"tp_mismatch": 1}
    finally:
        prefill.close()
        decode.close()


def test_a_dead_decode_is_a_miss_and_a_restarted_one_refuses_old_descriptors(sockets: Path) -> None:
    common = {"socket_dir": str(sockets)}
    decode = Engine("kv_producer", common, 1, "d")
    prefill = Engine("kv_consumer", {**common, "policy": POLICY}, 1, "p")
    try:
        tokens = list(range(300, 317))
        finish(decode, "d1", tokens, [1, 2, 3, 4, 5])
        assert load(prefill, "p1", tokens, [10, 11, 12, 13, 14]) == (4 * BS, set())
        decode.close()
        assert matched(prefill.sched, "p2", tokens, len(tokens), 0, None) == 0
        # in one process the index outlives its ranks by a moment; a killed engine is "unreachable"
        assert prefill.sched.tally.take()["misses"] in ({"unreachable": 1}, {"decode_not_ready": 1})
        decode = Engine("kv_producer", common, 1, "d")     # a new incarnation at the same paths
        finish(decode, "d2", tokens, [7, 8, 9, 10, 11])
        n, failed = load(prefill, "p3", tokens, [20, 21, 22, 23, 24])
        assert n == 4 * BS and failed == {20, 21, 22, 23}  # loaded with the cached, stale descriptors
        assert prefill.said.of("p3") == "stale_incarnation"                               # the rank's own cause
        assert prefill.sched.tally.take().get("rejections") == {"stale_incarnation": 1}  # counted in that step
        assert load(prefill, "p4", tokens, [30, 31, 32, 33, 34]) == (4 * BS, set())   # fetched anew
        assert torch.equal(prefill.caches[0][LAYERS[1]][33], decode.caches[0][LAYERS[1]][10])
    finally:
        prefill.close()
        decode.close()


def test_a_bank_drained_by_an_expired_lease_is_replaced_and_reuse_goes_on(pair: tuple[Engine, Engine]) -> None:
    """Issue 30: a lease that expires drains its bank (its importer may still read it).
    Once nobody holds the bank, each decode rank replaces it with a new bank holding the
    same blocks at the next generation; the index advertises that generation, an old
    prefix still loads, and a new request stores and loads. Before, the bank stayed
    draining and every later store and lease was refused (``draining``)."""
    from kvstate.core.descriptor import decode as decode_descriptor
    from kvstate.share.part import lease_request

    decode, prefill = pair
    tokens = list(range(2000, 2017))
    finish(decode, "d1", tokens, [9, 3, 40, 17, 22])
    assert load(prefill, "p1", tokens, [30, 31, 32, 33, 34]) == (4 * BS, set())
    before = [r.bank.generation for r in decode.decode]
    # An importer takes a lease on every rank and never renews it: it expires.
    held = []
    for r in decode.decode:
        d = decode_descriptor(r.exporter.descriptor(r.rank), decode.cfg.deployment)
        ch = chan.connect(d.socket_path, timeout=5.0)
        ch.send(lease_request(d, None), timeout=5.0)
        with ch.recv(timeout=5.0) as msg:
            assert chan.decode(msg.payload)["ok"] is True
        held.append(ch)
    for r in decode.decode:
        assert r.exporter.lease_server.expire(ahead_s=3600.0) >= 1  # ours (and the prefill engine's, if kept)
        wait_for(lambda r=r: r.bank.state == "draining", "the expired lease drains the bank")
    # The importer goes: nothing holds the old banks; each rank replaces its own.
    for ch in held:
        ch.close()
    wait_for(lambda: all(r.bank.state == "advertised" and r.bank.generation > g for r, g in zip(decode.decode, before)),
             "every rank's new bank advertised")
    index = decode.sched.index
    assert index is not None  # the index heard every new generation (a rank tells it right after)
    wait_for(lambda: index.ready() and all(index._ranks[r.rank].generation == r.bank.generation for r in decode.decode),
             "the index to advertise the new generation")
    assert decode.tally.take().get("banks_replaced") == len(decode.decode)
    # The old prefix is still retained (copied into the new bank) and loads at the new generation.
    assert load(prefill, "p2", tokens, [40, 41, 42, 43, 44]) == (4 * BS, set())
    for rank in range(len(decode.decode)):
        assert torch.equal(prefill.caches[rank][LAYERS[0]][42], decode.caches[rank][LAYERS[0]][40])
    # A new request stores into the new bank and loads from it.
    fresh = list(range(3000, 3013))
    finish(decode, "d2", fresh, [5, 6, 7, 8])
    assert load(prefill, "p3", fresh, [50, 51, 52, 53]) == (3 * BS, set())
    for rank in range(len(decode.decode)):
        assert torch.equal(prefill.caches[rank][LAYERS[1]][52], decode.caches[rank][LAYERS[1]][7])


# -- a finished request leaves no trace (issue 32) -------------------------------------------


def traces(engine: Engine) -> dict[str, int]:
    """Every per-request structure of the engine's scheduler side and ranks that is not empty."""
    sizes = {f"sched.{k}": v for k, v in engine.sched.sizes().items()}
    for r in engine.decode:
        sizes.update({f"decode{r.rank}.{k}": v for k, v in r.sizes().items()})
    for p in engine.prefill:
        sizes.update({f"prefill{p.rank}.{k}": v for k, v in p.sizes().items()})
    return {k: v for k, v in sizes.items() if v}


def settle(engine: Engine, finished: set[str] = frozenset()) -> tuple[set[str], set[str]]:
    """Steps (vLLM naming ``finished`` in the first) until nothing is left in flight;
    every id reported sending and receiving."""
    sent, loaded = set(), set()
    first = [set(finished)]

    def quiet() -> bool:
        s, lo, _ = engine.step(first.pop() if first else set())
        assert not (s & sent) and not (lo & loaded), "an id reported twice"
        sent.update(s)
        loaded.update(lo)
        return not first and not engine.sched.pending() and not any(p.busy() for p in engine.prefill) \
            and all(not r.sizes()["pending"] for r in engine.decode)
    wait_for(quiet, "the engine to settle", 30.0)
    wait_for(lambda: not any(k.endswith("live_groups") or k.endswith("live_shares") for k in traces(engine)),
             "every group to end")
    return sent, loaded


@pytest.fixture
def both(sockets: Path) -> Iterator[tuple[Engine, Engine]]:
    """A decode source and a ``kv_both`` engine that loads from it (and retains its own)."""
    common = {"socket_dir": str(sockets)}
    decode = Engine("kv_producer", common, 1, "decode-engine")
    engine = Engine("kv_both", {**common, "policy": POLICY, "source": "both-engine"}, 1, "both-engine")
    yield decode, engine
    engine.close()
    decode.close()


def test_a_request_whose_load_is_in_flight_is_never_a_producer(both: tuple[Engine, Engine]) -> None:
    """kv_both: vLLM finishes a request aborted in WAITING_FOR_REMOTE_KVS with its promised
    tokens counted as computed. Its pages were never loaded, and vLLM frees the request
    when the load reports: no store order, no delayed free (was: stores ordered, True, and
    the id later reported in finished_sending, which vLLM's scheduler asserts on). The
    same for an order refused before it had a group (block mismatch)."""
    decode, engine = both
    tokens = list(range(4000, 4017))
    finish(decode, "d1", tokens, [1, 2, 3, 4, 5])
    pages = [10, 11, 12, 13, 14]
    n = matched(engine.sched, "p1", tokens, len(tokens), 0, None)
    assert n == 4 * BS
    engine.sched.allocated("p1", pages, n)
    engine.sched.request_done("p1")                                     # the abort, load in flight
    assert engine.sched.request_finished("p1", tokens, n, pages, None) is False
    assert engine.sched.sizes()["store_orders"] == 0 and engine.sched.sizes()["index_storing"] == 0
    sent, loaded = settle(engine, {"p1"})
    assert (sent, loaded) == (set(), {"p1"})
    assert traces(engine) == {}

    n = matched(engine.sched, "p2", tokens, len(tokens), 0, None)
    engine.sched.allocated("p2", pages, n - BS)                         # not what was matched: refused
    engine.sched.request_done("p2")
    assert engine.sched.request_finished("p2", tokens, n, pages, None) is False
    sent, loaded = settle(engine, {"p2"})
    assert (sent, loaded) == (set(), {"p2"})
    assert traces(engine) == {}
    assert engine.sched.tally.take()["rejections"] == {"block_mismatch": 1}


@pytest.mark.parametrize("order", ["abort_then_failure", "failure_then_done"])
def test_a_failed_load_leaves_no_trace_whatever_the_order(pair: tuple[Engine, Engine], order: str) -> None:
    """A load that fails after vLLM finished its request (an abort during the load, or any
    load failure under kv_load_failure_policy="fail", where vLLM finishes the request
    before it hands over the connector output) leaves nothing behind (was: its id stayed in
    SchedulerSide._failed for good); a failure reported first is forgotten when it finishes."""
    decode, prefill = pair
    tokens = list(range(5000, 5017))
    finish(decode, "d1", tokens, [1, 2, 3, 4, 5])
    pages = [10, 11, 12, 13, 14]
    n = matched(prefill.sched, "p1", tokens, len(tokens), 0, None)
    prefill.sched.allocated("p1", pages, n)
    failure = LoadFailures(tuple(("p1", r, "timeout") for r in range(prefill.tp)))
    if order == "abort_then_failure":
        prefill.sched.request_done("p1")
        prefill.sched.worker_output(["p1"], set(pages[:4]), failure)
    else:
        prefill.sched.worker_output(["p1"], set(pages[:4]), failure)
        assert prefill.sched.sizes()["failed"] == 1                     # asked again, it is computed
        prefill.sched.request_done("p1")
    assert prefill.sched.tally.take()["rejections"] == {"timeout": 1}
    settle(prefill)   # the ranks' own report of p1 arrives after the scheduler's: ignored
    assert traces(prefill) == {}


def test_a_finished_request_that_stored_nothing_leaves_no_trace_on_the_ranks(pair: tuple[Engine, Engine]) -> None:
    """vLLM names every finished request to every rank; one that stored nothing (shorter
    than a block, or a prefix already kept: the common repeated prompt) is not remembered
    (was: kept in DecodeRank._announced for good)."""
    decode, _ = pair
    tokens = list(range(6000, 6017))
    finish(decode, "d1", tokens, [1, 2, 3, 4, 5])
    assert decode.sched.request_finished("short", tokens[:BS - 1], BS - 1, [7], None) is False
    assert decode.sched.request_finished("again", tokens, len(tokens), [8, 9, 10, 11, 12], None) is False
    sent, _ = settle(decode, {"short", "again"})
    assert sent == set()
    assert traces(decode) == {}


# -- heterogeneous TP and per-layer loads ---------------------------------------------------------


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_mixed_tp_loads_every_head_from_a_rank_holding_it(sockets: Path, src_tp: int, dst_tp: int) -> None:
    """A decode engine at src_tp serves a prefill engine at dst_tp (source_tp): every
    prefill rank's pages get exactly its heads, each from the decode rank that holds it."""
    common = {"socket_dir": str(sockets), "retain_bytes": 16 * 2 * 4 * BS * 2 * HD * 2}
    decode = Engine("kv_producer", common, src_tp, "decode-engine", total_heads=4)
    prefill = Engine("kv_consumer", {**common, "policy": POLICY, "source_tp": src_tp}, dst_tp, "prefill-engine",
                     total_heads=4)
    try:
        tokens = list(range(2000, 2000 + 3 * BS + 1))
        src = [7, 2, 11, 5]
        finish(decode, "d-mixed", tokens, src)
        dst = [40, 41, 42, 43]
        n, failed = load(prefill, "p-mixed", tokens, dst)
        assert (n, failed) == (3 * BS, set())
        for p in range(dst_tp):
            first, count = heads_mod.rank_heads(4, dst_tp, p)
            for h in range(count):
                d_rank = next(r for r in range(src_tp) if heads_mod.rank_heads(4, src_tp, r)[0] <= first + h
                              < sum(heads_mod.rank_heads(4, src_tp, r)))
                d_head = first + h - heads_mod.rank_heads(4, src_tp, d_rank)[0]
                for layer in LAYERS:
                    for s_page, d_page in zip(src[:3], dst[:3]):
                        assert torch.equal(prefill.caches[p][layer][d_page][h],
                                           decode.caches[d_rank][layer][s_page][d_head])
                    assert not prefill.caches[p][layer][dst[3]].any()
        assert prefill.tally.take()["loads_ok"] == dst_tp
    finally:
        prefill.close()
        decode.close()


def test_a_per_layer_load_runs_in_its_step_and_each_layer_waits_for_its_own_region(sockets: Path) -> None:
    """layer_loads: the order's load starts before the forward pass (start_layers, once
    the shares are ready) and each layer's wait returns once that layer is in place; the
    request is never reported in finished_recving (vLLM did not wait for it), and the
    scheduler side lets the group go with the output of the step that ran it."""
    common = {"socket_dir": str(sockets), "retain_bytes": 16 * 2 * HEADS * BS * 2 * HD * 2}
    decode = Engine("kv_producer", common, 1, "decode-engine")
    prefill = Engine("kv_consumer", {**common, "policy": POLICY, "layer_loads": True}, 1, "prefill-engine")
    try:
        tokens = list(range(4000, 4000 + 4 * BS + 1))
        src = [3, 9, 1, 12]
        finish(decode, "d-layers", tokens, src)
        n = matched(prefill.sched, "p-layers", tokens, len(tokens), 0, None)
        assert n == 4 * BS
        dst = [50, 51, 52, 53]
        prefill.sched.allocated("p-layers", dst, n)
        orders = prefill.sched.step_orders()                  # build_connector_meta
        rank = prefill.prefill[0]
        for order in orders.loads:
            rank.load(order)                                  # bind_connector_metadata
        rank.start_layers()                                   # start_load_kv: waits for ready, starts
        load = rank._loads["p-layers"]                        # started, and kept until after the forward
        assert load.handles is not None and len(load.handles) == 1
        for layer in LAYERS:                                  # the forward pass, layer by layer
            rank.wait_layer(layer)
            assert load.handles[0].region_ok(layer)
            for s_page, d_page in zip(src, dst):
                assert torch.equal(prefill.caches[0][layer][d_page], decode.caches[0][layer][s_page])
        done, failed = rank.finished()                        # get_finished after the forward
        assert done == set() and failed == set()
        assert prefill.sched.sizes()["layer_loads"] == 1 and prefill.sched.sizes()["active"] == 1
        prefill.sched.worker_output([], set(), rank.failures())  # the step's output
        sizes = prefill.sched.sizes()
        assert sizes["layer_loads"] == 0 and sizes["active"] == 0 and sizes["groups"] == 0
        counted = prefill.tally.take()
        assert rank.sizes()["loads"] == 0 and counted["loads_ok"] == 1 and counted["layer_waits"] == len(LAYERS)
    finally:
        prefill.close()
        decode.close()


def test_a_per_layer_load_ordered_before_its_rank_connected_waits_for_it(sockets: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A load ordered right after start-up reaches the forward pass (start_layers) while
    the rank's connect thread has joined the coordinator but not yet handed the rank its
    worker: start_layers waits for the worker, within load_timeout_s, and the load runs;
    it is not recomputed as not ready. The hand-over is held on a gate until start_layers
    was called."""
    common = {"socket_dir": str(sockets), "retain_bytes": 16 * 2 * HEADS * BS * 2 * HD * 2}
    gate = threading.Event()
    connect = PrefillRank._connect_part

    def held(self: PrefillRank, config: Any, *, reconnect: bool) -> Any:
        worker = connect(self, config, reconnect=reconnect)  # joined: the coordinator sees its link
        gate.wait(30.0)
        return worker

    monkeypatch.setattr(PrefillRank, "_connect_part", held)
    decode = Engine("kv_producer", common, 1, "decode-engine")
    prefill = Engine("kv_consumer", {**common, "policy": POLICY, "layer_loads": True, "load_timeout_s": 30.0}, 1,
                     "prefill-engine")
    try:
        tokens = list(range(6000, 6000 + 2 * BS + 1))
        finish(decode, "d-early", tokens, [5, 7])
        n = matched(prefill.sched, "p-early", tokens, len(tokens), 0, None)
        assert n == 2 * BS
        prefill.sched.allocated("p-early", [30, 31], n)
        rank = prefill.prefill[0]
        for order in prefill.sched.step_orders().loads:
            rank.load(order)
        assert rank.worker is None                            # joined, but not yet handed over
        opener = threading.Timer(0.2, gate.set)               # handed over while start_layers runs
        opener.start()
        rank.start_layers()
        opener.join()
        for layer in LAYERS:
            rank.wait_layer(layer)
        done, failed = rank.finished()
        assert failed == set() and rank.failures().reasons == ()
        for layer in LAYERS:
            for s_page, d_page in zip([5, 7], [30, 31]):
                assert torch.equal(prefill.caches[0][layer][d_page], decode.caches[0][layer][s_page])
    finally:
        gate.set()
        prefill.close()
        decode.close()


def test_a_per_layer_load_that_cannot_start_names_its_pages(sockets: Path) -> None:
    """The decode engine is gone before the step: the shares never become ready, the load
    fails in start_layers (within load_timeout_s) and its pages are named for recompute;
    a layer's wait then returns at once."""
    common = {"socket_dir": str(sockets), "retain_bytes": 16 * 2 * HEADS * BS * 2 * HD * 2}
    decode = Engine("kv_producer", common, 1, "decode-engine")
    prefill = Engine("kv_consumer", {**common, "policy": POLICY, "layer_loads": True, "load_timeout_s": 2.0}, 1,
                     "prefill-engine")
    try:
        tokens = list(range(5000, 5000 + 2 * BS + 1))
        finish(decode, "d-gone", tokens, [4, 6])
        n = matched(prefill.sched, "p-gone", tokens, len(tokens), 0, None)
        assert n == 2 * BS
        decode.close()
        prefill.sched.allocated("p-gone", [20, 21], n)
        rank = prefill.prefill[0]
        for order in prefill.sched.step_orders().loads:
            rank.load(order)
        rank.start_layers()
        for layer in LAYERS:
            rank.wait_layer(layer)
        done, failed = rank.finished()
        assert done == set() and failed == {20, 21}
        prefill.sched.worker_output([], failed, rank.failures())
        assert prefill.sched.sizes()["active"] == 0 and prefill.sched.tally.take()["rejections"]
    finally:
        prefill.close()
