"""The one error hierarchy of kvstate.

Every failure kvstate reports is a subclass of :class:`KvStateError`. A rejection carries
a reason code (an enum member) as well as a message, so callers branch on data, not on
text. Errors are plain classes: they are raised across threads and pickled by nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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


# -- optional backends ---------------------------------------------------------------


class BackendUnavailable(KvStateError):
    """A transport backend was asked for but its optional dependency or device is missing."""

    def __init__(self, backend: str, why: str) -> None:
        self.backend = backend
        self.why = why
        super().__init__(f"transport backend {backend!r} is unavailable: {why}")


# -- descriptors ---------------------------------------------------------------------


class DescriptorRejected(KvStateError):
    """One descriptor failed a validation rule. ``reason`` is a :class:`kvstate.validate.Reason`."""

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


# -- model checking (kvstate.models, kvstate.modelcheck) -----------------------------


class ModelGenerationError(SpecError):
    """A table names a guard, effect or event that the Promela generator has no meaning for."""


class ModelCheckError(KvStateError):
    """Spin or the C compiler failed, or pan's output could not be read. Nothing was verified."""


class SpinUnavailable(ModelCheckError):
    """The ``spin`` executable (or a C compiler for pan) is not installed."""
