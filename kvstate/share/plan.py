"""A checked transfer plan, submitted all or nothing.

Both directions (``Group.load``: bank blocks into engine pages; ``Bank.store``: engine
pages into bank blocks) first build a :class:`Plan`: every argument checked, every
tensor adapted, every copy list computed. Nothing is submitted while building, and a
refusal gives back every tensor adapted so far. :meth:`Plan.submit` then submits one op
per (rank, region). If submitting op k fails, ops 0..k-1 are cancelled where still
queued and awaited where a worker already took them, everything is reaped and given
back, and the failure is raised: no op of the plan is left in flight.

What a failed submit may leave written: the blocks of the plan's destinations that ops
already running copied (never a byte outside the plan's block ids). A cancelled op
writes nothing. The caller treats every block of the plan as not loaded.
"""

from __future__ import annotations

import itertools
import operator
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvstate.core.errors import KvStateError, ArgumentInvalid, TransferFailed
from kvstate.core.reasons import ArgumentReason, TransferFailReason
from kvstate.share.tensors import TensorRef
from kvstate.share.epochs import Begun
from kvstate.share.transfer import TransferHandle

#: Most block ids in one transfer.
MAX_BLOCKS = 1 << 20


def block_ids(values: object, limit: int | None, where: str) -> tuple[int, ...]:
    """``values`` as a tuple of ints in 0..limit-1 (any limit when None), or ArgumentInvalid (a load/store reason)."""
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Iterable):
        raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, where, f"must be a sequence of ints, not "
                                       f"{type(values).__name__}")
    try:
        items = list(itertools.islice(values, MAX_BLOCKS + 1))
    except Exception as exc:  # a caller's iterator failing is a bad argument, reported as such
        raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, where, f"iterating failed: {exc!r:.80}") from None
    if len(items) > MAX_BLOCKS:
        raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, where, f"more than {MAX_BLOCKS} blocks")
    out: list[int] = []
    for i, v in enumerate(items):
        if isinstance(v, bool) or type(v).__name__ in ("bool_", "bool"):  # numpy's too
            raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS,
                                           f"{where}[{i}]", f"{v!r} is a bool, not a block id")
        try:
            n = operator.index(v)
        except Exception:  # TypeError, or whatever a foreign __index__ raises
            raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, f"{where}[{i}]",
                                           f"{v!r:.40} is not an int") from None
        if n < 0 or (limit is not None and n >= limit):
            bound = "a block id >= 0" if limit is None else f"0..{limit - 1}"
            raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, f"{where}[{i}]", f"{n} is outside {bound}")
        out.append(n)
    if not out:
        raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, where, "no blocks")
    return tuple(out)


def unique(ids: Sequence[int], where: str) -> None:
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        for i, b in enumerate(ids):
            if b in seen:
                raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, f"{where}[{i}]",
                                               f"block {b} appears twice: two copies would write it")
            seen.add(b)


def apart(targets: Sequence[tuple[int, str, int, int]]) -> None:
    """Refuse destinations that two copies of one load would both write: (rank, where,
    address, span) of each destination tensor. Ranks never share memory, so any overlap
    across ranks is refused; one rank's regions may interleave (strided views of one
    tensor), so there only a tensor given for two regions is."""
    seen: dict[tuple[int, int, int], str] = {}
    for r, where, addr, n in targets:
        if n and seen.setdefault((r, addr, n), where) != where:
            raise ArgumentInvalid.transfer(ArgumentReason.TENSOR, where, f"is the tensor of {seen[(r, addr, n)]}: "
                                           "two copies would write the same bytes")
    # Each rank's spans merged, then one sweep: a span starting before the furthest end so
    # far overlaps that span, which (merged spans of one rank being apart) is another rank's.
    merged: list[tuple[int, int, int, str]] = []
    for r in sorted({t[0] for t in targets}):
        mine = sorted((a, a + n, w) for rank, w, a, n in targets if rank == r and n)
        for start, end, where in mine:
            if merged and merged[-1][2] == r and start < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]), r, merged[-1][3])
            else:
                merged.append((start, end, r, where))
    merged.sort()
    furthest: tuple[int, int, int, str] | None = None
    for span in merged:
        if furthest is not None and span[0] < furthest[1]:
            raise ArgumentInvalid.transfer(ArgumentReason.TENSOR, span[3], f"shares memory with {furthest[3]}: "
                                           "two copies would write the same bytes")
        if furthest is None or span[1] > furthest[1]:
            furthest = span


def triples(pairs: Sequence[tuple[int, int, int]], src_bases: Sequence[int], dst_bases: Sequence[int]) -> array[int]:
    """The op engine's block list (uint64 triples src_off, dst_off, len) for copying the
    runs ``pairs`` of every block: block i's copies start at src_bases[i], dst_bases[i]."""
    n, k = len(src_bases), len(pairs)
    out = array("Q", bytes(24 * n * k))
    for j, (ps, pd, pl) in enumerate(pairs):
        out[3 * j::3 * k] = array("Q", [s + ps for s in src_bases])
        out[3 * j + 1::3 * k] = array("Q", [d + pd for d in dst_bases])
        out[3 * j + 2::3 * k] = array("Q", [pl]) * n
    return out


@attrs.define(eq=False)
class Copy:
    """One op: ``blocks`` from ``src`` to ``dst`` (a mapping, a RawBuffer or a buffer)."""

    src: Any
    dst: Any
    blocks: Any                  # the block list, or a function building it (called at submit)
    region: str
    rank: int
    nbytes: int


@attrs.define(eq=False)
class Plan:
    """Everything one transfer will submit; see the module docstring."""

    kind: str                    # "load" or "store"
    label: str
    blocks: tuple[int, ...]      # destination block ids (load) or bank block ids (store)
    copies: list[Copy] = attrs.field(factory=list)
    refs: list[TensorRef] = attrs.field(factory=list)
    handle: TransferHandle | None = None
    #: (socket, ok, failed): the op engine sends one of them as the last op ends
    #: (:meth:`TransferHandle.report`). Armed here, before the handle can finish, so a fast
    #: op cannot end first and leave the message to Python (whose GIL an engine may hold).
    report: tuple[int, bytes, bytes] | None = None
    #: A store's block epochs, to end as its last op ends (:meth:`TransferHandle.report`).
    epochs: Begun | None = None
    #: A load's bank block ids: their block epochs are read before it is submitted and
    #: again once its copies completed (:meth:`kvstate.share.part.Part._voucher`).
    sources: tuple[int, ...] = ()

    def release(self) -> None:
        """Give back the tensors of a plan that was never submitted (idempotent)."""
        refs, self.refs = self.refs, []
        for r in refs:
            r.release()

    def submit(self, transport: Any) -> TransferHandle:
        """Submit every copy, all or nothing (see the module docstring). The handle is not
        yet active: the owner tracks it, then calls ``handle._activate(hook)``."""
        notify = hasattr(transport, "submit_blocks")
        h = TransferHandle(self.kind, self.label, self.blocks, notify=notify)
        h._keep(self.refs)
        self.refs = []
        submitted = 0
        try:
            for c in self.copies:
                blocks = c.blocks() if callable(c.blocks) else c.blocks  # built as late as possible
                if notify:
                    op = transport.submit_blocks(c.src, c.dst, blocks)
                else:  # a backend without completion fds: waiters poll its ops
                    op = transport.submit_gather(c.src, c.dst, blocks)
                h._add(op, c.region, c.rank, c.nbytes)
                submitted += 1
        except (KvStateError, OSError) as exc:
            c = self.copies[submitted]
            h._abort()
            which = TransferFailReason.LOAD if self.kind == "load" else TransferFailReason.STORE
            raise TransferFailed(which, f"{self.label}: submitting region {c.region!r} of rank {c.rank} failed "
                                        f"({exc}); the {submitted} op(s) submitted before it were cancelled or "
                                        "awaited, nothing is in flight") from exc
        except BaseException:
            h._abort()
            raise
        h.epochs = self.epochs
        try:
            if self.report is not None or self.epochs is not None:  # not yet activated: no op is reaped, so
                # this cannot miss one. False (socket gone): report_status stays None, the owner reports.
                if not h.report(*(self.report or (None, b"", b"")), epochs=self.epochs) \
                        and self.report is not None and self.epochs is not None:
                    h.report(None, b"", b"", epochs=self.epochs)  # the epochs at least
        except BaseException:  # the ops are in flight: nothing may be left behind them
            h._abort()
            raise
        self.handle = h
        return h
