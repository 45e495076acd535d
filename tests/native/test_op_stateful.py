"""Hypothesis stateful test of the op engine against a Python model, and its self-test.

The engine is paused between ``run_all`` steps, so the model knows exactly which ops are
queued (and pinning) at every step. Random submits (some with injected failures),
cancels, reaps, polls, completions, leases (explicit pins) taken and ended, unmaps,
releases, remaps and access changes are
checked against the model; after every step the native layer's own observation (pins,
ops in flight, live and queued ops) must equal the model's.

The one pin rule over every memory kind a host op can touch (docs/threat-model.md): an
op's ends are drawn from bank mappings (``a``, ``b``, ``c``: allocations this process
created), an imported mapping (``i``: a memfd exported, received and imported, as an
importer holds a peer's bank), a caller buffer (``buf``: buffer protocol) and caller
memory by address (``raw``: a :class:`RawBuffer` whose owner the test drops at once).
Unmapping or releasing a mapping under an op is refused with ``Busy`` (``pinned``); a
caller buffer cannot be resized while an op holds its export (``BufferError``); a
RawBuffer's owner lives until its op is reaped, and not longer. At quiescence each goes.
The CUDA kinds (mappings, imported mappings, device buffers) have their own machine on
the shim driver (tests/cudashim/test_op_stateful.py).

Invariants: INV-NO-UNMAP-PINNED, INV-OP-PINS, INV-EVENT-DECLARED.

The self-test builds a test-only module with a planted bug (unmap and release ignore
pins) and asserts that this same machine fails on it.
"""

from __future__ import annotations

import ctypes
import enum
import gc
import random
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvstate.core.reasons import ArgumentReason, BusyReason, TransitionReason
from kvstate.core import errors
from kvstate.core.errors import KvStateError
from kvstate.core.capabilities import Access
from kvstate.core.handles import HandleKind
from kvstate.transport.host import HostAllocation, HostMapping, HostReservation, HostTransport
from kvstate.transport.native import Native, Op, RawBuffer, default
from native.helpers import build_variant

PAGE = 4096
SIZE = 16 * PAGE
NAMES = ("a", "b", "c", "i")   # mappings. a, b, i: sources (never written); c: a sink
IMPORTED = ("i",)               # its allocation is an import of an exported memfd
CALLER = ("buf", "raw")         # caller memory: a buffer, a RawBuffer
SOURCES = ("a", "b", "i", *CALLER)
SINKS = ("c", *CALLER)
#: Access levels as the C layer orders them (each includes the previous).
LEVELS = (Access.NONE, Access.READ, Access.READ_WRITE)
ACCESS_NONE, ACCESS_READ, ACCESS_READ_WRITE = range(3)


def outcome(fn: Callable[[], Any]) -> enum.Enum | None:
    """The reason of the kvstate error ``fn`` raises (reasons name their class), or None."""
    try:
        fn()
    except KvStateError as exc:
        return exc.reason
    return None


def pattern(name: str) -> bytes:
    return random.Random(name).randbytes(SIZE)


class Owner:
    """What keeps a RawBuffer's memory alive (a tensor, in real use)."""

    def __init__(self, data: bytes | int) -> None:
        self.mem = ctypes.create_string_buffer(data, SIZE) if isinstance(data, bytes) else \
            ctypes.create_string_buffer(data)

    def raw(self) -> RawBuffer:
        return RawBuffer(ctypes.addressof(self.mem), len(self.mem), self)


class ModelOp:
    def __init__(self, op: Op, touches: frozenset[str], fail: bool, dst: bytearray | None,
                 expect: bytes | None) -> None:
        self.op = op
        self.touches = touches
        self.fail = fail
        self.dst = dst
        self.expect = expect
        self.state = "queued"
        self.buffers: list[bytearray] = []                       # caller buffers it exports
        self.owners: list[weakref.ref[Owner]] = []               # RawBuffer owners it holds
        self.raw_dst: weakref.ref[Owner] | None = None


def machine_for(nat: Native) -> type[RuleBasedStateMachine]:
    class OpEngine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.nat = nat
            self.t = HostTransport(granularity=PAGE, native=nat)
            self.regions: dict[str, HostMapping] = {}  # current (or stale, once unmapped) mapping
            self.mapped: dict[str, bool] = {}
            self.allocs: dict[str, HostAllocation | None] = {}
            self.access: dict[str, int] = {}
            self.ops: dict[int, ModelOp] = {}
            self.reaped: list[int] = []
            self.leases: dict[str, int] = {}      # explicit pins (leases) per region
            self.res: HostReservation | None = None
            self.base_live = self.base_queued = 0

        @initialize()
        def setup(self) -> None:
            base = self.nat.stats()  # the native layer is process-global: count from here
            self.base_live, self.base_queued = base.ops_live, base.ops_queued
            self.nat.pause(True)
            self.res = self.t.reserve(len(NAMES) * SIZE)
            for name in NAMES:
                self.allocs[name] = None
                self._map(name)

        def _map(self, name: str) -> None:
            fresh = self.allocs[name] is None
            if fresh:
                self.allocs[name] = self._imported() if name in IMPORTED else self.t.create(SIZE)
            alloc = self.allocs[name]
            assert alloc is not None and self.res is not None
            region = self.t.map(self.res, NAMES.index(name) * SIZE, alloc)
            self.t.set_access(region, Access.READ_WRITE)
            if fresh and name != "c":
                self.t.view(region)[:] = pattern(name)
            self.regions[name], self.mapped[name], self.access[name] = region, True, ACCESS_READ_WRITE
            self.leases[name] = 0

        def _imported(self) -> HostAllocation:
            """An import of a peer's memfd: exported, received and imported; the exporting
            allocation is released at once, as when the peer dies (the import outlives it)."""
            mine = self.t.create(SIZE)
            try:
                sent = self.t.export(mine, HandleKind.MEMFD)
                got = self.t.import_(self.t.receive_handle(HandleKind.MEMFD, sent.identity, [sent.fd]), SIZE)
            finally:
                self.t.release(mine)
            assert got.imported
            return got

        def inflight(self, name: str) -> int:
            return sum(1 for o in self.ops.values() if o.state == "queued" and name in o.touches)

        def pins(self, name: str) -> int:
            return self.inflight(name) + self.leases.get(name, 0)

        # -- rules ------------------------------------------------------------------------

        @rule(src=st.sampled_from(SOURCES), dst=st.sampled_from(SINKS), nblocks=st.integers(1, 4),
              seed=st.integers(0, 2**16), fail=st.booleans())
        def submit(self, src: str, dst: str, nblocks: int, seed: int, fail: bool) -> None:
            rng = random.Random(seed)
            blocks, expect, dst_off = [], bytearray(), 0
            src_bytes = pattern(src) if src not in CALLER else rng.randbytes(SIZE)
            for _ in range(nblocks):
                length = rng.randint(1, PAGE)
                off = rng.randrange(0, SIZE - length)
                blocks.append((off, dst_off, length))
                expect += src_bytes[off:off + length]
                dst_off += length
            # Caller memory: the test keeps a buffer (to try to resize it) but never a
            # RawBuffer's owner (only a weak reference: the op must hold it).
            ends: list[Any] = []
            buffers: list[bytearray] = []
            owners: list[weakref.ref[Owner]] = []
            dst_buf: bytearray | None = None
            for end, (name, data) in enumerate(((src, src_bytes), (dst, dst_off))):
                if name == "buf":
                    buf = bytearray(data)  # the source's bytes, or the destination's size
                    buffers.append(buf)
                    ends.append(buf)
                    dst_buf = buf if end == 1 else None
                elif name == "raw":
                    owner = Owner(data)
                    owners.append(weakref.ref(owner))
                    ends.append(owner.raw())
                    del owner
                else:
                    ends.append(self.regions[name].region)
            touches = frozenset(n for n in (src, dst) if n not in CALLER)

            if any(not self.mapped[n] for n in touches):
                want: enum.Enum | None = ArgumentReason.UNKNOWN_OBJECT
            elif (src not in CALLER and self.access[src] < ACCESS_READ) or (
                    dst not in CALLER and self.access[dst] < ACCESS_READ_WRITE):
                want = TransitionReason.GUARD
            else:
                want = None
            ops: list[Op] = []
            got = outcome(lambda: ops.append(self.nat.submit_gather(ends[0], ends[1], blocks, fail=fail)))
            del ends
            assert got is want, f"submit {src}->{dst}: expected {want}, got {got}"
            if ops:
                mop = self.ops[ops[0].id] = ModelOp(ops[0], touches, fail, dst_buf, bytes(expect))
                mop.buffers, mop.owners = buffers, owners
                mop.raw_dst = owners[-1] if dst == "raw" else None
                self.held_raw(mop)
            else:  # refused: nothing of the caller's is held
                gc.collect()
                assert all(o() is None for o in owners), "a refused op holds a RawBuffer's owner"
                self.resizable(buffers, "a refused op")

        def held_raw(self, op: ModelOp) -> None:
            assert all(o() is not None for o in op.owners), \
                f"INV-OP-PINS: a RawBuffer's owner was dropped while its op is {op.state} (not reaped)"

        @staticmethod
        def resizable(buffers: list[bytearray], who: str) -> None:
            for buf in buffers:
                try:
                    buf.append(0)
                except BufferError:
                    raise AssertionError(f"a caller buffer is still exported after {who}") from None
                buf.pop()

        @rule(name=st.sampled_from(NAMES))
        def unmap(self, name: str) -> None:
            if not self.mapped[name]:
                want: enum.Enum | None = ArgumentReason.UNKNOWN_OBJECT
            elif self.pins(name):
                want = BusyReason.PINNED
            else:
                want = None
            got = outcome(lambda: self.t.unmap(self.regions[name]))
            assert got is want, f"INV-NO-UNMAP-PINNED: unmap of {name} with {self.pins(name)} pins: " \
                                f"expected {want}, got {got}"
            if got is None:
                self.mapped[name] = False

        @rule(name=st.sampled_from(NAMES))
        def release(self, name: str) -> None:
            alloc = self.allocs[name]
            if alloc is None:
                return
            if self.mapped[name] and self.pins(name):
                want: enum.Enum | None = BusyReason.PINNED
            elif self.mapped[name]:
                want = BusyReason.MAPPED
            else:
                want = None
            got = outcome(lambda: self.t.release(alloc))
            assert got is want, f"INV-NO-UNMAP-PINNED: release of {name} with {self.pins(name)} pins: " \
                                f"expected {want}, got {got}"
            if got is None:
                self.allocs[name] = None

        @precondition(lambda self: not all(self.mapped.values()))
        @rule(name=st.sampled_from(NAMES))
        def remap(self, name: str) -> None:
            if not self.mapped[name]:
                self._map(name)

        @rule(name=st.sampled_from(NAMES), level=st.sampled_from([ACCESS_NONE, ACCESS_READ, ACCESS_READ_WRITE]))
        def set_access(self, name: str, level: int) -> None:
            if not self.mapped[name]:
                want: enum.Enum | None = ArgumentReason.UNKNOWN_OBJECT
            elif level < self.access[name] and self.pins(name):
                want = BusyReason.PINNED
            else:
                want = None
            got = outcome(lambda: self.t.set_access(self.regions[name], LEVELS[level]))
            assert got is want, f"set_access {name} {level}: expected {want}, got {got}"
            if got is None:
                self.access[name] = level

        @rule(name=st.sampled_from(NAMES))
        def lease(self, name: str) -> None:
            want = None if self.mapped[name] else ArgumentReason.UNKNOWN_OBJECT
            got = outcome(lambda: self.t.pin(self.regions[name]))
            assert got is want, f"pin {name}: expected {want}, got {got}"
            if got is None:
                self.leases[name] += 1

        @rule(name=st.sampled_from(NAMES))
        def end_lease(self, name: str) -> None:
            if not self.mapped[name]:
                want: enum.Enum | None = ArgumentReason.UNKNOWN_OBJECT
            elif not self.leases[name]:
                want = ArgumentReason.NATIVE  # an op's pin is never dropped by hand
            else:
                want = None
            got = outcome(lambda: self.t.unpin(self.regions[name]))
            assert got is want, f"unpin {name}: expected {want}, got {got}"
            if got is None:
                self.leases[name] -= 1

        @precondition(lambda self: bool(self.ops))
        @rule(data=st.data())
        def cancel(self, data: st.DataObject) -> None:
            op = self.ops[data.draw(st.sampled_from(sorted(self.ops)))]
            want = None if op.state == "queued" else TransitionReason.ILLEGAL
            got = outcome(op.op.cancel)
            assert got is want, f"INV-EVENT-DECLARED: cancel in {op.state}: expected {want}, got {got}"
            if got is None:
                op.state = "cancelled"

        @precondition(lambda self: bool(self.ops))
        @rule(data=st.data())
        def reap(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.ops)))
            op = self.ops[key]
            if op.state == "queued":
                assert outcome(op.op.reap) is TransitionReason.ILLEGAL, "INV-EVENT-DECLARED: reap of a queued op"
                return
            self.held_raw(op)
            raw_dst = op.raw_dst() if op.raw_dst is not None else None
            info = op.op.reap()
            assert info.state == op.state
            if op.state == "done" and op.dst is not None:
                assert bytes(op.dst) == op.expect, "gathered bytes differ from the source"
            if op.state == "done" and raw_dst is not None:
                assert raw_dst.mem.raw[:len(op.expect or b"")] == op.expect, "gathered bytes differ from the source"
            del raw_dst
            del self.ops[key]
            self.reaped.append(key)
            # Reaped: the op lets go of the caller's memory, and holds nothing for longer.
            self.resizable(op.buffers, "its op was reaped")
            assert all(o() is None for o in op.owners), "a reaped op still holds a RawBuffer's owner"

        @precondition(lambda self: any(o.buffers for o in self.ops.values()))
        @rule(data=st.data())
        def free_caller_buffer(self, data: st.DataObject) -> None:
            """Resizing (freeing) a caller buffer under an op that is not reaped is refused by
            the buffer protocol: the op holds its export."""
            op = self.ops[data.draw(st.sampled_from(sorted(k for k, o in self.ops.items() if o.buffers)))]
            for buf in op.buffers:
                with pytest.raises(BufferError):
                    buf.clear()
                    raise AssertionError(f"INV-OP-PINS: a caller buffer was resized under an op ({op.state})")

        @precondition(lambda self: bool(self.ops))
        @rule(data=st.data())
        def poll(self, data: st.DataObject) -> None:
            op = self.ops[data.draw(st.sampled_from(sorted(self.ops)))]
            assert op.op.wait(0.0 if op.state != "queued" else 0.001) is (op.state != "queued")

        @precondition(lambda self: bool(self.reaped))
        @rule(data=st.data())
        def stale_op(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(self.reaped))
            assert outcome(lambda: self.nat.reap(key)) is ArgumentReason.UNKNOWN_OBJECT
            assert outcome(lambda: self.nat.cancel(key)) is ArgumentReason.UNKNOWN_OBJECT

        @precondition(lambda self: any(o.state == "queued" for o in self.ops.values()))
        @rule()
        def run_all(self) -> None:
            queued = [o for o in self.ops.values() if o.state == "queued"]
            self.nat.pause(False)
            try:
                for o in queued:
                    assert o.op.wait(10.0), "a queued op did not finish within 10 s"
            finally:
                self.nat.pause(True)
            for o in queued:
                o.state = "failed" if o.fail else "done"

        # -- invariants -------------------------------------------------------------------

        @invariant()
        def native_observation_matches_model(self) -> None:
            """INV-OP-PINS: a region's pins are exactly the queued or running ops touching it."""
            if not self.regions:
                return
            for name in NAMES:
                if self.mapped[name]:
                    s = self.t.stats(self.regions[name])
                    assert (s.pins, s.inflight, s.explicit_pins) == \
                        (self.pins(name), self.inflight(name), self.leases[name]), \
                        f"INV-OP-PINS: {name} reports pins {s.pins}, in flight {s.inflight}, leases " \
                        f"{s.explicit_pins}; model {self.pins(name)}, {self.inflight(name)}, {self.leases[name]}"
            g = self.nat.stats()
            assert g.ops_live - self.base_live == len(self.ops)
            assert g.ops_queued - self.base_queued == sum(1 for o in self.ops.values() if o.state == "queued")
            assert g.ops_running == 0 and g.paused

        def teardown(self) -> None:
            for key, op in list(self.ops.items()):
                if op.state == "queued":
                    outcome(op.op.cancel)
                outcome(op.op.reap)
            self.nat.pause(False)
            for name in self.regions:
                for _ in range(self.leases.get(name, 0)):
                    outcome(lambda: self.t.unpin(self.regions[name]))
                if self.mapped.get(name):
                    outcome(lambda: self.t.unmap(self.regions[name]))
                alloc = self.allocs.get(name)
                if alloc is not None:
                    outcome(lambda: self.t.release(alloc))
            res = self.res
            if res is not None:
                outcome(lambda: self.t.free(res))

    return OpEngine


TestOpEngine = machine_for(default()).TestCase
TestOpEngine.settings = settings(TestOpEngine.settings, stateful_step_count=30)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Native:
    nat = build_variant(Path(tmp_path_factory.mktemp("planted")), "kvs_planted",
                        defines=[("KVS_PLANT_RELEASE_IGNORES_PINS", None)])
    assert nat.planted_bug
    return nat


def test_production_module_has_no_planted_bug() -> None:
    assert default().planted_bug is False


def test_stateful_machine_catches_unmap_and_release_ignoring_pins(planted: Native) -> None:
    """Self-test: the machine above fails on a build whose unmap/release ignore pins."""
    with pytest.raises(AssertionError, match="INV-NO-UNMAP-PINNED"):
        run_state_machine_as_test(
            machine_for(planted),
            settings=settings(max_examples=300, stateful_step_count=30, derandomize=True,
                              database=None, deadline=None, phases=[Phase.generate]),
        )
    assert planted.stats().pins == 0 and planted.stats().ops_live == 0
