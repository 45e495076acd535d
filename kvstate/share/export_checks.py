"""The checks of :class:`kvstate.share.exporter.ExportConfig`, field by field, run when
one is made: a bad value is ConfigInvalid before any exporter exists."""

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
