"""Completion reports (``kvs_report_open``): the op engine sends a prepared message on a
socket as the last op of a set becomes collectable, from its own thread. The decode rank
reports its stores to the index this way (kvstate.integrations.vllm.decode_rank)."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from support.errors import raises

from kvstate.core.errors import ArgumentInvalid
from kvstate.core.reasons import ArgumentReason
from kvstate.transport.native import Native

# The op tests' transport, engine and bank fixtures, shared rather than written again.
from native.test_ops import Bank, bank, nat, t  # noqa: F401


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


def _nothing(s: socket.socket) -> bool:
    try:
        s.recv(64, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    return False


def test_the_ok_message_goes_out_once_the_last_op_is_done_while_python_holds_the_gil(
        nat: Native, bank: Bank, pair: tuple[socket.socket, socket.socket]) -> None:
    mine, peer = pair
    nat.pause(True)
    ops = [nat.submit_copy(bank.region, bytearray(64), 64) for _ in range(3)]
    rid = nat.report(mine.fileno(), b"all done", b"some failed", [op.id for op in ops])
    assert _nothing(peer)                       # nothing is sent before the ops end
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(peer.recv(64)))
    reader.start()
    nat.pause(False)
    # Hold this process's GIL (a C call through PyDLL keeps it) while the ops finish: the
    # engine's thread sends regardless; the reader thread only picks it up afterwards.
    ctypes.PyDLL(None).usleep(200_000)
    reader.join(10)
    assert got == [b"all done"]
    assert nat.report_close(rid) == nat.lib.KVS_REPORT_SENT_OK
    for op in ops:
        assert op.reap().state == "done"


def test_a_failed_or_cancelled_op_sends_the_failed_message(nat: Native, bank: Bank,
                                                           pair: tuple[socket.socket, socket.socket]) -> None:
    mine, peer = pair
    nat.pause(True)
    ok = nat.submit_copy(bank.region, bytearray(64), 64)
    bad = nat.submit_copy(bank.region, bytearray(64), 64, fail=True)
    gone = nat.submit_copy(bank.region, bytearray(64), 64)
    rid = nat.report(mine.fileno(), b"ok", b"failed", [ok.id, bad.id, gone.id])
    gone.cancel()
    assert _nothing(peer)
    nat.pause(False)
    assert peer.recv(64) == b"failed"
    for op in (ok, bad, gone):
        op.wait(10)
    assert nat.report_close(rid) == nat.lib.KVS_REPORT_SENT_FAILED
    assert [op.reap().state for op in (ok, bad, gone)] == ["done", "failed", "cancelled"]


def test_ops_that_already_ended_send_at_once_and_the_callers_fd_may_close(
        nat: Native, bank: Bank, pair: tuple[socket.socket, socket.socket]) -> None:
    mine, peer = pair
    op = nat.submit_copy(bank.region, bytearray(64), 64)
    assert op.wait(10)
    fd = os.dup(mine.fileno())
    rid = nat.report(fd, b"ok", b"failed", [op.id])
    os.close(fd)                                 # the engine keeps its own descriptor
    assert peer.recv(64) == b"ok"
    nat.pause(True)
    late = nat.submit_copy(bank.region, bytearray(64), 64)
    fd = os.dup(mine.fileno())
    rid2 = nat.report(fd, b"late", b"failed", [late.id])
    os.close(fd)
    nat.pause(False)
    assert peer.recv(64) == b"late"
    assert nat.report_close(rid) == nat.report_close(rid2) == nat.lib.KVS_REPORT_SENT_OK
    op.reap()
    late.result(10)


def test_a_report_closed_while_pending_is_never_sent(nat: Native, bank: Bank,
                                                     pair: tuple[socket.socket, socket.socket]) -> None:
    mine, peer = pair
    nat.pause(True)
    op = nat.submit_copy(bank.region, bytearray(64), 64)
    rid = nat.report(mine.fileno(), b"ok", b"failed", [op.id])
    assert nat.report_close(rid) == nat.lib.KVS_REPORT_PENDING
    nat.pause(False)
    op.result(10)
    assert _nothing(peer)
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
        nat.report_close(rid)


def test_a_peer_gone_leaves_it_unsent(nat: Native, bank: Bank) -> None:
    mine, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    peer.close()
    try:
        op = nat.submit_copy(bank.region, bytearray(64), 64)
        rid = nat.report(mine.fileno(), b"ok", b"failed", [op.id])
        op.result(10)
        assert nat.report_close(rid) == nat.lib.KVS_REPORT_UNSENT
    finally:
        mine.close()


def test_refusals_change_nothing(nat: Native, bank: Bank, pair: tuple[socket.socket, socket.socket]) -> None:
    mine, peer = pair
    nat.pause(True)
    a = nat.submit_copy(bank.region, bytearray(64), 64)
    b = nat.submit_copy(bank.region, bytearray(64), 64)
    reaped = nat.submit_copy(bank.region, bytearray(64), 64)
    reaped.cancel()
    reaped.reap()
    fd = mine.fileno()
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
        nat.report(fd, b"ok", b"failed", [a.id, reaped.id])   # a was claimed, then let go
    for bad in ((fd, b"", b"x", [a.id]), (fd, b"x", b"x" * (nat.lib.KVS_REPORT_MAX_BYTES + 1), [a.id]),
                (fd, b"x", b"x", []), (-1, b"x", b"x", [a.id]), (fd, "x", b"x", [a.id]),
                (fd, b"x", b"x", [1 << 70])):
        with raises(ArgumentInvalid, ArgumentReason.NATIVE):
            nat.report(*bad)  # type: ignore[arg-type]
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        nat.report(fd, b"x", b"x", [a.id, a.id])               # an op named twice
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        nat.report(9999, b"x", b"x", [a.id])                   # not an open fd
    rid = nat.report(fd, b"a", b"failed", [a.id])              # a is free for a report
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        nat.report(fd, b"again", b"failed", [a.id, b.id])      # one report per op
    rid_b = nat.report(fd, b"b", b"failed", [b.id])
    nat.pause(False)
    assert sorted([peer.recv(64), peer.recv(64)]) == [b"a", b"b"]
    a.result(10)
    b.result(10)
    assert nat.report_close(rid) == nat.report_close(rid_b) == nat.lib.KVS_REPORT_SENT_OK
