"""The native request link (ffi/kvs_link.c, kvstate.share.link): the frames and refusals
of kvstate.channel.framing, checked against Python's own Channel on the same packets."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from support.errors import raises

from kvstate import channel as chan
from kvstate.channel import HEADER, MAGIC, Channel, Limits
from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from kvstate.share.link import NativeLink

LIMITS = Limits(max_payload=1024, max_fds=2)


@pytest.fixture
def pair() -> Iterator[tuple[Channel, NativeLink, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch = Channel(a, limits=LIMITS)
    link = NativeLink(ch, LIMITS)
    yield ch, link, b
    ch.close()
    b.close()


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


#: Packets framing.unpack refuses, each with fds attached where the case needs them.
BAD = {
    "short": (b"KVS", 0),
    "magic": (b"XXXX" + struct.pack("<IH2x", 2, 0) + b"{}", 0),
    "length-over": (HEADER.pack(MAGIC, 5, 0) + b"{}", 0),
    "length-under": (HEADER.pack(MAGIC, 1, 0) + b"{}", 0),
    "fds-missing": (HEADER.pack(MAGIC, 2, 1) + b"{}", 0),
    "fds-extra": (HEADER.pack(MAGIC, 2, 0) + b"{}", 1),
    "fds-over-cap": (HEADER.pack(MAGIC, 2, 3) + b"{}", 3),
    "truncated": (HEADER.pack(MAGIC, 2000, 0) + b"x" * 2000, 0),
}


def send_raw(b: socket.socket, data: bytes, nfds: int) -> None:
    fds = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(nfds)]
    try:
        if fds:
            socket.send_fds(b, [data], fds)
        else:
            b.send(data)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_malformed_frame_is_refused_as_framing_refuses_it_and_its_fds_closed(case: str) -> None:
    data, nfds = BAD[case]
    errors = []
    for native in (False, True):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ch = Channel(a, limits=LIMITS)
        link = NativeLink(ch, LIMITS)
        try:
            before = fd_count()
            send_raw(b, data, nfds)
            with pytest.raises(ChannelError) as exc:
                if native:
                    link.lock()
                    try:
                        link.recv(5.0)
                    finally:
                        link.unlock()
                else:
                    ch.recv(5.0)
            assert exc.value.reason is ChannelReason.FRAME
            assert fd_count() == before, "every fd of a refused frame is closed"
            errors.append(str(exc.value))
        finally:
            ch.close()
            b.close()
    assert errors[0] == errors[1]  # the same refusal, in the same words


def test_a_request_returns_the_answer_with_its_fds(pair: tuple[Channel, NativeLink, socket.socket]) -> None:
    ch, link, b = pair
    r, w = os.pipe()

    def answer() -> None:
        peer = Channel(b.dup(), limits=LIMITS)
        with peer.recv(5.0) as req:
            assert req.payload == b'{"op":"renew"}' and req.fds == ()
        peer.send(b'{"ok":true}', [r])
        peer.close()

    t = threading.Thread(target=answer)
    t.start()
    with link.request(b'{"op":"renew"}', 5.0) as msg:
        assert msg.payload == b'{"ok":true}' and len(msg.fds) == 1
        os.write(w, b"!")
        assert os.read(msg.fds[0], 1) == b"!"  # the very pipe, received
    t.join()
    os.close(r)
    os.close(w)


def test_caps_are_checked_before_sending(pair: tuple[Channel, NativeLink, socket.socket]) -> None:
    ch, link, b = pair
    link.lock()
    try:
        with raises(ChannelError, ChannelReason.FRAME):
            link.send(b"x" * (LIMITS.max_payload + 1))
        with raises(ChannelError, ChannelReason.FRAME):
            link.send(b"{}", [0, 1, 2])
        link.send(b"x" * LIMITS.max_payload)  # the cap itself is fine
    finally:
        link.unlock()
    assert len(b.recv(4096)) == HEADER.size + LIMITS.max_payload


def test_a_request_that_times_out_closes_the_link(pair: tuple[Channel, NativeLink, socket.socket]) -> None:
    ch, link, b = pair
    with raises(ChannelError, ChannelReason.TIMEOUT):
        link.request(b"{}", 0.05)
    assert link.closed  # a late answer would be read as the next request's
    assert b.recv(100) != b"" and b.recv(100) == b""  # the request, then the hang-up
    with raises(ChannelError, ChannelReason.CLOSED):
        link.request(b"{}", 1.0)
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ChannelError):
            link.request(b"{}", bad)


def test_closing_the_channel_wakes_a_waiting_request_and_closes_the_link(
        pair: tuple[Channel, NativeLink, socket.socket]) -> None:
    ch, link, b = pair
    got: list[BaseException] = []

    def wait() -> None:
        try:
            link.request(b"{}", 30.0)
        except ChannelError as exc:
            got.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    assert b.recv(100)  # the request went out: the thread waits for its answer now
    ch.close()          # Channel.on_close shuts the link's connection down
    t.join(30.0)
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], ChannelError) and got[0].closed
    assert link.closed


def test_a_peer_hang_up_is_closed(pair: tuple[Channel, NativeLink, socket.socket]) -> None:
    ch, link, b = pair
    b.close()
    with raises(ChannelError, ChannelReason.CLOSED):
        link.request(chan.encode({"op": "renew"}), 5.0)


def test_a_peer_that_said_why_and_hung_up_is_answered_by_what_it_said(
        pair: tuple[Channel, NativeLink, socket.socket]) -> None:
    """A server over its connection limit refuses at accept, then closes: the request's
    send then fails (EPIPE), but the refusal waits in the socket and is the answer, so the
    importer reports ConnectionLimit, not a bare hang-up (test_bounds saw the hang-up)."""
    ch, link, b = pair
    refusal = chan.encode({"ok": False, "code": "ConnectionLimit", "detail": "2 connections"})
    b.send(HEADER.pack(MAGIC, len(refusal), 0) + refusal)
    b.close()
    with link.request(chan.encode({"op": "lease"}), 5.0) as msg:
        assert chan.decode(msg.payload)["code"] == "ConnectionLimit"
    with raises(ChannelError, ChannelReason.CLOSED):  # and the link is closed after it
        link.request(chan.encode({"op": "lease"}), 5.0)


def test_a_timeout_of_any_finite_length_is_taken(pair: tuple[Channel, NativeLink, socket.socket]) -> None:
    """A long timeout is waited in poll's int milliseconds, a longer one in int64 ns: no
    overflow (the answer is there at once, so nothing actually waits)."""
    ch, link, b = pair
    peer = Channel(b.dup(), limits=LIMITS)
    try:
        peer.send(b'{"ok":true}')  # queued before the request: the answer is read at once
        for timeout in (1e7, 1e300):
            link.lock()
            try:
                link.send(b"{}", timeout=timeout)
                with link.recv(timeout) as msg:
                    assert msg.payload == b'{"ok":true}'
            finally:
                link.unlock()
            peer.send(b'{"ok":true}')
    finally:
        peer.close()


# -- the answer spin (ImportConfig.answer_spin_s): a wait polls before it sleeps -----------

#: The longest spin a link takes (kvs_link_set_spin clamps to it); a wait also stops
#: polling once another thread ran on its CPU.
LONG_SPIN_S = 1.0


def _linked(spin_s: float) -> tuple[Channel, NativeLink, socket.socket]:
    """A link with ``spin_s`` over one end of a socketpair: its channel, and the other end."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch = Channel(a, limits=LIMITS)
    return ch, NativeLink(ch, LIMITS, spin_s=spin_s), b


@pytest.fixture
def spinning() -> Iterator[tuple[Channel, NativeLink, socket.socket]]:
    ch, link, b = _linked(LONG_SPIN_S)
    yield ch, link, b
    ch.close()
    b.close()


@pytest.mark.parametrize("spins", [True, False])
def test_a_spinning_wait_takes_answers_while_it_polls_and_a_plain_one_never(spins: bool) -> None:
    """Answered at once by another thread, a spinning wait takes the answer while it polls;
    a wait without the spin never polls. A poll cut short because another thread ran on
    its CPU sleeps instead (the answerer itself may be that thread, and a loaded machine
    cuts most polls short), so requests go on until one answer was caught while polling,
    for at most 10 s."""
    ch, link, b = _linked(LONG_SPIN_S if spins else 0.0)
    peer = Channel(b, limits=LIMITS)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                with peer.recv(0.1):
                    pass
            except ChannelError:
                continue
            peer.send(b'{"ok":true}')

    t = threading.Thread(target=answer)
    t.start()
    try:
        deadline = time.monotonic() + 10.0
        for n in itertools.count(1):
            with link.request(b"{}", 30.0) as msg:
                assert msg.payload == b'{"ok":true}'
            if (spins and link.caught) or n >= 200 and (not spins or time.monotonic() > deadline):
                break
    finally:
        stop.set()
        t.join(30.0)
        ch.close()
        peer.close()
    assert link.caught >= 1 if spins else link.caught == 0, link.caught


def _ask_failing(link: NativeLink, timeout: float) -> tuple[threading.Event, list[BaseException]]:
    """A request on its own thread, expected to fail: set once it ended, with its error."""
    done = threading.Event()
    got: list[BaseException] = []

    def ask() -> None:
        try:
            link.request(b"{}", timeout)
        except ChannelError as exc:
            got.append(exc)
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    return done, got


def test_a_spinning_wait_ends_at_its_deadline_not_at_the_spins_end(
        spinning: tuple[Channel, NativeLink, socket.socket]) -> None:
    ch, link, b = spinning
    done, got = _ask_failing(link, 0.05)
    assert done.wait(30.0), "the wait did not end"
    assert len(got) == 1 and isinstance(got[0], ChannelError) and got[0].reason is ChannelReason.TIMEOUT
    assert link.closed


@pytest.mark.parametrize("how", ["closed here", "peer hung up"])
def test_a_spinning_wait_wakes_when_the_connection_ends(
        spinning: tuple[Channel, NativeLink, socket.socket], how: str) -> None:
    ch, link, b = spinning
    done, got = _ask_failing(link, 30.0)
    assert b.recv(100)  # the request went out: the thread spins for its answer now
    if how == "closed here":
        ch.close()
    else:
        b.close()
    assert done.wait(30.0), "the spinning wait did not see the end of its connection"
    assert len(got) == 1 and isinstance(got[0], ChannelError) and got[0].closed


def test_the_answer_spin_is_checked_by_the_config() -> None:
    from kvstate.core.errors import ConfigInvalid
    from kvstate.core.identity import Deployment
    from kvstate.share.import_config import ImportConfig

    deployment = Deployment("t", bytes(32))
    assert ImportConfig(deployment).answer_spin_s > 0  # on by default: B1 measures it
    assert ImportConfig(deployment, answer_spin_s=0).answer_spin_s == 0
    for bad in (-1e-6, 0.011, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ConfigInvalid):
            ImportConfig(deployment, answer_spin_s=bad)


def test_a_spin_gives_way_when_its_cpu_is_wanted(cpus: list[int]) -> None:
    """A busy process shares the asker's CPU, and the answer comes 50 ms after the
    request. The asker's poll is put aside for the busy one within a time slice, so it
    stops polling and sleeps: woken by the answer, it did not catch it while polling. (A
    poll that went on would wait out the busy one's slice each time the answer came.)"""
    ch, link, b = _linked(LONG_SPIN_S)
    peer = Channel(b, limits=LIMITS)
    asker_cpu, other = cpus[0], cpus[1]
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{asker_cpu}}})\nwhile True: pass"])
    answers: list[bytes] = []

    def ask() -> None:
        os.sched_setaffinity(0, {asker_cpu})  # this thread only
        with link.request(b"{}", 30.0) as msg:
            answers.append(msg.payload)

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {other})
    t = threading.Thread(target=ask)
    try:
        time.sleep(0.2)  # the busy process runs on the asker's CPU
        t.start()
        with peer.recv(30.0):
            pass
        time.sleep(0.05)
        peer.send(b'{"ok":true}')
        t.join(30.0)
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()
        ch.close()
        peer.close()
    assert answers == [b'{"ok":true}']
    assert link.caught == 0, "the wait polled on past the busy process's time slice"
