"""Issue 14, class 1: only KvStateError leaves the public API, whatever the arguments and
whatever the state; nothing leaks; a valid call afterwards still works.

Each example builds a world (a real exporter, importer and ready group on the host
transport), makes up to eight calls of public methods drawn from the whole surface
(:mod:`surface`) with arbitrary arguments (None, NUL and lone surrogates in strings,
negative and huge ints, NaN, bytes, wrong types), so later calls meet the states earlier
ones left. Any exception that is not a KvStateError fails the test; so does one whose
message is empty (errors carry a reason). Then a valid import and load must still
work, and teardown must leave no lease, mapping, fd, thread or native object.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.core.errors import KvStateError
from kvstate.harness import leaks
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostAllocation, HostMapping, HostReservation, HostTransport
from surface import GEOMETRY, SKIP, World, call_with, targets

ESCAPES: list[str] = []


@settings(max_examples=int(os.environ.get("KVSTATE_API_FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_only_typed_errors_escape_and_nothing_leaks(data: st.DataObject) -> None:
    before = leaks.snapshot()
    w = World()
    try:
        call_some([(n, fn) for n, fn in targets(w) if n not in SKIP], data, w.transport)
        still_works(w)
    finally:
        w.close()
    found = leaks.settled_leaks(before, grace_s=3.0)
    assert not found, f"leaked: {found}"


def call_some(surface: list[tuple[str, Callable[..., Any]]], data: st.DataObject,
              transport: HostTransport | None = None) -> None:
    """Up to eight calls drawn from ``surface`` with arbitrary arguments: each returns or
    raises a KvStateError with a reason; anything else fails the test."""
    for _ in range(data.draw(st.integers(1, 8))):
        name, fn = data.draw(st.sampled_from(surface), label="target")
        args, kwargs = call_with(fn, data.draw)
        try:
            result = fn(*args, **kwargs)
        except KvStateError as exc:
            assert str(exc), f"{name}: a KvStateError without a reason"
            continue
        except Exception as exc:  # the defect this test exists to find
            raise AssertionError(f"{name}(*{args!r:.200}, **{kwargs!r:.200}) raised untyped "
                                 f"{type(exc).__name__}: {exc}") from exc
        release(name, result, transport)
        del result  # a caller drops what it does not keep (bank views would pin the bank)


def release(name: str, result: object, transport: HostTransport | None) -> None:
    """Objects a call hands back that own resources are closed by the test, as a caller would.
    What the transport itself creates (allocations, reservations, mappings) are plain
    handles its caller owns, so the test gives them back; the same kinds handed out by a
    part or bank stay theirs."""
    if transport is not None and name.startswith("HostTransport."):
        giveback: dict[type, Callable[[Any], None]] = {
            HostAllocation: transport.release, HostReservation: transport.free, HostMapping: transport.unmap}
        if type(result) in giveback:
            try:
                giveback[type(result)](result)
            except KvStateError:
                pass
            return
    for attr in ("close", "stop"):
        fn = getattr(result, attr, None)
        if callable(fn) and type(result).__module__.startswith(("kvstate.channel", "kvstate.share.transfer")):
            try:
                fn()
            except KvStateError:
                pass


def still_works(w: World) -> None:
    """A valid import and load, through the same importer when it is still open."""
    fresh = w.make_exporter(w.dir / "again")
    importer = w.importer if not w.importer._stopping.is_set() else \
        Importer(ImportConfig(w.importer.config.deployment, reuse=w.importer.config.reuse), w.transport)
    try:
        group = importer.import_group([fresh.descriptor(r) for r in range(2)])
        dst = [bytearray(2 * GEOMETRY.block_bytes) for _ in range(2)]
        group.load_prefix([1, 3], dst)
        assert [bytes(b) for b in dst] == [bytes([r + 1]) * len(dst[r]) for r in range(2)]
        group.drain(5.0)
    finally:
        if importer is not w.importer:
            importer.close()
        fresh.stop()
        fresh.drain(5.0)
