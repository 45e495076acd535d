"""What an importer made from some descriptors, remembered by the descriptors' identity.

An importer sees the same few decoded descriptors again and again: ``decode_cached``
returns the same frozen object for the same wire bytes, so what is made from them alone
(their C structs, a group's encoded lease request) can be made once. Hashing a
descriptor would cost more than most of what is remembered, so entries are kept by the
descriptors' ids, and each entry holds its descriptors: no id is reused while it lives.
Pure; bounded (cleared when full); nothing that depends on time or on the importer's
expectation belongs here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
O = TypeVar("O")


class ByIdentity(Generic[T]):
    """Values made from descriptors (or any objects), kept by the objects' identity. An
    entry holds its objects, so while it lives no other object has their ids: a key
    found is a value made from these very objects."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._made: dict[object, tuple[object, T]] = {}

    def get(self, objects: Sequence[O], make: Callable[[Sequence[O]], T]) -> T:
        """The value ``make(objects)`` made from ``objects`` (these very ones, in order)."""
        key = tuple(map(id, objects))
        held = self._made.get(key)
        return held[1] if held is not None else self._add(key, tuple(objects), make(objects))

    def one(self, obj: O, make: Callable[[O], T]) -> T:
        """The value ``make(obj)`` made from ``obj`` alone."""
        held = self._made.get(id(obj))
        return held[1] if held is not None else self._add(id(obj), obj, make(obj))

    def _add(self, key: object, objects: object, made: T) -> T:
        if len(self._made) >= self._limit:
            self._made.clear()
        self._made[key] = (objects, made)
        return made
