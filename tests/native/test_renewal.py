"""The native renewal thread (ffi/kvs_renew.c, kvstate.share.renewal), against a peer
that answers on a real socket: the frame it sends is the one Python's renewal sent, a
granted renewal moves the lease's expiry on, and anything but a grant is one outcome on
the eventfd, worded as Python's renewal worded it, after which that lease is left alone."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvstate import channel as chan
from kvstate.channel import Channel, Limits
from kvstate.core.errors import ChannelError, ImportFailed
from kvstate.share.link import NativeLink
from kvstate.share.renewal import Renewal
from support.waiting import wait_until

LIMITS = Limits()


class Peer:
    """The exporter's end: it records every request and answers from ``answers`` (the
    last one repeats)."""

    def __init__(self, sock: socket.socket, answers: list[bytes]) -> None:
        self.channel = Channel(sock, limits=LIMITS)
        self.answers = answers
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            try:
                with self.channel.recv(30.0) as msg:
                    self.requests.append(msg.payload)
                answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
                self.channel.send(answer)
            except ChannelError:
                self.channel.close()
                return

    def stop(self) -> None:
        self.channel.close()
        self.thread.join(30.0)


@pytest.fixture
def renewal() -> Iterator[Renewal[str]]:
    r: Renewal[str] = Renewal(interval_s=0.05, timeout_s=5.0)
    yield r
    r.close()


def connect(answers: list[bytes]) -> tuple[Channel, NativeLink, Peer]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch = Channel(a, limits=LIMITS)
    return ch, NativeLink(ch, LIMITS), Peer(b, answers)


def wait_for_outcome(renewal: Renewal[str]) -> list[tuple[str, object]]:
    p = select.poll()
    p.register(renewal.fileno(), select.POLLIN)
    assert p.poll(30_000), "the renewal thread reported nothing"
    return list(renewal.take())


def test_renewals_send_pythons_frame_and_move_the_expiry_on(renewal: Renewal[str]) -> None:
    ch, link, peer = connect([chan.encode({"ok": True, "expires_in_s": 60.0})])
    try:
        key = renewal.add("part", link, rank=1, lease_id=7, term_s=0.2, renewed_at=time.monotonic())
        assert key is not None
        wait_until(lambda: len(peer.requests) >= 3, 30.0)  # else the assertions say what came
        assert peer.requests[:3] == [chan.encode({"lease": 7, "op": "renew", "rank": 1})] * 3
        state = renewal.state(key)
        assert state is not None and state.renewals >= 2 and not state.failed
        assert state.expires_at > state.renewed_at + 59  # what the exporter answered
        renewal.remove(key)
        assert renewal.state(key) is None
        asked = len(peer.requests)
        time.sleep(0.3)  # removed: never renewed again
        assert len(peer.requests) <= asked + 1  # (one may have been in flight)
        assert renewal.take() == []
    finally:
        ch.close()
        peer.stop()


@pytest.mark.parametrize("answer,expect", [
    (b'{"code":"not_renewing","detail":"draining","ok":false}', "lease refused (not_renewing): draining"),
    (b'{"code":"gone","detail":"no lease","expires_in_s":5,"ok":false}', "lease refused (gone): no lease"),
    (b'{"ok":true}', "malformed renewal"),
    (b'{"expires_in_s":-1,"ok":true}', "malformed renewal"),
    (b'{"expires_in_s":1e12,"ok":true}', "malformed renewal"),
    (b'{"expires_in_s":"1","ok":true}', "malformed renewal"),
    (b'{"expires_in_s":1,"ok":true,"ok":true}', "duplicate key"),
    (b'{"expires_in_s":1,"ok":true}x', "malformed message"),
    (b'[1]', "must be a JSON object"),
])
def test_anything_but_a_grant_is_one_outcome_worded_as_python_did(renewal: Renewal[str], answer: bytes,
                                                                   expect: str) -> None:
    ch, link, peer = connect([answer])
    try:
        renewal.add("the part", link, rank=0, lease_id=3, term_s=0.1, renewed_at=time.monotonic())
        ((part, exc),) = wait_for_outcome(renewal)
        assert part == "the part" and expect in str(exc), exc
        assert isinstance(exc, (ImportFailed, ChannelError))
        asked = len(peer.requests)
        time.sleep(0.3)
        assert len(peer.requests) == asked == 1  # a failed lease is not renewed again
        assert renewal.take() == []
    finally:
        ch.close()
        peer.stop()


def test_a_grant_with_extra_fields_and_nesting_is_a_grant(renewal: Renewal[str]) -> None:
    answer = b'{"bank":{"a":[1,{"b":"}"}],"s":"\\"x"},"expires_in_s":30,"ok":true,"z":null}'
    ch, link, peer = connect([answer])
    try:
        key = renewal.add("p", link, rank=0, lease_id=1, term_s=0.1, renewed_at=time.monotonic())
        assert key is not None
        while len(peer.requests) < 2:
            time.sleep(0.01)
        state = renewal.state(key)
        assert state is not None and state.renewals >= 1 and not state.failed
    finally:
        ch.close()
        peer.stop()


def test_a_link_that_fails_is_an_outcome_and_is_closed(renewal: Renewal[str]) -> None:
    ch, link, peer = connect([chan.encode({"ok": True, "expires_in_s": 60.0})])
    peer.channel.close()  # the exporter goes away
    try:
        renewal.add("p", link, rank=0, lease_id=1, term_s=0.1, renewed_at=time.monotonic())
        ((part, exc),) = wait_for_outcome(renewal)
        assert isinstance(exc, ChannelError) and exc.closed and link.closed
    finally:
        ch.close()
        peer.stop()


def test_a_stopped_renewal_takes_no_lease(renewal: Renewal[str]) -> None:
    ch, link, peer = connect([chan.encode({"ok": True, "expires_in_s": 60.0})])
    try:
        renewal.close()
        assert renewal.add("p", link, rank=0, lease_id=1, term_s=1.0, renewed_at=time.monotonic()) is None
        assert renewal.take() == [] and renewal.state(1) is None
        renewal.remove(1)  # harmless
    finally:
        ch.close()
        peer.stop()


def test_a_lease_due_before_the_armed_time_is_renewed_on_its_own_time() -> None:
    """An add never wakes the thread (kvs_renew.c arms the timer itself): a short lease
    added while the timer waits for a long one must still be renewed on its own time."""
    r: Renewal[str] = Renewal(interval_s=60.0, timeout_s=5.0)
    ch, link, peer = connect([chan.encode({"ok": True, "expires_in_s": 0.2})])
    try:
        now = time.monotonic()
        assert r.add("long", link, rank=0, lease_id=1, term_s=100.0, renewed_at=now) is not None  # due in 50 s
        time.sleep(0.05)  # the thread has armed its timer for the long lease
        short = r.add("short", link, rank=1, lease_id=2, term_s=0.2, renewed_at=time.monotonic())  # due in 0.1 s
        assert short is not None
        # The peer records a request before the renewer reads its answer: wait for both.
        wait_until(lambda: len(peer.requests) >= 2 and getattr(r.state(short), "renewals", 0) >= 2, 10.0)
        assert peer.requests[:2] == [chan.encode({"lease": 2, "op": "renew", "rank": 1})] * 2
        state = r.state(short)
        assert state is not None and state.renewals >= 2 and not state.failed
    finally:
        r.close()
        ch.close()
        peer.stop()


class Silent(Peer):
    """An exporter that stopped (SIGSTOP, a hung process): it takes requests and never
    answers."""

    def serve(self) -> None:
        while True:
            try:
                with self.channel.recv(30.0) as msg:
                    self.requests.append(msg.payload)
            except ChannelError:
                self.channel.close()
                return


def test_an_exporter_that_stops_answering_holds_up_only_its_own_lease(renewal: Renewal[str]) -> None:
    """Renewals are in flight side by side: while one exporter's renewal waits for an
    answer that never comes (until request_timeout_s fails it), another exporter's lease
    goes on being renewed. Renewed one after another, each waiting for its answer, the
    other lease would wait too and run out at its exporter (a healthy bank drained)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    hung_ch = Channel(a, limits=LIMITS)
    hung_link, hung = NativeLink(hung_ch, LIMITS), Silent(b, [])
    ch, link, peer = connect([chan.encode({"ok": True, "expires_in_s": 60.0})])
    try:
        stuck = renewal.add("hung", hung_link, rank=0, lease_id=1, term_s=0.2, renewed_at=time.monotonic())
        fine = renewal.add("fine", link, rank=0, lease_id=2, term_s=0.2, renewed_at=time.monotonic())
        assert stuck is not None and fine is not None
        wait_until(lambda: hung.requests, 10.0)
        first = getattr(renewal.state(fine), "renewals", 0)
        wait_until(lambda: getattr(renewal.state(fine), "renewals", 0) >= first + 10, 30.0)
        hung_state = renewal.state(stuck)  # its one renewal still unanswered, not yet failed
        assert hung_state is not None and not hung_state.failed and len(hung.requests) == 1, hung_state
        assert renewal.take() == []
    finally:
        for c in (ch, hung_ch):
            c.close()
        peer.stop()
        hung.stop()
