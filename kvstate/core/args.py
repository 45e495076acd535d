"""Argument checks for the public entry points. Pure.

Every public method checks its arguments before its first side effect (type, range,
encoding, size), so a caller's mistake is an :class:`~kvstate.core.errors.ArgumentInvalid`
naming the argument and an :class:`~kvstate.core.reasons.ArgumentReason`, never a
TypeError, KeyError, AttributeError or UnicodeEncodeError from deep inside. Each helper
returns the value (narrowed for mypy), so a check reads as an assignment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

from kvstate.core.errors import ArgumentInvalid
from kvstate.core.paths import MAX_SOCKET_PATH, _shape
from kvstate.core.reasons import ArgumentReason

T = TypeVar("T")

#: Longest text an entry point takes where it has no tighter bound of its own.
MAX_TEXT = 4096
#: The largest C int (int32): what native calls take as a count or a file descriptor.
INT32_MAX = (1 << 31) - 1
#: The largest file descriptor native calls take.
FD_MAX = INT32_MAX


def _is(value: object, kinds: tuple[type[T], ...]) -> TypeGuard[T]:
    """``value`` is an instance of one of ``kinds``; a bool is not an int here."""
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds and int in kinds)


def need(name: str, value: object, kind: type[T] | tuple[type[T], ...]) -> T:
    """``value`` is an instance of ``kind`` (bool is not an int here)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not _is(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE, f"must be {names}, not {type(value).__name__}")
    return value


def need_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    if type(value) is not int:
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE, f"must be an int, not {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ArgumentInvalid.of(name, ArgumentReason.RANGE, f"{value} is outside {lo}..{hi}")
    return value


def need_seconds(name: str, value: object, *, allow_zero: bool = True) -> float:
    """A finite, non-negative number of seconds (int or float, not bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE, f"must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero) or value > 1e9:
        raise ArgumentInvalid.of(name, ArgumentReason.RANGE, f"{value!r} is not a finite number of seconds in 0..1e9")
    return float(value)


def need_text(name: str, value: object, max_len: int = MAX_TEXT, *, allow_empty: bool = False) -> str:
    """Text that every OS interface takes: no NUL, no lone surrogate, bounded."""
    if not isinstance(value, str):
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE, f"must be a str, not {type(value).__name__}")
    if not value and not allow_empty:
        raise ArgumentInvalid.of(name, ArgumentReason.LENGTH, "must not be empty")
    if len(value) > max_len:
        raise ArgumentInvalid.of(name, ArgumentReason.LENGTH, f"is {len(value)} characters, more than {max_len}")
    if "\x00" in value:
        raise ArgumentInvalid.of(name, ArgumentReason.ENCODING, "holds a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ArgumentInvalid.of(name, ArgumentReason.ENCODING, "holds a lone surrogate") from None
    return value


def need_path(name: str, value: object) -> Path:
    """A filesystem path (str or PathLike of str) without NUL or lone surrogates."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return Path(need_text(name, value))


def need_bytes(name: str, value: object, max_len: int | None = None) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE, f"must be bytes, not {type(value).__name__}")
    out = bytes(value)
    if max_len is not None and len(out) > max_len:
        raise ArgumentInvalid.of(name, ArgumentReason.LENGTH, f"is {len(out)} bytes, more than {max_len}")
    return out


def need_items(name: str, value: object, kind: type[T] | tuple[type[T], ...], max_len: int | None = None) -> list[T]:
    """A list or tuple of ``kind`` (not a str, not a lazy iterator a check would consume)."""
    if not isinstance(value, (list, tuple)):
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE, f"must be a list or tuple, not {type(value).__name__}")
    if max_len is not None and len(value) > max_len:
        raise ArgumentInvalid.of(name, ArgumentReason.LENGTH, f"has {len(value)} items, more than {max_len}")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for i, item in enumerate(value):  # the item's name is written only for a refusal
        if not _is(item, kinds):
            need(f"{name}[{i}]", item, kind)
    return list(value)


def need_callable(name: str, value: object) -> Any:
    if not callable(value):
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE, f"must be callable, not {type(value).__name__}")
    return value


def need_callables(name: str, value: object) -> tuple[Any, ...]:
    """An iterable of callables (observers), taken whole."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE,
                                 f"must be an iterable of callables, not {type(value).__name__}")
    items = tuple(value)
    for i, item in enumerate(items):
        need_callable(f"{name}[{i}]", item)
    return items


def need_choice(name: str, value: object, choices: Iterable[str]) -> str:
    options = tuple(choices)
    if not isinstance(value, str) or value not in options:
        raise ArgumentInvalid.of(name, ArgumentReason.RANGE, f"must be one of {', '.join(options)}, not {value!r:.40}")
    return value


def need_mapping_keys(name: str, value: object, keys: Sequence[str]) -> dict[str, Any]:
    """Keyword overrides limited to known names."""
    if not isinstance(value, dict):
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE, f"must be a mapping, not {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in keys)
    if unknown:
        raise ArgumentInvalid.of(name, ArgumentReason.RANGE, f"unknown name(s) {unknown[:5]}; known: {', '.join(keys)}")
    return dict(value)


def need_kinds(name: str, value: object, kind: type[T]) -> frozenset[T]:
    """A non-empty frozenset of ``kind`` values (handle kinds, device ids)."""
    if not isinstance(value, frozenset) or not value or not all(isinstance(v, kind) for v in value):
        raise ArgumentInvalid.of(name, ArgumentReason.TYPE, f"must be a non-empty frozenset of {kind.__name__}, "
                                 f"not {value!r:.80}")
    return value


def typed(kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """An attrs validator: an instance of ``kind`` (or None when ``optional``), refused as
    ArgumentInvalid naming the field."""
    def check(inst: object, attribute: Any, value: object) -> None:
        if optional and value is None:
            return
        need(f"{type(inst).__name__}.{attribute.name}", value, kind)
    return check


def need_socket_dir(name: str, value: object, *, room: int = 2) -> Path:
    """A directory that will hold unix sockets (a config's socket directory), refused where
    the config is made rather than at bind or connect: absolute and normalised as the channel
    requires (:mod:`kvstate.core.paths`), and short enough that a socket in it, ``room``
    bytes longer ('/' and the file's name), fits ``sun_path``. Reads no filesystem: the
    channel checks ownership and symlinks when it binds or connects."""
    return _socket_shaped(name, value, room)


def need_socket_path(name: str, value: object) -> Path:
    """A unix socket's own path, shaped as :func:`need_socket_dir` checks a directory."""
    return _socket_shaped(name, value, 0)


def _socket_shaped(name: str, value: object, room: int) -> Path:
    path = need_path(name, value)
    text = str(path)
    try:
        size = len(os.fsencode(text))
    except UnicodeEncodeError:
        size = 0  # not encodable: _shape names it
    if size + room > MAX_SOCKET_PATH:
        more = f", and a socket in it {room} more" if room else ""
        raise ArgumentInvalid.of(name, ArgumentReason.LENGTH, f"is {size} bytes{more}: a unix socket path holds at "
                                 f"most {MAX_SOCKET_PATH}")
    problem = _shape(text)
    if problem is not None:
        raise ArgumentInvalid.of(name, ArgumentReason.RANGE, f"{problem[1]} for a unix socket, not {text!r:.80}")
    return path
