"""Messages of the coordinator protocol, over the control channel (SOCK_SEQPACKET).

A worker connects to its coordinator and says :class:`Hello` (its rank, tp, pid); the
coordinator answers :class:`Welcome` or :class:`Refused`. Then the coordinator sends
:class:`Command`\\ s (one per rank event of ``spec/rank.toml`` that the coordinator table
sends, ``send_<command>``) and :class:`Tick`\\ s (heartbeats, so a worker can tell a silent
coordinator from a busy one), and the worker sends :class:`Report`\\ s: the state its share
entered, which is the coordinator event ``part_<state>``.

Every field is checked on receipt: a peer's JSON may hold anything, so an unknown kind,
command or state, a missing field, or a field of the wrong type is a
:class:`ChannelError` (PROTOCOL), never a KeyError or TypeError.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from kvstate import channel as chan
from kvstate.core.reasons import ChannelReason
from kvstate.core.errors import ChannelError
from kvstate.core.spec import load_machine

VERSION = 1

CommandName = Literal["check", "open", "ready", "drain", "close", "abort"]
ReportState = Literal["validated", "rejected", "imported", "failed", "draining", "quiescent", "closed"]

#: Commands are the rank events the coordinator table sends (effects ``send_<command>``).
COMMANDS: tuple[CommandName, ...] = ("check", "open", "ready", "drain", "close", "abort")
#: Reports are the rank states a worker reports entering (coordinator events ``part_<state>``).
REPORTS: tuple[ReportState, ...] = ("validated", "rejected", "imported", "failed", "draining", "quiescent",
                                    "closed")


def check_against_tables() -> None:
    """The command and report names above are the tables' (a test calls this; so does the
    coordinator at import, so a renamed event cannot go unnoticed)."""
    coord, rank = load_machine("coordinator"), load_machine("rank")
    sent = {e.removeprefix("send_") for e in coord.effects if e.startswith("send_")}
    reported = {e.removeprefix("part_") for e in coord.event_names if e.startswith("part_")}
    if sent != set(COMMANDS) or not sent <= set(rank.event_names) or reported != set(REPORTS):
        raise ChannelError(ChannelReason.PROTOCOL, f"protocol names differ from the tables: commands {sorted(sent)}, "
                           f"reports {sorted(reported)}")


@attrs.frozen
class Hello:
    rank: int
    tp: int
    pid: int
    version: int = VERSION


@attrs.frozen
class Welcome:
    tp: int
    heartbeat_s: float
    silence_s: float       # a worker that hears nothing for this long treats its coordinator as dead


@attrs.frozen
class Refused:
    code: str
    detail: str


@attrs.frozen
class Tick:
    pass


@attrs.frozen
class Command:
    cmd: CommandName
    group: str
    descriptor: bytes | None = None          # check: this rank's wire descriptor
    blocks: Mapping[str, Any] | None = None  # check: {"group", "epochs", "hashes"} or None
    why: str = ""                            # abort: what failed the group


@attrs.frozen
class Report:
    group: str
    rank: int
    state: ReportState
    detail: str = ""                         # rejected, failed: why
    reasons: tuple[str, ...] = ()            # rejected: RejectReason values
    info: Mapping[str, Any] | None = None    # imported: fingerprint, tp, generation, size, leases, import_s


Message = Hello | Welcome | Refused | Tick | Command | Report


def encode(msg: Message) -> bytes:
    if isinstance(msg, Hello):
        body: dict[str, Any] = {"kind": "hello", "rank": msg.rank, "tp": msg.tp, "pid": msg.pid,
                                "version": msg.version}
    elif isinstance(msg, Welcome):
        body = {"kind": "welcome", "tp": msg.tp, "heartbeat_s": msg.heartbeat_s, "silence_s": msg.silence_s}
    elif isinstance(msg, Refused):
        body = {"kind": "refused", "code": msg.code, "detail": msg.detail}
    elif isinstance(msg, Tick):
        body = {"kind": "tick"}
    elif isinstance(msg, Command):
        body = {"kind": "command", "cmd": msg.cmd, "group": msg.group, "why": msg.why}
        if msg.descriptor is not None:
            body["descriptor"] = msg.descriptor
        if msg.blocks is not None:
            body["blocks"] = dict(msg.blocks)
    else:
        body = {"kind": "report", "group": msg.group, "rank": msg.rank, "state": msg.state, "detail": msg.detail,
                "reasons": list(msg.reasons)}
        if msg.info is not None:
            body["info"] = dict(msg.info)
    return chan.encode(body)


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in body:
        if default is ...:
            raise ChannelError(ChannelReason.PROTOCOL, f"{body.get('kind')!s:.20} message lacks field {name!r}")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if type(value) not in kinds or (float in kinds and isinstance(value, float) and value != value):
        names = "/".join(k.__name__ for k in kinds)
        raise ChannelError(ChannelReason.PROTOCOL, f"field {name!r} must be {names}, not {type(value).__name__}")
    return value


def _choice(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ChannelError(ChannelReason.PROTOCOL, f"unknown {what} {value!r:.40}")
    return value


def decode(data: bytes) -> Message:
    """The message in one frame's payload; ChannelError (PROTOCOL) (a ChannelError (FRAME) is left as it is)."""
    body = chan.decode(data)
    kind = _field(body, "kind", str)
    if kind == "hello":
        return Hello(_field(body, "rank", int), _field(body, "tp", int), _field(body, "pid", int),
                     _field(body, "version", int))
    if kind == "welcome":
        return Welcome(_field(body, "tp", int), float(_field(body, "heartbeat_s", (int, float))),
                       float(_field(body, "silence_s", (int, float))))
    if kind == "refused":
        return Refused(_field(body, "code", str), _field(body, "detail", str))
    if kind == "tick":
        return Tick()
    if kind == "command":
        cmd: Any = _choice(_field(body, "cmd", str), COMMANDS, "command")
        blocks = _field(body, "blocks", dict, None)
        return Command(cmd, _field(body, "group", str), _field(body, "descriptor", bytes, None), blocks,
                       _field(body, "why", str, ""))
    if kind == "report":
        state: Any = _choice(_field(body, "state", str), REPORTS, "report state")
        reasons = _field(body, "reasons", list, [])
        if not all(type(r) is str for r in reasons):
            raise ChannelError(ChannelReason.PROTOCOL, "field 'reasons' must list strings")
        return Report(_field(body, "group", str), _field(body, "rank", int), state, _field(body, "detail", str, ""),
                      tuple(reasons), _field(body, "info", dict, None))
    raise ChannelError(ChannelReason.PROTOCOL, f"unknown message kind {kind!r:.40}")


def imported_info(info: Mapping[str, Any] | None) -> tuple[bytes, int, int, int, int, float]:
    """(fingerprint, tp, generation, size, leases, import_s) of an imported report, checked."""
    if info is None:
        raise ChannelError(ChannelReason.PROTOCOL, "an imported report carries no info")
    return (_field(info, "fingerprint", bytes), _field(info, "tp", int), _field(info, "generation", int),
            _field(info, "size", int), _field(info, "leases", int),
            float(_field(info, "import_s", (int, float))))
