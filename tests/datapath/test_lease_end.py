"""A load that outlives its lease is not trusted.

The exporter pins a block only while a lease names it. When the importer's link to the
exporter closes while a load is in flight (the link shuts itself on a timed-out request,
which the renewal thread can meet under load), the exporter takes the hang-up as the end
of the lease, and may store new bytes into the block before the load copies it. The load
then completes, with bytes of another prompt. So a load whose link hung up before its
copies ended fails, whatever the copies read (the same check for the exporter's death:
its memory is intact then, but the importer cannot tell the two apart in time).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from kvstate.core.machine import StateChange
from kvstate.transport.host import HostTransport
from datapath.conftest import GRANULARITY
from datapath.support import GEOMETRY, Wrapped, bank_pattern, engine, zeros

BANK_IDS, DST_IDS = [1, 6, 2], [3, 11, 5]


def _rewrite(bank: Any, blocks: list[int]) -> None:
    """What a store into blocks no lease pins writes: other bytes."""
    view = bank.view()
    for r in GEOMETRY.regions:
        for b in blocks:
            for o, n in r.runs():
                at = r.offset + b * r.block_stride_bytes + o
                view[at:at + n] = b"\xee" * n
    del view


class _GatherOnly(Wrapped):
    """The host transport without completion fds (as a backend without them): nothing
    finishes a load's handle until a caller asks, so its regions are judged before it
    finished, as an engine's per-layer waits judge them."""

    def __getattr__(self, name: str) -> Any:
        if name == "submit_blocks":
            raise AttributeError(name)
        return super().__getattr__(name)


def _load_across(make_world: Any, cut: bool, *, wait: bool = True, **world_kw: Any) -> tuple[Any, dict[str, Any]]:
    """A load queued on the paused op engine; with ``cut``, the importer's link shuts (as
    on a timed-out request) and the exporter, once it ended the lease, rewrites the blocks
    before the load copies them. Returns the handle, finished unless ``wait`` is False
    (then only its copies ended), and its pages."""
    world = make_world(GEOMETRY, fill=bank_pattern, **world_kw)
    group = world.group()
    bank = world.banks[0]
    ended = threading.Event()

    def on_change(change: StateChange) -> None:
        if change.event == "peer_died":
            ended.set()

    bank.observe(on_change)
    nat = engine()
    nat.pause(True)
    try:
        dst = zeros()
        h = group.load(BANK_IDS, dst, DST_IDS)
        if cut:
            link = group.parts[0].link
            assert link is not None and link.native is not None
            link.native.close()
            assert ended.wait(10.0), "the exporter did not end the lease on the hang-up"
            _rewrite(bank, BANK_IDS)
    finally:
        nat.pause(False)
    if wait:
        assert h.wait(10.0)
    else:
        assert all(h.wait_region(n, 10.0) for n in GEOMETRY.names)
    return h, dst


def test_a_load_whose_link_hung_up_before_its_copies_ended_fails(make_world: Any) -> None:
    h, dst = _load_across(make_world, cut=True)
    page = dst[GEOMETRY.regions[0].name].select(GEOMETRY.regions[0].block_dim, DST_IDS[0])
    assert set(page.contiguous().view(torch.uint8).numpy().tobytes()) == {0xEE}  # it copied the new bytes
    result = h.result()
    assert result is not None and not result.ok, "a load across the lease's end was trusted"
    assert h.failed_blocks() == frozenset(DST_IDS)
    assert not any(h.region_ok(n) for n in GEOMETRY.names)
    h.close()


def test_a_load_whose_link_held_succeeds(make_world: Any) -> None:
    """The control: the same load, the link intact."""
    h, _ = _load_across(make_world, cut=False)
    result = h.result()
    assert result is not None and result.ok and all(h.region_ok(n) for n in GEOMETRY.names)
    h.close()


def test_a_region_judged_before_the_load_finished_is_not_ok_across_the_lease_end(make_world: Any) -> None:
    """The per-layer path: an engine uses a layer's pages once ``region_ok`` says so, before
    the handle finished. There too, a region copied after the link hung up is not ok."""
    h, _ = _load_across(make_world, cut=True, wait=False, transport=_GatherOnly(HostTransport(granularity=GRANULARITY)))
    assert h.result() is None  # not finished: these answers are the ops' own
    assert [h.region_ok(n) for n in GEOMETRY.names] == [False] * len(GEOMETRY.names)
    assert h.wait(10.0) and h.failed_blocks() == frozenset(DST_IDS)
    h.close()


def test_the_exporter_shuts_a_connection_down_before_it_ends_its_leases(make_world: Any) -> None:
    """The exporter's own end of a connection (its stop, a frame out of step): a child of
    its process may hold a copy of the socket, and then closing its fd hangs nothing up.
    It shuts the connection down before it ends the leases, so the load is still judged."""
    world = make_world(GEOMETRY, fill=bank_pattern)
    group = world.group()
    copies = [os.dup(int(fd)) for fd in os.listdir("/proc/self/fd")  # what a forked child would hold
              if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")]
    nat = engine()
    try:
        nat.pause(True)
        try:
            dst = zeros()
            h = group.load(BANK_IDS, dst, DST_IDS)
            world.exporter.stop()  # ends every lease of every connection it served
            _rewrite(world.banks[0], BANK_IDS)
        finally:
            nat.pause(False)
        assert h.wait(10.0)  # the copies, then the poll, while the copies of the socket live
        assert h.failed_blocks() == frozenset(DST_IDS), "a load across the lease's end was trusted"
        h.close()
    finally:
        for fd in copies:
            os.close(fd)
