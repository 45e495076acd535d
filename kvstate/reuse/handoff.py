"""Prefix load is not decode handoff: kvstate's side of the separation.

Two different things move KV in a disaggregated deployment:

- the **prefix load** (kvstate's operation): before prefill, the prefill worker loads a
  prefix that a decode worker retained, chosen by :mod:`kvstate.reuse.policy` and pinned by an
  :mod:`kvstate.reuse.inventory` lease;
- the **decode handoff** (the engine's): after prefill, the engine's KV connector hands
  the new KV to the decode worker, described by the request's ``kv_transfer_params``
  (vLLM's NixlConnector or MooncakeConnector, Dynamo, SGLang), including the engine ids
  of data-parallel *child* engines.

kvstate never reads, rewrites or re-serializes the handoff parameters (INV-HANDOFF-UNTOUCHED).
:func:`load_prefix` runs a prefix load with them held aside in a :class:`Untouched`
capsule: a fingerprint of the exact value (types, order, float bits) is taken before and
checked after, and the very same object is handed back. A change raises
:class:`TransitionError` (HANDOFF_MODIFIED): a kvstate bug, surfaced rather than shipped.

Where kvstate itself must name an engine (the decode worker it loads a prefix from),
:func:`resolve_child_engine` maps an engine id to exactly one advertised engine. vLLM gives
each data-parallel rank its own engine id, ``<engine_id>_dp<rank>`` (see
``vllm/v1/engine/core.py``, which appends the rank to ``kv_transfer_config.engine_id``),
so a parent id can match several children: that is :class:`ArgumentInvalid` (ENGINE_AMBIGUOUS), and no
match at all is :class:`ArgumentInvalid` (ENGINE_MISSING). kvstate never guesses.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import attrs

from kvstate.core.errors import ArgumentInvalid, TransitionError
from kvstate.core.reasons import ArgumentReason, TransitionReason

T = TypeVar("T")
P = TypeVar("P")

_MAX_DEPTH = 64


def fingerprint(value: object) -> bytes:
    """A digest of ``value`` that changes with any change of content, type or order.

    Covers what handoff parameters hold: None, bool, int, float (by its bits), str, bytes,
    list, tuple and dict (in insertion order). Anything else raises
    :class:`ArgumentInvalid` (HANDOFF_PARAMS), since it could change without the digest seeing it.
    """
    h = hashlib.blake2b(digest_size=32, person=b"kvstate-handoff")
    _feed(h, value, 0)
    return h.digest()


def _feed(h: Any, value: object, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ArgumentInvalid(ArgumentReason.HANDOFF_PARAMS, f"handoff parameters nest deeper than {_MAX_DEPTH} levels")
    t = type(value)
    if value is None:
        h.update(b"N")
    elif t is bool:
        h.update(b"T" if value else b"F")
    elif t is int:
        data = str(value).encode()
        h.update(b"I" + struct.pack("<Q", len(data)) + data)
    elif t is float:
        h.update(b"D" + struct.pack("<d", value))
    elif isinstance(value, str) and t is str:
        data = value.encode("utf-8", "surrogatepass")
        h.update(b"S" + struct.pack("<Q", len(data)) + data)
    elif isinstance(value, bytes) and t is bytes:
        h.update(b"B" + struct.pack("<Q", len(value)) + value)
    elif t is list or t is tuple:
        assert isinstance(value, (list, tuple))
        h.update((b"L" if t is list else b"U") + struct.pack("<Q", len(value)))
        for item in value:
            _feed(h, item, depth + 1)
    elif t is dict:
        assert isinstance(value, dict)
        h.update(b"M" + struct.pack("<Q", len(value)))
        for k, v in value.items():
            _feed(h, k, depth + 1)
            _feed(h, v, depth + 1)
    else:
        raise ArgumentInvalid(ArgumentReason.HANDOFF_PARAMS, 
            f"cannot fingerprint a {t.__name__} in handoff parameters; expected JSON-like values")


class Untouched(Generic[P]):
    """The engine's handoff parameters, held aside while kvstate works.

    :meth:`give_back` returns the very object captured, after checking that its content
    is exactly what it was (:class:`TransitionError` (HANDOFF_MODIFIED) otherwise).
    """

    __slots__ = ("_params", "_digest")

    def __init__(self, params: P) -> None:
        self._params = params
        self._digest = fingerprint(params)

    @property
    def digest(self) -> bytes:
        return self._digest

    def give_back(self) -> P:
        now = fingerprint(self._params)
        if now != self._digest:
            raise TransitionError(TransitionReason.HANDOFF_MODIFIED,
                                  "the decode handoff parameters changed during a prefix load")
        return self._params


@attrs.frozen
class PrefixLoaded(Generic[T, P]):
    """The prefix load's result, and the handoff parameters exactly as they came in."""

    result: T
    handoff_params: P


def load_prefix(handoff_params: P, load: Callable[[], T]) -> PrefixLoaded[T, P]:
    """Run the prefix load ``load`` with the engine's ``handoff_params`` held untouched.

    ``handoff_params`` is the request's ``kv_transfer_params`` (or ``None``); kvstate does
    not interpret it. The returned :class:`PrefixLoaded` carries the same object.
    """
    capsule = Untouched(handoff_params)
    result = load()
    return PrefixLoaded(result, capsule.give_back())


_DP_SUFFIX = re.compile(r"_dp(\d+)\Z")


def resolve_child_engine(engine_id: str, advertised: Iterable[str], *, dp_rank: int | None = None) -> str:
    """The one advertised engine that ``engine_id`` (and optionally ``dp_rank``) names.

    - with ``dp_rank``: exactly ``<engine_id>_dp<dp_rank>``;
    - without: ``engine_id`` itself or its children ``<engine_id>_dp<n>``, which must be
      exactly one engine.
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise ArgumentInvalid(ArgumentReason.ENGINE_MISSING, f"engine id must be a non-empty string, got {engine_id!r}")
    if isinstance(advertised, str):
        raise ArgumentInvalid(ArgumentReason.ENGINE_MISSING,
                              "advertised engine ids must be a collection of strings, not one string")
    known = sorted(set(advertised))
    if dp_rank is not None:
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise ArgumentInvalid(ArgumentReason.ENGINE_MISSING,
                                  f"dp_rank must be a non-negative integer, got {dp_rank!r}")
        child = f"{engine_id}_dp{dp_rank}"
        if child not in known:
            raise ArgumentInvalid(ArgumentReason.ENGINE_MISSING,
                                  f"child engine {child!r} is not advertised; advertised: {', '.join(known)}")
        return child
    matches = [e for e in known if e == engine_id
               or (e.startswith(engine_id) and _DP_SUFFIX.fullmatch(e[len(engine_id):]) is not None)]
    if not matches:
        raise ArgumentInvalid(ArgumentReason.ENGINE_MISSING,
                              f"no advertised engine matches {engine_id!r}; advertised: {', '.join(known)}")
    if len(matches) > 1:
        raise ArgumentInvalid.engine_ambiguous(engine_id, matches)
    return matches[0]
