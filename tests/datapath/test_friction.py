"""Friction found wiring kvstate into an engine: each one fixed where it bites."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstate.core.errors import ChannelError, ConfigInvalid, KvStateError
from kvstate.core.paths import MAX_SOCKET_PATH
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.transport.host import HostTransport
from datapath.conftest import DEPLOYMENT, GRANULARITY, socket_dir


@pytest.mark.parametrize("source", [b"", b"x" * 15, b"x" * 17, "0" * 16, None, bytearray(16)])
def test_source_id_must_be_16_bytes_where_it_is_configured(source: object) -> None:
    with pytest.raises(ConfigInvalid) as info:
        ExportConfig(DEPLOYMENT, Path("/tmp"), source, 1)  # type: ignore[arg-type]
    assert info.value.field == "ExportConfig.source_id" and "exactly 16 bytes" in str(info.value)


@pytest.mark.parametrize("tp", [0, -1, True, 1.0, "2"])
def test_tp_is_checked_where_it_is_configured(tp: object) -> None:
    with pytest.raises(ConfigInvalid):
        ExportConfig(DEPLOYMENT, Path("/tmp"), os.urandom(16), tp)  # type: ignore[arg-type]


def test_exporters_share_a_socket_directory_without_naming_themselves() -> None:
    d = socket_dir()
    exporters = [Exporter(ExportConfig(DEPLOYMENT, d, os.urandom(16), 1), HostTransport(granularity=GRANULARITY))
                 for _ in range(3)]
    try:
        for ex in exporters:
            ex.start()
        assert len({ex.socket_path for ex in exporters}) == 3
        assert all(ex.socket_path.parent == d and ex.socket_path.exists() for ex in exporters)
    finally:
        for ex in exporters:
            ex.stop()


def test_a_name_another_live_exporter_serves_is_refused_clearly() -> None:
    d = socket_dir()
    a = Exporter(ExportConfig(DEPLOYMENT, d, os.urandom(16), 1), HostTransport(granularity=GRANULARITY), name="decode")
    b = Exporter(ExportConfig(DEPLOYMENT, d, os.urandom(16), 1), HostTransport(granularity=GRANULARITY), name="decode")
    a.start()
    try:
        with pytest.raises(ChannelError, match="another server is listening there"):
            b.start()
    finally:
        b.stop()
        a.stop()


@pytest.mark.parametrize("name", ["", "a/b", "x\0y", ".", 7])
def test_bad_exporter_names_are_refused(name: object) -> None:
    with pytest.raises(KvStateError):
        Exporter(ExportConfig(DEPLOYMENT, socket_dir(), os.urandom(16), 1), HostTransport(granularity=GRANULARITY),
                 name=name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["n" * 300, "a\ud800"])
def test_a_name_no_socket_or_descriptor_can_hold_is_refused_when_the_exporter_is_made(name: str) -> None:
    """Too long for sun_path, or a lone surrogate: the exporter was made and its banks
    registered, then advertise() signed a descriptor importers refuse or raised, and start()
    could not bind."""
    with pytest.raises(ConfigInvalid) as info:
        Exporter(ExportConfig(DEPLOYMENT, socket_dir(), os.urandom(16), 1), HostTransport(granularity=GRANULARITY),
                 name=name)
    assert info.value.field == "name"


def test_the_longest_name_that_fits_its_socket_dir_is_served() -> None:
    config = ExportConfig(DEPLOYMENT, socket_dir(), os.urandom(16), 1)
    most = MAX_SOCKET_PATH - len(os.fsencode(f"{config.socket_dir}/.sock"))
    with pytest.raises(ConfigInvalid, match=f"at most {most}"):
        Exporter(config, HostTransport(granularity=GRANULARITY), name="n" * (most + 1))
    ex = Exporter(config, HostTransport(granularity=GRANULARITY), name="n" * most)
    ex.start()
    try:
        assert len(os.fsencode(ex.socket_path)) == MAX_SOCKET_PATH and ex.socket_path.exists()
    finally:
        ex.stop()
