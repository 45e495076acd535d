"""The exporter's configuration (:class:`ExportConfig`), checked field by field when it is
made: a bad value is ConfigInvalid before any exporter exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from kvstate import channel as chan
from kvstate.core.args import need_path, typed
from kvstate.core.errors import ConfigInvalid, KvStateError
from kvstate.core.handles import FD_KINDS, HandleKind
from kvstate.core.identity import Deployment

_SOURCE_ID_BYTES = 16


def source_id(_: object, attribute: attrs.Attribute[bytes], value: object) -> None:
    if not isinstance(value, bytes) or len(value) != _SOURCE_ID_BYTES:
        raise ConfigInvalid.of("ExportConfig.source_id", f"must be exactly {_SOURCE_ID_BYTES} bytes (it is signed into "
                               f"every descriptor and importers refuse any other length), not {value!r:.40}")


def positive_int(_: object, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigInvalid.of(f"ExportConfig.{attribute.name}", f"must be an int >= 1, not {value!r:.40}")

def seconds(_: object, attribute: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e9 or value != value:
        raise ConfigInvalid.of(f"ExportConfig.{attribute.name}", f"must be a finite number of seconds > 0, "
                               f"not {value!r:.40}")


def socket_dir(_: object, attribute: attrs.Attribute[Path], value: object) -> None:
    try:
        need_path("ExportConfig.socket_dir", value)
    except KvStateError as exc:
        raise ConfigInvalid.of("ExportConfig.socket_dir", str(exc)) from None


#: Hosts that bind every interface: a descriptor that named one would send importers on
#: other nodes to their own host.
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def tcp_listen(config: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    where = "ExportConfig.tcp_listen"
    if not isinstance(value, tuple) or len(value) != 2:
        raise ConfigInvalid.of(where, f"must be a (host, port) tuple, not {value!r:.60}")
    host, port = value
    if not isinstance(host, str) or not host.isascii() or not host.isprintable() or len(host) > 253:
        raise ConfigInvalid.of(where, f"host must be a printable ASCII name or address, not {host!r:.60}")
    if host in _WILDCARDS:
        raise ConfigInvalid.of(where, f"host {host!r} binds every interface, and descriptors name it: "
                               "give the address other nodes reach this one at")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigInvalid.of(where, f"port must be an int in 0..65535 (0: any free one), not {port!r:.40}")
    if config.handle_kind in FD_KINDS:  # fds travel over AF_UNIX only: such a lease could never be answered
        raise ConfigInvalid.of(where, f"{config.handle_kind.value} handles are file descriptors and cannot cross "
                               "nodes: serve them on the unix socket (no tcp_listen), or export NIXL handles")


@attrs.frozen
class ExportConfig:
    deployment: Deployment = attrs.field(validator=typed(Deployment))
    socket_dir: Path = attrs.field(validator=socket_dir)
    source_id: bytes = attrs.field(validator=source_id)  # the logical KV source: 16 bytes
    tp: int = attrs.field(validator=positive_int)
    lease_timeout_s: float = attrs.field(default=30.0, validator=seconds)
    descriptor_ttl_s: float = attrs.field(default=300.0, validator=seconds)
    max_leases: int = attrs.field(default=64, validator=positive_int)  # per bank
    max_connections: int = attrs.field(default=chan.DEFAULT_MAX_CONNECTIONS, validator=positive_int)
    request_timeout_s: float = attrs.field(default=5.0, validator=seconds)
    handle_kind: HandleKind = attrs.field(default=HandleKind.MEMFD,  # what the banks are exported as
                                          validator=typed(HandleKind))
    #: Also serve leases over TCP, for banks read from other nodes (NIXL): (host, port), the
    #: address every descriptor names; port 0 takes a free one.
    tcp_listen: tuple[str, int] | None = attrs.field(default=None, validator=tcp_listen)
