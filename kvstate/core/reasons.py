"""The reason codes of kvstate's errors: one enum per public error class (docs/api.md).

Every :class:`~kvstate.core.errors.KvStateError` carries ``reason``, a member of the enum
its class names here; ``reason.value`` is a stable snake_case string, so callers branch
on data, not on message text. A member no code raises is marked reserved.
"""

from __future__ import annotations

import enum
from typing import NoReturn


class _Reason(enum.Enum):
    """A reason enum: looking up a value it lacks is a typed error, like every public call."""

    @classmethod
    def _missing_(cls, value: object) -> NoReturn:
        from kvstate.core.errors import ArgumentInvalid  # at call time: errors imports this module

        raise ArgumentInvalid.of(cls.__name__, ArgumentReason.RANGE,
                                 f"{value!r:.40} is not one of {', '.join(str(m.value) for m in cls)}")


class RejectReason(_Reason):
    """Why a descriptor or group was rejected: one reason code per validation rule."""

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


class ConfigReason(_Reason):
    """What part of a configuration was refused (ConfigInvalid.reason)."""

    FIELD = "field"                            # a config object's field (``field`` names it)
    GEOMETRY = "geometry"                      # a geometry or region is malformed (``field``)
    UNKNOWN_SETTING = "unknown_setting"        # a reuse setting name kvstate does not know (``name``)
    INVALID_SETTING = "invalid_setting"        # a known setting with a value it may not take (``name``)
    CAPABILITIES_INCOMPLETE = "capabilities_incomplete"  # a capability publication lacks fields (``missing``)
    CAPABILITIES_INVALID = "capabilities_invalid"        # a capability field is malformed (``field``)
    UNKNOWN_PROFILE = "unknown_profile"        # a deployment profile name kvstate does not define
    SPEC = "spec"                              # a transition table is malformed (``source``, ``entry``)
    BINDING = "binding"                        # a class does not match its table's guards and effects
    MODEL = "model"                            # a table means nothing to the Promela generator
    HEAD_SPLIT = "head_split"                  # KV heads no TP split divides (``kvstate.core.heads``)


class ArgumentReason(_Reason):
    """Why a public entry point (or a load or store) refused an argument before doing anything."""

    TYPE = "type"                # not the type the parameter takes
    RANGE = "range"              # outside the values the parameter takes (or an unknown name)
    LENGTH = "length"            # empty where it may not be, or longer than its bound
    ENCODING = "encoding"        # a NUL, or a lone surrogate, in text an OS interface would take
    STATE = "state"              # the object cannot take the call in its state (released, closed, not mapped)
    # loads and stores (``where`` names the argument: ``region 'layer.3'``, ``dst_block_ids[7]``)
    BLOCK_IDS = "block_ids"      # not ints, out of range, empty, repeated destination, lengths differ
    REGIONS = "regions"          # tensors missing for a region, or named for no region
    TENSOR = "tensor"            # not a tensor, array, DLPack object or buffer
    DTYPE = "dtype"              # element type differs from the region's
    SHAPE = "shape"              # dimensions differ from the region's (block dimension aside)
    STRIDES = "strides"          # negative, overlapping, or too many runs per block
    DEVICE = "device"            # memory this transport cannot reach (CUDA tensors for now)
    READ_ONLY = "read_only"      # a load destination that cannot be written
    RANK = "rank"                # no such rank in the group, or none named at tp > 1
    TIMEOUT = "timeout"          # not a finite number of seconds >= 0
    PLAN = "plan"                # `load`/`store` fired without a plan built by Group.load/Bank.store
    # the retained inventory and the reuse policy
    BLOCK_HASH = "block_hash"    # a block hash that is not an unsigned 64-bit integer
    UNKNOWN_LEASE = "unknown_lease"  # releasing a lease the inventory did not grant (or already released)
    NOT_PINNED = "not_pinned"    # unpinning a block that holds no engine pin
    POLICY_INPUT = "policy_input"  # a reuse-policy input (candidate, block count) is malformed
    INVENTORY = "inventory"      # a malformed inventory input: group name, budget, epoch, block request
    # the native layer (``call`` and ``code`` name the C function and its KVS_E_* value)
    NATIVE = "native"            # zero or unaligned size, bad flag, buffer address 0
    UNKNOWN_OBJECT = "unknown_object"  # no allocation, reservation, region or op has that id (any more)
    OUT_OF_RANGE = "out_of_range"  # an offset or length outside its region, buffer or reservation
    OVERLAP = "overlap"          # a mapping would overlap another in the same reservation
    # the engine's decode handoff
    ENGINE_MISSING = "engine_missing"      # no advertised engine matches the engine id
    ENGINE_AMBIGUOUS = "engine_ambiguous"  # several child engines match (``matches``)
    HANDOFF_PARAMS = "handoff_params"      # handoff parameters kvstate cannot fingerprint


class BackendReason(_Reason):
    """Why a backend cannot serve (BackendUnavailable.reason)."""

    MISSING = "missing"          # its optional dependency, driver or device is not there (``backend``)
    UNSUITABLE = "unsuitable"    # it lacks what the caller needs (a mapped transport, host memory)
    NO_DEVICE = "no_device"      # no visible CUDA device has the requested UUID
    FABRIC = "fabric"            # FABRIC handles asked for, but this worker's trial did not pass
    SPIN = "spin"                # the ``spin`` executable or a C compiler for pan is not installed
    UNSUPPORTED = "unsupported"  # the operation has no meaning for this backend (NIXL never maps)


class ImportReason(_Reason):
    """Why an import failed after its group passed validation (ImportFailed.reason): the
    step that failed, so an engine can tell a refusal from a dead peer without its text."""

    REFUSED = "refused"          # the exporter refused the lease (its ``code`` says why)
    STALE = "stale"              # the decode worker no longer holds the requested blocks (old epoch, evicted)
    PEER = "peer"                # the exporter is gone, silent or refused the connection (ChannelError)
    MALFORMED = "malformed"      # the exporter's answer is malformed: not a frame, not JSON, not a grant
    HANDLE = "handle"            # a received handle failed its checks (``defect`` says which)
    NATIVE = "native"            # a native call failed while opening or mapping (host, CUDA, NIXL)
    INTERRUPTED = "interrupted"  # the group was faulted or closed while it imported
    FAILED = "failed"            # anything else (an untyped fault; the cause is chained)


class ImportDefect(_Reason):
    """Which check a received handle failed (ImportFailed.defect, with reason HANDLE or STALE);
    NIXL handle bytes carry :class:`kvstate.transport.nixl.handle.HandleDefect` instead."""

    KIND = "kind"                # a kind this backend does not carry
    SIZE = "size"                # handle bytes of the wrong length for their kind
    FDS = "fds"                  # an fd kind without exactly one fd, or a byte kind with fds
    FD = "fd"                    # the received fd cannot be examined (fstat failed)
    FD_SIZE = "fd_size"          # the received fd's size is not the size announced
    FD_UNSEALED = "fd_unsealed"  # the fd lacks F_SEAL_SHRINK, F_SEAL_GROW or F_SEAL_SEAL
    FD_NOT_MEMFD = "fd_not_memfd"  # the fd is not a memfd
    FD_IDENTITY = "fd_identity"  # the fd's (st_dev, st_ino) differs from its descriptor's
    LEGACY_IPC = "legacy_ipc"    # a legacy cuIpc rule: VMM memory, an open in the exporter, not enabled


class TransferFailReason(_Reason):
    """Which transfer did not complete (TransferFailed.reason); nothing it wrote may be used."""

    LOAD = "load"                # a prefix load (bank to engine)
    STORE = "store"              # a store (engine to bank)
    LEASE_ENDED = "lease_ended"  # refused: the importer's lease on the bank ended or expired


class BusyReason(_Reason):
    """What holds the resource (Busy.reason)."""

    PINNED = "pinned"            # native ops or leases pin the region
    OWNED = "owned"              # a part or a bank owns the mapping: close that instead
    MAPPED = "mapped"            # mappings of the allocation or reservation remain
    BLOCKS = "blocks"            # retained blocks are pinned or under lease (``hashes``)
    VIEWS = "views"              # engine views of a bank's memory are still alive
    STORING = "storing"          # a store is still writing the bank block (one at a time)
    ENGINE = "engine"            # the op engine has ops queued or running
    CONNECTIONS = "connections"  # a server runs its cap of connection handlers (``limit``)


class TimeoutReason(_Reason):
    """What did not finish in time (TimedOut.reason)."""

    OP = "op"                    # a wait on a native op; the op is untouched
    DRAIN = "drain"              # quiescence; nothing was released
    NIXL = "nixl"                # a NIXL transfer; it was released (cancelled)


class ChannelReason(_Reason):
    """How the control channel failed (ChannelError.reason)."""

    CLOSED = "closed"            # EOF from the peer, closed here, or no server listening at the path
    PEER_DIED = "peer_died"      # the peer process exited (its pidfd became readable)
    TIMEOUT = "timeout"          # a blocking step did not complete within its timeout
    REJECTED = "rejected"        # the peer's uid is not allowed (``pid``, ``uid``)
    UNAUTHENTICATED = "unauthenticated"  # a TCP peer did not prove it holds the deployment key
    FRAME = "frame"              # a message broke the framing rules
    PROTOCOL = "protocol"        # a message the coordinator protocol does not allow
    COORDINATOR_REFUSED = "coordinator_refused"  # the coordinator refused a worker's hello (``code``)
    UNSAFE_PATH = "unsafe_path"  # the socket path or its directory is a symlink, foreign-owned or too open
    FAILED = "failed"            # connect, listen, accept or send failed at the OS
    SETUP = "setup"              # a channel was set up with a bad parameter (limits, timeout)


class GroupEvent(_Reason):
    """The coordinator event that ended a coordinated group (GroupFailed.reason)."""

    PART_FAILED = "part_failed"        # a worker reported its part failed
    PART_DRAINING = "part_draining"    # a worker's part started draining (a fault on its side)
    PART_IMPORTED = "part_imported"    # an imported part disagrees with the group
    PART_REJECTED = "part_rejected"    # a worker's validation rejected its part
    WORKER_DIED = "worker_died"        # a worker's connection closed, its process exited, or none came
    TIMEOUT = "timeout"                # the group did not reach ready (or drain) in time
    DRAIN = "drain"                    # reserved: a drain is an ordinary end, not a failure


class NativeReason(_Reason):
    """Which layer failed underneath (NativeError.reason); report it."""

    FAILED = "failed"            # the native layer refused a call (``call``, ``code``)
    OS = "os"                    # a system call failed (``errno``)
    NO_MEMORY = "no_memory"      # the native layer could not allocate its bookkeeping
    OP_FAILED = "op_failed"      # a native op ended in ``failed`` (``op``)
    REGISTRATION = "registration"  # registering a bank failed at ``step``; rolled back
    EFFECT = "effect"            # a guard or effect raised an untyped exception; rolled back (``cause``)
    CUDA = "cuda"                # a CUDA driver call failed with another CUresult (``result``, ``name``)
    CUDA_INVALID = "cuda_invalid"  # the driver refused an argument (INVALID_VALUE, INVALID_HANDLE, ...)
    CUDA_MEMORY = "cuda_memory"  # the device (or the driver's bookkeeping) is out of memory
    CUDA_UNSUPPORTED = "cuda_unsupported"  # the device, driver or system does not support this
    CUDA_NOT_PERMITTED = "cuda_not_permitted"  # the driver forbids this here
    CUDA_CONTEXT = "cuda_context"  # no usable context (not initialised, deinitialised, wrong)
    CUDA_FAULT = "cuda_fault"    # a sticky asynchronous fault: the context is lost
    NIXL = "nixl"                # a NIXL call or transfer failed (``op``)
    MODEL_CHECK = "model_check"  # Spin or the C compiler failed, or pan's output could not be read


class TransitionReason(_Reason):
    """Why a machine refused an event (TransitionError.reason); nothing changed. ILLEGAL
    from a load or store means the group, share or bank is no longer ready (recompute);
    otherwise a kvstate bug, or a race the caller lost."""

    ILLEGAL = "illegal"          # the event is not declared in the machine's current state
    GUARD = "guard"              # declared, but no row's guards admit it (``failed``)
    REENTRANT = "reentrant"      # an effect or guard fired another event on the same machine
    HANDOFF_MODIFIED = "handoff_modified"  # the decode handoff parameters changed during a load


class DecisionReason(_Reason):
    """Why a reuse decision came out as it did, or why a candidate was skipped; a closed
    gate is ReuseRefused.reason."""

    CHOSEN = "chosen"                          # a decision, not a refusal: this candidate was chosen
    REUSE_DISABLED = "reuse_disabled"          # reuse is off (the default): enable_decode_to_prefill_reuse
    GPU_REUSE_DISABLED = "gpu_reuse_disabled"  # a GPU import without enable_gpu_reuse
    GPU_PROFILE_NOT_ADMITTED = "gpu_profile_not_admitted"  # a GPU import without an admitted deployment profile
    NO_LONGER_PREFIX = "no_longer_prefix"      # a decision: the candidate does not extend the prefix
    NO_ELIGIBLE_SOURCE = "no_eligible_source"  # a decision: no candidate passed the rules
    BELOW_MINIMUM_BLOCKS = "below_minimum_blocks"  # a decision: fewer blocks than the minimum
    BELOW_MINIMUM_SAVING = "below_minimum_saving"  # a decision: the estimated saving is below the minimum
