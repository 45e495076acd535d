"""The one error hierarchy of kvstate.

Every failure kvstate reports is a subclass of :class:`KvStateError`. A rejection carries
a reason code (an enum member) as well as a message, so callers branch on data, not on
text. Errors are plain classes: they are raised across threads and pickled by nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstate.core.reasons import ImportReason


class KvStateError(Exception):
    """Root of every error kvstate raises."""


# -- specification and machines ------------------------------------------------------


class SpecError(KvStateError):
    """A transition table is malformed. The message names the file and the entry."""

    def __init__(self, source: str, entry: str, problem: str) -> None:
        self.source = source
        self.entry = entry
        self.problem = problem
        super().__init__(f"{source}: {entry}: {problem}")


class BindingError(SpecError):
    """A class implementing a machine does not match its table's guards and effects."""


class TransitionError(KvStateError):
    """Base of the errors a machine raises when an event cannot be applied."""

    def __init__(self, machine: str, state: str, event: str, message: str) -> None:
        self.machine = machine
        self.state = state
        self.event = event
        super().__init__(message)


class IllegalTransition(TransitionError):
    """The event is not declared for the machine's current state. Nothing changed."""

    def __init__(self, machine: str, state: str, event: str) -> None:
        super().__init__(
            machine, state, event,
            f"{machine}: event {event!r} is not declared in state {state!r}",
        )


class GuardRejected(TransitionError):
    """The event is declared for the state, but no row's guards admit it. Nothing changed."""

    def __init__(self, machine: str, state: str, event: str, failed: Sequence[str]) -> None:
        self.failed = tuple(failed)
        super().__init__(
            machine, state, event,
            f"{machine}: event {event!r} in state {state!r} refused by guard(s) "
            + ", ".join(self.failed),
        )


class ReentrantTransition(TransitionError):
    """An effect or guard tried to fire another event on the same machine."""

    def __init__(self, machine: str, state: str, event: str) -> None:
        super().__init__(
            machine, state, event,
            f"{machine}: event {event!r} fired from inside a transition in state {state!r}",
        )


class EffectFailed(KvStateError):
    """A guard or effect raised an untyped exception (``OSError``, ``RuntimeError``,
    ``MemoryError``, a bug). The transition was rolled back like any failing effect: the
    machine is still in ``state`` and the earlier effects' undos ran. ``step`` names the
    guard or effect (the reason); the original exception is ``cause`` (and chained)."""

    def __init__(self, machine: str, state: str, event: str, step: str, cause: BaseException) -> None:
        self.machine = machine
        self.state = state
        self.event = event
        self.step = step
        self.cause = cause
        super().__init__(f"{machine}: {step} of event {event!r} in state {state!r} raised "
                         f"{type(cause).__name__}: {cause}; rolled back")


# -- optional backends ---------------------------------------------------------------


class BackendUnavailable(KvStateError):
    """A transport backend was asked for but its optional dependency or device is missing."""

    def __init__(self, backend: str, why: str) -> None:
        self.backend = backend
        self.why = why
        super().__init__(f"transport backend {backend!r} is unavailable: {why}")


class TransportUnsuitable(KvStateError):
    """A registered backend lacks what the caller needs: the lifecycle sides need a
    ``MappedTransport`` (NIXL is not one: it loads, never maps), and a bank's host view
    needs host-addressable memory."""

    def __init__(self, backend: str, need: str) -> None:
        self.backend = backend
        self.need = need
        super().__init__(f"transport {backend!r} cannot be used here: {need}")


# -- geometry ------------------------------------------------------------------------


class GeometryInvalid(KvStateError, ValueError):
    """A geometry or region is malformed. ``field`` names what is wrong (``regions[2]
    'layer.1'.strides``)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"geometry: {field}: {problem}")


class ConfigInvalid(KvStateError, ValueError):
    """A configuration value is refused where it is made. ``field`` names it."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"{field}: {problem}")


class ArgumentInvalid(KvStateError, ValueError):
    """A public entry point refused an argument before any side effect. ``argument`` names
    it; ``reason`` is a :class:`kvstate.core.reasons.ArgumentReason` (type, range, length,
    encoding, state)."""

    def __init__(self, argument: str, reason: Any, problem: str) -> None:
        self.argument = argument
        self.reason = reason
        self.problem = problem
        super().__init__(f"{argument}: {reason.value}: {problem}")


class BlockOutOfRange(KvStateError, IndexError):
    """A block id outside the geometry's blocks."""


# -- descriptors ---------------------------------------------------------------------


class DescriptorRejected(KvStateError):
    """One descriptor failed a validation rule. ``reason`` is a :class:`kvstate.core.reasons.RejectReason`."""

    def __init__(self, reason: Any, detail: str, rank: int | None = None) -> None:
        self.reason = reason
        self.detail = detail
        self.rank = rank
        where = "" if rank is None else f" (rank {rank})"
        super().__init__(f"descriptor rejected{where}: {reason.value}: {detail}")


class GroupRejected(KvStateError):
    """A group failed validation. Every failing rule is listed; nothing was opened."""

    def __init__(self, problems: Sequence[DescriptorRejected]) -> None:
        self.problems = tuple(problems)
        lines = "; ".join(str(p) for p in self.problems)
        super().__init__(f"group rejected ({len(self.problems)} problem(s)): {lines}")

    @property
    def reasons(self) -> frozenset[Any]:
        return frozenset(p.reason for p in self.problems)


# -- native layer --------------------------------------------------------------------


class NativeError(KvStateError):
    """The native layer refused a call. ``code`` is the C ``KVS_E_*`` value, ``call`` the function."""

    def __init__(self, call: str, code: int, detail: str) -> None:
        self.call = call
        self.code = code
        self.detail = detail
        super().__init__(f"{call}: {detail}")


class NativeInvalidArgument(NativeError):
    """An argument was malformed: zero or unaligned size, bad flag, buffer address 0."""


class NativeOSError(NativeError):
    """A system call inside the native layer failed; ``errno`` says which way."""

    def __init__(self, call: str, code: int, detail: str, errno: int) -> None:
        self.errno = errno
        super().__init__(call, code, detail)


class NativeNoMemory(NativeError):
    """The native layer could not allocate its bookkeeping."""


class UnknownNativeObject(NativeError):
    """No allocation, reservation, region or op has that id (any more)."""


class RegionPinned(NativeError):
    """Unmap, release or a lowering of access was refused: native ops or leases pin the region."""


class StillMapped(NativeError):
    """Release of an allocation, or freeing of a reservation, refused while mappings remain."""


class OutOfRange(NativeError):
    """An offset or length falls outside its region, buffer or reservation."""


class MappingOverlap(NativeError):
    """A mapping would overlap another mapping in the same reservation."""


class ImportRefused(NativeError):
    """A received fd was refused before anything was mapped."""


class FdWrongSize(ImportRefused):
    """The received fd's size (fstat) is not the size the descriptor announced."""


class FdUnsealed(ImportRefused):
    """The received fd lacks F_SEAL_SHRINK, F_SEAL_GROW or F_SEAL_SEAL."""


class FdNotMemfd(ImportRefused):
    """The received fd is not a memfd."""


class FdIdentityMismatch(ImportRefused):
    """The received fd's (st_dev, st_ino) differs from the handle bytes of its descriptor."""


class OpWaitTimeout(NativeError):
    """A wait on a native op ended before the op finished. The op is untouched."""


class OpFailed(NativeError):
    """A native op ended in ``failed``; ``reason`` is the error the worker reported."""

    def __init__(self, call: str, code: int, detail: str, op: int) -> None:
        self.op = op
        super().__init__(call, code, detail)


class EngineBusy(NativeError):
    """The op engine cannot be reconfigured while ops are queued or running."""


# -- control channel -----------------------------------------------------------------


class ChannelError(KvStateError):
    """Base of the control channel's errors."""


class ChannelClosed(ChannelError):
    """The peer closed the connection (EOF), or it was closed here."""


class PeerDied(ChannelClosed):
    """The peer process exited (its pidfd became readable)."""


class ChannelTimeout(ChannelError):
    """A blocking step of the control channel did not complete within its timeout."""


class PeerRejected(ChannelError):
    """The peer's credentials (SO_PEERCRED) are not among the allowed uids."""

    def __init__(self, pid: int, uid: int, allowed: frozenset[int]) -> None:
        self.pid = pid
        self.uid = uid
        self.allowed = allowed
        super().__init__(f"peer pid {pid} uid {uid} is not allowed (allowed uids: {sorted(allowed)})")


class PeerUnauthenticated(ChannelError):
    """A peer across nodes (TCP) did not prove it holds the deployment's key."""


class UnsafeSocketPath(ChannelError):
    """The socket path or its directory is a symlink, foreign-owned or too open."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"unsafe socket path {path!r}: {why}")


class FrameError(ChannelError):
    """A message broke the framing rules: too large, truncated, malformed or too many fds."""


# -- exporter and importer lifecycles ------------------------------------------------


class RegistrationFailed(KvStateError):
    """Registering a bank with its transport failed at ``step``; every earlier step was
    rolled back and the bank keeps its previous owner and state (INV-REGISTER-ATOMIC)."""

    def __init__(self, step: str, cause: BaseException) -> None:
        self.step = step
        super().__init__(f"bank registration failed at {step}: {cause}")


class LeaseRefused(KvStateError):
    """The exporter refused a lease. ``code`` says why (e.g. stale, draining, unknown_rank)."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        super().__init__(f"lease refused ({code}): {detail}")


class ImportFailed(KvStateError):
    """Importing one rank part failed; the whole group was rolled back and is failed.
    ``reason`` is a :class:`kvstate.core.reasons.ImportReason`, from ``cause`` unless given;
    ``cause`` is the failure itself (also chained)."""

    def __init__(self, rank: int, cause: BaseException, reason: ImportReason | None = None) -> None:
        self.rank = rank
        self.cause = cause
        self.reason = import_reason(cause) if reason is None else reason
        #: What failed, in words (a wrapped ImportFailed's own, not its text again).
        self.detail: str = cause.detail if isinstance(cause, ImportFailed) else str(cause)
        super().__init__(f"import of rank {rank} failed ({self.reason.value}): {self.detail}")


class ReuseStale(ImportFailed):
    """The decode worker no longer holds the requested blocks (old epoch, evicted): the
    retained inventory is advisory. Nothing was granted; recompute the prefix."""


class TransferError(KvStateError):
    """Base of the errors of loads (bank to engine) and stores (engine to bank)."""


class TransferRejected(TransferError):
    """A load or store argument was refused before anything was submitted: nothing was
    written and no op is in flight. ``reason`` is a
    :class:`kvstate.core.reasons.TransferReason`; ``where`` names the argument (``region
    'layer.3'``, ``dst_block_ids[7]``)."""

    def __init__(self, reason: Any, where: str, detail: str) -> None:
        self.reason = reason
        self.where = where
        self.detail = detail
        super().__init__(f"{reason.value}: {where}: {detail}")


class LoadFailed(TransferError):
    """A prefix load did not complete; nothing it wrote may be used."""


class StoreFailed(TransferError):
    """A store into a bank did not complete; the bank blocks it targeted hold no valid KV."""


class ViewsOutstanding(KvStateError):
    """Engine views of a bank's memory (from ``Bank.tensors``) are still alive, so the
    memory is not unmapped or released under them."""


class ReuseRefused(KvStateError):
    """The importer refused to import because a reuse gate is closed: reuse is off (the
    default), or a GPU import lacks GPU reuse or an admitted deployment profile. Nothing
    was decoded, connected or opened. ``reason`` is a
    :class:`kvstate.reuse.policy.DecisionReason`."""

    def __init__(self, reason: Any, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"import refused ({reason.value}): {detail}")


class DrainTimeout(KvStateError):
    """Quiescence was not reported within the allowed time; nothing was released."""


# -- the coordinator protocol (rank groups across processes) -------------------------


class ProtocolError(ChannelError):
    """A peer of the coordinator protocol sent a message the protocol does not allow
    (unknown kind or command, a missing or mistyped field)."""


class CoordinatorRefused(ChannelError):
    """The coordinator refused a worker's hello. ``code``: duplicate_rank, rank_range,
    tp_mismatch or version."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        super().__init__(f"coordinator refused the worker ({code}): {detail}")


class GroupFailed(KvStateError):
    """A coordinated group failed before ready, or was drained by a fault after ready.
    ``event`` is the coordinator event that ended it (part_failed, worker_died, timeout,
    part_imported for an incompatible part, part_draining, drain); ``rank`` the rank it
    concerned, if one did. Every worker was told to roll back or drain."""

    def __init__(self, event: str, rank: int | None, detail: str) -> None:
        self.event = event
        self.rank = rank
        self.detail = detail
        where = "" if rank is None else f" (rank {rank})"
        super().__init__(f"coordinated group failed by {event}{where}: {detail}")


# -- policy and profile --------------------------------------------------------------


class SettingsError(KvStateError):
    """A reuse setting could not be loaded. ``source`` says where it came from."""


class UnknownSetting(SettingsError):
    """A setting name that kvstate does not know. Nothing was loaded."""

    def __init__(self, name: str, source: str, known: Sequence[str]) -> None:
        self.name = name
        self.source = source
        super().__init__(f"{source}: unknown setting {name!r}; known: {', '.join(known)}")


class InvalidSetting(SettingsError):
    """A known setting with a value it may not take (wrong type, negative, non-finite)."""

    def __init__(self, name: str, value: object, problem: str, source: str = "value") -> None:
        self.name = name
        self.value = value
        self.problem = problem
        self.source = source
        super().__init__(f"{source}: setting {name!r} = {value!r}: {problem}")


class PolicyInputError(KvStateError):
    """An input to the reuse policy (a candidate, a block count) is malformed."""


class InventoryError(KvStateError):
    """Base of the errors the retained inventory raises. The inventory is unchanged."""


class InvalidBlockHash(InventoryError):
    """A block hash that is not an unsigned 64-bit integer."""


class BlockBusy(InventoryError):
    """Removing or clearing blocks that are pinned or under lease. Nothing was removed."""

    def __init__(self, group: str, hashes: Sequence[int]) -> None:
        self.group = group
        self.hashes = tuple(hashes)
        shown = ", ".join(f"{h:#018x}" for h in self.hashes[:4])
        more = "" if len(self.hashes) <= 4 else f" (+{len(self.hashes) - 4} more)"
        super().__init__(f"group {group!r}: block(s) {shown}{more} are pinned or under lease")


class UnknownLease(InventoryError):
    """Releasing a lease the inventory did not grant, or one already released."""


class NotPinned(InventoryError):
    """Unpinning a block that holds no engine pin."""


class CapabilitiesRejected(KvStateError):
    """A capability publication was refused whole: nothing of it was accepted."""


class CapabilitiesIncomplete(CapabilitiesRejected):
    """A capability publication lacks fields. Every missing field is named."""

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = tuple(missing)
        super().__init__("partial capability set refused; missing: " + ", ".join(self.missing))


class CapabilitiesInvalid(CapabilitiesRejected):
    """A capability publication has a malformed, unknown or inconsistent field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"capability {field!r}: {problem}")


class UnknownProfile(KvStateError):
    """A deployment profile name kvstate does not define."""


class HandoffError(KvStateError):
    """Base of the errors about the engine's decode handoff and its engine ids."""


class ChildEngineMissing(HandoffError):
    """No advertised engine matches the engine id kvstate must load from."""


class ChildEngineAmbiguous(HandoffError):
    """Several advertised child engines match and nothing says which one to use."""

    def __init__(self, engine_id: str, matches: Sequence[str]) -> None:
        self.engine_id = engine_id
        self.matches = tuple(matches)
        super().__init__(f"engine id {engine_id!r} is ambiguous: it matches {', '.join(self.matches)}; "
                         "name the child engine (or its data-parallel rank)")


class HandoffParamsUnsupported(HandoffError):
    """The handoff parameters hold a value kvstate cannot fingerprint to prove it untouched."""


class HandoffParamsModified(HandoffError):
    """The decode handoff parameters changed during a prefix load. This is a kvstate bug."""


# -- cuda backend --------------------------------------------------------------------


class HandleRefused(KvStateError):
    """A received handle does not match its descriptor (kind, size or fds); nothing was opened."""


class HandleWrongSize(HandleRefused):
    """Handle bytes of the wrong length for their kind (FABRIC and CUDA_IPC are exactly 64)."""


class HandleFdsMismatch(HandleRefused):
    """An fd kind arrived without exactly one fd, or a byte kind arrived with fds."""


class CudaError(KvStateError):
    """A CUDA driver call failed. ``result`` is the CUresult value, ``name`` its name."""

    def __init__(self, call: str, result: int, name: str, detail: str = "") -> None:
        self.call = call
        self.result = result
        self.name = name
        super().__init__(f"{call}: {name} ({result}){': ' + detail if detail else ''}")


class CudaInvalidArgument(CudaError):
    """The driver refused an argument (CUDA_ERROR_INVALID_VALUE, INVALID_HANDLE, ...)."""


class CudaOutOfMemory(CudaError):
    """The device (or the driver's bookkeeping) is out of memory."""


class CudaNotSupported(CudaError):
    """The device, driver or system does not support this (handle type, VMM, peer access)."""


class CudaNotPermitted(CudaError):
    """The driver forbids this here (for example opening a legacy IPC handle in its own process)."""


class CudaContextError(CudaError):
    """No usable context: not initialised, deinitialised, or the wrong context."""


class CudaDeviceFault(CudaError):
    """A sticky, asynchronous fault (illegal address, launch failure): the context is lost."""


class CudaDeviceNotFound(KvStateError):
    """No visible CUDA device has the requested UUID (devices are named by UUID, never ordinal)."""


class FabricUnavailable(KvStateError):
    """FABRIC handles were asked for, but this worker's trial export and import did not pass."""


class LegacyIpcRefused(KvStateError):
    """A legacy cuIpc constraint was violated: VMM (not cuMemAlloc) memory, an open in the
    exporting process itself, or legacy IPC not requested when the transport was built."""


# -- nixl ----------------------------------------------------------------------------


class NixlError(KvStateError):
    """Base of the errors of the NIXL transport (kvstate.transport.nixl.transport)."""


class NixlHandleRejected(NixlError):
    """NIXL handle bytes failed a rule; ``reason`` is a :class:`kvstate.transport.nixl.handle.HandleDefect`.

    Raised before anything is handed to NIXL: the bytes are malformed, oversize, of an
    unknown version, or do not match the descriptor that carries them.
    """

    def __init__(self, reason: Any, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"nixl handle rejected: {reason.value}: {detail}")


class NixlStaleGeneration(NixlHandleRejected):
    """The handle (or the remote view) belongs to an older generation of the bank."""


class NixlOperationFailed(NixlError):
    """A NIXL call or transfer failed. ``op`` names the step; the NIXL error is chained."""

    def __init__(self, op: str, detail: str) -> None:
        self.op = op
        self.detail = detail
        super().__init__(f"nixl {op} failed: {detail}")


class NixlTimeout(NixlOperationFailed):
    """A transfer did not complete within its timeout; it was released (cancelled)."""


class NixlUnsupported(NixlError):
    """The operation has no meaning for NIXL (imports are read, never mapped)."""


class LeaseEnded(KvStateError):
    """A load was refused because the importer's lease on the bank has ended or expired.

    NIXL deregistration does not revoke a peer's access, so this gate, not NIXL, is
    what keeps a peer off memory the owner may already be reusing.
    """

    def __init__(self, bank: str, why: str) -> None:
        self.bank = bank
        self.why = why
        super().__init__(f"lease on {bank} has ended ({why}); the load was not started")


# -- model checking (kvstate.derive.promela, kvstate.harness.modelcheck) -----------------------------


class ModelGenerationError(SpecError):
    """A table names a guard, effect or event that the Promela generator has no meaning for."""


class ModelCheckError(KvStateError):
    """Spin or the C compiler failed, or pan's output could not be read. Nothing was verified."""


class SpinUnavailable(ModelCheckError):
    """The ``spin`` executable (or a C compiler for pan) is not installed."""


# -- hardening -----------------------------------------------------------------------


class ConnectionLimit(ChannelError):
    """A server already runs its cap of concurrent connection handlers; the new
    connection was refused (closed) instead of spawning another thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"connection refused: {limit} connection handler(s) already running")


def import_reason(cause: BaseException) -> ImportReason:
    """The :class:`~kvstate.core.reasons.ImportReason` of a failure while importing."""
    if isinstance(cause, EffectFailed):  # an untyped fault of a step: what it was
        cause = cause.cause
    if isinstance(cause, ImportFailed):  # a step that knew its reason
        return cause.reason
    if isinstance(cause, LeaseRefused):
        return ImportReason.STALE if cause.code == "stale_inventory" else ImportReason.REFUSED
    if isinstance(cause, (HandleRefused, ImportRefused, NixlHandleRejected, LegacyIpcRefused)):
        return ImportReason.HANDLE
    if isinstance(cause, (FrameError, ProtocolError)):
        return ImportReason.MALFORMED
    if isinstance(cause, ChannelError):
        return ImportReason.PEER
    if isinstance(cause, (NativeError, CudaError, NixlError, OSError)):
        return ImportReason.NATIVE
    if isinstance(cause, IllegalTransition):  # a fault moved the group on meanwhile
        return ImportReason.INTERRUPTED
    return ImportReason.FAILED
