"""Block epochs: a load never vouches for a block a store wrote during its copies.

The exporter keeps one 64-bit epoch per bank block in a sealed page (kvstate.share.epochs):
odd while a store may write the block, moved on by two per store. An importer reads the
epochs of a load's source blocks before it submits the copies and again once they
completed; a rank whose blocks moved, or were mid-store, has its copies failed.

These run a real exporter and importer (sockets, memfds, the op engine), with the op
engine paused to hold a load and a store in flight together.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import socket
import threading
from typing import Any

import pytest
import torch

from kvstate import channel as chan
from kvstate.core.errors import Busy
from kvstate.core.reasons import BusyReason
from kvstate.share.epochs import SEALS, EpochPage, EpochView, page_size
from kvstate.share.importer import ImportConfig, Importer
from support.reuse import REUSE_ON
from datapath.conftest import DEPLOYMENT, GRANULARITY
from datapath.support import GEOMETRY, FailingOps, Wrapped, bank_pattern, collected, engine, zeros
from kvstate.transport.host import HostTransport
from support.waiting import wait_until

BANK_IDS, DST_IDS = [1, 6, 2], [3, 11, 5]


def _pattern(value: int) -> dict[str, torch.Tensor]:
    """Engine pages whose every byte is ``value``: what a store writes is recognisable."""
    out = zeros()
    for t in out.values():
        t.view(torch.uint8).fill_(value)
    return out


def _bytes_of(dst: dict[str, torch.Tensor], page: int) -> set[int]:
    r = GEOMETRY.regions[0]
    return set(dst[r.name].select(r.block_dim, page).contiguous().view(torch.uint8).numpy().tobytes())


def _load_beside_store(make_world: Any, store_blocks: list[int], *, store_first: bool) -> tuple[Any, Any, Any]:
    """A load of BANK_IDS and a store of 0xEE pages into ``store_blocks`` of the same bank,
    both queued on the paused op engine (the store submitted after the load, or before
    it), then run. Returns the load's handle (finished), its pages and the store's handle."""
    world = make_world(GEOMETRY, fill=bank_pattern)
    group, bank = world.group(), world.banks[0]
    group.load(BANK_IDS, zeros(), DST_IDS).wait(10.0)  # the epoch page is asked once, here
    nat = engine()
    nat.pause(True)
    try:
        dst = zeros()
        src = _pattern(0xEE)
        if store_first:
            s = bank.store(src, list(range(len(store_blocks))), store_blocks)
            h = group.load(BANK_IDS, dst, DST_IDS)
        else:
            h = group.load(BANK_IDS, dst, DST_IDS)
            s = bank.store(src, list(range(len(store_blocks))), store_blocks)
    finally:
        nat.pause(False)
    assert h.wait(10.0) and s.wait(10.0)
    return h, dst, s


def test_a_load_beside_a_store_into_its_blocks_fails(make_world: Any) -> None:
    h, dst, s = _load_beside_store(make_world, [6], store_first=False)
    assert s.result() is not None and s.result().ok
    result = h.result()
    assert result is not None and not result.ok, "a load whose block a store rewrote was trusted"
    assert h.failed_blocks() == frozenset(DST_IDS)
    assert not any(h.region_ok(n) for n in GEOMETRY.names)
    h.close()


def test_a_load_of_a_block_mid_store_fails(make_world: Any) -> None:
    """The store submitted first: the load's first read sees its odd epoch."""
    h, dst, s = _load_beside_store(make_world, [2], store_first=True)
    result = h.result()
    assert result is not None and not result.ok
    h.close()


def test_a_load_of_a_block_whose_store_has_not_ended_fails(make_world: Any) -> None:
    """A store still writing the block when the load's copies ended (its epoch odd at both
    reads, unchanged): an odd epoch never vouches."""
    world = make_world(GEOMETRY, fill=bank_pattern)
    group, bank = world.group(), world.banks[0]
    group.load(BANK_IDS, zeros(), DST_IDS).wait(10.0)
    _, blocks, odd = bank.block_epochs.begin([6], "a store that is slow to end")
    try:
        h = group.load(BANK_IDS, zeros(), DST_IDS)
        assert h.wait(10.0) and not h.result().ok
        h.close()
    finally:
        bank.block_epochs.end(blocks, odd)


class _StoreWhileSubmitting(Wrapped):
    """The importer's host transport, where the exporter stores into the load's blocks, and
    the store ends, while the load is being submitted: between the load's first epoch read
    and its copies."""

    bank: Any = None

    def submit_blocks(self, src: Any, dst: Any, blocks: Any, **kw: Any) -> Any:
        bank, self.bank = self.bank, None
        if bank is not None:
            assert bank.store(_pattern(0xEE), [0], [BANK_IDS[1]]).wait(10.0) and collected(bank)
        return self._inner.submit_blocks(src, dst, blocks, **kw)


def test_a_store_that_ended_before_the_copies_began_fails_the_load(make_world: Any) -> None:
    """The load was ordered for the blocks as they were; it copied what a later store
    wrote (whole: the store had ended). Another version than the one asked for."""
    transport = _StoreWhileSubmitting(HostTransport(granularity=GRANULARITY))
    world = make_world(GEOMETRY, fill=bank_pattern, transport=transport)
    group = world.group()
    group.load(BANK_IDS, zeros(), DST_IDS).wait(10.0)
    transport.bank = world.banks[0]
    dst = zeros()
    h = group.load(BANK_IDS, dst, DST_IDS)
    assert h.wait(10.0) and _bytes_of(dst, DST_IDS[1]) == {0xEE}  # it did copy the new version
    assert not h.result().ok, "a load that copied a version stored after it was ordered was trusted"
    h.close()


def test_a_load_beside_a_store_into_other_blocks_succeeds(make_world: Any) -> None:
    """The control: a store into blocks the load does not read changes nothing for it."""
    h, dst, s = _load_beside_store(make_world, [0, 7], store_first=False)
    result = h.result()
    assert result is not None and result.ok and all(h.region_ok(n) for n in GEOMETRY.names)
    assert _bytes_of(dst, DST_IDS[0]) != {0xEE}
    h.close()


def test_a_load_after_a_store_ended_reads_it(make_world: Any) -> None:
    world = make_world(GEOMETRY, fill=bank_pattern)
    group, bank = world.group(), world.banks[0]
    before = bank.block_epochs.epoch(6)
    assert bank.store(_pattern(0xEE), [0], [6]).wait(10.0) and collected(bank)
    assert bank.block_epochs.epoch(6) == before + 2
    dst = zeros()
    h = group.load(BANK_IDS, dst, DST_IDS)
    assert h.wait(10.0) and h.result().ok
    assert _bytes_of(dst, DST_IDS[1]) == {0xEE}
    h.close()


def test_a_store_ends_its_epochs_before_anyone_hears_it_ended(make_world: Any) -> None:
    """The op engine makes the epochs even as the store's last op ends, before its report
    goes out and before ``wait`` returns: a decode index advertises the blocks on that
    report, and the exporter's Python (the engine's, in a decode worker) may be busy. Here
    the bank's lock is held throughout, so Python cannot collect the store."""
    world = make_world(GEOMETRY, fill=bank_pattern)
    group, bank = world.group(), world.banks[0]
    group.load(BANK_IDS, zeros(), DST_IDS).wait(10.0)
    before = bank.block_epochs.epoch(6)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with bank.locked():
            held.set()
            release.wait(10.0)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5.0)
        s = bank.store(_pattern(0xEE), [0], [6], report=(ours.fileno(), b"ok", b"failed"))
        theirs.settimeout(10.0)
        assert theirs.recv(16) == b"ok"
        assert bank.block_epochs.epoch(6) == before + 2, "the store was reported while its block read as written"
        dst = zeros()
        h = group.load(BANK_IDS, dst, DST_IDS)
        assert h.wait(10.0) and h.result().ok and _bytes_of(dst, DST_IDS[1]) == {0xEE}
        h.close()
        assert s.wait(10.0)
        again = bank.store(_pattern(0xDD), [0], [6])  # right after wait: not Busy
    finally:
        release.set()
        holder.join()
        ours.close()
        theirs.close()
    assert again.wait(10.0) and collected(bank) and bank.block_epochs.epoch(6) == before + 4


def test_an_earlier_stores_collection_never_ends_a_later_stores_epoch(make_world: Any) -> None:
    """The op engine ended store 1's epoch; store 2 on the same block began before store
    1 was collected. Collecting store 1 must leave store 2's odd epoch alone."""
    world = make_world(GEOMETRY, fill=bank_pattern)
    bank = world.banks[0]
    gate, entered = threading.Event(), threading.Event()
    collect = bank._store_finished

    def late(handle: Any) -> None:
        entered.set()
        gate.wait(10.0)
        collect(handle)

    bank._store_finished = late  # type: ignore[method-assign]  # store 1's collection waits
    first = bank.store(_pattern(0xEE), [0], [6])
    bank._store_finished = collect  # type: ignore[method-assign]
    assert entered.wait(10.0) and first.wait(10.0)
    nat = engine()
    nat.pause(True)
    try:
        second = bank.store(_pattern(0xDD), [0], [6])
        odd = bank.block_epochs.epoch(6)
        assert odd & 1
        gate.set()
        assert wait_until(lambda: first not in bank.stores)
        assert bank.block_epochs.epoch(6) == odd, "collecting store 1 ended store 2's epoch"
    finally:
        gate.set()
        nat.pause(False)
    assert second.wait(10.0) and collected(bank) and bank.block_epochs.epoch(6) == odd + 1


def test_the_page_is_asked_once_per_link_and_bank(make_world: Any) -> None:
    world = make_world(GEOMETRY, fill=bank_pattern)
    group = world.group()
    for _ in range(3):
        h = group.load(BANK_IDS, zeros(), DST_IDS)
        assert h.wait(10.0) and h.result().ok
        h.close()
    link = group.parts[0].link
    assert link is not None and len(link.block_epochs) == 1
    assert all(isinstance(v, EpochView) for v in link.block_epochs.values())


def test_a_page_that_could_not_be_had_fails_the_load_and_is_asked_again(make_world: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A transient failure (here the page does not map) is no answer: that load is not
    trusted, and the next one asks again and is checked."""
    world = make_world(GEOMETRY, fill=bank_pattern)
    group = world.group()

    def no_map(cls: type, fd: int, num_blocks: int) -> EpochView:
        raise OSError(errno.ENOMEM, "injected")

    with monkeypatch.context() as m:
        m.setattr(EpochView, "open", classmethod(no_map))
        h = group.load(BANK_IDS, zeros(), DST_IDS)
        assert h.wait(10.0) and not h.result().ok
        h.close()
    link = group.parts[0].link
    assert link is not None and not link.block_epochs  # nothing remembered
    nat = engine()
    nat.pause(True)
    try:  # the next load on the same link is checked: a store beside it fails it
        h = group.load(BANK_IDS, zeros(), DST_IDS)
        s = world.banks[0].store(_pattern(0xEE), [0], [6])
    finally:
        nat.pause(False)
    assert h.wait(10.0) and s.wait(10.0) and not h.result().ok
    h.close()
    h = group.load(BANK_IDS, zeros(), DST_IDS)
    assert h.wait(10.0) and h.result().ok
    assert all(isinstance(v, EpochView) for v in link.block_epochs.values())
    h.close()


def test_the_page_goes_only_to_a_lease_holder(make_world: Any) -> None:
    """The page names the bank a lease is on: a connection without that lease gets none."""
    world = make_world(GEOMETRY, fill=bank_pattern)
    group = world.group()
    link = group.parts[0].link
    assert link is not None and group.parts[0].lease_id is not None
    other = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), HostTransport(granularity=GRANULARITY))
    try:
        theirs = other.import_group([world.exporter.descriptor(0)])  # a lease on another connection
        for lease in (group.parts[0].lease_id + 1000, theirs.parts[0].lease_id):
            with link.request(chan.encode({"op": "block_epochs", "rank": 0, "lease": lease}), 5.0) as msg:
                reply = chan.decode(msg.payload)
                assert reply.get("ok") is False and reply.get("code") == "unknown_lease" and msg.fds == ()
        theirs.drain(5.0)
    finally:
        other.close()


def test_a_failed_store_moves_the_epochs_on_too(make_world: Any) -> None:
    """A store that failed may have written part of a block: its epoch moves on as well."""
    failing = FailingOps(HostTransport(granularity=GRANULARITY))
    world = make_world(GEOMETRY, fill=bank_pattern)
    bank = world.banks[0]
    bank.transport = failing  # the store's ops go through it
    failing.arm(fail_at=frozenset({0}))
    before = bank.block_epochs.epoch(4)
    s = bank.store(_pattern(0xEE), [0], [4])
    assert s.wait(10.0) and not s.result().ok and collected(bank)
    assert bank.block_epochs.epoch(4) == before + 2


def test_one_store_at_a_time_per_block(make_world: Any) -> None:
    world = make_world(GEOMETRY, fill=bank_pattern)
    bank = world.banks[0]
    nat = engine()
    nat.pause(True)
    try:
        first = bank.store(_pattern(0xEE), [0, 1], [3, 4])
        epochs = [bank.block_epochs.epoch(b) for b in range(GEOMETRY.num_blocks)]
        with pytest.raises(Busy) as caught:
            bank.store(_pattern(0xDD), [0, 1], [5, 4])
        assert caught.value.reason is BusyReason.STORING
        assert [bank.block_epochs.epoch(b) for b in range(GEOMETRY.num_blocks)] == epochs  # all or none
        assert len(bank.stores) == 1
    finally:
        nat.pause(False)
    assert first.wait(10.0) and collected(bank)
    assert bank.store(_pattern(0xDD), [0, 1], [5, 4]).wait(10.0)


# -- the page itself -----------------------------------------------------------------


def _received(page: EpochPage) -> int:
    """The page's fd as an importer holds it: another open file of the same memfd."""
    assert page.fd is not None
    return os.open(f"/proc/self/fd/{page.fd}", os.O_RDONLY)


def test_a_received_page_reads_the_exporters_epochs_and_cannot_write_them() -> None:
    page = EpochPage(20, "test")
    fd = _received(page)
    try:
        view = EpochView.open(fd, 20)
        assert view.read([3, 4]) == (0, 0)
        _, blocks, odd = page.begin([4], "test")
        assert odd == (1,)
        assert view.read([3, 4]) == (0, 1) and not view.vouches([3, 4], (0, 0))
        assert not view.vouches([4], view.read([4]))  # an odd epoch never vouches, even unchanged
        page.end(blocks, odd)
        page.end(blocks, odd)  # once only: the op engine may have ended it already
        assert view.read([4]) == (2,) and view.vouches([4], (2,)) and view.vouches([3, 4], (0, 2))
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        rw = os.open(f"/proc/self/fd/{page.fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):  # F_SEAL_FUTURE_WRITE: no new writable mapping
                mmap.mmap(rw, page.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\x01", 0)
        finally:
            os.close(rw)
    finally:
        os.close(fd)
        page.close()


def test_a_page_that_is_not_sealed_or_not_its_size_is_refused() -> None:
    fd = os.memfd_create("not a page", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, page_size(20))
        with pytest.raises(ValueError, match="seals"):
            EpochView.open(fd, 20)
    finally:
        os.close(fd)
    page = EpochPage(20, "test")
    fd = _received(page)
    try:
        with pytest.raises(ValueError, match="bytes"):
            EpochView.open(fd, 20 + mmap.PAGESIZE)  # a page of another bank's size
    finally:
        os.close(fd)
        page.close()
