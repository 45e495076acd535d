"""The exporter's configuration (:class:`ExportConfig`), checked field by field when it is
made: a bad value is ConfigInvalid before any exporter exists."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from kvstate import channel as chan
from kvstate.core.args import INT32_MAX, need_int, need_socket_dir, need_text, typed
from kvstate.core.errors import ConfigInvalid, KvStateError
from kvstate.core.handles import FD_KINDS, HandleKind
from kvstate.core.identity import Deployment
from kvstate.core.paths import MAX_SOCKET_PATH
from kvstate.core.validate import MAX_TP

_SOURCE_ID_BYTES = 16


def source_id(_: object, attribute: attrs.Attribute[bytes], value: object) -> None:
    if not isinstance(value, bytes) or len(value) != _SOURCE_ID_BYTES:
        raise ConfigInvalid.of("ExportConfig.source_id", f"must be exactly {_SOURCE_ID_BYTES} bytes (it is signed into "
                               f"every descriptor and importers refuse any other length), not {value!r:.40}")


def int_in(most: int) -> Any:
    """An int in 1..most (not a bool, nor an IntEnum or other int subclass: other configs
    refuse those too), refused as ConfigInvalid naming the field."""
    def check(_: object, attribute: attrs.Attribute[int], value: object) -> None:
        try:
            need_int(f"ExportConfig.{attribute.name}", value, 1, most)
        except KvStateError as exc:
            raise ConfigInvalid.of(f"ExportConfig.{attribute.name}", f"must be an int in 1..{most}: "
                                   f"{exc.detail}") from None
    return check


def seconds(_: object, attribute: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e9 or value != value:
        raise ConfigInvalid.of(f"ExportConfig.{attribute.name}", f"must be a finite number of seconds > 0, "
                               f"not {value!r:.40}")


#: Room left in ``sun_path`` beyond the socket directory, for the socket file an exporter
#: names by default, ``/exporter-<pid>-<8 hex>.sock`` (a pid has at most 7 digits:
#: PID_MAX_LIMIT is 2**22): a directory that passes here is never refused by start() for
#: its shape or length. A name of the caller's own must fit what is left (socket_path).
SOCKET_NAME_ROOM = len("/exporter-4194304-01234567.sock")


def socket_dir(_: object, attribute: attrs.Attribute[Path], value: object) -> None:
    try:
        need_socket_dir("ExportConfig.socket_dir", value, room=SOCKET_NAME_ROOM)
    except KvStateError as exc:
        raise ConfigInvalid.of("ExportConfig.socket_dir", exc.detail) from None


def socket_path(config: ExportConfig, name: object) -> Path:
    """The control socket ``<socket_dir>/<name>.sock`` of an exporter named ``name``,
    refused as ConfigInvalid (``name``) unless the channel can bind it and importers can
    take a descriptor naming it: a file name (no '/', '.' or '..'), text every OS interface
    takes (need_text), and a whole path that fits ``sun_path``."""
    try:
        text = need_text("name", name, MAX_SOCKET_PATH)
    except KvStateError as exc:
        raise ConfigInvalid.of("name", f"must be a file name: {exc.detail}") from None
    if "/" in text or text in (".", ".."):
        raise ConfigInvalid.of("name", f"must be a file name (no '/', not '.' or '..'), not {text!r:.40}")
    # Longer, start() could not bind the socket and importers would refuse descriptors naming it.
    most = MAX_SOCKET_PATH - len(os.fsencode(Path(config.socket_dir) / ".sock"))
    if len(text.encode()) > most:
        raise ConfigInvalid.of("name", f"is {len(text.encode())} bytes: in {config.socket_dir} the socket path "
                               f"must fit {MAX_SOCKET_PATH} bytes (sun_path), so at most {most}")
    return Path(config.socket_dir) / f"{text}.sock"


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
    tp: int = attrs.field(validator=int_in(MAX_TP))  # descriptors sign it; importers take at most MAX_TP
    lease_timeout_s: float = attrs.field(default=30.0, validator=seconds)
    descriptor_ttl_s: float = attrs.field(default=300.0, validator=seconds)
    # The native lease server takes these two as C int32 (ffi/kvs_lease.c).
    max_leases: int = attrs.field(default=64, validator=int_in(INT32_MAX))  # per bank
    max_connections: int = attrs.field(default=chan.DEFAULT_MAX_CONNECTIONS, validator=int_in(INT32_MAX))
    request_timeout_s: float = attrs.field(default=5.0, validator=seconds)
    handle_kind: HandleKind = attrs.field(default=HandleKind.MEMFD,  # what the banks are exported as
                                          validator=typed(HandleKind))
    #: Also serve leases over TCP, for banks read from other nodes (NIXL): (host, port), the
    #: address every descriptor names; port 0 takes a free one.
    tcp_listen: tuple[str, int] | None = attrs.field(default=None, validator=tcp_listen)
