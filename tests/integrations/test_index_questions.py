"""A prefill scheduler's questions to a decode index while the index is slow or silent:
every request running in the engine waits for vLLM's scheduling loop, so a question is
sent, its reply read at a later step, and matched to its question by order
(kvstate.integrations.vllm.index_client, "Questions in flight"); and what the scheduler
does with the answers: every source asked at once, and an answer used only when its keys
are the prompt's own.

The index here is a script on a real socket at the decode source's path: it takes
questions and answers them only when told, in order, as a decode index does."""

from __future__ import annotations

import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integrations.test_vllm_flow import BS, POLICY, Engine, wait_for
from kvstate import channel as chan
from kvstate.core.errors import ChannelError
from kvstate.core.identity import Deployment
from kvstate.core.reasons import ChannelReason
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.hashing import HASH_BYTES, Compat, block_key
from kvstate.integrations.vllm.index_client import Found, IndexClient, Refusal
from kvstate.integrations.vllm.scheduler_side import STEP_WAIT_S

COMPAT = Compat(model="tiny", dtype="bf16", block_size=BS, head_dim=8, kv_heads=2, layers=("l0",), tp=1, isa="vec",
                engine="test")
DEPLOYMENT = Deployment("questions", bytes(range(32)))


class ScriptedIndex:
    """A decode index's socket whose questions wait until :meth:`answer` is called."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.questions: queue.Queue[tuple[chan.Channel, dict[str, Any]]] = queue.Queue()
        self.connections: list[chan.Channel] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            ch = chan.Channel(sock, limits=wire.LIMITS)
            self.connections.append(ch)
            self._threads.append(threading.Thread(target=self._read, args=(ch,), daemon=True))
            self._threads[-1].start()

    def _read(self, ch: chan.Channel) -> None:
        while not self._stop.is_set():
            try:
                with ch.recv(timeout=0.05) as msg:
                    self.questions.put((ch, wire.decode(msg.payload, "lookup", "descriptors")))
            except ChannelError as exc:
                if exc.reason is not ChannelReason.TIMEOUT:
                    return

    def answer(self, blocks: list[int], keys: Callable[[list[bytes], list[int]], list[int]] | None = None) -> int:
        """Answer the next ``len(blocks)`` questions, in the order they came: ``found``
        with that many blocks, in bank blocks 0, 1, ..., under ``keys(hashes, slots)``
        of the question's hashes (default: keys of no prompt). Returns how many replies a
        connection took (the others' client had closed it)."""
        sent = 0
        for n in blocks:
            ch, question = self.questions.get(timeout=5.0)
            slots = list(range(n))
            named = list(range(100, 100 + n)) if keys is None else \
                keys(wire.split_hashes(question["hashes"], HASH_BYTES)[:n], slots)
            try:
                ch.send(wire.encode("found", blocks=n, slots=slots, keys=named, epochs=[1], generation=1))
                sent += 1
            except ChannelError:
                pass
        return sent

    def close(self) -> None:
        self._stop.set()
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        for t in self._threads:
            t.join(5.0)
        for ch in self.connections:
            ch.close()


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvs-q-"))  # AF_UNIX paths are short; pytest's are long
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def index(sockets: Path) -> Iterator[ScriptedIndex]:
    scripted = ScriptedIndex(sockets / "decode.index.sock")
    yield scripted
    scripted.close()


HASHES = [bytes([i]) * 32 for i in range(4)]


def test_replies_are_read_in_order_and_each_reaches_its_own_question(index: ScriptedIndex, sockets: Path) -> None:
    client = IndexClient(sockets / "decode.index.sock", DEPLOYMENT, timeout_s=5.0)
    try:
        assert client.lookup(COMPAT, HASHES, token="a", wait_s=0) is None   # sent; the index holds it
        assert client.lookup(COMPAT, HASHES, token="b", wait_s=0) is None
        assert client.lookup(COMPAT, HASHES, token="a", wait_s=0) is None   # asked once, not again
        index.answer([2, 3])
        b = client.lookup(COMPAT, HASHES, token="b", wait_s=5.0)           # reads a's reply on the way
        a = client.lookup(COMPAT, HASHES, token="a", wait_s=0)
        assert isinstance(a, Found) and isinstance(b, Found) and (a.blocks, b.blocks) == (2, 3)
        assert index.questions.empty() and client.in_flight() == 0
    finally:
        client.close()


def test_a_forgotten_questions_reply_is_read_and_dropped(index: ScriptedIndex, sockets: Path) -> None:
    client = IndexClient(sockets / "decode.index.sock", DEPLOYMENT, timeout_s=5.0)
    try:
        assert client.lookup(COMPAT, HASHES, token="gone", wait_s=0) is None
        client.forget("gone")                                                # its request ended
        assert client.in_flight() == 0
        assert client.lookup(COMPAT, HASHES, token="next", wait_s=0) is None
        index.answer([1, 4])
        got = client.lookup(COMPAT, HASHES, token="next", wait_s=5.0)
        assert isinstance(got, Found) and got.blocks == 4                    # not the forgotten one's 1
        assert client.in_flight() == 0
    finally:
        client.close()


def test_a_question_past_its_timeout_ends_every_question_on_its_connection(index: ScriptedIndex,
                                                                             sockets: Path) -> None:
    client = IndexClient(sockets / "decode.index.sock", DEPLOYMENT, timeout_s=0.3)
    try:
        assert client.lookup(COMPAT, HASHES, token="a", wait_s=0) is None
        assert client.lookup(COMPAT, HASHES, token="b", wait_s=0) is None
        polls = 0
        while (a := client.lookup(COMPAT, HASHES, token="a", wait_s=0.01)) is None:
            polls += 1
        assert polls >= 2                                                    # asked again, never held
        b = client.lookup(COMPAT, HASHES, token="b", wait_s=0)
        assert a == Refusal("timeout", a.detail) and b == Refusal("timeout", b.detail)
        assert index.answer([2, 2]) == 0    # late replies, to the connection the client closed
        assert client.lookup(COMPAT, HASHES, token="c", wait_s=0) is None   # a new connection
        index.answer([3])
        c = client.lookup(COMPAT, HASHES, token="c", wait_s=5.0)
        assert isinstance(c, Found) and c.blocks == 3
        assert len(index.connections) == 2 and client.in_flight() == 0
    finally:
        client.close()


def test_a_silent_decode_index_holds_no_step_and_ends_in_a_timeout_miss(index: ScriptedIndex,
                                                                         sockets: Path) -> None:
    """The scheduler's match returns None (vLLM asks again at its next step) while the
    index is silent, each call within what a step may wait, until the question's timeout:
    then a miss, counted once, and nothing of the request is left. The router's route
    (malformed here) is looked at once, not at every step."""
    timeout = 0.5
    prefill = Engine("kv_consumer", {"socket_dir": str(sockets), "policy": POLICY, "lookup_timeout_s": timeout},
                     1, "p")
    try:
        tokens = list(range(100, 117))
        steps, longest = 0, 0.0
        while True:
            started = time.monotonic()
            n = prefill.sched.match("p1", tokens, len(tokens), 0, None, "not a source!")
            longest = max(longest, time.monotonic() - started)
            if n is not None:
                break
            steps += 1
            prefill.sched.step_orders()                                       # the engine's next step
        assert n == 0 and steps >= 3
        assert longest < timeout / 2, (longest, STEP_WAIT_S)               # never the whole timeout
        counted = prefill.sched.tally.take()
        assert counted["misses"] == {"timeout": 1} and counted["routes_ignored"] == {"malformed": 1}, counted
        assert prefill.sched.sizes()["asking"] == 0 and prefill.sched.sizes()["questions"] == 0
    finally:
        prefill.close()


def test_every_source_is_asked_in_the_first_step_and_the_decision_waits_for_both(sockets: Path) -> None:
    """With two sources, both questions leave in the step that first asks: a slow first
    source does not hold back the question to the second (the decision then waits for the
    slowest answer, not their sum). Neither answer alone decides: the policy reads both."""
    first, second = ScriptedIndex(sockets / "first.index.sock"), ScriptedIndex(sockets / "second.index.sock")
    prefill = Engine("kv_consumer", {"socket_dir": str(sockets), "policy": POLICY, "lookup_timeout_s": 5.0,
                                     "sources": ["first", "second"]}, 1, "p")
    try:
        tokens = list(range(100, 117))

        def step() -> int | None:
            n = prefill.sched.match("p1", tokens, len(tokens), 0, None)
            prefill.sched.step_orders()
            return n

        assert step() is None
        wait_for(lambda: first.questions.qsize() == 1 and second.questions.qsize() == 1, "both questions asked")
        assert second.answer([0]) == 1            # the second answers first: still waiting for the first
        assert step() is None and step() is None
        assert first.answer([0]) == 1
        decided = wait_for(lambda: [n] if (n := step()) is not None else None, "the decision")
        assert decided == [0]                     # no blocks at either: a miss
        counted = prefill.sched.tally.take()
        assert counted["lookups"] == 2 and sum(counted["misses"].values()) == 1, counted
        assert first.questions.empty() and second.questions.empty()
        assert prefill.sched.sizes()["asking"] == 0 and prefill.sched.sizes()["questions"] == 0
    finally:
        prefill.close()
        first.close()
        second.close()


def test_an_answer_naming_another_prompts_blocks_is_never_leased(index: ScriptedIndex, sockets: Path) -> None:
    """A found reply's keys must be those of this prompt's own hashes in the bank blocks it
    names (what the lease pins): one about another prompt (an index's bug, or a reply
    read for another question) is a miss, and the connection it came on closes. The same
    reply with this prompt's keys goes on to the descriptors (the control)."""
    prefill = Engine("kv_consumer", {"socket_dir": str(sockets), "policy": POLICY, "lookup_timeout_s": 5.0}, 1, "p")
    dep = prefill.cfg.deployment

    def own(hashes: list[bytes], slots: list[int]) -> list[int]:
        return [block_key(dep, h, s) for h, s in zip(hashes, slots)]

    def other(hashes: list[bytes], slots: list[int]) -> list[int]:
        return own([bytes(b ^ 1 for b in h) for h in hashes], slots)

    try:
        tokens = list(range(100, 117))                                     # 4 blocks beyond nothing local
        assert prefill.sched.match("p1", tokens, len(tokens), 0, None) is None
        assert index.answer([3], other) == 1
        decided = wait_for(lambda: [n] if (n := prefill.sched.match("p1", tokens, len(tokens), 0, None)) is not None
                           else None, "p1's decision")
        assert decided == [0]
        assert prefill.sched.tally.take()["misses"] == {"protocol": 1}
        assert prefill.sched.match("p2", tokens, len(tokens), 0, None) is None   # on a new connection
        wait_for(lambda: len(index.connections) == 2, "a second connection")
        assert index.answer([3], own) == 1
        wait_for(lambda: prefill.sched.match("p2", tokens, len(tokens), 0, None) is None
                 and not index.questions.empty(), "p2's next question")
        _, question = index.questions.get()
        assert question["kind"] == "descriptors"                          # this prompt's blocks: on to the lease
        prefill.sched.request_done("p2")
        assert prefill.sched.sizes()["asking"] == 0
    finally:
        prefill.close()


def test_a_prompt_that_grew_while_asked_is_asked_again(index: ScriptedIndex, sockets: Path) -> None:
    """The answer to a shorter prompt's question is not used for the longer one (its
    blocks were counted against fewer hashes): the first question is forgotten."""
    prefill = Engine("kv_consumer", {"socket_dir": str(sockets), "policy": POLICY, "lookup_timeout_s": 5.0}, 1, "p")
    dep = prefill.cfg.deployment
    try:
        short, longer = list(range(100, 109)), list(range(100, 117))       # 2 and 4 blocks to ask for
        assert prefill.sched.match("p1", short, len(short), 0, None) is None
        assert prefill.sched.match("p1", longer, len(longer), 0, None) is None
        wait_for(lambda: index.questions.qsize() == 2, "both questions")
        assert index.answer([2, 0], lambda hs, ss: [block_key(dep, h, s) for h, s in zip(hs, ss)]) == 2
        decided = wait_for(lambda: [n] if (n := prefill.sched.match("p1", longer, len(longer), 0, None)) is not None
                           else None, "the decision")
        assert decided == [0]                                              # the longer prompt's answer: none
        assert prefill.sched.sizes()["questions"] == 0
    finally:
        prefill.close()
