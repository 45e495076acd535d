"""Why a descriptor or group was rejected: one reason code per validation rule."""

from __future__ import annotations

import enum


class RejectReason(enum.Enum):
    OVERSIZE = "oversize"                      # input larger than its cap
    MALFORMED = "malformed"                    # not a well-formed descriptor
    VERSION = "version"                        # wire version this build does not speak
    AUTHENTICATION = "authentication"          # MAC does not verify with the deployment key
    DOMAIN = "domain"                          # names another deployment
    RANK_RANGE = "rank_range"                  # rank outside 0..tp-1
    TP_SIZE = "tp_size"                        # tp outside 1..max_tp, or not the group's tp
    TP_MISMATCH = "tp_mismatch"                # heterogeneous TP: the exporting group's tp is not the importer's
    DUPLICATE_RANK = "duplicate_rank"          # two descriptors for one rank
    MISSING_RANK = "missing_rank"              # a rank of 0..tp-1 has no descriptor
    MIXED_GROUP = "mixed_group"                # parts of different sources
    GEOMETRY = "geometry"                      # fingerprint differs in the group or from expectation
    DTYPE = "dtype"                            # element type differs within the group
    DEVICE_UUID = "device_uuid"                # device not acceptable to this importer
    HOST = "host"                              # same-node handle from another host or boot
    INCARNATION = "incarnation"                # exporter restarted since
    GENERATION = "generation"                  # older than a generation already seen
    EXPIRED = "expired"                        # past its expiry
    HANDLE_KIND = "handle_kind"                # unknown, or not accepted by this importer
    HANDLE_SIZE = "handle_size"                # handle bytes not exact for the kind
    TOTAL_SIZE = "total_size"                  # size does not match geometry and granularity
    SOCKET_PATH = "socket_path"                # not an absolute path to a socket
    SOCKET_SYMLINK = "socket_symlink"          # a component of the path is a symlink
    SOCKET_DIR_OWNER = "socket_dir_owner"      # directory not owned by the expected uid
    SOCKET_DIR_MODE = "socket_dir_mode"        # directory accessible to group or others


class TransferReason(enum.Enum):
    """Why a load or store argument was refused before any submit."""

    BLOCK_IDS = "block_ids"          # not ints, out of range, empty, repeated destination, lengths differ
    REGIONS = "regions"              # tensors missing for a region, or named for no region
    TENSOR = "tensor"                # not a tensor, array, DLPack object or buffer
    DTYPE = "dtype"                  # element type differs from the region's
    SHAPE = "shape"                  # dimensions differ from the region's (block dimension aside)
    STRIDES = "strides"              # negative, overlapping, or too many runs per block
    DEVICE = "device"                # memory this transport cannot reach (CUDA tensors for now)
    READ_ONLY = "read_only"          # a load destination that cannot be written
    RANK = "rank"                    # no such rank in the group, or none named at tp > 1
    STATE = "state"                  # the group, part or bank cannot move data now (closed, not mapped)
    TIMEOUT = "timeout"              # not a finite number of seconds >= 0
    PLAN = "plan"                    # `load`/`store` fired without a plan built by Group.load/Bank.store


class ImportReason(enum.Enum):
    """Why an import failed after its group passed validation (ImportFailed.reason): the
    step that failed, so an engine can tell a refusal from a dead peer without its text."""

    REFUSED = "refused"          # the exporter refused the lease (LeaseRefused; its `code` says why)
    STALE = "stale"              # the decode worker no longer holds the requested blocks (ReuseStale)
    PEER = "peer"                # the exporter is gone, silent or refused the connection (ChannelError)
    MALFORMED = "malformed"      # the exporter's answer is malformed: not a frame, not JSON, not a grant
    HANDLE = "handle"            # a received handle failed its checks: kind, fds, identity, seals, size
    NATIVE = "native"            # a native call failed while opening or mapping (host, CUDA, NIXL)
    INTERRUPTED = "interrupted"  # the group was faulted or closed while it imported
    FAILED = "failed"            # anything else (an untyped fault; the cause is chained)


class ArgumentReason(enum.Enum):
    """Why a public entry point refused an argument before doing anything."""

    TYPE = "type"                # not the type the parameter takes
    RANGE = "range"              # outside the values the parameter takes (or an unknown name)
    LENGTH = "length"            # empty where it may not be, or longer than its bound
    ENCODING = "encoding"        # a NUL, or a lone surrogate, in text an OS interface would take
    STATE = "state"              # the object cannot take the call in its state (released, closed)
