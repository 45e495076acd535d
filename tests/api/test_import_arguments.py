"""Importer.import_group refuses what it cannot ask for before anything of the group
exists, and a request too large for its link fails that group alone."""

from __future__ import annotations

from typing import Any

import pytest

from kvstate.core.errors import ArgumentInvalid, KvStateError
from kvstate.share.part import BlockRequest
from surface import World


@pytest.fixture
def world() -> Any:
    w = World()
    yield w
    w.close()


def _wire(w: World) -> list[bytes]:
    return [w.exporter.descriptor(r) for r in range(2)]


@pytest.mark.parametrize("override", [
    {"handle_kinds": frozenset({"memfd"})}, {"handle_kinds": frozenset()}, {"device_uuids": frozenset({1})},
    {"now_ns": "soon"},
], ids=["kind names", "no kinds", "int device ids", "str time"])
def test_a_refused_expectation_override_leaves_no_group_behind(world: World, override: dict[str, Any]) -> None:
    before = list(world.importer.groups)
    for _ in range(3):
        with pytest.raises(ArgumentInvalid):
            world.importer.import_group(_wire(world), **override)
    assert world.importer.groups == before
    group = world.importer.import_group(_wire(world))
    assert group.state == "ready"


def test_a_lease_request_larger_than_its_link_fails_its_group_alone(world: World) -> None:
    """The request is refused before it is sent: the link it would have gone on stays, and
    so does the ready group already on it."""
    hashes = tuple(range(2**63, 2**63 + 3000))  # each rank names them: two ranks take more than a frame
    with pytest.raises(KvStateError, match="more than the 65536 a link"):
        world.importer.import_group(_wire(world), blocks=BlockRequest("big", (0, 0), hashes))
    assert world.group.state == "ready"
    block = world.group.parts[0].descriptor.geometry.block_bytes
    assert world.group.load_prefix([0], [bytearray(block), bytearray(block)]).bytes == 2 * block
