"""What a backend can do, as shared vocabulary: the transport layer publishes it and the
reuse layer admits deployment profiles by it, so neither imports the other. Pure data."""

from __future__ import annotations

import enum

import attrs

from kvstate.core.handles import HandleKind


class Access(enum.Enum):
    NONE = "none"
    READ = "read"
    READ_WRITE = "read_write"


class MemoryKind(enum.Enum):
    HOST = "host"
    DEVICE = "device"


class Scope(enum.Enum):
    SAME_NODE = "same_node"
    CROSS_NODE = "cross_node"


@attrs.frozen
class Capabilities:
    """What a backend can do, as published to peers and checked by profile admission."""

    handle_kinds: frozenset[HandleKind]
    memory_kinds: frozenset[MemoryKind]
    scopes: frozenset[Scope]


class FabricTrial(enum.Enum):
    """The outcome of the trial FABRIC export/import a CUDA worker runs at start-up."""

    PASSED = "passed"
    FAILED = "failed"
    NOT_RUN = "not_run"
