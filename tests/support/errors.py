"""``pytest.raises`` for kvstate's grouped errors: the class and its reason, both checked."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvstate.core.errors import KvStateError


@contextmanager
def raises(cls: type[KvStateError], reason: enum.Enum | tuple[enum.Enum, ...], *, match: str | None = None,
           defect: enum.Enum | None = None) -> Iterator[Any]:
    """Like ``pytest.raises(cls, match=match)``, and the error's ``reason`` is ``reason`` (or
    one of them), its ``defect`` ``defect`` when given."""
    with pytest.raises(cls, match=match) as info:
        yield info
    got = info.value.reason
    allowed = reason if isinstance(reason, tuple) else (reason,)
    assert got in allowed, f"{cls.__name__} with reason {got}, expected {reason}: {info.value}"
    if defect is not None:
        assert getattr(info.value, "defect", None) is defect, \
            f"{cls.__name__} with defect {getattr(info.value, 'defect', None)}, expected {defect}"
