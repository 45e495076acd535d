"""The op engine: copies and gathers, pins, waits without the GIL, the table in C."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest

from support.errors import raises

from kvstate.core import errors
from kvstate.core.reasons import ArgumentReason, BusyReason, TimeoutReason, NativeReason, TransitionReason
from kvstate.core.errors import ArgumentInvalid, Busy, TimedOut, NativeError, TransitionError
from kvstate.transport.native import Native
from kvstate.core.capabilities import Access
from kvstate.transport.host import HostAllocation, HostMapping, HostReservation, HostTransport

BANK = 2 << 20


class Bank:
    """One mapped, patterned bank with read-write access."""

    def __init__(self, t: HostTransport, seed: int = 1) -> None:
        self.t = t
        self.a: HostAllocation = t.create(BANK)
        self.r: HostReservation = t.reserve(BANK)
        self.m: HostMapping = t.map(self.r, 0, self.a)
        t.set_access(self.m, Access.READ_WRITE)
        rng = random.Random(seed)
        self.data = rng.randbytes(BANK)
        t.view(self.m)[:] = self.data

    @property
    def region(self) -> int:
        return self.m.region

    def close(self) -> None:
        self.t.unmap(self.m)
        self.t.release(self.a)
        self.t.free(self.r)


@pytest.fixture
def t() -> HostTransport:
    return HostTransport()


@pytest.fixture
def nat(t: HostTransport) -> Iterator[Native]:
    yield t.native
    t.native.pause(False)


@pytest.fixture
def bank(t: HostTransport) -> Iterator[Bank]:
    b = Bank(t)
    yield b
    b.close()


def test_contiguous_copy_region_to_buffer_and_back(nat: Native, bank: Bank) -> None:
    buf = bytearray(BANK)
    nat.submit_copy(bank.region, buf, BANK).result(10)
    assert buf == bank.data
    back = bytearray(b"\x5a" * 4096)
    nat.submit_copy(back, bank.region, 4096, dst_off=BANK - 4096).result(10)
    assert bytes(bank.t.view(bank.m)[BANK - 4096:]) == b"\x5a" * 4096


def test_gather_of_random_blocks(nat: Native, bank: Bank) -> None:
    blk = 4096
    order = list(range(BANK // blk))
    random.Random(7).shuffle(order)
    blocks = [(src * blk, i * blk, blk) for i, src in enumerate(order[:200])]
    buf = bytearray(200 * blk)
    info = nat.submit_gather(bank.region, buf, blocks).result(10)
    assert info.state == "done" and info.bytes == 200 * blk
    for i, src in enumerate(order[:200]):
        assert buf[i * blk:(i + 1) * blk] == bank.data[src * blk:(src + 1) * blk]


def test_gather_takes_a_uint64_buffer_of_blocks(nat: Native, bank: Bank) -> None:
    import array

    blocks = array.array("Q", [0, 100, 10, 4096, 0, 5])
    buf = bytearray(200)
    nat.submit_gather(bank.region, buf, blocks).result(10)
    assert buf[:5] == bank.data[4096:4101] and buf[100:110] == bank.data[:10]


def test_release_while_pinned_is_refused_and_fine_after_completion(t: HostTransport, nat: Native) -> None:
    """INV-NO-UNMAP-PINNED, INV-OP-PINS: an op in flight pins its region; once it has
    completed, unmap and release succeed."""
    b = Bank(t)
    nat.pause(True)
    buf = bytearray(BANK)
    op = nat.submit_copy(b.region, buf, BANK)
    st = t.stats(b.m)
    assert (st.pins, st.inflight) == (1, 1) and op.info().state == "queued"
    with raises(Busy, BusyReason.PINNED):
        t.unmap(b.m)
    with raises(Busy, BusyReason.PINNED):
        t.release(b.a)
    nat.pause(False)
    info = op.result(10)
    assert info.state == "done" and buf == b.data
    st = t.stats(b.m)
    assert (st.pins, st.inflight, st.completed, st.bytes) == (0, 0, 1, BANK)
    b.close()


def test_wait_times_out_and_releases_the_gil(nat: Native, bank: Bank) -> None:
    nat.pause(True)
    op = nat.submit_copy(bank.region, bytearray(16), 16)
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    th = threading.Thread(target=spin)
    th.start()
    start = time.monotonic()
    assert op.wait(0.3) is False  # blocks in C for 0.3 s
    waited = time.monotonic() - start
    stop.set()
    th.join(5)
    assert 0.25 <= waited < 5
    assert ticks > 1000, "the other thread did not run while the wait blocked"
    assert op.poll() is False
    with raises(TimedOut, TimeoutReason.OP):
        op.result(0.01)
    nat.pause(False)
    op.result(10)


def test_undeclared_events_are_refused_by_the_c_table(nat: Native, bank: Bank) -> None:
    """INV-EVENT-DECLARED: reap of a queued op and cancel of a done op are refused in C."""
    nat.pause(True)
    op = nat.submit_copy(bank.region, bytearray(16), 16)
    with raises(TransitionError, TransitionReason.ILLEGAL) as exc:
        op.reap()
    assert exc.value.state == "queued" and exc.value.event == "reap"
    op.cancel()
    assert op.info().state == "cancelled" and bank.t.stats(bank.m).pins == 0
    with raises(TransitionError, TransitionReason.ILLEGAL):
        op.cancel()
    assert op.reap().state == "cancelled"
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
        op.reap()
    nat.pause(False)


def test_cancel_unpins_and_counts(nat: Native, bank: Bank) -> None:
    """A cancelled op is counted as cancelled (not done, not failed) and drops its pins."""
    nat.pause(True)
    try:
        before = nat.stats()
        op = nat.submit_copy(bank.region, bytearray(16), 16)
        assert bank.t.stats(bank.m).pins == 1
        op.cancel()
        after = nat.stats()
        assert (after.cancelled, after.completed, after.failed) == \
            (before.cancelled + 1, before.completed, before.failed)
        assert bank.t.stats(bank.m).pins == 0 and op.reap().state == "cancelled"
    finally:
        nat.pause(False)


def test_a_stale_op_id_never_names_the_op_that_reuses_its_slot(nat: Native, bank: Bank) -> None:
    """Ids carry a sequence number beside the slot: once reaped, an op's id stays unknown
    even after a new op takes its slot (the next free slot is the one just freed)."""
    old = nat.submit_copy(bank.region, bytearray(16), 16)
    old.result(10)
    new = nat.submit_copy(bank.region, bytearray(16), 16)
    try:
        assert new.id != old.id
        for call in (old.info, old.reap, old.cancel, lambda: old.wait(0.0)):
            with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
                call()
    finally:
        new.result(10)


def test_injected_failure_unpins_and_counts(nat: Native, bank: Bank) -> None:
    before = nat.stats()
    with raises(NativeError, NativeReason.OP_FAILED) as exc:
        nat.submit_copy(bank.region, bytearray(16), 16, fail=True).result(10)
    assert exc.value.code == nat.lib.KVS_E_INJECTED
    st = bank.t.stats(bank.m)
    assert st.pins == 0 and st.failed == 1
    assert nat.stats().failed == before.failed + 1


def test_guard_regions_mapped_and_bounds(t: HostTransport, nat: Native, bank: Bank) -> None:
    live = nat.stats().ops_live
    t.set_access(bank.m, Access.READ)
    with raises(TransitionError, TransitionReason.GUARD) as exc:
        nat.submit_copy(bytearray(16), bank.region, 16)  # needs read-write on the destination
    assert exc.value.failed == ("regions_mapped",)
    t.set_access(bank.m, Access.NONE)
    with raises(TransitionError, TransitionReason.GUARD):
        nat.submit_copy(bank.region, bytearray(16), 16)
    t.set_access(bank.m, Access.READ_WRITE)
    with raises(ArgumentInvalid, ArgumentReason.OUT_OF_RANGE):
        nat.submit_copy(bank.region, bytearray(16), 17)
    with raises(ArgumentInvalid, ArgumentReason.OUT_OF_RANGE):
        nat.submit_copy(bank.region, bytearray(16), 16, src_off=BANK - 8)
    with raises(ArgumentInvalid, ArgumentReason.OUT_OF_RANGE):
        nat.submit_gather(bank.region, bytearray(16), [(0, 0, 8), (2**64 - 1, 0, 2)])
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        nat.submit_copy(bank.region, b"read-only bytes", 4)
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        nat.submit_gather(bank.region, bytearray(16), [])
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
        nat.submit_copy(12345, bytearray(16), 4)
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        nat.wait(1, -1.0)
    assert nat.stats().ops_live == live and t.stats(bank.m).pins == 0


def test_configure_workers_refused_while_busy(nat: Native, bank: Bank) -> None:
    nat.pause(True)
    op = nat.submit_copy(bank.region, bytearray(16), 16)
    with raises(Busy, BusyReason.ENGINE):
        nat.configure(4)
    nat.pause(False)
    op.result(10)
    nat.configure(4)
    assert nat.stats().workers == 4
    buf = bytearray(BANK)
    nat.submit_copy(bank.region, buf, BANK).result(10)
    assert buf == bank.data
    nat.configure(2)
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        nat.configure(0)


def test_many_ops_from_many_threads(nat: Native, bank: Bank) -> None:
    """Counters stay exact under concurrent submitters and waiters."""
    before = nat.stats()

    def submitter(k: int) -> None:
        for i in range(50):
            buf = bytearray(64)
            nat.submit_copy(bank.region, buf, 64, src_off=(k * 50 + i) * 64).result(10)
            assert buf == bank.data[(k * 50 + i) * 64:(k * 50 + i + 1) * 64]

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    after = nat.stats()
    assert after.completed - before.completed == 200 and after.ops_live == 0
    assert bank.t.stats(bank.m).completed == 200 and bank.t.stats(bank.m).pins == 0


def test_a_paused_engine_runs_exactly_the_ops_it_is_allowed_in_queue_order(nat: Native, bank: Bank) -> None:
    """kvs_engine_allow: while paused, the next N queued ops run to the end (every part of
    a large one too) and the rest stay queued, provably not started; unpausing runs them.
    Tests hold a chosen op of a transfer with it (the last layer of a per-layer load)."""
    with raises(ArgumentInvalid, ArgumentReason.STATE):
        nat.allow(1)  # not paused
    nat.pause(True)
    bufs = [bytearray(BANK), bytearray(4096), bytearray(4096)]
    ops = [nat.submit_copy(bank.region, bufs[0], BANK), nat.submit_copy(bank.region, bufs[1], 4096),
           nat.submit_copy(bank.region, bufs[2], 4096)]
    nat.allow(2)
    assert ops[0].wait(10) and ops[1].wait(10)
    assert ops[2].info().state == "queued" and not ops[2].wait(0.05)
    assert bufs[0] == bank.data and bufs[1] == bank.data[:4096] and bufs[2] == bytearray(4096)
    nat.allow(0)
    assert ops[2].info().state == "queued"
    nat.pause(False)
    assert ops[2].result(10).state == "done" and bufs[2] == bank.data[:4096]
    for op in ops[:2]:
        assert op.reap().state == "done"
    with raises(ArgumentInvalid, ArgumentReason.RANGE):
        nat.allow(-1)
