"""The one error hierarchy of kvstate: a few classes, grouped by what the caller does.

Every failure kvstate reports is a :class:`KvStateError`. Its class says what to do
(fix the configuration, fix the call, recompute, wait, drop the link, report it); its
``reason``, a member of the class's enum in :mod:`kvstate.core.reasons`, says what
happened, and ``detail`` says it in words. Named constructors (``ConfigInvalid.geometry``
and the like) build the messages that need more than one field, so each message has
one home. docs/api.md tables every class and reason.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvstate.core.reasons import (
    ArgumentReason, BackendReason, BusyReason, ChannelReason, ConfigReason, DecisionReason,
    GroupEvent, ImportReason, NativeReason, RejectReason, TimeoutReason,
    TransferFailReason, TransitionReason,
)


class KvStateError(Exception):
    """Root of every error kvstate raises: catch it to catch them all. ``reason`` is an
    enum member (its ``.value`` a stable string), ``detail`` what happened in words."""

    reason: enum.Enum
    detail: str

    def __init__(self, reason: enum.Enum, detail: str, message: str | None = None) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(detail if message is None else message)


# -- fix it: the configuration or the call ---------------------------------------------


class ConfigInvalid(KvStateError, ValueError):
    """Fix the configuration: a config value, geometry, setting, capability set, profile
    or transition table is refused where it is made. Nothing was loaded."""

    reason: ConfigReason

    def __init__(self, reason: ConfigReason, detail: str, *, field: str | None = None,
                 name: str | None = None, source: str | None = None, value: object = None,
                 missing: Sequence[str] = (), entry: str | None = None, problem: str | None = None,
                 message: str | None = None) -> None:
        self.field = field        # the field at fault (``regions[2] 'layer.1'.strides``)
        self.name = name          # a setting's name
        self.source = source      # where a setting or table came from
        self.value = value        # a setting's refused value
        self.missing = tuple(missing)  # the fields a capability set lacks
        self.entry = entry        # a table's entry at fault
        self.problem = problem    # what is wrong, without the field
        super().__init__(reason, detail, message)

    @classmethod
    def of(cls, field: str, problem: str) -> ConfigInvalid:
        """A config object's ``field`` is refused."""
        return cls(ConfigReason.FIELD, f"{field}: {problem}", field=field, problem=problem)

    @classmethod
    def geometry(cls, field: str, problem: str) -> ConfigInvalid:
        """A geometry or region is malformed at ``field``."""
        return cls(ConfigReason.GEOMETRY, f"geometry: {field}: {problem}", field=field, problem=problem)

    @classmethod
    def spec(cls, source: str, entry: str, problem: str,
             reason: ConfigReason = ConfigReason.SPEC) -> ConfigInvalid:
        """A transition table (SPEC), its binding (BINDING) or its model (MODEL) is malformed."""
        return cls(reason, f"{source}: {entry}: {problem}", source=source, entry=entry, problem=problem)

    @classmethod
    def binding(cls, source: str, entry: str, problem: str) -> ConfigInvalid:
        """A class implementing a machine does not match its table's guards and effects."""
        return cls.spec(source, entry, problem, ConfigReason.BINDING)

    @classmethod
    def model(cls, source: str, entry: str, problem: str) -> ConfigInvalid:
        """A table names a guard, effect or event the Promela generator has no meaning for."""
        return cls.spec(source, entry, problem, ConfigReason.MODEL)

    @classmethod
    def unknown_setting(cls, name: str, source: str, known: Sequence[str]) -> ConfigInvalid:
        return cls(ConfigReason.UNKNOWN_SETTING,
                   f"{source}: unknown setting {name!r}; known: {', '.join(known)}", name=name, source=source)

    @classmethod
    def invalid_setting(cls, name: str, value: object, problem: str, source: str = "value") -> ConfigInvalid:
        return cls(ConfigReason.INVALID_SETTING, f"{source}: setting {name!r} = {value!r}: {problem}",
                   name=name, value=value, problem=problem, source=source)

    @classmethod
    def capabilities_incomplete(cls, missing: Sequence[str]) -> ConfigInvalid:
        return cls(ConfigReason.CAPABILITIES_INCOMPLETE,
                   "partial capability set refused; missing: " + ", ".join(missing), missing=missing)

    @classmethod
    def capabilities_invalid(cls, field: str, problem: str) -> ConfigInvalid:
        return cls(ConfigReason.CAPABILITIES_INVALID, f"capability {field!r}: {problem}",
                   field=field, problem=problem)


class ArgumentInvalid(KvStateError, ValueError):
    """Fix the call: an argument was refused before any side effect (by a public entry
    point, a load or store, the inventory, the policy or the native layer)."""

    reason: ArgumentReason

    def __init__(self, reason: ArgumentReason, detail: str, *, argument: str | None = None,
                 call: str | None = None, code: int | None = None, matches: Sequence[str] = (),
                 message: str | None = None) -> None:
        self.argument = argument  # the argument at fault (``region 'layer.3'``, ``dst_block_ids[7]``)
        self.call = call          # the native function that refused it
        self.code = code          # its KVS_E_* value
        self.matches = tuple(matches)  # the child engines an ambiguous engine id matches
        super().__init__(reason, detail, message)

    @classmethod
    def of(cls, argument: str, reason: ArgumentReason, problem: str) -> ArgumentInvalid:
        """``argument`` of a public entry point is refused."""
        return cls(reason, problem, argument=argument, message=f"{argument}: {reason.value}: {problem}")

    @classmethod
    def transfer(cls, reason: ArgumentReason, where: str, detail: str) -> ArgumentInvalid:
        """A load or store argument is refused: nothing was written and no op is in flight."""
        return cls(reason, detail, argument=where, message=f"{reason.value}: {where}: {detail}")

    @classmethod
    def native(cls, call: str, code: int, detail: str,
               reason: ArgumentReason = ArgumentReason.NATIVE) -> ArgumentInvalid:
        """The native layer (``call``, ``code``: its KVS_E_* value, -1 if Python refused first)."""
        return cls(reason, detail, call=call, code=code, message=f"{call}: {detail}")

    @classmethod
    def engine_ambiguous(cls, engine_id: str, matches: Sequence[str]) -> ArgumentInvalid:
        return cls(ArgumentReason.ENGINE_AMBIGUOUS,
                   f"engine id {engine_id!r} is ambiguous: it matches {', '.join(matches)}; "
                   "name the child engine (or its data-parallel rank)", argument=engine_id, matches=matches)


class BackendUnavailable(KvStateError):
    """Install or enable it: a backend, device or tool was asked for but is missing here,
    or cannot do what was asked."""

    reason: BackendReason

    def __init__(self, reason: BackendReason, detail: str, *, backend: str | None = None,
                 message: str | None = None) -> None:
        self.backend = backend
        super().__init__(reason, detail, message)

    @classmethod
    def missing(cls, backend: str, why: str) -> BackendUnavailable:
        return cls(BackendReason.MISSING, why, backend=backend,
                   message=f"transport backend {backend!r} is unavailable: {why}")

    @classmethod
    def unsuitable(cls, backend: str, need: str) -> BackendUnavailable:
        """The lifecycle sides need a ``MappedTransport`` (NIXL loads, never maps); a bank's
        host view needs host-addressable memory."""
        return cls(BackendReason.UNSUITABLE, need, backend=backend,
                   message=f"transport {backend!r} cannot be used here: {need}")


# -- recompute: refused, stale or failed -----------------------------------------------


class DescriptorRejected(KvStateError):
    """Recompute: one descriptor failed a validation rule; nothing was opened."""

    reason: RejectReason

    def __init__(self, reason: RejectReason, detail: str, rank: int | None = None) -> None:
        self.rank = rank
        where = "" if rank is None else f" (rank {rank})"
        super().__init__(reason, detail, f"descriptor rejected{where}: {reason.value}: {detail}")


class GroupRejected(KvStateError):
    """Recompute: a group failed validation; every failing rule is in ``problems`` (the
    first one's reason is ``reason``); nothing was opened."""

    reason: RejectReason

    def __init__(self, problems: Sequence[DescriptorRejected]) -> None:
        if not problems:
            raise ValueError("GroupRejected needs at least one problem")
        self.problems = tuple(problems)
        lines = "; ".join(str(p) for p in self.problems)
        super().__init__(self.problems[0].reason, lines,
                         f"group rejected ({len(self.problems)} problem(s)): {lines}")

    @property
    def reasons(self) -> frozenset[RejectReason]:
        return frozenset(p.reason for p in self.problems)


class ReuseRefused(KvStateError):
    """Recompute: a reuse gate is closed (reuse is off, the default; or a GPU import lacks
    GPU reuse or an admitted profile). Nothing was decoded, connected or opened."""

    reason: DecisionReason

    def __init__(self, reason: DecisionReason, detail: str) -> None:
        super().__init__(reason, detail, f"import refused ({reason.value}): {detail}")


class ImportFailed(KvStateError):
    """Recompute: importing a rank part failed (a lease refused, blocks gone stale, a
    handle refused, the peer gone); the group was rolled back. ``cause`` is the failure
    itself when one was wrapped (also chained); ``defect`` says which handle check failed."""

    reason: ImportReason

    def __init__(self, reason: ImportReason, detail: str, *, rank: int | None = None,
                 cause: BaseException | None = None, code: str | None = None,
                 defect: enum.Enum | None = None, call: str | None = None,
                 native_code: int | None = None, message: str | None = None) -> None:
        self.rank = rank
        self.cause = cause
        self.code = code          # the exporter's refusal code (REFUSED, STALE)
        self.defect = defect      # an ImportDefect, or NIXL's own handle defect
        self.call = call          # the native function that refused a received fd ...
        self.native_code = native_code  # ... and its KVS_E_* value
        super().__init__(reason, detail, message)

    @classmethod
    def of(cls, rank: int, reason: ImportReason, detail: str) -> ImportFailed:
        """Rank ``rank``'s import failed at a step kvstate checks itself."""
        return cls(reason, detail, rank=rank, message=f"import of rank {rank} failed ({reason.value}): {detail}")

    @classmethod
    def wrap(cls, rank: int, cause: BaseException, reason: ImportReason | None = None) -> ImportFailed:
        """The failure of rank ``rank``'s import: ``reason`` from ``cause`` unless given; a
        wrapped ImportFailed lends its defect (a refusal's ``code`` stays on ``cause``)."""
        why = import_reason(cause) if reason is None else reason
        inner = cause if isinstance(cause, ImportFailed) else None
        # a rank's own failure lends its detail (its text would repeat "import of rank");
        # a refusal or a handle check keeps its whole text (the refusal code)
        detail = inner.detail if inner is not None and inner.rank is not None else str(cause)
        return cls(why, detail, rank=rank, cause=cause, defect=None if inner is None else inner.defect,
                   code=None if inner is None else inner.code,
                   message=f"import of rank {rank} failed ({why.value}): {detail}")

    @classmethod
    def lease_refused(cls, code: str, detail: str) -> ImportFailed:
        """The exporter refused a lease; ``code`` says why (stale_inventory is STALE)."""
        reason = ImportReason.STALE if code == "stale_inventory" else ImportReason.REFUSED
        return cls(reason, detail, code=code, message=f"lease refused ({code}): {detail}")

    @classmethod
    def handle(cls, defect: enum.Enum, detail: str, *, call: str | None = None,
               code: int | None = None) -> ImportFailed:
        """A received handle failed a check before anything was opened (``call`` and
        ``code`` name the native check that refused it, if one did)."""
        return cls(ImportReason.HANDLE, detail, defect=defect, call=call, native_code=code,
                   message=detail if call is None else f"{call}: {detail}")

    @classmethod
    def nixl_handle(cls, defect: enum.Enum, detail: str) -> ImportFailed:
        """NIXL handle bytes failed a rule (``defect`` is a nixl HandleDefect) before
        anything was handed to NIXL: malformed, oversize, another version, another
        generation, or not the descriptor's."""
        return cls(ImportReason.HANDLE, detail, defect=defect,
                   message=f"nixl handle rejected: {defect.value}: {detail}")


class TransferFailed(KvStateError):
    """Recompute those blocks: a load or store did not complete, or its lease ended;
    nothing it wrote may be used."""

    reason: TransferFailReason

    def __init__(self, reason: TransferFailReason, detail: str, *, bank: str | None = None,
                 message: str | None = None) -> None:
        self.bank = bank
        super().__init__(reason, detail, message)

    @classmethod
    def lease_ended(cls, bank: str, why: str) -> TransferFailed:
        """NIXL deregistration does not revoke a peer's access, so this gate, not NIXL, keeps
        a peer off memory the owner may already be reusing."""
        return cls(TransferFailReason.LEASE_ENDED, why, bank=bank,
                   message=f"lease on {bank} has ended ({why}); the load was not started")


class GroupFailed(KvStateError):
    """Recompute: a coordinated group failed before ready, or a fault drained it after;
    every worker was told to roll back or drain. ``event`` is the coordinator event (its
    GroupEvent is ``reason``), ``rank`` the rank it concerned, if one did."""

    reason: GroupEvent

    def __init__(self, event: str, rank: int | None, detail: str) -> None:
        self.event = event
        self.rank = rank
        where = "" if rank is None else f" (rank {rank})"
        super().__init__(GroupEvent(event), detail, f"coordinated group failed by {event}{where}: {detail}")


# -- wait -------------------------------------------------------------------------------


class Busy(KvStateError):
    """Wait and retry later: the resource is pinned, mapped, leased, viewed or at its cap;
    nothing changed."""

    reason: BusyReason

    def __init__(self, reason: BusyReason, detail: str, *, call: str | None = None,
                 code: int | None = None, group: str | None = None, hashes: Sequence[int] = (),
                 limit: int | None = None, message: str | None = None) -> None:
        self.call = call
        self.code = code
        self.group = group        # the inventory group of busy blocks
        self.hashes = tuple(hashes)
        self.limit = limit        # a server's connection cap
        super().__init__(reason, detail, message)

    @classmethod
    def native(cls, reason: BusyReason, call: str, code: int, detail: str) -> Busy:
        return cls(reason, detail, call=call, code=code, message=f"{call}: {detail}")

    @classmethod
    def blocks(cls, group: str, hashes: Sequence[int]) -> Busy:
        shown = ", ".join(f"{h:#018x}" for h in hashes[:4])
        more = "" if len(hashes) <= 4 else f" (+{len(hashes) - 4} more)"
        return cls(BusyReason.BLOCKS, f"group {group!r}: block(s) {shown}{more} are pinned or under lease",
                   group=group, hashes=hashes)

    @classmethod
    def connections(cls, limit: int) -> Busy:
        return cls(BusyReason.CONNECTIONS,
                   f"connection refused: {limit} connection handler(s) already running", limit=limit)


class TimedOut(KvStateError):
    """Wait again or give up: an op, a drain or a NIXL transfer did not finish in time.
    (A silent peer on the control channel is a ChannelError with reason TIMEOUT.)"""

    reason: TimeoutReason

    def __init__(self, reason: TimeoutReason, detail: str, *, call: str | None = None,
                 code: int | None = None, op: str | None = None, message: str | None = None) -> None:
        self.call = call
        self.code = code
        self.op = op              # the NIXL step
        super().__init__(reason, detail, message)

    @classmethod
    def native(cls, call: str, code: int, detail: str) -> TimedOut:
        """A wait on a native op ended before the op finished; the op is untouched."""
        return cls(TimeoutReason.OP, detail, call=call, code=code, message=f"{call}: {detail}")

    @classmethod
    def nixl(cls, op: str, detail: str) -> TimedOut:
        """A NIXL transfer did not complete in time; it was released (cancelled)."""
        return cls(TimeoutReason.NIXL, detail, op=op, message=f"nixl {op} failed: {detail}")


# -- drop the link ----------------------------------------------------------------------


class ChannelError(KvStateError):
    """Recompute and drop the link: the peer is gone, silent, not allowed, at an unsafe
    path, or broke the framing or the protocol."""

    reason: ChannelReason

    def __init__(self, reason: ChannelReason, detail: str, *, pid: int | None = None,
                 uid: int | None = None, allowed: frozenset[int] = frozenset(), code: str | None = None,
                 path: str | None = None, message: str | None = None) -> None:
        self.pid = pid
        self.uid = uid
        self.allowed = allowed
        self.code = code          # the coordinator's refusal code
        self.path = path          # an unsafe socket path
        super().__init__(reason, detail, message)

    @classmethod
    def unsafe_path(cls, path: str, why: str) -> ChannelError:
        """The socket path or its directory is a symlink, foreign-owned or too open: a
        server's own path (fix the configuration) or a peer's (drop it)."""
        return cls(ChannelReason.UNSAFE_PATH, why, path=path, message=f"unsafe socket path {path!r}: {why}")

    @property
    def closed(self) -> bool:
        """The connection is gone: closed by the peer or here, or the peer process died."""
        return self.reason in (ChannelReason.CLOSED, ChannelReason.PEER_DIED)

    @classmethod
    def peer_rejected(cls, pid: int, uid: int, allowed: frozenset[int]) -> ChannelError:
        return cls(ChannelReason.REJECTED,
                   f"peer pid {pid} uid {uid} is not allowed (allowed uids: {sorted(allowed)})",
                   pid=pid, uid=uid, allowed=allowed)

    @classmethod
    def coordinator_refused(cls, code: str, detail: str) -> ChannelError:
        """``code``: duplicate_rank, rank_range, tp_mismatch or version."""
        return cls(ChannelReason.COORDINATOR_REFUSED, detail, code=code,
                   message=f"coordinator refused the worker ({code}): {detail}")


# -- report it --------------------------------------------------------------------------


class NativeError(KvStateError):
    """Report it: the native layer, the OS, the CUDA driver, NIXL or the model checker
    failed, or a step raised an untyped exception (rolled back)."""

    reason: NativeReason

    def __init__(self, reason: NativeReason, detail: str, *, call: str | None = None,
                 code: int | None = None, errno: int | None = None, op: int | str | None = None,
                 result: int | None = None, name: str | None = None, step: str | None = None,
                 cause: BaseException | None = None, machine: str | None = None, state: str | None = None,
                 event: str | None = None, message: str | None = None) -> None:
        self.call = call          # the C function or driver call
        self.code = code          # the C KVS_E_* value
        self.errno = errno
        self.op = op              # the native op id, or the NIXL step
        self.result = result      # the CUresult value ...
        self.name = name          # ... and its name
        self.step = step          # the registration step, or the guard or effect that raised
        self.cause = cause        # the untyped exception (also chained)
        self.machine = machine    # where an untyped exception was raised: machine, state, event
        self.state = state
        self.event = event
        super().__init__(reason, detail, message)

    @classmethod
    def native(cls, call: str, code: int, detail: str, reason: NativeReason = NativeReason.FAILED,
               errno: int | None = None, op: int | None = None) -> NativeError:
        """The native layer refused ``call`` with KVS_E_* ``code``."""
        return cls(reason, detail, call=call, code=code, errno=errno, op=op, message=f"{call}: {detail}")

    @classmethod
    def cuda(cls, call: str, result: int, name: str, detail: str = "",
             reason: NativeReason = NativeReason.CUDA) -> NativeError:
        return cls(reason, detail, call=call, result=result, name=name,
                   message=f"{call}: {name} ({result}){': ' + detail if detail else ''}")

    @classmethod
    def registration(cls, step: str, cause: BaseException) -> NativeError:
        """Registering a bank failed at ``step``; every earlier step was rolled back and the
        bank keeps its previous owner and state (INV-REGISTER-ATOMIC)."""
        return cls(NativeReason.REGISTRATION, str(cause), step=step, cause=cause,
                   message=f"bank registration failed at {step}: {cause}")

    @classmethod
    def nixl(cls, op: str, detail: str) -> NativeError:
        return cls(NativeReason.NIXL, detail, op=op, message=f"nixl {op} failed: {detail}")

    @classmethod
    def effect(cls, machine: str, state: str, event: str, step: str, cause: BaseException) -> NativeError:
        """A guard or effect raised an untyped exception (OSError, MemoryError, a bug): the
        transition was rolled back, the machine is still in ``state``."""
        return cls(NativeReason.EFFECT, f"{type(cause).__name__}: {cause}", step=step, cause=cause,
                   machine=machine, state=state, event=event,
                   message=f"{machine}: {step} of event {event!r} in state {state!r} raised "
                           f"{type(cause).__name__}: {cause}; rolled back")


# -- a bug ------------------------------------------------------------------------------


class TransitionError(KvStateError):
    """The transition tables forbid the event in the machine's state; nothing changed.
    ILLEGAL from a load or store is an ordinary outcome (the group or share is no longer
    ready: its exporter, coordinator or lease went; the bank drains): recompute. Any other
    case is a bug, or a race the caller lost."""

    reason: TransitionReason

    def __init__(self, reason: TransitionReason, detail: str, *, machine: str | None = None,
                 state: str | None = None, event: str | None = None, failed: Sequence[str] = ()) -> None:
        self.machine = machine
        self.state = state
        self.event = event
        self.failed = tuple(failed)  # the guards that refused
        super().__init__(reason, detail)

    @classmethod
    def illegal(cls, machine: str, state: str, event: str) -> TransitionError:
        return cls(TransitionReason.ILLEGAL, f"{machine}: event {event!r} is not declared in state {state!r}",
                   machine=machine, state=state, event=event)

    @classmethod
    def guard(cls, machine: str, state: str, event: str, failed: Sequence[str]) -> TransitionError:
        return cls(TransitionReason.GUARD, f"{machine}: event {event!r} in state {state!r} refused by "
                   "guard(s) " + ", ".join(failed), machine=machine, state=state, event=event, failed=failed)

    @classmethod
    def reentrant(cls, machine: str, state: str, event: str) -> TransitionError:
        return cls(TransitionReason.REENTRANT,
                   f"{machine}: event {event!r} fired from inside a transition in state {state!r}",
                   machine=machine, state=state, event=event)


#: The public error classes, in the order docs/api.md tables them, each with its reason enum.
REASONS: dict[type[KvStateError], type[enum.Enum]] = {
    ConfigInvalid: ConfigReason, ArgumentInvalid: ArgumentReason, BackendUnavailable: BackendReason,
    DescriptorRejected: RejectReason, GroupRejected: RejectReason, ReuseRefused: DecisionReason,
    ImportFailed: ImportReason, TransferFailed: TransferFailReason, GroupFailed: GroupEvent,
    Busy: BusyReason, TimedOut: TimeoutReason, ChannelError: ChannelReason, NativeError: NativeReason,
    TransitionError: TransitionReason,
}


def import_reason(cause: BaseException) -> ImportReason:
    """The :class:`~kvstate.core.reasons.ImportReason` of a failure while importing."""
    if isinstance(cause, NativeError) and cause.reason is NativeReason.EFFECT:  # an untyped fault: what it was
        assert cause.cause is not None
        cause = cause.cause
    if isinstance(cause, ImportFailed):  # a step that knew its reason (a lease refusal, a handle)
        return cause.reason
    if isinstance(cause, ChannelError):
        if cause.reason in (ChannelReason.FRAME, ChannelReason.PROTOCOL):
            return ImportReason.MALFORMED
        return ImportReason.PEER
    if isinstance(cause, (NativeError, OSError)) or (
            isinstance(cause, (ArgumentInvalid, Busy, TimedOut)) and cause.call is not None) or (
            isinstance(cause, TimedOut) and cause.reason is TimeoutReason.NIXL):
        return ImportReason.NATIVE  # the native layer (or the driver, or NIXL) refused
    if isinstance(cause, TransitionError) and cause.reason is TransitionReason.ILLEGAL:
        return ImportReason.INTERRUPTED  # a fault moved the group on meanwhile
    return ImportReason.FAILED
