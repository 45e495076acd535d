"""Hypothesis stateful test of asynchronous loads on a real group over the real op engine.

Rules: start loads (some ops failing on the engine through its fault injection, some
submits failing part way), pause and resume the engine, cancel loads, wait for a region,
wait for a load, close handles, drain the group. Invariants, after every step:

- no op leaks: the engine holds no more live ops than the unfinished loads submitted,
  and at the end ``ops_live`` is back where it started, with no pin and no load left;
- a finished load's failed regions are exactly the regions whose ops failed or were
  cancelled, its ``failed_blocks()`` all of its pages when there is one and none
  otherwise; a failed or cancelled region's pages were never written, a completed one's
  hold the bank's bytes;
- a submit failing part way leaves nothing in flight and nothing written;
- no load is accepted by a group that is not ready (no partial or draining group loads).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstate.core.errors import TransferFailed, TransitionError
from kvstate.core.reasons import TransferFailReason, TransitionReason
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostTransport
from datapath.conftest import DEPLOYMENT, GRANULARITY, socket_dir
from datapath.support import GEOMETRY, FailingOps, bank_pattern, engine, live_ops, zeros
from support.reuse import REUSE_ON

NAMES = GEOMETRY.names


class Load:
    def __init__(self, handle: Any, dst: dict[str, torch.Tensor], bank_ids: list[int], dst_ids: list[int],
                 fail: frozenset[int]) -> None:
        self.handle, self.dst, self.bank_ids, self.dst_ids, self.fail = handle, dst, bank_ids, dst_ids, fail
        self.cancelled = False
        self.checked = False


class AsyncLoads(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.baseline = live_ops()
        self.nat = engine()
        self.exporter = Exporter(ExportConfig(DEPLOYMENT, socket_dir(), os.urandom(16), 1),
                                 HostTransport(granularity=GRANULARITY))
        bank = self.exporter.add_bank(0, GEOMETRY)
        bank.fire("register")
        bank_pattern(bank)
        bank.fire("advertise")
        self.exporter.start()
        self.bank = bank
        self.transport = FailingOps(HostTransport(granularity=GRANULARITY))
        self.importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), self.transport)
        self.group = self.importer.import_group([self.exporter.descriptor(0)])
        self.loads: list[Load] = []
        self.paused = False

    def teardown(self) -> None:
        if not hasattr(self, "group"):
            return
        self.nat.pause(False)
        for load in self.loads:
            assert load.handle.wait(30.0)
            self.check_finished(load)
            load.handle.close()
        self.group.drain(30.0)
        assert self.group.state == "closed" and not self.group.loads
        assert live_ops() == self.baseline, "INV-OP-PINS: ops leaked"
        self.importer.close()
        self.exporter.stop()
        self.exporter.drain(30.0)

    # -- rules ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(1, 3))
        bank_ids = data.draw(st.lists(st.integers(0, 7), min_size=n, max_size=n, unique=True))
        dst_ids = data.draw(st.lists(st.integers(1, 15), min_size=n, max_size=n, unique=True))
        fail = data.draw(st.frozensets(st.integers(0, len(NAMES) - 1), max_size=2))
        raise_at = data.draw(st.one_of(st.none(), st.integers(0, len(NAMES) - 1)))
        dst = zeros()
        self.transport.arm(raise_at=raise_at, fail_at=fail)
        if self.group.state != "ready":
            try:
                self.group.load(bank_ids, dst, dst_ids)
            except TransitionError as exc:
                if exc.reason is not TransitionReason.ILLEGAL:
                    raise
                return
            raise AssertionError(f"a {self.group.state} group accepted a load")
        before = live_ops()
        try:
            handle = self.group.load(bank_ids, dst, dst_ids)
        except TransferFailed as exc:
            if exc.reason is not TransferFailReason.LOAD:
                raise
            assert raise_at is not None
            assert live_ops() <= before, "a failed submit left ops in flight"
            if self.paused:
                assert not any(t.view(torch.int16).any() for t in dst.values()), "a cancelled op wrote"
            return
        assert raise_at is None
        self.loads.append(Load(handle, dst, bank_ids, dst_ids, fail))

    @rule(paused=st.booleans())
    def pause(self, paused: bool) -> None:
        self.nat.pause(paused)
        self.paused = paused

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        load = data.draw(st.sampled_from(self.loads))
        load.cancelled = True
        load.handle.cancel()

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def wait_region(self, data: st.DataObject) -> None:
        load = data.draw(st.sampled_from(self.loads))
        name = data.draw(st.sampled_from(NAMES))
        if load.handle.wait_region(name, 0.0 if self.paused else 30.0):
            assert load.handle.region_ok(name) is not None
            if load.handle.region_ok(name):
                self.check_region(load, name)
        else:
            assert self.paused

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def wait(self, data: st.DataObject) -> None:
        load = data.draw(st.sampled_from(self.loads))
        if load.handle.wait(0.0 if self.paused else 30.0):
            self.check_finished(load)

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        load = data.draw(st.sampled_from(self.loads))
        if not load.handle.done():
            # Closing an unfinished load cancels what is still queued; an unpaused engine
            # on a loaded machine may not have run every op yet.
            load.cancelled = True
        load.handle.close()
        self.check_finished(load)
        self.loads.remove(load)

    @precondition(lambda self: self.group.state == "ready")
    @rule()
    def drain_group(self) -> None:
        self.group.fire("drain")  # loads in flight go on; no new one is accepted

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def no_op_leaks(self) -> None:
        if not hasattr(self, "loads"):
            return
        bound = self.baseline + sum(len(load.handle._entries) for load in self.loads if not load.handle.done())
        assert live_ops() <= bound, "more live ops than unfinished loads submitted"

    def check_region(self, load: Load, name: str) -> None:
        r = GEOMETRY.region(name)
        view = self.bank.view()
        for b, d in zip(load.bank_ids, load.dst_ids):
            got = load.dst[name].select(r.block_dim, d).contiguous().view(torch.uint8).numpy().tobytes()
            want = b"".join(bytes(view[r.offset + b * r.block_stride_bytes + o:][:n]) for o, n in r.runs())
            assert got == want, f"region {name}: page {d} differs from bank block {b}"
        del view

    def check_finished(self, load: Load) -> None:
        h = load.handle
        assert h.done()
        result = h.result()
        assert result is not None
        failed = set(result.failed_regions)
        injected = {NAMES[i] for i in load.fail}
        assert injected <= failed, "an op that failed on the engine was reported done"
        if not load.cancelled:
            assert failed == injected, f"failed regions {failed}, injected {injected}"
        assert h.failed_blocks() == (frozenset(load.dst_ids) if failed else frozenset())
        for name in NAMES:
            if name in failed:
                assert not load.dst[name].view(torch.int16).any(), f"failed or cancelled region {name} wrote"
            else:
                self.check_region(load, name)


TestAsyncLoads = AsyncLoads.TestCase
TestAsyncLoads.settings = settings(max_examples=20, stateful_step_count=20, deadline=None)
