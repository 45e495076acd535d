"""The prefill side's client of a decode source's index (:mod:`.index`).

:class:`IndexClient` keeps one connection per source (reconnecting after a failure) and
caches the source's descriptors. A ``found`` reply names the generation of the
descriptors it was computed under; the client fetches them again when that changes or
when they near expiry. It does not carry the exporter's incarnation: a reply is never
atomic with the exporters anyway (a decode engine may restart right after it), so the
lease is the one authority on staleness. After a decode restart the first load with the
old descriptors is refused (``stale_incarnation``), the connector drops the cache, and
vLLM recomputes those blocks.

**Questions in flight.** The scheduler asks from vLLM's scheduling loop, and every
request running in the engine waits for that loop. So a question is sent, and its reply
read later: a call that names a ``token`` waits at most ``wait_s`` and returns None while
the reply is still on its way; the next call with the same token reads it. The index
answers a connection's questions in order, so the client matches replies to questions by
their order. A question unanswered ``timeout_s`` after it was sent is refused
(``timeout``), and the connection closes with every question on it: a late reply must
never be read as the next question's. A call without a token waits for its reply, up to
``timeout_s``.
"""

from __future__ import annotations

import collections
import select
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvstate import channel as chan
from kvstate.channel.tcp import SCHEME, connect_tcp
from kvstate.core.descriptor import decode as decode_descriptor
from kvstate.core.errors import ChannelError, DescriptorRejected
from kvstate.core.identity import Deployment
from kvstate.core.reasons import ChannelReason
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.hashing import COMPAT_FIELDS, Compat, block_keys


@attrs.frozen
class Found:
    """A lookup's answer: the first ``blocks`` prefix blocks are retained, in these bank
    blocks under these inventory keys; ``epochs[r]`` is rank r's inventory epoch, all under
    descriptors of ``generation``."""

    blocks: int
    slots: tuple[int, ...]
    keys: tuple[int, ...]
    epochs: tuple[int, ...]
    generation: int

    def names(self, deployment: Deployment, hashes: Sequence[bytes], first: int = 0) -> bool:
        """Whether blocks ``first`` to ``blocks`` are those of the prompt with these
        ``hashes``: each key must be the decode side's key of the prompt's own hash in that
        bank block (:func:`~.hashing.block_keys`). The lease pins a block by its key, so a
        reply that passes names this prompt's KV and no other."""
        return self.blocks <= len(hashes) and \
            block_keys(deployment, hashes[first:self.blocks], self.slots[first:self.blocks]) == \
            list(self.keys[first:self.blocks])


#: The reasons an index refuses a question with: the compatibility key's (hashing) and its own.
INDEX_REFUSALS = frozenset({reason for _, reason in COMPAT_FIELDS} | {"malformed", "decode_not_ready"})


def _connection_limit(payload: bytes) -> bool:
    """Whether ``payload`` is a channel server's refusal of a connection over its cap."""
    try:
        return chan.decode(payload).get("code") == "ConnectionLimit"
    except ChannelError:
        return False


@attrs.frozen
class Refusal:
    """No answer to use: ``reason`` is a short code (``unreachable``, ``timeout``,
    ``protocol``, ``busy``, ``decode_not_ready``, ``tp_mismatch`` and the other
    compatibility reasons)."""

    reason: str
    detail: str


Reply = dict[str, Any]


def _refusal(reply: Reply) -> Refusal:
    """The index's ``refused`` reply: a peer's word, so only a known reason becomes a metric label."""
    return Refusal(reply["reason"] if reply["reason"] in INDEX_REFUSALS else "refused", reply["detail"])


@attrs.define(eq=False)
class _Question:
    token: Hashable
    deadline: float
    wanted: bool = True  # False once forgotten: its reply is read and dropped


class IndexClient:
    """One prefill scheduler's connection to one decode source's index (see the module
    docstring). Not thread-safe: the scheduler calls it from its one thread."""

    def __init__(self, path: Path | str, deployment: Deployment, timeout_s: float, *,
                 refresh_before_s: float = 60.0) -> None:
        #: a socket path (this node) or ``tcp://HOST:PORT`` (another node's index)
        self.address = str(path) if str(path).startswith(SCHEME) else None
        self.path = Path(path)
        self.deployment = deployment
        self.timeout_s = timeout_s
        self.refresh_before_s = refresh_before_s
        self._ch: chan.Channel | None = None
        self._asked: collections.deque[_Question] = collections.deque()  # on self._ch, in order
        self._replies: dict[Hashable, Reply | Refusal] = {}
        self._descriptors: tuple[bytes, ...] | None = None
        self._generation = -1
        self._expires_ns = 0

    def close(self) -> None:
        self._fail_all(Refusal("unreachable", "the client closed its connection"))

    def in_flight(self) -> int:
        """Questions someone still waits for, answered or not (sizes); a forgotten one is
        read and dropped with the next reply on its connection."""
        return sum(q.wanted for q in self._asked) + len(self._replies)

    def distrust(self, detail: str) -> None:
        """A reply broke the protocol in a way only its asker can see: the connection closes,
        and every question on it is refused (``protocol``)."""
        self._fail_all(Refusal("protocol", detail))

    def forget(self, token: Hashable) -> None:
        """The asker no longer wants ``token``'s reply (its request ended or was decided)."""
        self._replies.pop(token, None)
        for q in self._asked:
            if q.token == token:
                q.wanted = False

    # -- questions and replies ----------------------------------------------------------------

    def _fail_all(self, refusal: Refusal) -> None:
        """Close the connection; every question on it gets ``refusal``."""
        if self._ch is not None:
            self._ch.close()
            self._ch = None
        while self._asked:
            q = self._asked.popleft()
            if q.wanted:
                self._replies[q.token] = refusal

    def _connect(self) -> chan.Channel:
        if self._ch is None:
            if self.address is not None:
                self._ch = connect_tcp(self.address, self.deployment, timeout=self.timeout_s, limits=wire.LIMITS)
            else:
                self._ch = chan.connect(self.path, timeout=self.timeout_s, limits=wire.LIMITS)
        return self._ch

    def _waiting_for(self, token: Hashable) -> bool:
        return any(q.token == token and q.wanted for q in self._asked)

    def _send(self, token: Hashable, payload: bytes) -> None:
        if self._ch is not None and not self._asked and self._ch.hung_up():
            self._fail_all(Refusal("unreachable", ""))  # the index closed it while idle (or restarted)
        for attempt in (0, 1):  # one reconnect: the index may have closed it just now
            try:
                ch = self._connect()
            except (ChannelError, OSError) as exc:
                self._replies[token] = Refusal("unreachable", str(exc))
                return
            try:
                ch.send(payload, timeout=self.timeout_s)
            except ChannelError as exc:
                refusal = Refusal("timeout" if exc.reason is ChannelReason.TIMEOUT else "unreachable", str(exc))
                again = not attempt and not self._asked and exc.reason is ChannelReason.CLOSED
                self._fail_all(refusal)
                if not again:
                    self._replies[token] = refusal
                    return
                continue
            self._asked.append(_Question(token, time.monotonic() + self.timeout_s))
            return

    def _read_one(self, until: float) -> bool:
        """Read the oldest question's reply, waiting until ``until`` at most; past that
        question's deadline, every question on the connection is refused. False when
        nothing came."""
        q, ch = self._asked[0], self._ch
        assert ch is not None
        if not ch.pending():
            now = time.monotonic()
            wait = min(until, q.deadline) - now
            if wait > 0:
                p = select.poll()  # not select(): it refuses fds past FD_SETSIZE, common in engines
                p.register(ch.fileno(), select.POLLIN)
                p.poll(max(1, int(wait * 1000 + 0.999)))
            if not ch.pending():
                if time.monotonic() < q.deadline:
                    return False
                self._fail_all(Refusal("timeout", f"no answer within {self.timeout_s} s"))
                return True
        try:
            with ch.recv(timeout=max(0.0, q.deadline - time.monotonic())) as msg:
                payload = bytes(msg.payload)
        except ChannelError as exc:
            self._fail_all(Refusal({ChannelReason.TIMEOUT: "timeout", ChannelReason.PROTOCOL: "protocol"}
                                   .get(exc.reason, "unreachable"), str(exc)))
            return True
        try:
            reply: Reply = wire.decode(payload, "found", "descriptor_set", "refused")
        except ChannelError as exc:
            # the server's own refusal of a connection over its cap, not the index's
            if exc.reason is ChannelReason.PROTOCOL and _connection_limit(payload):
                self._fail_all(Refusal("busy", "the decode index serves its most connections now"))
            else:
                self._fail_all(Refusal("protocol", str(exc)))
            return True
        self._asked.popleft()
        if q.wanted:
            self._replies[q.token] = reply
        return True

    def _ask(self, token: Hashable | None, payload: bytes, wait_s: float | None) -> Reply | Refusal | None:
        """``token``'s reply: asked by the first call that names it, read by this call or a
        later one; None while it is still in flight after ``wait_s``. Without a token:
        asked now, and waited for up to the timeout."""
        if token is None:
            token, wait_s = object(), None
        if token not in self._replies and not self._waiting_for(token):
            self._send(token, payload)
        until = time.monotonic() + (self.timeout_s if wait_s is None else wait_s)
        while token not in self._replies:
            if not self._read_one(until) and time.monotonic() >= until:  # else it woke early: wait on
                return None
        return self._replies.pop(token)

    # -- the two questions ----------------------------------------------------------------------

    def lookup(self, compat: Compat, hashes: Sequence[bytes], *, token: Hashable | None = None,
               wait_s: float | None = None) -> Found | Refusal | None:
        """How many of ``hashes`` (a prompt's prefix blocks) the source retains. With a
        ``token``: None while the reply is in flight (see the module docstring)."""
        reply = self._ask(token, wire.encode("lookup", compat=compat.as_dict(),
                                             hashes=b"".join(hashes[:wire.MAX_BLOCKS])), wait_s)
        if reply is None or isinstance(reply, Refusal):
            return reply
        if reply["kind"] == "refused":
            return _refusal(reply)
        if reply["kind"] != "found" or not reply["epochs"] or \
                not len(reply["slots"]) == len(reply["keys"]) == reply["blocks"] <= len(hashes):
            self._fail_all(Refusal("protocol", "a malformed reply came before"))
            return Refusal("protocol", f"malformed answer to a lookup: {reply!r:.100}")
        return Found(reply["blocks"], tuple(reply["slots"]), tuple(reply["keys"]), tuple(reply["epochs"]),
                     reply["generation"])

    def descriptors(self, compat: Compat, generation: int, *, token: Hashable | None = None,
                    wait_s: float | None = None) -> tuple[bytes, ...] | Refusal | None:
        """The source's descriptors: the cached ones unless ``generation`` differs from
        theirs or they expire within ``refresh_before_s``. With a ``token``: None while
        the reply is in flight."""
        if self._descriptors is not None and generation == self._generation \
                and time.time_ns() + self.refresh_before_s * 1e9 < self._expires_ns:
            if token is not None:
                self.forget(token)  # asked before the cache had them: that reply is not needed
            return self._descriptors
        reply = self._ask(token, wire.encode("descriptors", compat=compat.as_dict()), wait_s)
        if reply is None or isinstance(reply, Refusal):
            return reply
        if reply["kind"] == "refused":
            return _refusal(reply)
        if reply["kind"] != "descriptor_set" or not reply["descriptors"]:
            self._fail_all(Refusal("protocol", "a malformed reply came before"))
            return Refusal("protocol", "malformed answer to a descriptor request")
        try:
            decoded = [decode_descriptor(d, self.deployment) for d in reply["descriptors"]]
        except DescriptorRejected as exc:
            return Refusal(exc.reason.value, str(exc))
        self._descriptors = tuple(reply["descriptors"])
        self._generation = decoded[0].generation
        self._expires_ns = min(d.expires_at_ns for d in decoded)
        return self._descriptors

    def drop_descriptors(self) -> None:
        """Forget the cached descriptors (a lease or the validation refused them)."""
        self._descriptors = None
        self._generation = -1
