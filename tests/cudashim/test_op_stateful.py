"""The one pin rule over every CUDA memory kind, as a Hypothesis state machine on the shim.

The CUDA half of tests/native/test_op_stateful.py: the C engine's CUDA path against a
model. An op's ends are drawn from a mapping this process created (``m``), an imported
mapping (``i``: a VMM allocation exported as a POSIX fd and imported, as an importer
holds a peer's bank), a device buffer of ``alloc_buffer`` (``d``) and caller memory by
address inside that buffer (``dr``: a RawBuffer, which names the buffer's region; its
owner, which the test drops at submit, must live until the op is reaped). The
shim stalls the device between ``run_all`` steps, so the model knows which ops are in
flight: unmap and release of a mapping, and ``free_buffer`` of a buffer, that an op in
flight touches are refused with ``Busy`` (``pinned``); releasing a mapped allocation is
``Busy`` (``mapped``); at quiescence each goes. After every step the native layer's pins
equal the model's and the shim recorded no violation (nothing unmapped or freed under a
queued copy).

Invariants: INV-NO-UNMAP-PINNED, INV-OP-PINS, INV-EVENT-DECLARED.

The self-test runs the same machine on a build that drops an op's pins at enqueue
(``KVS_PLANT_CUDA_EARLY_UNPIN``) and asserts that it fails.
"""

from __future__ import annotations

import enum
import gc
import weakref
from collections.abc import Callable, Iterator
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

from cudashim.conftest import UUID
from cudashim.shim import use
from kvstate.core.capabilities import Access
from kvstate.core.errors import KvStateError
from kvstate.core.handles import HandleKind
from kvstate.core.reasons import ArgumentReason, BusyReason, TransitionReason
from kvstate.transport.cuda import CudaTransport
from kvstate.transport.cuda.objects import CudaAllocation, CudaMapping, CudaReservation, DeviceBuffer
from kvstate.transport.native import Native, Op, RawBuffer, default

MAPPINGS = ("m", "i")           # i: an imported allocation
ENDS = ("m", "i", "d", "dr")    # d: a device buffer; dr: caller memory (a RawBuffer) inside it
CHUNK = 256


class Owner:
    """What keeps caller memory alive (an engine's tensor, in real use)."""


def outcome(fn: Callable[[], Any]) -> enum.Enum | None:
    try:
        fn()
    except KvStateError as exc:
        return exc.reason
    return None


def machine_for(nat: Native) -> type[RuleBasedStateMachine]:
    class CudaOps(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.shim = use()
            self.t: CudaTransport | None = None
            self.res: dict[str, CudaReservation] = {}
            self.allocs: dict[str, CudaAllocation | None] = {}
            self.maps: dict[str, CudaMapping] = {}
            self.mapped: dict[str, bool] = {}
            self.buf: DeviceBuffer | None = None
            self.ops: dict[int, tuple[Op, frozenset[str]]] = {}
            self.done: set[int] = set()
            self.owners: dict[int, list[weakref.ref[Owner]]] = {}  # of each op's RawBuffers

        @initialize()
        def setup(self) -> None:
            self.shim.reset()
            self.live = self.shim.live()
            self.t = CudaTransport(UUID, native=nat)
            self.g = self.t.granularity()
            for name in MAPPINGS:
                self.res[name] = self.t.reserve(self.g)
                self.allocs[name] = None
                self._map(name)
            self.buf = self.t.alloc_buffer(2 * self.g)
            self.shim.stall(True)

        def _map(self, name: str) -> None:
            assert self.t is not None
            if self.allocs[name] is None:
                self.allocs[name] = self._imported() if name == "i" else self.t.create(self.g)
            alloc = self.allocs[name]
            assert alloc is not None
            self.maps[name] = self.t.map(self.res[name], 0, alloc)
            self.t.set_access(self.maps[name], Access.READ_WRITE)
            self.mapped[name] = True

        def _imported(self) -> CudaAllocation:
            """An import of a peer's VMM allocation (POSIX fd); the exporting allocation is
            released at once, as when the peer dies (the import holds the memory)."""
            assert self.t is not None
            mine = self.t.create(self.g)
            try:
                h = self.t.export(mine, HandleKind.POSIX_FD)
                return self.t.import_(self.t.receive_handle(HandleKind.POSIX_FD, h.identity, [h.fd]), self.g)
            finally:
                self.t.release(mine)

        def inflight(self, name: str) -> int:
            touched = {"d", "dr"} if name == "d" else {name}
            return sum(1 for k, (_, ends) in self.ops.items() if k not in self.done and ends & touched)

        def end(self, name: str, owners: list[weakref.ref[Owner]]) -> Any:
            assert self.buf is not None
            if name in MAPPINGS:
                return self.maps[name]
            if name == "d":
                return self.buf
            owner = Owner()
            owners.append(weakref.ref(owner))
            return RawBuffer(self.buf.ptr + self.g, self.g, owner)  # inside the buffer: pins it too

        # -- rules ------------------------------------------------------------------------

        @precondition(lambda self: self.buf is not None)
        @rule(src=st.sampled_from(ENDS), dst=st.sampled_from(ENDS), src_off=st.integers(0, 7),
              dst_off=st.integers(0, 7))
        def submit(self, src: str, dst: str, src_off: int, dst_off: int) -> None:
            assert self.t is not None
            stale = [n for n in (src, dst) if n in MAPPINGS and not self.mapped[n]]
            want = ArgumentReason.UNKNOWN_OBJECT if stale else None
            ops: list[Op] = []
            blocks = [(src_off * CHUNK, dst_off * CHUNK, CHUNK)]
            owners: list[weakref.ref[Owner]] = []
            got = outcome(lambda: ops.append(self.t.submit_blocks(self.end(src, owners), self.end(dst, owners),  # type: ignore[union-attr]
                                                                  blocks)))
            assert got is want, f"submit {src}->{dst}: expected {want}, got {got}"
            gc.collect()
            if ops:
                self.ops[ops[0].id] = (ops[0], frozenset((src, dst)))
                self.owners[ops[0].id] = owners
                assert all(o() is not None for o in owners), \
                    "INV-OP-PINS: a RawBuffer's owner was dropped while its op is in flight"
            else:
                assert all(o() is None for o in owners), "a refused op holds a RawBuffer's owner"

        @rule(name=st.sampled_from(MAPPINGS))
        def unmap(self, name: str) -> None:
            assert self.t is not None
            if not self.mapped[name]:
                want: enum.Enum | None = ArgumentReason.UNKNOWN_OBJECT
            elif self.inflight(name):
                want = BusyReason.PINNED
            else:
                want = None
            got = outcome(lambda: self.t.unmap(self.maps[name]))  # type: ignore[union-attr]
            assert got is want, f"INV-NO-UNMAP-PINNED: unmap of {name} with {self.inflight(name)} ops " \
                                f"in flight: expected {want}, got {got}"
            if got is None:
                self.mapped[name] = False

        @rule(name=st.sampled_from(MAPPINGS))
        def release(self, name: str) -> None:
            alloc, t = self.allocs[name], self.t
            if alloc is None or t is None:
                return
            if self.mapped[name] and self.inflight(name):
                want: enum.Enum | None = BusyReason.PINNED
            elif self.mapped[name]:
                want = BusyReason.MAPPED
            else:
                want = None
            got = outcome(lambda: t.release(alloc))
            assert got is want, f"INV-NO-UNMAP-PINNED: release of {name} with {self.inflight(name)} ops " \
                                f"in flight: expected {want}, got {got}"
            if got is None:
                self.allocs[name] = None

        @precondition(lambda self: not all(self.mapped.values()))
        @rule(name=st.sampled_from(MAPPINGS))
        def remap(self, name: str) -> None:
            if not self.mapped[name]:
                self._map(name)

        @precondition(lambda self: self.buf is not None)
        @rule()
        def free_buffer(self) -> None:
            t, buf = self.t, self.buf
            assert t is not None and buf is not None
            want = BusyReason.PINNED if self.inflight("d") else None
            got = outcome(lambda: t.free_buffer(buf))
            assert got is want, f"INV-NO-UNMAP-PINNED: free_buffer with {self.inflight('d')} ops in flight: " \
                                f"expected {want}, got {got}"
            if got is None:
                self.buf = None

        @precondition(lambda self: self.buf is None)
        @rule()
        def alloc_buffer(self) -> None:
            assert self.t is not None
            self.buf = self.t.alloc_buffer(2 * self.g)

        @precondition(lambda self: bool(self.ops))
        @rule(data=st.data())
        def reap_or_cancel(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.ops)))
            op, _ = self.ops[key]
            if key not in self.done:  # work on a stream cannot be withdrawn, nor reaped unfinished
                assert outcome(op.cancel) is TransitionReason.ILLEGAL, "INV-EVENT-DECLARED: cancel of a running op"
                assert outcome(op.reap) is TransitionReason.ILLEGAL, "INV-EVENT-DECLARED: reap of a running op"
                return
            assert all(o() is not None for o in self.owners[key]), \
                "INV-OP-PINS: a RawBuffer's owner was dropped before its op was reaped"
            assert op.reap().state == "done"
            del self.ops[key]
            self.done.discard(key)
            assert all(o() is None for o in self.owners.pop(key)), "a reaped op still holds a RawBuffer's owner"

        @precondition(lambda self: any(k not in self.done for k in self.ops))
        @rule()
        def run_all(self) -> None:
            self.shim.stall(False)
            try:
                for key, (op, _) in self.ops.items():
                    assert op.wait(10.0), "an op did not finish within 10 s"
                    self.done.add(key)
            finally:
                self.shim.stall(True)

        # -- invariants -------------------------------------------------------------------

        @invariant()
        def native_pins_match_the_model(self) -> None:
            if self.t is None:
                return
            for name in MAPPINGS:
                if self.mapped[name]:
                    s = self.t.stats(self.maps[name])
                    assert (s.pins, s.inflight) == (self.inflight(name),) * 2, \
                        f"INV-OP-PINS: {name} reports pins {s.pins}, in flight {s.inflight}; " \
                        f"model {self.inflight(name)}"
            v = self.shim.violations()
            assert v.count == 0, f"INV-NO-UNMAP-PINNED: the shim saw memory go under a copy: {v.text}"

        def teardown(self) -> None:
            self.shim.stall(False)
            t = self.t
            if t is None:
                return
            for op, _ in self.ops.values():
                op.wait(10.0)
                outcome(op.reap)
            for name in MAPPINGS:
                alloc = self.allocs.get(name)
                if self.mapped.get(name):
                    outcome(lambda: t.unmap(self.maps[name]))
                if name in self.res:
                    outcome(lambda: t.free(self.res[name]))
                if alloc is not None:
                    outcome(lambda: t.release(alloc))
            buf = self.buf
            if buf is not None:
                outcome(lambda: t.free_buffer(buf))
            t.close()

    return CudaOps


TestCudaOps = machine_for(default()).TestCase
TestCudaOps.settings = settings(TestCudaOps.settings, stateful_step_count=30)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Native]:
    from native.helpers import build_variant

    nat = build_variant(Path(tmp_path_factory.mktemp("planted_cuda")), "kvs_planted_cuda_ops",
                        defines=[("KVS_PLANT_CUDA_EARLY_UNPIN", None)])
    assert nat.planted_bug
    yield nat


def test_the_machine_catches_pins_dropped_before_the_device_is_done(planted: Native) -> None:
    with pytest.raises(AssertionError, match="INV-"):
        run_state_machine_as_test(
            machine_for(planted),
            settings=settings(max_examples=100, stateful_step_count=30, derandomize=True,
                              database=None, deadline=None, phases=[Phase.generate]),
        )
    use().stall(False)
