"""LoadHandle: per-region waits, cancel, failed blocks, callbacks, the fd, the load-complete
change, concurrency, and all-or-nothing submit, on the real op engine."""

from __future__ import annotations

import select
import threading
import time
from typing import Any

import pytest

from support.errors import raises
import torch

from kvstate.core.errors import ArgumentInvalid, TransferFailed
from kvstate.core.machine import StateChange
from kvstate.core.reasons import ArgumentReason, TransferFailReason
from kvstate.share import transfer
from kvstate.transport.host import HostTransport
from datapath.conftest import GRANULARITY
from datapath.support import GEOMETRY, FailingOps, bank_pattern, collected, engine, live_ops, untouched, zeros

BANK_IDS, DST_IDS = [1, 6, 2], [3, 11, 5]


def _ready(make_world: Any, **kw: Any) -> Any:
    world = make_world(GEOMETRY, fill=bank_pattern, **kw)
    return world, world.group()


def _expected(world: Any, dst: dict[str, torch.Tensor]) -> None:
    """Every loaded page equals its bank block, bit for bit."""
    view = world.banks[0].view()
    for r in GEOMETRY.regions:
        for b, d in zip(BANK_IDS, DST_IDS):
            got = dst[r.name].select(r.block_dim, d).contiguous().view(torch.uint8).numpy().tobytes()
            want = b"".join(bytes(view[r.offset + b * r.block_stride_bytes + o:][:n]) for o, n in r.runs())
            assert got == want, (r.name, b, d)
    del view


def test_a_load_returns_at_once_and_completes_on_the_engine(make_world: Any) -> None:
    world, group = _ready(make_world)
    nat = engine()
    nat.pause(True)
    try:
        dst = zeros()
        h = group.load(BANK_IDS, dst, DST_IDS)  # submitted; no worker may run while paused
        assert not h.done() and not h.wait(0.0) and not h.wait_region("layer.0", 0.01)
        assert h.region_ok("layer.0") is None and h.failed_blocks() == frozenset() and h.result() is None
    finally:
        nat.pause(False)
    assert h.wait_region("layer.0", 10.0) and h.wait(10.0) and h.done()
    assert all(h.region_ok(n) for n in GEOMETRY.names)
    _expected(world, dst)
    result = h.result()
    assert result is not None and result.ok and result.bytes == len(BANK_IDS) * GEOMETRY.block_bytes
    h.close()


def test_cancel_fails_exactly_the_cancelled_regions_and_writes_nothing_they_held(make_world: Any) -> None:
    world, group = _ready(make_world)
    nat = engine()
    before = live_ops()
    dst = zeros()
    nat.pause(True)
    try:
        h = group.load(BANK_IDS, dst, DST_IDS)
        h._entries[2].op.cancel()  # cancel region layer.2 only, while queued
        h._entries[3].op.cancel()
    finally:
        nat.pause(False)
    assert h.wait(10.0)
    assert [h.region_ok(n) for n in GEOMETRY.names] == [True, True, False, False]
    assert h.failed_blocks() == frozenset(DST_IDS)  # a block needs every region
    assert h.result().failed_regions == ("layer.2", "layer.3")  # type: ignore[union-attr]
    assert untouched({n: dst[n] for n in ("layer.2", "layer.3")})
    h.close()
    assert live_ops() == before and collected(group)

    nat.pause(True)
    try:
        h = group.load(BANK_IDS, dst := zeros(), DST_IDS)
        h.cancel()  # the whole load, while every op is queued
    finally:
        nat.pause(False)
    assert h.wait(10.0) and h.failed_blocks() == frozenset(DST_IDS) and untouched(dst)
    h.close()
    assert live_ops() == before


def test_an_op_failing_on_the_engine_fails_its_region(make_world: Any) -> None:
    t = FailingOps(HostTransport(granularity=GRANULARITY))
    world, group = _ready(make_world, transport=t)
    t.arm(fail_at=frozenset({1}))
    h = group.load(BANK_IDS, zeros(), DST_IDS)
    assert h.wait(10.0)
    assert h.result().failed_regions == ("layer.1",) and h.failed_blocks() == frozenset(DST_IDS)  # type: ignore[union-attr]
    assert h.region_ok("layer.0") and h.region_ok("layer.1") is False
    h.close()


def test_callbacks_fd_and_the_load_complete_change(make_world: Any) -> None:
    changes: list[StateChange] = []
    seen = threading.Event()

    def observe(c: StateChange) -> None:
        if c.event == "loaded":
            changes.append(c)
            seen.set()

    world, group = _ready(make_world, observers=(observe,))
    nat = engine()
    calls: list[Any] = []
    nat.pause(True)
    try:
        h = group.load(BANK_IDS, zeros(), DST_IDS)
        fd = h.fileno()
        assert h.fileno() == fd  # one fd per handle
        assert select.select([fd], [], [], 0.0)[0] == []  # not readable before it finished
        h.add_done_callback(calls.append)
    finally:
        nat.pause(False)
    assert select.select([fd], [], [], 10.0)[0] == [fd]  # an event loop wakes up...
    assert h.done()  # ...and asks
    assert select.select([fd], [], [], 0.0)[0] == [fd]  # and it stays readable
    assert seen.wait(10.0)
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.001)
    assert calls == [h]
    late: list[Any] = []
    h.add_done_callback(late.append)  # after the end: called at once, here
    assert late == [h]
    assert changes[0].machine == "group" and (changes[0].source, changes[0].dest) == ("ready", "ready")
    assert not group.loads  # the load-complete change collected it
    h.close()
    h.close()  # idempotent
    with pytest.raises(ArgumentInvalid) as info:
        h.fileno()
    assert info.value.reason is ArgumentReason.STATE


def test_a_failing_callback_is_logged_not_raised(make_world: Any, caplog: pytest.LogCaptureFixture) -> None:
    world, group = _ready(make_world)
    h = group.load(BANK_IDS, zeros(), DST_IDS)
    assert h.wait(10.0)

    def boom(_: Any) -> None:
        raise RuntimeError("callback bug")

    h.add_done_callback(boom)
    assert "callback bug" in caplog.text
    h.close()


def test_concurrent_loads_on_one_group_never_mix_their_ops(make_world: Any) -> None:
    world, group = _ready(make_world)
    before = live_ops()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(8):
                bank_ids = [(k + i) % 8, (k + i + 3) % 8]
                dst = zeros(capacity=4)
                h = group.load(bank_ids, dst, [1, 3])
                assert h.wait(10.0) and not h.failed_blocks()
                assert len(h._entries) == len(GEOMETRY.regions)  # its own ops, no one else's
                view = world.banks[0].view()
                r = GEOMETRY.regions[k % 4]
                want = bytes(view[r.offset + bank_ids[1] * r.block_stride_bytes:][:r.runs()[0][1]])
                got = dst[r.name].select(1, 3)[0].contiguous().view(torch.uint8).numpy().tobytes()
                assert got == want
                del view
                h.close()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert live_ops() == before
    group.drain(10.0)
    assert group.state == "closed"


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_submit_failing_at_region_k_cancels_and_awaits_the_rest(make_world: Any, k: int) -> None:
    """INV all-or-nothing submit: ops 0..k-1 were queued (engine paused), so they are
    cancelled: nothing is written, nothing is left in flight, the group stays usable."""
    t = FailingOps(HostTransport(granularity=GRANULARITY))
    world, group = _ready(make_world, transport=t)
    nat = engine()
    before = nat.stats()
    dst = zeros()
    t.arm(raise_at=k)
    nat.pause(True)
    try:
        with raises(TransferFailed, TransferFailReason.LOAD, match=f"submitting region 'layer.{k}' of rank 0 failed"):
            group.load(BANK_IDS, dst, DST_IDS)
    finally:
        nat.pause(False)
    after = nat.stats()
    assert after.ops_live == before.ops_live and after.cancelled - before.cancelled == k
    assert untouched(dst) and not group.loads and group.state == "ready"
    t.arm()
    h = group.load(BANK_IDS, dst, DST_IDS)  # a valid load still works
    assert h.wait(10.0) and not h.failed_blocks()
    _expected(world, dst)
    h.close()


def test_a_submit_failure_while_earlier_ops_run_awaits_them(make_world: Any) -> None:
    """Without the pause earlier ops may already be copying: they are awaited (never cut
    short), reaped, and the load reported failed with nothing in flight."""
    t = FailingOps(HostTransport(granularity=GRANULARITY))
    world, group = _ready(make_world, transport=t)
    before = live_ops()
    t.arm(raise_at=3)
    with raises(TransferFailed, TransferFailReason.LOAD):
        group.load(BANK_IDS, zeros(), DST_IDS)
    assert live_ops() == before and not group.loads
    assert all(p.pins() == 0 for p in group.parts)


def test_drain_waits_for_loads_in_flight_then_closes(make_world: Any) -> None:
    world, group = _ready(make_world)
    nat = engine()
    nat.pause(True)
    h = group.load(BANK_IDS, zeros(), DST_IDS)
    group.fire("drain")
    with pytest.raises(Exception):
        group.fire("quiesce")  # ops queued and pinning the parts
    nat.pause(False)
    assert group.drain(10.0) >= 0.0 and group.state == "closed"
    assert h.done() and not h.failed_blocks()
    h.close()


def test_a_bank_store_is_cancellable_and_observable(make_world: Any) -> None:
    changes: list[str] = []
    world = make_world(GEOMETRY, advertise=False)
    bank = world.banks[0]
    bank.observe(lambda c: changes.append(c.event))
    nat = engine()
    before = live_ops()
    src = zeros(capacity=12)
    nat.pause(True)
    try:
        h = bank.store(src, [1, 2], [3, 4])
        assert bank.pins() > 0 and bank.stores  # its ops pin the bank's memory
        h.cancel()
    finally:
        nat.pause(False)
    assert h.wait(10.0) and h.failed_blocks() == frozenset({3, 4})
    deadline = time.monotonic() + 10
    while "stored" not in changes and time.monotonic() < deadline:
        time.sleep(0.001)
    assert changes == ["store", "stored"] and not bank.stores and live_ops() == before
    h.close()


class Synchronous(FailingOps):
    """Every op has finished by the time submit returns: the load is over before the
    handle is handed out."""

    def submit_blocks(self, src: Any, dst: Any, blocks: Any, **kw: Any) -> Any:
        op = super().submit_blocks(src, dst, blocks, **kw)
        assert op.wait(10.0)
        return op


def test_region_ok_says_how_a_region_ended_while_another_thread_finishes_the_load(
        make_world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once wait_region said a region's ops finished, region_ok says how, even while the
    dispatcher is reaping them to finish the load: it read a reaped op as a failed one
    (docs/guide.md's layer loop failed so in about 1 run of 8). Reaps are slowed here to
    hold that window open."""
    world, group = _ready(make_world)
    real = transfer._reap
    waited, reaping = threading.Event(), threading.Event()

    def slow_reap(op: Any) -> str:
        waited.wait(10.0)                            # reaps start once wait_region said "finished"
        state = real(op)
        reaping.set()                                # one op is reaped, the load not yet finished
        time.sleep(0.2)
        return state
    monkeypatch.setattr(transfer, "_reap", slow_reap)
    dst = zeros()
    h = group.load(BANK_IDS, dst, DST_IDS)
    assert all(h.wait_region(name, 10.0) for name in GEOMETRY.names)
    waited.set()
    assert reaping.wait(10.0)                        # the dispatcher is reaping, one op at a time
    assert [h.region_ok(name) for name in GEOMETRY.names] == [True] * len(GEOMETRY.names)
    assert h.wait(10.0)
    _expected(world, dst)
    h.close()


def test_done_is_true_while_another_thread_records_how_the_finished_ops_ended(
        make_world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every op ended and the dispatcher is reaping them: done() is True, not "not yet"
    (a per-layer load whose layers were all in place stayed a step longer in the prefill
    rank when done() answered False from under the dispatcher's reaps)."""
    world, group = _ready(make_world)
    real = transfer._reap
    reaping = threading.Event()

    def slow_reap(op: Any) -> str:
        state = real(op)
        reaping.set()
        time.sleep(0.05)
        return state
    monkeypatch.setattr(transfer, "_reap", slow_reap)
    dst = zeros()
    h = group.load(BANK_IDS, dst, DST_IDS)
    assert reaping.wait(10.0)                        # the dispatcher is finishing the load
    assert h.done()
    assert h.result() is not None and h.result().ok  # type: ignore[union-attr]
    _expected(world, dst)
    h.close()


def test_a_load_that_finished_before_it_was_handed_out_still_completes_on_its_own(make_world: Any) -> None:
    """No caller waits: the dispatcher alone must finish it (callback, fd, `loaded`)."""
    world, group = _ready(make_world, transport=Synchronous(HostTransport(granularity=GRANULARITY)))
    done = threading.Event()
    h = group.load(BANK_IDS, zeros(), DST_IDS)
    h.add_done_callback(lambda _: done.set())
    assert done.wait(10.0)
    assert select.select([h.fileno()], [], [], 10.0)[0]
    h.close()


def test_a_stray_wake_up_neither_finishes_a_handle_nor_closes_its_fd() -> None:
    """The dispatcher fetched an event for a finished handle's eventfd; that number was
    closed and reused by a new handle's eventfd before the dispatcher looked it up, so
    the new handle hears a wake-up nobody sent. Seen once in a fresh-clone run: the new
    handle finished under its owner, which then wrote to the closed fd (EBADF; a write
    into whatever file reused the number is worse). A wake-up with nothing to read must
    change nothing."""
    from kvstate.share.transfer import TransferHandle

    h = TransferHandle("load", "stray", [0], notify=True)
    fd = h.notify_fd
    assert fd is not None
    h._progress()                                     # the stray event, before the owner activates it
    assert not h._finished.is_set() and h.notify_fd == fd
    h._activate(None)                                 # the owner's own wake-up finishes it (no ops)
    assert h._finished.wait(10.0) and h.notify_fd is None
    h.close()
