"""Each backend module ends with a ``_conformance`` function that mypy strict checks (``make
test`` runs mypy on kvstate/): host and cuda assign themselves to MappedTransport, NIXL to
the narrower protocols. This shows that check catches a backend whose method drifted from
the protocol, and passes the same code without the drift."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.errors import raises

from kvstate.core.errors import BackendUnavailable
from kvstate.core.reasons import BackendReason
from kvstate.core.capabilities import Access
from support.reuse import REUSE_ON

api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = """
from kvstate.transport.host import HostAllocation, HostHandle, HostMapping, HostReservation, HostTransport
from kvstate.transport.protocol import MappedTransport, RegionStats


class Backend(HostTransport):
    def stats(self, mapping: {param}) -> RegionStats:
        return super().stats(mapping)  # type: ignore[arg-type]


def _conformance(t: Backend) -> None:
    mapped: MappedTransport[HostHandle, HostAllocation, HostReservation, HostMapping, HostMapping] = t
    del mapped
"""


def mypy_errors(code: str, tmp_path: Path) -> list[str]:
    (tmp_path / "mypy.ini").write_text("[mypy]\n", encoding="utf-8")
    out, err, _ = api.run(["--config-file", str(tmp_path / "mypy.ini"), "--strict", "--python-version", "3.11",
                           "--cache-dir", str(tmp_path / "cache"), "--disable-error-code", "override",
                           "--disable-error-code", "unused-ignore", "-c", code])
    assert not err, err
    return [line for line in out.splitlines() if ": error:" in line]


def test_conformance_check_catches_a_drifted_backend(tmp_path: Path) -> None:
    assert mypy_errors(SNIPPET.format(param="HostMapping"), tmp_path) == []
    found = mypy_errors(SNIPPET.format(param="HostReservation"), tmp_path)
    assert len(found) == 1 and "Incompatible types in assignment" in found[0] and "MappedTransport" in found[0], found


def test_lifecycle_sides_refuse_a_backend_that_cannot_map_before_touching_it() -> None:
    """BackendUnavailable (UNSUITABLE), not an AttributeError later: what NIXL gets (the NIXL suite
    shows it on the real library); here with the narrowest registrable backend."""
    from kvstate.core.capabilities import Capabilities, MemoryKind, Scope
    from kvstate.core.handles import HandleKind
    from kvstate.core.identity import Deployment
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.share.importer import ImportConfig, Importer
    from kvstate.transport import Backend, Registry

    class LoadOnly:
        name = "load-only"
        capabilities = Capabilities(handle_kinds=frozenset({HandleKind.NIXL}),
                                    memory_kinds=frozenset({MemoryKind.HOST}), scopes=frozenset({Scope.CROSS_NODE}))

        def granularity(self) -> int:
            return 4096

        def device_uuid(self) -> bytes:
            return bytes(16)

        def set_access(self, mapping: object, access: Access) -> None:
            raise AssertionError("touched")

    t = LoadOnly()
    assert isinstance(t, Backend) and Registry().register(t) is t
    deployment = Deployment("t", bytes(32))
    with raises(BackendUnavailable, BackendReason.UNSUITABLE, match="load-only"):
        Exporter(ExportConfig(deployment, ROOT / "nonexistent", bytes(16), 1), t)  # type: ignore[arg-type]
    with raises(BackendUnavailable, BackendReason.UNSUITABLE, match="load-only"):
        Importer(ImportConfig(deployment, reuse=REUSE_ON), t)  # type: ignore[arg-type]
