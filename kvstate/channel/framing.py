"""Frames and payloads of the control channel.

A message is one SOCK_SEQPACKET packet: a 12-byte header (magic, payload length, fd
count), then the payload, with any fds attached by SCM_RIGHTS. The kernel keeps packet
boundaries, so a frame is never split or merged; :func:`unpack` refuses a truncated
packet, a header that disagrees with what arrived, and too many fds, closing every fd
that came with a refused frame. Payloads are a small strict JSON codec (no pickle, no
eval): :func:`encode` and :func:`decode`.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

import attrs

from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason

MAGIC = b"KVS\x01"
HEADER = struct.Struct("<4sIH2x")
DEFAULT_MAX_PAYLOAD = 64 * 1024
HARD_MAX_PAYLOAD = 1 << 20
DEFAULT_MAX_FDS = 16
HARD_MAX_FDS = 253  # SCM_MAX_FD
DEFAULT_TIMEOUT = 5.0


@attrs.frozen
class Message:
    """One received message. The fds are owned by the receiver: close them when done."""

    payload: bytes
    fds: tuple[int, ...] = ()

    def close(self) -> None:
        for fd in self.fds:
            close_quietly(fd)

    def __enter__(self) -> Message:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@attrs.frozen
class Limits:
    """Size caps of one channel. Both ends should agree; each enforces its own."""

    max_payload: int = DEFAULT_MAX_PAYLOAD
    max_fds: int = DEFAULT_MAX_FDS

    def __attrs_post_init__(self) -> None:
        if not 0 < self.max_payload <= HARD_MAX_PAYLOAD:
            raise ChannelError(ChannelReason.SETUP, f"max_payload must be in 1..{HARD_MAX_PAYLOAD}")
        if not 0 <= self.max_fds <= HARD_MAX_FDS:
            raise ChannelError(ChannelReason.SETUP, f"max_fds must be in 0..{HARD_MAX_FDS}")


def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not (timeout >= 0 and timeout != float("inf")):
        raise ChannelError(ChannelReason.SETUP, f"timeout must be a finite number of seconds >= 0, not {timeout!r:.40}")
    return timeout


def remaining_ms(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000 + 0.999))


def pack(payload: bytes, nfds: int, limits: Limits) -> bytes:
    """The frame of one message, after checking it against ``limits``."""
    if len(payload) > limits.max_payload:
        raise ChannelError(ChannelReason.FRAME,
                           f"payload of {len(payload)} bytes exceeds the cap of {limits.max_payload}")
    if nfds > limits.max_fds:
        raise ChannelError(ChannelReason.FRAME, f"{nfds} fds exceed the cap of {limits.max_fds}")
    return HEADER.pack(MAGIC, len(payload), nfds) + payload


_MSG_TRUNC, _MSG_CTRUNC = int(socket.MSG_TRUNC), int(socket.MSG_CTRUNC)  # ints: enum arithmetic is slow


def unpack(data: bytes, fds: list[int], flags: int, limits: Limits) -> Message:
    """The message in one received packet, or ChannelError (FRAME) with every received fd closed."""
    def refuse(why: str) -> ChannelError:
        for fd in fds:
            close_quietly(fd)
        return ChannelError(ChannelReason.FRAME, why)

    if not data and not fds:
        raise ChannelError(ChannelReason.CLOSED, "the peer closed the connection")
    if flags & _MSG_TRUNC:
        raise refuse(f"message larger than the cap of {limits.max_payload} bytes")
    if flags & _MSG_CTRUNC:
        raise refuse(f"fds dropped (MSG_CTRUNC): more than the cap of {limits.max_fds}, or this process is "
                     f"out of fds")
    if len(data) < HEADER.size:
        raise refuse(f"frame of {len(data)} bytes is shorter than its header")
    magic, length, nfds = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise refuse(f"bad magic {magic!r}")
    if length != len(data) - HEADER.size:
        raise refuse(f"header says {length} payload bytes, frame carries {len(data) - HEADER.size}")
    if nfds != len(fds) or nfds > limits.max_fds:
        raise refuse(f"header says {nfds} fds, {len(fds)} arrived")
    return Message(data[HEADER.size:], tuple(fds))


def _encode_bytes(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$b64": base64.b64encode(bytes(value)).decode("ascii")}
    raise TypeError(f"cannot encode {type(value).__name__}")


def _pairs(items: list[tuple[str, Any]]) -> Any:
    obj = dict(items)
    if len(obj) != len(items):
        raise ChannelError(ChannelReason.FRAME, "duplicate key in message")
    if set(obj) == {"$b64"}:
        try:
            return base64.b64decode(obj["$b64"], validate=True)
        except (TypeError, ValueError):
            raise ChannelError(ChannelReason.FRAME, "malformed $b64 value") from None
    return obj


def _bad_constant(name: str) -> Any:
    raise ChannelError(ChannelReason.FRAME, f"non-finite number {name} in message")


# One codec each, built once: every message of a lease's round trip went through a fresh
# encoder and decoder. Both keep no state between calls (as json's own default ones).
_ENCODER = json.JSONEncoder(default=_encode_bytes, separators=(",", ":"), sort_keys=True, allow_nan=False)
_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_bad_constant)


def encode(obj: Mapping[str, Any]) -> bytes:
    """A JSON object as bytes. ``bytes`` values travel as ``{"$b64": "..."}``."""
    if not isinstance(obj, Mapping):
        raise ChannelError(ChannelReason.FRAME, "a message must be a JSON object")
    try:
        return _ENCODER.encode(obj).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ChannelError(ChannelReason.FRAME, f"cannot encode message: {exc}") from None


def decode(data: bytes) -> dict[str, Any]:
    """The inverse of :func:`encode`. Refuses duplicate keys, NaN/Infinity and non-objects."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ChannelError(ChannelReason.FRAME, f"a message is bytes, not {type(data).__name__}")
    try:
        value = _DECODER.decode(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also an int of >4300 digits
        raise ChannelError(ChannelReason.FRAME, f"malformed message: {exc}") from None
    if not isinstance(value, dict):
        raise ChannelError(ChannelReason.FRAME, "a message must be a JSON object")
    return value
