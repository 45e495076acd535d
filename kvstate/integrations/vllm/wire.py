"""Messages of the decode index protocol, over the control channel (SOCK_SEQPACKET).

The decode engine's scheduler side serves an *index* (:mod:`.index`). Two kinds of peers
connect to it:

- each **decode rank** (its worker process) says ``hello`` (rank, tp, pid, its
  inventory's epoch, its compatibility key), then reports ``advertised`` descriptors,
  ``stored`` blocks and ``removed`` keys; the index sends it ``evict``. Each rank also
  opens a *report link* (``report_link``, answered ``linked``), on which its op engine
  sends ``stored`` reports to the index's native thread;
- each **prefill scheduler** sends ``lookup`` (its compatibility key and the prefix hashes
  of a prompt), answered ``found`` (bank blocks, inventory keys, every rank's epoch) or
  ``refused`` (a reason); and ``descriptors``, answered ``descriptor_set``.

Every field of a received message is checked (:func:`decode`): a peer's JSON may hold
anything, so a wrong kind, a missing field or a field of the wrong type is a
:class:`ChannelError` (PROTOCOL), never a KeyError or TypeError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvstate import channel as chan
from kvstate.core.reasons import ChannelReason
from kvstate.core.errors import ChannelError

#: The most blocks one message names: a request retains, and a lookup asks about, at most
#: its first MAX_BLOCKS prefix blocks (64k tokens at 16-token blocks). Why this bound: a
#: SOCK_SEQPACKET message must fit the sender's socket buffer whole, and Linux's default
#: (net.core.wmem_default, 212,992 bytes) leaves about 208 KiB; the largest message here,
#: ``found``, costs up to 27 bytes per block, ``stored`` and ``evict`` 21: 4,096 blocks
#: stay under 120 KiB (tests/integrations/test_vllm_parts.py sends the worst cases).
MAX_BLOCKS = 4096
#: Every message's cap, below what the kernel sends at once (a longer one is a ChannelError (FRAME) here).
LIMITS = chan.Limits(max_payload=192 * 1024)

_Check = Callable[[object], bool]


def _int(v: object) -> bool:
    return type(v) is int and 0 <= v < 1 << 64  # what a found's lists carry back


def _ints(v: object) -> bool:
    return isinstance(v, list) and len(v) <= MAX_BLOCKS and all(type(x) is int and 0 <= x < 1 << 64 for x in v)


def _bytes(v: object) -> bool:
    return isinstance(v, bytes)


def _blobs(v: object) -> bool:
    return isinstance(v, list) and len(v) <= 1024 and all(isinstance(x, bytes) for x in v)


def _str(v: object) -> bool:
    return isinstance(v, str) and len(v) <= 4096


def _dict(v: object) -> bool:
    return isinstance(v, dict)


#: kind -> field -> check. Every field is required, none other is allowed.
SCHEMA: Mapping[str, Mapping[str, _Check]] = {
    "hello": {"rank": _int, "tp": _int, "pid": _int, "epoch": _int, "compat": _dict},
    "advertised": {"rank": _int, "descriptor": _bytes, "generation": _int},
    "stored": {"rank": _int, "keys": _ints, "failed": _ints},
    "removed": {"rank": _int, "keys": _ints, "busy": _ints},
    "welcome": {"tp": _int},
    "report_link": {"rank": _int},
    "linked": {"rank": _int},
    "evict": {"keys": _ints},
    "lookup": {"compat": _dict, "hashes": _bytes},
    "descriptors": {"compat": _dict},
    "found": {"blocks": _int, "slots": _ints, "keys": _ints, "epochs": _ints, "generation": _int},
    "descriptor_set": {"descriptors": _blobs},
    "refused": {"reason": _str, "detail": _str},
}


def encode(kind: str, **fields: Any) -> bytes:
    """A message of ``kind``; refuses (ChannelError (PROTOCOL)) what :func:`decode` would refuse."""
    msg = {"kind": kind, **fields}
    _check(msg)
    return chan.encode(msg)


def decode(payload: bytes, *kinds: str) -> dict[str, Any]:
    """The message in ``payload``, checked; ChannelError (PROTOCOL) unless its kind is one of ``kinds``."""
    msg = chan.decode(payload)
    _check(msg)
    if kinds and msg["kind"] not in kinds:
        raise ChannelError(ChannelReason.PROTOCOL, f"expected {' or '.join(kinds)}, got {msg['kind']!r}")
    return msg


def _check(msg: Mapping[str, Any]) -> None:
    kind = msg.get("kind")
    schema = SCHEMA.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ChannelError(ChannelReason.PROTOCOL, f"unknown message kind {kind!r:.40}")
    fields = set(msg) - {"kind"}
    if fields != set(schema):
        raise ChannelError(ChannelReason.PROTOCOL, f"{kind}: fields {sorted(fields)}, expected {sorted(schema)}")
    for name, check in schema.items():
        if not check(msg[name]):
            raise ChannelError(ChannelReason.PROTOCOL, f"{kind}: field {name!r} is malformed: {msg[name]!r:.60}")


def split_hashes(blob: bytes, size: int) -> list[bytes]:
    """The prefix hashes packed in a lookup (ChannelError (PROTOCOL) unless whole and bounded)."""
    if len(blob) % size or len(blob) // size > MAX_BLOCKS:
        raise ChannelError(ChannelReason.PROTOCOL,
                           f"lookup: {len(blob)} hash bytes is not a whole number of at most {MAX_BLOCKS} "
                           f"{size}-byte hashes")
    return [blob[i:i + size] for i in range(0, len(blob), size)]
