"""ExportConfig and ImportConfig refuse, where they are made, values the exporter or every
import would refuse later: ints the native layer cannot hold, a tp importers refuse,
socket directories the channel cannot bind in, fingerprints and device ids that match no
descriptor, parking without the native renewal that parked leases need."""

from __future__ import annotations

import enum
import os
from pathlib import Path

import pytest

from support.errors import raises

from kvstate.core.errors import ConfigInvalid
from kvstate.core.identity import Deployment
from kvstate.core.paths import MAX_SOCKET_PATH
from kvstate.core.reasons import ConfigReason
from kvstate.core.validate import MAX_TP
from kvstate.core.args import INT32_MAX
from kvstate.share.export_config import SOCKET_NAME_ROOM, ExportConfig
from kvstate.share.import_config import ImportConfig

DEPLOYMENT = Deployment("configs", bytes(range(32)))
SOURCE = b"\x02" * 16


class One(enum.IntEnum):
    ONE = 1


def export_config(**kw: object) -> ExportConfig:
    base: dict[str, object] = {"deployment": DEPLOYMENT, "socket_dir": Path("/tmp/kvs-cfg"), "source_id": SOURCE,
                               "tp": 1}
    return ExportConfig(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("field, most", [("tp", MAX_TP), ("max_leases", INT32_MAX), ("max_connections", INT32_MAX)])
def test_export_config_refuses_ints_the_native_layer_or_importers_refuse(field: str, most: int) -> None:
    """tp: descriptors past MAX_TP are refused by every importer; max_leases and
    max_connections: the native lease server takes C int32s (a bare OverflowError at
    Exporter() past them). An IntEnum is refused as other configs refuse it."""
    assert getattr(export_config(**{field: most}), field) == most
    for value in (most + 1, 2**70, One.ONE):
        with raises(ConfigInvalid, ConfigReason.FIELD) as info:
            export_config(**{field: value})
        assert info.value.field == f"ExportConfig.{field}"


def _dir_of(size: int) -> str:
    return "/tmp/" + "d" * (size - len("/tmp/"))


@pytest.mark.parametrize("socket_dir", ["relative/dir", "sock", "/tmp/a/../b", _dir_of(200)])
def test_export_config_refuses_a_socket_dir_start_would_refuse(socket_dir: str) -> None:
    """Relative, not normalised, or too long for a socket in it to fit sun_path: it passed
    construction and failed at start(), after banks were registered."""
    with raises(ConfigInvalid, ConfigReason.FIELD) as info:
        export_config(socket_dir=socket_dir)
    assert info.value.field == "ExportConfig.socket_dir"


def test_the_longest_socket_dir_leaves_room_for_the_default_socket_name() -> None:
    longest = _dir_of(MAX_SOCKET_PATH - SOCKET_NAME_ROOM)
    assert export_config(socket_dir=longest).socket_dir == longest
    default = f"{longest}/exporter-4194304-{os.urandom(4).hex()}.sock"  # pid <= PID_MAX_LIMIT (2**22)
    assert len(default.encode()) == MAX_SOCKET_PATH
    with raises(ConfigInvalid, ConfigReason.FIELD, match="socket_dir"):
        export_config(socket_dir=longest + "d")


@pytest.mark.parametrize("field, good, bad", [
    ("device_uuids", frozenset({b"u" * 16, b"v" * 16}), frozenset()),
    ("device_uuids", frozenset({b"u" * 16}), frozenset({1, 2})),
    ("device_uuids", frozenset({b"u" * 16}), frozenset({b"u" * 15})),
    ("geometry_fingerprint", b"g" * 16, b"abc"), ("geometry_fingerprint", b"g" * 16, b"g" * 32),
    ("block_format", b"f" * 16, b""), ("block_format", b"f" * 16, b"f" * 17),
])
def test_import_config_refuses_values_no_descriptor_matches(field: str, good: object, bad: object) -> None:
    """Each bad value was accepted, and every import then refused descriptor by descriptor
    (a descriptor's device uuid and fingerprints are 16 bytes)."""
    assert getattr(ImportConfig(DEPLOYMENT, **{field: good}), field) == good  # type: ignore[arg-type]
    with raises(ConfigInvalid, ConfigReason.FIELD) as info:
        ImportConfig(DEPLOYMENT, **{field: bad})  # type: ignore[arg-type]
    assert info.value.field == f"ImportConfig.{field}"


def test_parking_needs_the_native_renewal() -> None:
    """A parked lease is renewed only by the native renewal thread: without it park_s was
    accepted and parking silently off."""
    with raises(ConfigInvalid, ConfigReason.FIELD, match="native_renewal") as info:
        ImportConfig(DEPLOYMENT, park_s=30.0, native_renewal=False)
    assert info.value.field == "ImportConfig.park_s"
    assert ImportConfig(DEPLOYMENT, park_s=0.0, native_renewal=False).park_s == 0.0
    assert ImportConfig(DEPLOYMENT, park_s=30.0).park_s == 30.0
