"""The decode index's lookup table, mirrored in C and answered by a native thread.

The decode engine's scheduler process (vLLM's EngineCore) busy-polls holding its GIL, so a
prefill scheduler's ``lookup`` and ``descriptors`` must not wait for its Python. The
mirror (``ffi/kvs_index.c``) holds what those answers need: each advertised block's hash,
bank block and inventory key, and, while every rank is connected at one generation, the
ranks' epochs, the generation and the ``descriptor_set`` reply. Its thread
(``ffi/kvs_index_thread.c``) serves the index's socket. :class:`~.index.DecodeIndex` keeps
the mirror up to date as its :class:`~.slots.SlotTable` advertises and evicts, and as
ranks come, advertise and go: off the request path, under the table's and the index's
own locks, so the mirror changes in the order they do.

What the mirror does not answer (a decode rank's ``hello``, a question under another
compatibility key, anything malformed) comes back with its connection
(:meth:`IndexMirror.handoffs`), and Python's DecodeIndex, the reference, serves that
connection from then on. Lookups found blocks are reported back (:meth:`touched`) so the
table's least-recently-used order still counts them.

Stores reach the lookups the same way, without the scheduler's Python: the table names
each block it assigns (:meth:`expect`), the index names each rank's process
(:meth:`rank`), and each rank opens a report link to the thread, on which its op engine
sends the ``stored`` report as the store ends. The thread advertises a block once every
rank reported it, then queues the report for the table (:meth:`reports`), whose own
account follows (its advertise of a block the thread advertised is a no-op).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from kvstate import channel as chan
from kvstate.core.errors import ArgumentInvalid, KvStateError
from kvstate.core.reasons import ArgumentReason
from kvstate.transport import native


class IndexMirror:
    """One decode index's native mirror and server (see the module docstring)."""

    def __init__(self, compat: bytes, not_ready: bytes, *, hash_bytes: int, capacity: int, max_blocks: int,
                 limits: chan.Limits, max_connections: int, first_timeout_s: float, idle_s: float) -> None:
        nat = native.default()
        # Untyped: kvstate.transport.libkvs types the memory and op calls, not these.
        self._nat = nat
        ffi: Any = nat.ffi
        lib: Any = nat.lib
        self.ffi, self.lib = ffi, lib
        self.hash_bytes = hash_bytes
        self._max_payload = limits.max_payload
        out = ffi.new("kvs_index **")
        self._check(lib.kvs_index_new(compat, len(compat), not_ready, len(not_ready), hash_bytes, capacity,
                                           max_blocks, limits.max_payload, os.getuid(), max_connections,
                                           int(first_timeout_s * 1e9), int(idle_s * 1e9), out), "kvs_index_new")
        def free(x: Any) -> None:  # a thread still running is stopped first
            lib.kvs_index_stop(x)
            lib.kvs_index_free(x)

        self._x = ffi.gc(out[0], free)
        self._out = ffi.new("char[]", limits.max_payload)
        self._report = ffi.new("char[]", limits.max_payload)  # reports()'s own (handoffs() uses _out)
        self._report_len = ffi.new("uint32_t *")
        self._len = ffi.new("uint32_t *")
        self._fd = ffi.new("int32_t *")

    def _check(self, rc: int, call: str) -> None:
        if rc < 0:
            raise self._nat.error(rc, call, "the decode index's mirror")

    def deadlines(self, first_timeout_s: float, idle_s: float) -> None:
        """How long a new connection may stay silent, and one that was answered."""
        self._check(self.lib.kvs_index_deadlines(self._x, int(first_timeout_s * 1e9), int(idle_s * 1e9)),
                    "kvs_index_deadlines")

    # -- what Python keeps up to date ---------------------------------------------------

    def advertise(self, block_hash: bytes, slot: int, key: int) -> None:
        self._check(self.lib.kvs_index_advertise(self._x, self._hash(block_hash), slot, key), "kvs_index_advertise")

    def expect(self, block_hash: bytes, slot: int, key: int, tp: int) -> None:
        """Bank block ``slot`` is being stored with ``block_hash`` under ``key`` on each of
        ``tp`` ranks: the thread advertises it once every rank's report came on its link."""
        self._check(self.lib.kvs_index_expect(self._x, self._hash(block_hash), slot, key, tp), "kvs_index_expect")

    def settle(self, slot: int, key: int) -> None:
        """No longer expected (the table decided the block's outcome itself)."""
        rc = self.lib.kvs_index_settle(self._x, slot, key)
        if rc != self.lib.KVS_E_NOENT:
            self._check(rc, "kvs_index_settle")

    def rank(self, rank: int, pid: int) -> None:
        """Rank ``rank`` runs in process ``pid`` (0: in none): only it may open its report link."""
        self._check(self.lib.kvs_index_rank(self._x, rank, pid), "kvs_index_rank")

    def reports(self) -> list[bytes]:
        """The ``stored`` reports the thread took from the ranks' report links since the
        last call, in the order they came (the table's account of them is Python's)."""
        out: list[bytes] = []
        n = self._report_len
        while self.lib.kvs_index_next_report(self._x, self._report, self._max_payload, n) == 1:
            out.append(bytes(self.ffi.buffer(self._report, n[0])))
        return out

    @property
    def advertised_here(self) -> int:
        """Blocks the thread advertised from the ranks' reports."""
        return int(self.lib.kvs_index_advertised_here(self._x))

    def withdraw(self, block_hash: bytes) -> None:
        rc = self.lib.kvs_index_withdraw(self._x, self._hash(block_hash))
        if rc != self.lib.KVS_E_NOENT:
            self._check(rc, "kvs_index_withdraw")

    def _hash(self, block_hash: bytes) -> bytes:
        if len(block_hash) != self.hash_bytes:
            raise ArgumentInvalid.of("block_hash", ArgumentReason.LENGTH,
                                     f"has {len(block_hash)} bytes, not {self.hash_bytes}")
        return block_hash

    def advertised(self) -> int:
        return int(self.lib.kvs_index_advertised(self._x))

    def ready(self, descriptor_set: bytes, epochs: Sequence[int], generation: int) -> None:
        arr = self.ffi.new("uint64_t[]", list(epochs))
        self._check(self.lib.kvs_index_ready(self._x, descriptor_set, len(descriptor_set), arr, len(epochs),
                                             generation), "kvs_index_ready")

    def unready(self) -> None:
        self._check(self.lib.kvs_index_unready(self._x), "kvs_index_unready")

    # -- answers ------------------------------------------------------------------------------

    def answer(self, request: bytes) -> bytes | None:
        """The native reply to one request payload, or None: Python answers it."""
        out = self.ffi.new("char[]", self._max_payload)
        rc = self.lib.kvs_index_answer(self._x, request, len(request), out, self._max_payload, self._len)
        if rc == self.lib.KVS_INDEX_PYTHON:
            return None
        self._check(rc, "kvs_index_answer")
        return bytes(self.ffi.buffer(out, self._len[0]))

    def touched(self) -> list[int]:
        """The bank blocks native lookups found since the last call, oldest first."""
        out: list[int] = []
        buf = self.ffi.new("uint32_t[]", 4096)
        while True:
            n = self.lib.kvs_index_touched(self._x, buf, 4096)
            out.extend(buf[0:n])
            if n < 4096:
                return out

    @property
    def lookups(self) -> int:
        return int(self.lib.kvs_index_lookups(self._x))

    # -- the thread ---------------------------------------------------------------------------

    def serve(self, listen_fd: int) -> None:
        self._check(self.lib.kvs_index_serve(self._x, listen_fd), "kvs_index_serve")

    def stop(self) -> None:
        self._check(self.lib.kvs_index_stop(self._x), "kvs_index_stop")

    def connections(self) -> int:
        return int(self.lib.kvs_index_connections(self._x))

    def handoff_fd(self) -> int:
        return int(self.lib.kvs_index_handoff_fd(self._x))

    def handoffs(self, limits: chan.Limits) -> list[tuple[chan.Channel | None, bytes]]:
        """The connections waiting for Python, each with the request it sent (a channel of
        None: the peer could not be set up, for example it has exited)."""
        out: list[tuple[chan.Channel | None, bytes]] = []
        while self.lib.kvs_index_next_handoff(self._x, self._fd, self._out, self._max_payload, self._len) == 1:
            payload = bytes(self.ffi.buffer(self._out, self._len[0]))
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=self._fd[0])
            try:
                out.append((chan.Channel(sock, limits=limits), payload))
            except KvStateError:  # the Channel closed the socket
                out.append((None, payload))
        return out
