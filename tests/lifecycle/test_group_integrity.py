"""Issue 14, classes 3 and 5: a group is imported in two phases (every rank leased and
checked before any rank opens), and a ready group never holds a part that left it.

A transport that counts opens (``import_``) and maps proves zero opens whenever any rank
is rejected, at tp 1..8, whatever the rejection: validation (dtype, expiry, geometry,
device), the exporter's refusal at lease time (stale incarnation, stale generation, a
draining bank), its report disagreeing with the descriptor, or a handle that is not the
file its descriptor names.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import attrs
import pytest

from support.errors import raises
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEPLOYMENT, GEOMETRY, GRANULARITY, make_exporter
from kvstate.core.reasons import TransitionReason
from kvstate.core.descriptor import decode, encode
from kvstate.core.errors import GroupRejected, ImportFailed, KvStateError, TransitionError
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import fd_identity
from kvstate.core.reasons import ImportReason, RejectReason
from kvstate.share.exporter import Exporter
from kvstate.core.machine import guard
from kvstate.share.importer import Group, ImportConfig, Importer
from kvstate.transport.host import HostTransport
from support.reuse import REUSE_ON


class CountingTransport:
    """The real host transport, counting the calls that open or map a received handle."""

    def __init__(self, inner: HostTransport) -> None:
        self._inner = inner
        self.name = inner.name
        self.opens = 0
        self.maps = 0
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Any:
        return self._inner.capabilities

    def import_(self, handle: Any, size: int) -> Any:
        with self._lock:
            self.opens += 1
        return self._inner.import_(handle, size)

    def map(self, reservation: Any, offset: int, allocation: Any) -> Any:
        with self._lock:
            self.maps += 1
        return self._inner.map(reservation, offset, allocation)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


REJECTIONS = ("dtype", "expired", "device_report", "incarnation", "generation", "draining", "handle_identity",
              "num_blocks")


def tampered(wire: bytes, **changes: Any) -> bytes:
    """The descriptor with fields changed, signed again with the deployment's key (an
    exporter of the same deployment can sign anything: the checks must not trust it)."""
    return encode(attrs.evolve(decode(wire, DEPLOYMENT), **changes), DEPLOYMENT)


def reject_one(ex: Exporter, wire: list[bytes], rank: int, how: str) -> None:
    d = decode(wire[rank], DEPLOYMENT)
    if how == "dtype":       # the same bytes per block, read as another number format
        wire[rank] = tampered(wire[rank], geometry=Geometry(tuple(
            attrs.evolve(r, dtype=DType.FP16) for r in d.geometry.regions)))
    elif how == "num_blocks":  # signed, but not what the exporter's bank holds
        wire[rank] = tampered(wire[rank], geometry=Geometry.uniform(
            layers=2, kv_heads=2, head_dim=16, block_tokens=8, dtype=DType.BF16, layout=Layout.LAYER_MAJOR,
            num_blocks=GEOMETRY.num_blocks - 1))
    elif how == "expired":
        wire[rank] = tampered(wire[rank], expires_at_ns=time.time_ns() - 1)
    elif how == "device_report":  # passes validation; the exporter's lease report disagrees
        wire[rank] = tampered(wire[rank], device_uuid=os.urandom(16))
    elif how == "incarnation":    # a descriptor of an earlier process of this exporter
        wire[rank] = tampered(wire[rank], incarnation=os.urandom(16))
    elif how == "generation":     # the bank was advertised again since
        ex.banks[rank].advertise()
    elif how == "draining":       # the bank stopped granting leases
        ex.banks[rank].fire("drain")
    elif how == "handle_identity":  # the exporter sends an fd that is not the file named
        wire[rank] = tampered(wire[rank], handle=fd_identity(1, 2))
    else:
        raise AssertionError(how)


def finish(ex: Exporter) -> None:
    ex.stop()
    for bank in ex.banks.values():
        for lease in list(bank.leases.values()):
            lease.channel.close()
    ex.drain(5.0)


@settings(max_examples=40, deadline=None)
@given(tp=st.integers(1, 8), data=st.data())
def test_zero_opens_whenever_any_rank_is_rejected(tp: int, data: st.DataObject) -> None:
    """INV-REJECT-BEFORE-OPEN, INV-LEASE-BEFORE-OPEN: one rank (or several) rejected, at
    any tp: no rank's handle is opened or mapped, every lease taken in phase 1 is
    returned, the group ends rejected or failed, and a valid import afterwards works."""
    inner = HostTransport(granularity=GRANULARITY)
    counting = CountingTransport(inner)
    ex = make_exporter(tp, inner, name=f"twophase-{tp}")
    importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), counting)  # type: ignore[arg-type]
    before = inner.native.stats()
    try:
        wire = [ex.descriptor(r) for r in range(tp)]
        ranks = data.draw(st.lists(st.integers(0, tp - 1), min_size=1, max_size=min(tp, 3), unique=True))
        for rank in ranks:
            reject_one(ex, wire, rank, data.draw(st.sampled_from(REJECTIONS)))
        with pytest.raises((GroupRejected, ImportFailed)) as info:
            importer.import_group(wire)
        group = importer.groups[-1]
        assert (counting.opens, counting.maps) == (0, 0), f"INV-REJECT-BEFORE-OPEN: {info.value}"
        assert group.state in ("rejected", "failed") and all(p.is_terminal for p in group.parts)
        assert all(p.channel is None and p.received is None for p in group.parts)
        assert sum(len(b.leases) for b in ex.banks.values()) == 0, "a phase-1 lease was kept"
        after = inner.native.stats()
        assert (after.allocations, after.regions, after.reservations) == \
            (before.allocations, before.regions, before.reservations)
        if "dtype" in str(info.value):
            assert isinstance(info.value, GroupRejected) and RejectReason.DTYPE in info.value.reasons
        # and the importer still works: re-advertised, not draining
        fresh = make_exporter(tp, inner, name=f"twophase-ok-{tp}")
        ok = importer.import_group([fresh.descriptor(r) for r in range(tp)])
        assert ok.state == "ready" and counting.opens == tp
        ok.drain(5.0)
        finish(fresh)
    finally:
        importer.close()
        finish(ex)


def test_dtype_only_difference_is_its_own_validation_reason(transport: HostTransport) -> None:
    """A dtype-only difference between two ranks is refused by validation (reason DTYPE),
    nothing opened, no lease taken, the group rejected (not stuck importing)."""
    ex = make_exporter(2, transport, name="dtype")
    counting = CountingTransport(transport)
    importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), counting)  # type: ignore[arg-type]
    try:
        wire = [ex.descriptor(0), ex.descriptor(1)]
        reject_one(ex, wire, 1, "dtype")
        with pytest.raises(GroupRejected) as info:
            importer.import_group(wire)
        assert info.value.reasons == {RejectReason.DTYPE} and info.value.problems[0].rank == 1
        assert importer.groups[-1].state == "rejected" and counting.opens == 0
        assert not any(b.leases for b in ex.banks.values())
    finally:
        importer.close()


def test_complete_refused_never_leaves_group_importing(transport: HostTransport) -> None:
    """Whatever makes `complete` refuse after phase 2 (here a part whose mapping is made
    to disagree with its descriptor), the group is failed and rolled back, its leases
    returned: never left importing with leases held."""
    ex = make_exporter(2, transport, name="refused")
    importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), transport)
    importer.group_class = IncompatibleGroup
    try:
        with pytest.raises(ImportFailed, match="parts_compatible") as info:
            importer.import_group([ex.descriptor(0), ex.descriptor(1)])
        assert info.value.reason is ImportReason.FAILED  # a guard of the table refused
        g = importer.groups[-1]
        assert g.state == "failed" and all(p.state == "closed" and p.mapping is None for p in g.parts)
        assert not any(b.leases for b in ex.banks.values())
    finally:
        importer.close()


class IncompatibleGroup(Group):  # type: ignore[type-arg]
    """A group whose compatibility guard refuses (standing in for any late refusal)."""

    @guard("parts_compatible")
    def _compatible(self, **kw: Any) -> bool:
        return False


# -- class 5: a ready group keeps its parts --------------------------------------------------

PART_EVENTS = ("validate", "reject", "lease", "open", "close", "import_failed")


@pytest.mark.parametrize("event", PART_EVENTS)
@pytest.mark.parametrize("state", ["ready", "draining"])
def test_part_events_never_break_a_ready_group(transport: HostTransport, importer: Importer,
                                               event: str, state: str) -> None:
    """Every part event on every part of a ready (or draining) group is refused, changing
    nothing (parts[1].fire("close") was accepted before, leaving a ready group with an
    unmapped part)."""
    ex = make_exporter(3, transport, name=f"intact-{event}-{state}")
    group = importer.import_group([ex.descriptor(r) for r in range(3)])
    if state == "draining":
        group.fire("drain")
    for part in group.parts:
        with raises(TransitionError, (TransitionReason.ILLEGAL, TransitionReason.GUARD)):
            part.fire(event)
    assert group.state == state
    assert all(p.state == "imported" and p.mapping is not None for p in group.parts)
    dst = [bytearray(GEOMETRY.block_bytes) for _ in range(3)]
    if state == "ready":
        group.load_prefix([3], dst)
    group.drain(5.0)
    assert group.state == "closed" and all(p.mapping is None for p in group.parts)
