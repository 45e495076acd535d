"""Block epochs: a page per bank that says, for each block, whether a store is writing it
and how many stores it has seen, so that a load can tell it copied a block no store
touched (docs/proposals/lease-per-link.md, item 3).

The exporter keeps, per block, a 64-bit epoch in a memfd of its own (:class:`EpochPage`),
which it maps read-write and then seals with ``F_SEAL_FUTURE_WRITE``: an importer that
receives the fd can map it read-only and nothing else. A store makes each of its blocks'
epochs odd before its first op is submitted, and even again once every op of it ended
(done, failed or cancelled): the op engine does that as the last op ends, before the
store's report goes out (``kvs_report_open``), and the store's collection where the
engine could not. A block's epoch is odd exactly while a store may be writing it, and
it never goes back. One store at a time per block: a second store
on a block whose epoch is odd is refused (Busy, ``storing``), since two stores would
make each other's odd epoch even.

An importer reads a load's source blocks as a seqlock reader does (:class:`EpochView`):
their epochs once before its ops are submitted, and again once the ops completed. The
load vouches for a block only when both reads are the same even number; otherwise the
rank's copies count as failed and the engine recomputes them
(:meth:`kvstate.share.transfer.TransferHandle._activate`, ``held``). Epochs are
compared at full width and the page lives as long as the bank's memory, so they never
wrap or restart under a reader.

Order: the exporter's odd store precedes the op submission, and its even store (a
release compare-and-swap in the op engine) follows the last op's completion; the
importer's first read precedes its submission, and its second follows the completion it
observed. Each of those hand-offs crosses a lock or an atomic of the
op engine, which orders the plain 8-byte loads and stores around it.

Writes through ``Bank.tensors()`` (the engine using the bank as its KV cache) are not
stores: no epoch covers them.
"""

from __future__ import annotations

import fcntl
import functools
import mmap
import operator
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

from kvstate.core.errors import Busy, NativeError
from kvstate.core.reasons import BusyReason, NativeReason

#: Not in Python's fcntl module: no new writable mapping, write() refused (Linux 5.1).
F_SEAL_FUTURE_WRITE = 0x0010
#: The seals an importer requires of a received page.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL | F_SEAL_FUTURE_WRITE
#: Bytes per block: one unsigned 64-bit epoch.
ENTRY_BYTES = 8


def page_size(num_blocks: int) -> int:
    """The page's size in bytes: one entry per block, rounded up to whole pages."""
    page = mmap.PAGESIZE
    return max(page, -(-num_blocks * ENTRY_BYTES // page) * page)


def _read(epochs: memoryview, blocks: Sequence[int]) -> tuple[int, ...]:
    # itemgetter of one index returns an item, not a tuple.
    if len(blocks) > 1:
        return operator.itemgetter(*blocks)(epochs)  # type: ignore[no-any-return]
    return tuple(epochs[b] for b in blocks)


def new_page(num_blocks: int, label: str) -> EpochPage:
    """A bank's page; NativeError (OS) when the system refuses one (nothing is left)."""
    try:
        return EpochPage(num_blocks, label)
    except OSError as exc:
        raise NativeError(NativeReason.OS, f"{label}: cannot make its epoch page: {exc.strerror or exc}",
                          call="epoch page", errno=exc.errno) from exc


class Begun(NamedTuple):
    """A store's epochs, made odd by :meth:`EpochPage.begin`: what ends them, there
    (:meth:`EpochPage.end`) or in the op engine as the store's last op ends
    (``kvs_report_open``, which takes the three in this order)."""

    page: mmap.mmap           # the bank's page, mapped writable
    blocks: tuple[int, ...]   # the store's blocks, once each
    odd: tuple[int, ...]      # their odd epochs: an end moves only these on


class EpochPage:
    """The exporter's page of one bank (see the module docstring)."""

    def __init__(self, num_blocks: int, label: str) -> None:
        self.num_blocks = num_blocks
        self.size = page_size(num_blocks)
        fd = os.memfd_create(f"kvs-epochs {label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        m = None
        try:
            os.ftruncate(fd, self.size)
            m = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # after the one writable mapping
        except BaseException:
            if m is not None:
                m.close()
            os.close(fd)
            raise
        self._map = m
        self.fd: int | None = fd
        self._epochs = memoryview(self._map).cast("Q")
        self._lock = threading.Lock()  # stores start and end on different threads

    def begin(self, blocks: Sequence[int], label: str) -> Begun:
        """A store of ``blocks`` is about to be submitted: each epoch goes odd, all or none.
        Busy (``storing``) when another store still writes one of them. Returns what ends
        them (:meth:`end`, or the op engine as the store's last op ends: ``Plan.epochs``)."""
        e = self._epochs
        with self._lock:
            busy = sorted({b for b in blocks if e[b] & 1})
            if busy:
                raise Busy(BusyReason.STORING, f"{label}: a store is still writing bank block(s) {busy[:8]}; "
                                               "one store at a time per block")
            ids = tuple(dict.fromkeys(blocks))  # once each: a block named twice must not come out even
            for b in ids:
                e[b] += 1
            return Begun(self._map, ids, tuple(e[b] for b in ids))

    def end(self, blocks: Sequence[int], odd: Sequence[int]) -> None:
        """No op of the store that made ``blocks`` odd (``odd``, from :meth:`begin`) writes
        any more: each goes even, unless it already did. Whether the store succeeded or not."""
        e = self._epochs
        with self._lock:
            for b, o in zip(blocks, odd):
                if e[b] == o:
                    e[b] = o + 1

    def epoch(self, block: int) -> int:
        return int(self._epochs[block])

    def close(self) -> None:
        """With the bank's memory (released): the fd and this mapping go; importers' own
        mappings stay valid."""
        fd, self.fd = self.fd, None
        if fd is not None:
            self._epochs.release()
            self._map.close()
            os.close(fd)


class EpochView:
    """An importer's read-only mapping of an exporter's :class:`EpochPage`."""

    def __init__(self, epochs: memoryview, num_blocks: int, mapping: mmap.mmap | None = None) -> None:
        self._epochs = epochs
        self._map = mapping
        self.num_blocks = num_blocks

    @classmethod
    def open(cls, fd: int, num_blocks: int) -> EpochView:
        """Map a received page read-only (the fd stays the caller's). ValueError when it is
        not a sealed page of ``num_blocks`` entries: an exporter's page can be written only
        through the exporter's own mapping."""
        st = os.fstat(fd)
        if st.st_size != page_size(num_blocks):
            raise ValueError(f"an epoch page of {st.st_size} bytes, not {page_size(num_blocks)}")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & SEALS != SEALS:
            raise ValueError(f"an epoch page without the seals {SEALS:#x} (has {seals:#x})")
        m = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        return cls(memoryview(m).cast("Q"), num_blocks, m)

    def read(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """The epochs of ``blocks`` now (before a load's ops are submitted)."""
        return _read(self._epochs, blocks)

    def close(self) -> None:
        """Unmap (the link it came on closed). A load still asking gets an error, which
        vouches for nothing (:meth:`kvstate.share.transfer.TransferHandle._lost`)."""
        self._epochs.release()
        if self._map is not None:
            self._map.close()

    def vouches(self, blocks: Sequence[int], before: tuple[int, ...]) -> bool:
        """After a load's ops completed: no store wrote ``blocks`` since :meth:`read` gave
        ``before``, nor was one writing them then."""
        return _read(self._epochs, blocks) == before and not functools.reduce(operator.or_, before, 0) & 1
