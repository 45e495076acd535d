"""Identities and domain-separated digests. Pure: stdlib and attrs only.

Every digest kvstate computes is BLAKE2b with a personalisation string naming its
purpose, so a value hashed for one purpose can never be confused with another, and the
descriptor MAC is keyed with the deployment's secret, so descriptors from another
deployment fail authentication.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from kvstate.core.args import need_text
from kvstate.core.errors import ConfigInvalid

UUID_BYTES = 16
DEPLOYMENT_KEY_BYTES = 32


class Purpose(enum.Enum):
    """BLAKE2b personalisation per purpose (at most 16 bytes each)."""

    DESCRIPTOR_MAC = b"kvstate/desc-mac"
    GEOMETRY = b"kvstate/geometry"
    DEPLOYMENT = b"kvstate/deploy"
    HOST = b"kvstate/host"
    INVENTORY = b"kvstate/inventry"
    CHANNEL_AUTH = b"kvstate/chanauth"


def hasher(purpose: Purpose, *, key: bytes = b"", size: int = 32) -> hashlib.blake2b:
    """BLAKE2b personalised for ``purpose``, keyed when ``key`` is given, before any data.
    Hashing many short messages under one key, ``copy()`` it for each: a copy costs a
    third of a new keyed hash, which compresses its key block first."""
    return hashlib.blake2b(digest_size=size, key=key, person=purpose.value)


def digest(purpose: Purpose, data: bytes, *, key: bytes = b"", size: int = 32) -> bytes:
    """BLAKE2b of ``data`` personalised for ``purpose``, keyed when ``key`` is given."""
    h = hasher(purpose, key=key, size=size)
    h.update(data)
    return h.digest()


def _exact_bytes(n: int) -> Callable[[Any, attrs.Attribute[bytes], bytes], None]:
    def check(instance: Any, attribute: attrs.Attribute[bytes], value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != n:
            raise ConfigInvalid.of(f"{type(instance).__name__}.{attribute.name}", f"must be exactly {n} bytes")
    return check


def _name(instance: Any, attribute: attrs.Attribute[str], value: str) -> None:
    need_text(f"{type(instance).__name__}.{attribute.name}", value, 256)


@attrs.frozen
class DeviceUUID:
    """A device named by its 16-byte UUID (``cuDeviceGetUuid``), never by ordinal."""

    value: bytes = attrs.field(validator=_exact_bytes(UUID_BYTES))

    def __str__(self) -> str:
        return "GPU-" + str(uuid.UUID(bytes=self.value))


@attrs.frozen
class Incarnation:
    """One life of one worker process: random, so a restart makes old descriptors stale."""

    value: bytes = attrs.field(validator=_exact_bytes(UUID_BYTES))

    @classmethod
    def new(cls) -> Incarnation:
        return cls(os.urandom(UUID_BYTES))

    def __str__(self) -> str:
        return self.value.hex()


class FabricKind(enum.Enum):
    NODE = "node"          # one host: memfd, POSIX-fd VMM, legacy IPC
    NVLINK = "nvlink"      # an NVLink / IMEX clique: FABRIC handles
    NETWORK = "network"    # reachable over the network only: NIXL


@attrs.frozen
class FabricDomain:
    """Where a handle can be opened: one node, one NVLink clique, or the network."""

    kind: FabricKind
    name: str = attrs.field(validator=_name)


@attrs.frozen(repr=False)
class Deployment:
    """A serving deployment: its name and the secret key its descriptors are MAC'd with."""

    name: str = attrs.field(validator=_name)
    key: bytes = attrs.field(validator=_exact_bytes(DEPLOYMENT_KEY_BYTES))

    @property
    def id(self) -> bytes:
        """Public 16-byte id; descriptors carry it as their domain."""
        return _deployment_id(self.name)

    def __repr__(self) -> str:  # never print the key
        return f"Deployment(name={self.name!r}, id={self.id.hex()})"

    @classmethod
    def generate(cls, name: str) -> Deployment:
        return cls(name, os.urandom(DEPLOYMENT_KEY_BYTES))


@functools.lru_cache(maxsize=256)
def _deployment_id(name: str) -> bytes:
    # Asked for by every decode and validation: a keyed hash computed once per name.
    return digest(Purpose.DEPLOYMENT, name.encode(), size=UUID_BYTES)


BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def host_boot_id(path: str = BOOT_ID_PATH) -> bytes:
    """The kernel's boot id as 16 bytes: it changes on every boot of the host."""
    with open(path, encoding="ascii") as f:
        return uuid.UUID(f.read().strip()).bytes


def host_device_uuid(boot_id: bytes) -> DeviceUUID:
    """The device UUID of host memory on this boot of this host."""
    return DeviceUUID(digest(Purpose.HOST, boot_id, size=UUID_BYTES))
