"""The importer's configuration (:class:`ImportConfig`), checked when it is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvstate.core.args import need_kinds, typed
from kvstate.core.errors import ConfigInvalid, KvStateError
from kvstate.core.identity import UUID_BYTES, Deployment
from kvstate.core.rules import ID_BYTES
from kvstate.core.validate import MAX_TP
from kvstate.reuse.policy import ReuseSettings
from kvstate.reuse.profile import Admitted


def _seconds(_: object, attribute: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e9 or value != value:
        raise ConfigInvalid.of(f"ImportConfig.{attribute.name}", f"must be a finite number of seconds > 0, "
                               f"not {value!r:.40}")


def _seconds_or_off(_: object, attribute: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e9 or value != value:
        raise ConfigInvalid.of(f"ImportConfig.{attribute.name}", f"must be a finite number of seconds >= 0 "
                               f"(0: off), not {value!r:.40}")


def _seconds_at_most(most: float) -> Callable[[object, attrs.Attribute[float], object], None]:
    def check(_: object, attribute: attrs.Attribute[float], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= most:
            raise ConfigInvalid.of(f"ImportConfig.{attribute.name}", f"must be a number of seconds in 0..{most} "
                                   f"(0: off), not {value!r:.40}")
    return check


def _count(most: int) -> Callable[[object, attrs.Attribute[int], object], None]:
    def check(_: object, attribute: attrs.Attribute[int], value: object) -> None:
        if type(value) is not int or not 1 <= value <= most:
            raise ConfigInvalid.of(f"ImportConfig.{attribute.name}", f"must be an int in 1..{most}, not {value!r:.40}")
    return check


def _optional(kind: type) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None and not isinstance(value, kind):
            raise ConfigInvalid.of(f"ImportConfig.{attribute.name}", f"must be {kind.__name__} or None, "
                                   f"not {type(value).__name__}")
    return check


def _fingerprint(_: object, attribute: attrs.Attribute[bytes | None], value: object) -> None:
    # A geometry or block-format fingerprint is 16 bytes (kvstate.core.geometry): any other
    # length matches no descriptor, and every import would be refused.
    if value is not None and (type(value) is not bytes or len(value) != ID_BYTES):
        raise ConfigInvalid.of(f"ImportConfig.{attribute.name}", f"must be {ID_BYTES} bytes (a geometry's "
                               f"fingerprint) or None, not {value!r:.40}")


def _device_uuids(_: object, attribute: attrs.Attribute[frozenset[bytes] | None], value: object) -> None:
    if value is None:
        return
    try:  # the check WorkerConfig and Expectation make
        uuids = need_kinds("ImportConfig.device_uuids", value, bytes)
    except KvStateError as exc:
        raise ConfigInvalid.of("ImportConfig.device_uuids", exc.detail) from None
    if any(len(u) != UUID_BYTES for u in uuids):  # a descriptor's device_uuid is 16 bytes: no other matches
        raise ConfigInvalid.of("ImportConfig.device_uuids", f"every uuid must be {UUID_BYTES} bytes, "
                               f"not {value!r:.80}")


def _park(config: Any, attribute: attrs.Attribute[float], value: object) -> None:
    _seconds_or_off(config, attribute, value)
    if value and not config.native_renewal:  # a parked lease is renewed only by the native thread
        raise ConfigInvalid.of("ImportConfig.park_s", f"{value!r:.40} needs native_renewal (parking is off "
                               "without it): set native_renewal=True or park_s=0")


#: The default ``ImportConfig.answer_spin_s`` (B1's floor waits the same way).
ANSWER_SPIN_S = 250e-6


@attrs.frozen
class ImportConfig:
    deployment: Deployment = attrs.field(validator=typed(Deployment))
    request_timeout_s: float = attrs.field(default=5.0, validator=_seconds)
    max_tp: int = attrs.field(default=64, validator=_count(MAX_TP))
    max_parallel_imports: int = attrs.field(default=8, validator=_count(256))  # kept: parts open without threads now
    #: A channel to an exporter that no lease uses closes after this (kvstate.share.peers).
    link_idle_s: float = attrs.field(default=2.0, validator=_seconds)
    geometry_fingerprint: bytes | None = attrs.field(default=None, validator=_fingerprint)  # of the banks
    block_format: bytes | None = attrs.field(default=None, validator=_fingerprint)  # the engine's pages hold
    device_uuids: frozenset[bytes] | None = attrs.field(default=None, validator=_device_uuids)
    #: Leases are renewed every min(half the lease, this) seconds while leased or mapped,
    #: so a bank that drains (and refuses renewal) gets its mappings back within this.
    renew_interval_s: float = attrs.field(default=1.0, validator=_seconds)
    #: Leases on persistent links are renewed by a native thread that never waits for the
    #: GIL (kvstate.share.renewal); off, Python's expiry thread renews them (and a process
    #: holding its GIL past a lease's term loses the lease).
    native_renewal: bool = attrs.field(default=True, validator=typed(bool))
    #: A closed part whose import pinned no blocks leaves its lease and mapping on its link
    #: for this long, for the next import of the same bank to adopt without a round trip
    #: (kvstate.share.parked); 0: off. Needs native_renewal.
    park_s: float = attrs.field(default=0.0, validator=_park)
    #: A wait for an answer from an exporter on this node (a lease, a release) polls this
    #: long before its thread sleeps, and sleeps at once when another thread wants its
    #: CPU (ffi/kvs_link.c). The answer usually comes within it, and a sleeping CPU's
    #: wake-up costs about 40 us on a virtual machine, as much as the exporter's answer
    #: itself (B1); 0: sleep at once.
    answer_spin_s: float = attrs.field(default=ANSWER_SPIN_S, validator=_seconds_at_most(0.01))
    #: The reuse switches, enforced by import_group (kvstate.reuse.gates): off by default.
    reuse: ReuseSettings = attrs.field(default=ReuseSettings(), validator=typed(ReuseSettings))
    #: The deployment profile admission (kvstate.reuse.profile.admit); GPU imports need one.
    admission: Admitted | None = attrs.field(default=None, validator=_optional(Admitted))

