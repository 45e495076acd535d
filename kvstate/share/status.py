"""What a live node holds right now: snapshots of exporters and coordinators, and the
read-only ``status`` request that serves them over the control channel.

An operator asks ``kvstate status --socket-dir DIR``: every socket in the directory is
asked once, over the same SEQPACKET channel and peer-credential check as a lease (so only
an allowed uid is answered). Exporters answer with their banks (state, generation,
inventory epoch, leases with the importer's pid and time left, holds, pins, retained
blocks, stores in flight); a coordinator answers with its groups and each rank's part as
its worker last reported it. A socket nobody listens on is a leftover of a dead process
and is shown as such.

A status request changes nothing: it fires no event, takes no lease, and reads each bank
under its machine's lock only for as long as it copies the fields.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstate import channel as chan
from kvstate.core.errors import ChannelError, KvStateError
from kvstate.core.reasons import ChannelReason

if TYPE_CHECKING:
    from kvstate.share.coordinator import Coordinator
    from kvstate.share.bank import Bank
    from kvstate.share.exporter import Exporter

#: The request every kvstate server answers with its snapshot.
REQUEST = {"op": "status"}
#: Version of the snapshot's layout (a reader refuses others).
VERSION = 1
#: Leases listed per bank (all are counted): an answer must fit one control-channel frame.
MAX_LEASES_SHOWN = 32


def waiting_for(leases: list[dict[str, Any]], holds: int, pins: int, stores: int) -> str:
    """Why a draining bank is not quiescent yet, in words ("" when nothing holds it)."""
    parts = []
    if leases:
        each = ", ".join(f"pid {x['pid']} " + ("expired, not returned" if x["expired"]
                                                  else f"expires in {x['expires_in_s']:.0f} s") for x in leases[:4])
        more = f" and {len(leases) - 4} more" if len(leases) > 4 else ""
        parts.append(f"{len(leases)} lease{'s' * (len(leases) != 1)}: {each}{more}")
    if holds:
        parts.append(f"{holds} hold{'s' * (holds != 1)} (importers that may have it open)")
    if pins:
        parts.append(f"{pins} pin{'s' * (pins != 1)}")
    if stores:
        parts.append(f"{stores} store{'s' * (stores != 1)} in flight")
    return "; ".join(parts)


def bank_status(bank: Bank[Any, Any, Any, Any, Any], now: float) -> dict[str, Any]:
    with bank.locked():
        leases = [{"id": x.id, "pid": x.channel.peer.pid, "expires_in_s": round(x.expires_at - now, 3),
                   "expired": x.expired, "blocks": x.blocks}
                  for x in bank.leases.values()]
        out: dict[str, Any] = {
            "rank": bank.rank, "state": bank.state, "generation": bank.generation,
            "epoch": bank.inventory_epoch, "size": bank.size, "blocks": bank.geometry.num_blocks,
            "lease_count": len(leases), "leases": leases[:MAX_LEASES_SHOWN], "holds": len(bank.holds),
            "stores": len(bank.stores)}
    out["pins"] = bank.pins()
    out["waiting_for"] = waiting_for(leases, out["holds"], out["pins"], out["stores"]) \
        if out["state"] == "draining" else ""
    return out


def exporter_status(exporter: Exporter[Any, Any, Any, Any, Any], asking: int = 0,
                    max_bytes: int | None = None) -> dict[str, Any]:
    """``asking``: connections that are the status request itself (not counted);
    ``max_bytes``: what one frame carries (past it the lease lists go, their counts stay)."""
    now = time.monotonic()
    inv = exporter.inventory
    banks = [bank_status(b, now) for _, b in sorted(exporter.banks.items())]
    out: dict[str, Any] = {
        "version": VERSION, "kind": "exporter", "pid": os.getpid(), "path": str(exporter.socket_path),
        "incarnation": exporter.incarnation.value.hex(), "tp": exporter.config.tp,
        "lease_timeout_s": exporter.config.lease_timeout_s, "connections": exporter.connections() - asking,
        "retained_blocks": None if inv is None else len(inv), "banks": banks}
    if max_bytes is not None and len(chan.encode(out)) > max_bytes:
        for bank in banks:
            bank["leases"] = []
        out["truncated"] = "lease lists left out: the snapshot did not fit one frame"
    return out


def coordinator_status(coordinator: Coordinator) -> dict[str, Any]:
    with coordinator._lock:
        links = {r: {"pid": x.pid, "alive": x.alive} for r, x in sorted(coordinator.links.items())}
        groups = list(coordinator.groups.values())
    return {"version": VERSION, "kind": "coordinator", "pid": os.getpid(), "path": str(coordinator.socket_path),
            "tp": coordinator.config.tp, "workers": [{"rank": r, **v} for r, v in links.items()],
            "groups": [{"gid": g.gid, "state": g.state, "age_s": round(time.monotonic() - g.started, 3),
                        "failure": None if g.failure is None else str(g.failure),
                        "parts": [{"rank": p.rank, "pid": p.pid, "state": p.state, "dead": p.dead,
                                   "leases": p.leases} for p in g.ranks()]}
                       for g in groups]}


def is_request(payload: bytes) -> bool:
    """Whether a first message is a status request (servers check before their protocol)."""
    try:
        return chan.decode(payload) == REQUEST
    except KvStateError:
        return False


def query(path: str | os.PathLike[str], timeout: float = 2.0) -> dict[str, Any]:
    """Ask one server for its snapshot (ChannelError: nobody listens there, or it is not a
    kvstate server that answers status, or it broke the frame)."""
    with _connect(path, timeout) as ch:
        return _ask(ch, path, timeout)


def _connect(path: str | os.PathLike[str], timeout: float) -> chan.Channel:
    return chan.connect(path, timeout=timeout, limits=chan.Limits(max_payload=chan.HARD_MAX_PAYLOAD))


#: The fields of an answer that :func:`render` reads, per kind: a type (tuple) each, or
#: ``[fields]`` for a list of objects. The answer comes from another process, so a field
#: missing or of another type is caught here, for that one socket, and not as a crash
#: midway through printing the whole snapshot.
_INT, _NUMBER, _TEXT, _FLAG = (int,), (int, float), (str,), (bool,)
_LEASE = {"id": _INT, "pid": _INT, "expires_in_s": _NUMBER, "expired": _FLAG, "blocks": _INT}
_BANK = {"rank": _INT, "state": _TEXT, "generation": _INT, "epoch": _INT, "lease_count": _INT, "holds": _INT,
         "pins": _INT, "waiting_for": _TEXT, "leases": [_LEASE]}
_PART = {"rank": _INT, "pid": (int, type(None)), "state": (str, type(None)), "dead": _FLAG}
_GROUP = {"gid": _TEXT, "state": _TEXT, "age_s": _NUMBER, "failure": (str, type(None)), "parts": [_PART]}
_SHAPES: dict[str, dict[str, Any]] = {
    "exporter": {"pid": _INT, "path": _TEXT, "tp": _INT, "incarnation": _TEXT, "connections": _INT,
                 "retained_blocks": (int, type(None)), "banks": [_BANK]},
    "coordinator": {"pid": _INT, "path": _TEXT, "tp": _INT, "groups": [_GROUP],
                    "workers": [{"rank": _INT, "pid": _INT, "alive": _FLAG}]},
}


def _shape_problem(value: Any, shape: dict[str, Any], where: str) -> str | None:
    """What in ``value`` does not fit ``shape`` (see :data:`_SHAPES`), or None."""
    if not isinstance(value, dict):
        return f"{where} is not an object"
    for key, want in shape.items():
        if key not in value:
            return f"{where} has no {key!r}"
        got = value[key]
        if isinstance(want, list):
            if not isinstance(got, list):
                return f"{where}.{key} is not a list"
            for i, item in enumerate(got):
                problem = _shape_problem(item, want[0], f"{where}.{key}[{i}]")
                if problem is not None:
                    return problem
        elif not isinstance(got, want) or isinstance(got, bool) and bool not in want:  # True is an int
            return f"{where}.{key} is {type(got).__name__}, not {' or '.join(t.__name__ for t in want)}"
    return None


def _ask(ch: chan.Channel, path: str | os.PathLike[str], timeout: float) -> dict[str, Any]:
    ch.send(chan.encode(REQUEST), timeout=timeout)
    with ch.recv(timeout=timeout) as msg:
        answer = chan.decode(msg.payload)
    if not isinstance(answer, dict) or answer.get("version") != VERSION or "kind" not in answer:
        raise ChannelError(ChannelReason.PROTOCOL, f"{path}: not a status answer (version {VERSION})")
    kind = answer["kind"]
    if not isinstance(kind, str) or kind not in _SHAPES:
        raise ChannelError(ChannelReason.PROTOCOL, f"{path}: not a status answer (kind {kind!r:.40})")
    problem = _shape_problem(answer, _SHAPES[kind], kind)
    if problem is not None:
        raise ChannelError(ChannelReason.PROTOCOL, f"{path}: malformed status answer: {problem}")
    return answer


def node_status(socket_dirs: Sequence[str | os.PathLike[str]], timeout: float = 2.0) -> dict[str, Any]:
    """Every socket of each of ``socket_dirs``, asked in name order. ChannelError (unsafe_path) for
    a directory that fails the channel's checks (owner, mode, no symlink)."""
    roots = [Path(d) for d in socket_dirs]
    for root in roots:  # all of them before any socket is asked
        chan.check_socket_dir(root)
    endpoints: list[dict[str, Any]] = []
    for root in roots:
        for path in sorted(p for p in root.iterdir() if p.suffix == ".sock"):
            try:
                ch = _connect(path, timeout)
            except ChannelError as exc:  # refused: nobody listens there (closed), or another fault
                endpoints.append({"kind": "stale" if exc.closed else "other", "path": str(path), "detail": str(exc)})
                continue
            try:  # a live server that does not answer status (another protocol) is not a leftover
                with ch:
                    endpoints.append(_ask(ch, path, timeout))
            except ChannelError as exc:
                endpoints.append({"kind": "other", "path": str(path), "detail": str(exc)})
    return {"version": VERSION, "socket_dirs": [str(r) for r in roots], "time": time.time(), "endpoints": endpoints}


def render(status: dict[str, Any]) -> str:
    """The snapshot as the text an operator reads."""
    lines = [f"kvstate status: {', '.join(status['socket_dirs'])} ({len(status['endpoints'])} socket(s))"]
    for ep in status["endpoints"]:
        name = Path(ep["path"]).name
        if ep["kind"] == "exporter":
            lines.append(f"  exporter {name}  pid {ep['pid']}  tp {ep['tp']}  incarnation {ep['incarnation'][:8]}  "
                         f"{ep['connections']} connection(s)"
                         + ("" if ep["retained_blocks"] is None else f"  {ep['retained_blocks']} retained block(s)"))
            for b in ep["banks"]:
                lines.append(f"    bank rank {b['rank']}: {b['state']}  generation {b['generation']}  "
                             f"epoch {b['epoch']}  {b['lease_count']} lease(s)  {b['holds']} hold(s)  "
                             f"{b['pins']} pin(s)")
                lines.extend(_lease_lines(b["leases"]))
                if b["waiting_for"]:
                    lines.append(f"      draining, waits for {b['waiting_for']}")
        elif ep["kind"] == "coordinator":
            workers = ", ".join(f"r{w['rank']}=pid {w['pid']}{'' if w['alive'] else ' (gone)'}" for w in ep["workers"])
            lines.append(f"  coordinator {name}  pid {ep['pid']}  tp {ep['tp']}  workers: {workers or 'none'}")
            for g in ep["groups"]:
                lines.append(f"    group {g['gid']}: {g['state']}  age {g['age_s']:.1f} s"
                             + (f"  failed: {g['failure']}" if g["failure"] else ""))
                for p in g["parts"]:
                    lines.append(f"      part rank {p['rank']}: {p['state'] or '-'}  pid {p['pid']}"
                                 + ("  (dead)" if p["dead"] else ""))
        elif ep["kind"] == "stale":
            lines.append(f"  {name}: nobody listens (left by a process that is gone)")
        else:
            lines.append(f"  {name}: {ep['detail']}")
    return "\n".join(lines)


def _lease_lines(leases: Iterable[dict[str, Any]]) -> list[str]:
    return [f"      lease {x['id']}: importer pid {x['pid']}  "
            + ("expired, not returned" if x["expired"] else f"expires in {x['expires_in_s']:.1f} s")
            + (f"  pins {x['blocks']} block(s)" if x["blocks"] else "") for x in leases]
