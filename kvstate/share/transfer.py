"""Handles of loads and stores in flight: per-region waits, cancel, failed blocks, a
completion callback and a pollable fd.

Theory of operation
-------------------

A transfer is one native op per (rank, region), all submitted before the call that made
the handle returns; the copies run on the op engine's threads. The last op is told to
add 1 to the handle's private eventfd when it becomes collectable (done, failed or
cancelled: ``kvs_op_notify``). One dispatcher thread per process polls the private fds
of every live handle (epoll); woken, it looks for an op still pending (ops finish
roughly in order, so usually there is none) and has that one notify in turn. When none
is pending, the dispatcher (or whichever caller of ``wait``/``done`` gets there first)
*finishes* the handle, once:

1. reaps every op and records how each ended; gives back the tensors' memory
   (buffer exports, DLPack capsules);
2. wakes ``wait`` callers and makes the public fd readable;
3. calls the owner's hook, which fires ``loaded`` on the group (``stored`` on the bank):
   the load-complete :class:`~kvstate.core.machine.StateChange`, and the owner forgets
   it; then the completion callbacks.

The public fd (:meth:`TransferHandle.fileno`) is a separate eventfd that kvstate never
reads: it becomes readable when the transfer has finished and stays readable, so an
event loop can ``add_reader`` it and call :meth:`done`. It is closed by :meth:`close`.

The dispatcher exits when no handle is live for a short while; the next transfer starts
it again.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvstate.core.args import need_callable
from kvstate.core.errors import KvStateError, NativeError, ArgumentInvalid, Busy, TimedOut, TransferFailed
from kvstate.core.reasons import ArgumentReason, TransferFailReason
from kvstate.share.epochs import Begun

log = logging.getLogger(__name__)

#: How long an idle dispatcher waits for a new transfer before its thread exits.
DISPATCHER_LINGER_S = 0.25
#: How long close() waits for ops a worker had already started (a copy of one region).
CLOSE_WAIT_S = 60.0

PENDING, DONE, FAILED, CANCELLED = "pending", "done", "failed", "cancelled"
#: A load's op that completed after its rank's lease may have ended (see ``_activate``).
LOST = "lost"


def check_timeout(timeout: object, where: str = "timeout") -> float:
    """``timeout`` as seconds: an int or float in 0..1e9 (not a bool; the bound of every
    seconds argument, :func:`need_seconds`, so the native nanoseconds fit), else
    ArgumentInvalid (a load/store reason)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 1e9:
        raise ArgumentInvalid.transfer(ArgumentReason.TIMEOUT, where, f"must be a number of seconds in 0..1e9, "
                                       f"not {timeout!r:.40}")
    return float(timeout)


@attrs.frozen
class TransferResult:
    """How a finished transfer ended. ``failed_blocks`` are the destination block ids
    (load) or bank block ids (store) that hold nothing usable."""

    blocks: int
    bytes: int
    seconds: float
    failed_blocks: frozenset[int]
    failed_regions: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.failed_blocks


@attrs.frozen
class LoadResult:
    """What a waited prefix load (``load_prefix``) copied: blocks, bytes and seconds."""

    blocks: int
    bytes: int
    seconds: float


@attrs.define(eq=False)
class _Entry:
    op: Any
    region: str
    rank: int
    nbytes: int
    state: str = PENDING


class TransferHandle:
    """A load or store in flight. See the module docstring; made by ``Group.load``,
    ``Group.load_prefix`` and ``Bank.store``, never directly."""

    def __init__(self, kind: str, label: str, blocks: Sequence[int], *, notify: bool) -> None:
        self.kind = kind
        self.label = label
        self._blocks = tuple(blocks)
        self._entries: list[_Entry] = []
        self._refs: list[Any] = []  # TensorRefs to give back when finished
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._finishing = False
        self._notify_fd: int | None = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if notify else None
        self._watched: set[Any] = set()  # ops told to notify _notify_fd
        self._user_fd: int | None = None
        self._callbacks: list[Callable[[TransferHandle], None]] = []
        self._on_finish: Callable[[TransferHandle], None] | None = None
        self._held: Callable[[int], bool] | None = None
        self._result: TransferResult | None = None
        self._report: tuple[Any, int, bool] | None = None  # (native, id, with a message) the op engine acts on
        #: A store's block epochs (``Plan.epochs``): the owner ends them after the reaps too,
        #: where the op engine did not (kvstate.share.epochs).
        self.epochs: Begun | None = None
        self._report_status: str | None = None
        self._closed = False
        self._t0 = time.monotonic()

    def __repr__(self) -> str:
        return f"<{self.kind} {self.label}: {len(self._entries)} op(s), {'finished' if self._finished.is_set() else 'in flight'}>"

    @property
    def blocks(self) -> tuple[int, ...]:
        """Destination block ids (load) or bank block ids (store), as the plan named them."""
        return self._blocks

    # -- built by the load and store paths --------------------------------------------------

    @property
    def notify_fd(self) -> int | None:
        return self._notify_fd

    def _add(self, op: Any, region: str, rank: int, nbytes: int) -> None:
        self._entries.append(_Entry(op, region, rank, nbytes))

    def _keep(self, refs: Sequence[Any]) -> None:
        self._refs.extend(refs)

    def _activate(self, on_finish: Callable[[TransferHandle], None] | None, *,
                  held: Callable[[int], bool] | None = None) -> None:
        """All ops are submitted and the owner tracks the handle: let it finish. If it
        cannot be watched (epoll or eventfd refused: ENOMEM, ENOSPC; no thread; a native
        refusal), nothing stays in flight: its ops are cancelled or awaited, and the error
        (TransferFailed, load or store, for an OS one) says so; the owner forgets the handle.

        ``held(rank)`` (a load's): whether ``rank``'s copies read what the load was ordered
        for, asked once they completed: its lease still holds, and no store wrote the blocks
        meanwhile (``Part._voucher``). Otherwise that rank's ops count as failed (:data:`LOST`)."""
        self._on_finish = on_finish
        self._held = held
        fd = self._notify_fd
        if fd is None:
            return
        try:
            _dispatcher.register(self)
            if not self._watch_next():
                # Every op finished before anyone watched: wake the dispatcher to finish it
                # (not here: the owner may be inside the transition that submitted it).
                # Under the lock, and only while the fd is still ours: _finish gives it up
                # under the lock before closing it, so nothing writes to a closed number.
                with self._lock:
                    if self._notify_fd == fd and not self._finishing:
                        os.eventfd_write(fd, 1)
        except BaseException as exc:  # OSError, no thread (RuntimeError), a native refusal: none in flight
            self._on_finish = None
            _dispatcher.unregister(fd)
            self._abort()
            if isinstance(exc, KvStateError) or not isinstance(exc, Exception):
                raise
            reason = TransferFailReason.LOAD if self.kind == "load" else TransferFailReason.STORE
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise TransferFailed(reason, f"{self.label}: the transfer cannot be watched ({why}); "
                                 "its ops were cancelled or awaited, nothing is in flight") from exc

    def _watch_next(self) -> bool:
        """Have the last op that is still pending notify the private fd; False when none is
        pending (every op is collectable). Called with no lock held, or by the dispatcher."""
        fd = self._notify_fd
        for e in reversed(self._entries):
            if e.state != PENDING or e.op in self._watched:
                if e.op in self._watched and not _collectable(e.op):
                    return True  # its notification is still to come
                continue
            if not _collectable(e.op):
                if fd is None:
                    return True
                self._watched.add(e.op)
                e.op.notify(fd)  # at once if it finished meanwhile: the dispatcher looks again
                return True
        return False

    def _abort(self) -> None:
        """A submit failed part way: cancel what was submitted, wait for what a worker
        already took, reap everything, give the memory back. The owner never saw it."""
        self.cancel()
        self._wait_ops(self._entries, CLOSE_WAIT_S)
        self._finish(call_owner=False)

    # -- what the engine calls ------------------------------------------------------------

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.region for e in self._entries))

    def done(self) -> bool:
        """True once every op finished (done, failed or cancelled); it waits only while
        another thread (the dispatcher) is recording how the finished ops ended."""
        if self._finished.is_set():
            return True
        if all(_collectable(e.op) for e in self._entries):
            self._finish()
            # When another thread was already finishing, _finish returned at once: its
            # reaps end soon, and the ops are over, so the answer is True, not "not yet".
            self._finished.wait(CLOSE_WAIT_S)
        return self._finished.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every op; True when the transfer finished.
        It does not raise for a failed transfer: see :meth:`result`."""
        deadline = time.monotonic() + check_timeout(timeout)
        if not self._finished.is_set() and self._wait_ops(self._entries, timeout):
            self._finish()
        return self._finished.wait(max(0.0, deadline - time.monotonic()))

    def wait_region(self, name: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the ops of region ``name`` (every rank); True
        when they finished, so the engine may use that region's pages if
        :meth:`region_ok` says so, while later regions still load."""
        t = check_timeout(timeout)
        mine = [e for e in self._entries if e.region == name]
        if not mine:
            raise ArgumentInvalid.transfer(ArgumentReason.REGIONS,
                                           f"region {name!r:.80}", f"not part of this {self.kind}")
        return self._finished.is_set() or self._wait_ops(mine, t)

    def region_ok(self, name: str) -> bool | None:
        """True when every op of region ``name`` completed, False when one failed or was
        cancelled, None while any is still pending."""
        mine = [e for e in self._entries if e.region == name]
        if not mine:
            raise ArgumentInvalid.transfer(ArgumentReason.REGIONS,
                                           f"region {name!r:.80}", f"not part of this {self.kind}")
        if not self._finished.is_set():
            states = [_state(e.op) for e in mine]
            if any(s in ("queued", "running", "created") for s in states):
                return None
            if "reaped" not in states:
                return all(s == DONE for s in states) and not self._lost({e.rank for e in mine})
            # Another thread is finishing the handle: it reaped these ops and records how
            # they ended (a reaped op is not a failed one). That takes no longer than the reaps.
            if not self._finished.wait(CLOSE_WAIT_S):
                return None
        return all(e.state == DONE for e in mine)

    def _lost(self, ranks: set[int]) -> set[int]:
        """Those of ``ranks`` whose lease may have ended (see :meth:`_activate`); a check
        that cannot answer vouches for nothing."""
        held = self._held
        if held is None:
            return set()
        lost = set()
        for rank in ranks:
            try:
                if not held(rank):
                    lost.add(rank)
            except Exception:  # a rank nobody can vouch for is lost, never trusted
                log.exception("%s: cannot tell whether rank %d's lease holds", self.label, rank)
                lost.add(rank)
        return lost

    def cancel(self) -> None:
        """Cancel every op not yet taken by a worker; ops already copying complete. The
        transfer then finishes with the cancelled regions' blocks in failed_blocks()."""
        for e in self._entries:
            if e.state == PENDING:
                try:
                    e.op.cancel()
                except KvStateError:
                    pass  # running, finished, or already reaped: it ends on its own

    def failed_blocks(self) -> frozenset[int]:
        """The block ids that hold nothing usable: every block of the transfer when any of
        its ops failed or was cancelled (a block needs every region), none otherwise.
        Complete once :meth:`done` is True; empty before."""
        r = self._result
        return frozenset() if r is None else r.failed_blocks

    def result(self) -> TransferResult | None:
        """How it ended, once finished; None before."""
        return self._result

    def report(self, sock: int | None, ok: bytes, failed: bytes, *,
               epochs: Begun | None = None) -> bool:
        """Have the op engine itself send ``ok`` (every op done) or ``failed`` (any failed or
        was cancelled) on socket ``sock`` as the last op ends, from its own thread, so the
        peer hears of the outcome without waiting for this process's Python (its GIL may be
        the engine's for a while). A store's ``epochs`` go even there first (``sock`` None:
        no message).
        False when that can no longer be arranged (the transfer already finished, or has a
        report): the caller reports, and ends the epochs, itself. After finishing,
        :attr:`report_status` says whether a message went out."""
        with self._lock:
            if self._finishing or self._report is not None or not self._entries:
                return False
            native = getattr(self._entries[0].op, "_native", None)
            if native is None or any(getattr(e.op, "_native", None) is not native for e in self._entries):
                return False  # ops of another engine (a fake in a test): nothing native to ask
            try:
                rid = native.report(sock, ok, failed, [e.op.id for e in self._entries], epochs=epochs)
            except KvStateError:
                return False  # an op was reaped meanwhile, or the socket is gone: report yourself
            self._report = (native, rid, sock is not None)
            return True

    @property
    def report_status(self) -> str | None:
        """After finishing: ``"sent_ok"``, ``"sent_failed"`` or ``"unsent"`` for a transfer
        with a :meth:`report`, None without one (or before it finished)."""
        return self._report_status

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Call ``fn(handle)`` once the transfer finished: at once (in this thread) if it
        already has, else from the thread that finishes it (usually kvstate's dispatcher).
        An exception from ``fn`` is logged, never raised."""
        need_callable("fn", fn)
        with self._lock:
            if not self._finished.is_set():
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def fileno(self) -> int:
        """An fd that becomes readable (and stays so) when the transfer finished; valid
        until :meth:`close`."""
        with self._lock:
            if self._closed:
                raise ArgumentInvalid.transfer(ArgumentReason.STATE, self.label, "the handle is closed")
            if self._user_fd is None:
                self._user_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                if self._finished.is_set():
                    os.eventfd_write(self._user_fd, 1)
            return self._user_fd

    def close(self) -> None:
        """Release the handle: cancel what has not started, wait for what has, finish,
        close the fd. Idempotent."""
        if not self._finished.is_set():
            self.cancel()
            self._wait_ops(self._entries, CLOSE_WAIT_S)
            self._finish()
        with self._lock:
            self._closed = True
            fd, self._user_fd = self._user_fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> TransferHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Only a finished handle can be collected (the owner and the dispatcher hold live
        # ones), so its ops are reaped and closing the fd races with nobody.
        fd = getattr(self, "_user_fd", None)
        if fd is not None and self._finished.is_set():
            os.close(fd)

    # -- finishing ----------------------------------------------------------------------------

    def _wait_ops(self, entries: Sequence[_Entry], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for e in entries:
            if e.state != PENDING:
                continue
            try:
                if not e.op.wait(max(0.0, deadline - time.monotonic())):
                    return False
            except ArgumentInvalid as exc:
                if exc.reason is not ArgumentReason.UNKNOWN_OBJECT:
                    raise
                return self._finished.wait(max(0.0, deadline - time.monotonic()))  # reaped by a finishing thread
        return True

    def _progress(self) -> None:
        """The private fd was written: finish if no op is pending, else watch the next."""
        with self._lock:
            fd = self._notify_fd
            if fd is None or self._finishing:
                return
            try:
                os.eventfd_read(fd)
            except BlockingIOError:
                # Nothing was written: a stray wake-up, from an event the dispatcher fetched
                # for a finished handle's fd whose number this handle's eventfd reuses. Only
                # a notification may move this handle (its owner may be activating it now).
                return
        if not self._watch_next():
            self._finish()

    def _finish(self, *, call_owner: bool = True) -> None:
        with self._lock:
            if self._finishing:
                return
            self._finishing = True
            fd, self._notify_fd = self._notify_fd, None
        if fd is not None:
            _dispatcher.unregister(fd)
        with self._lock:
            report, self._report = self._report, None
        if report is not None:  # every op is collectable: the engine has sent it, or failed to
            status = _close_report(report[0], report[1])
            if report[2]:
                self._report_status = status
        for e in self._entries:
            e.state = _reap(e.op)
        lost = self._lost({e.rank for e in self._entries if e.state == DONE})
        for e in self._entries:
            if e.state == DONE and e.rank in lost:
                e.state = LOST
        if lost:
            log.warning("%s: rank(s) %s cannot vouch for what their copies read (the lease may have ended, or a "
                        "store wrote the blocks meanwhile); their blocks are failed", self.label, sorted(lost))
        if fd is not None:
            os.close(fd)  # after the reaps: no op can still write to that number
        for r in self._refs:
            r.release()
        self._refs.clear()
        failed = tuple(dict.fromkeys(e.region for e in self._entries if e.state != DONE))
        self._result = TransferResult(len(self._blocks), sum(e.nbytes for e in self._entries if e.state == DONE),
                                      time.monotonic() - self._t0, frozenset(self._blocks) if failed else frozenset(),
                                      failed)
        with self._lock:
            # Waiters wake before the owner's hook runs: a waiter may hold the owner's lock,
            # which the hook (firing `loaded`) needs.
            self._finished.set()
            callbacks, self._callbacks = self._callbacks, []
            if self._user_fd is not None:
                os.eventfd_write(self._user_fd, 1)
        hook = self._on_finish if call_owner else None
        if hook is not None:
            _call(hook, self)
        for fn in callbacks:
            _call(fn, self)


def _collectable(op: Any) -> bool:
    try:
        return bool(op.poll())
    except ArgumentInvalid as exc:
        if exc.reason is not ArgumentReason.UNKNOWN_OBJECT:
            raise
        return True


def _state(op: Any) -> str:
    try:
        return str(op.info().state)
    except ArgumentInvalid as exc:
        if exc.reason is not ArgumentReason.UNKNOWN_OBJECT:
            raise
        return "reaped"


def _reap(op: Any) -> str:
    try:
        state = str(op.reap().state)
    except (NativeError, ArgumentInvalid, Busy, TimedOut) as exc:  # any native refusal (not collectable, gone):
        # a bug, reported, never raised here
        log.error("reaping %r failed: %s", op, exc)
        return FAILED
    return state if state in (DONE, FAILED, CANCELLED) else FAILED


def _close_report(native: Any, report: int) -> str:
    try:
        status = native.report_close(report)
    except KvStateError as exc:  # a bug, reported, never raised here
        log.error("closing report %d failed: %s", report, exc)
        return "unsent"
    lib = native.lib
    return {lib.KVS_REPORT_SENT_OK: "sent_ok", lib.KVS_REPORT_SENT_FAILED: "sent_failed"}.get(status, "unsent")


def _call(fn: Callable[[TransferHandle], None], handle: TransferHandle) -> None:
    try:
        fn(handle)
    except Exception:
        log.exception("completion callback %r of %r failed", fn, handle)


class _Dispatcher:
    """One thread per process polling the private fds of live handles (see above)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[int, TransferHandle] = {}
        self._epoll: select.epoll | None = None
        self._wake: int | None = None  # an eventfd that makes an idle thread exit now
        self._thread: threading.Thread | None = None

    def register(self, h: TransferHandle) -> None:
        fd = h.notify_fd
        assert fd is not None
        with self._lock:
            if self._thread is None:
                self._start()
            assert self._epoll is not None
            self._epoll.register(fd, select.EPOLLIN)  # first: a refused fd is never recorded
            self._handles[fd] = h

    def _start(self) -> None:
        """The thread and its fds, all or nothing (an fd or the thread may be refused)."""
        ep = select.epoll()
        wake: int | None = None
        try:
            wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            ep.register(wake, select.EPOLLIN)
            thread = threading.Thread(target=self._run, args=(ep, wake), name="kvstate-transfers", daemon=True)
            thread.start()
        except BaseException:
            ep.close()
            if wake is not None:
                os.close(wake)
            raise
        self._epoll, self._wake, self._thread = ep, wake, thread

    def unregister(self, fd: int) -> None:
        with self._lock:
            if self._handles.pop(fd, None) is not None and self._epoll is not None:
                self._epoll.unregister(fd)

    def live(self) -> int:
        with self._lock:
            return len(self._handles)

    def stop_if_idle(self, timeout: float = 2.0) -> bool:
        """End the thread now (closing its fds) if no transfer is live; True when none runs."""
        with self._lock:
            thread, wake = self._thread, self._wake
            if thread is None:
                return True
            if self._handles or wake is None:
                return False
            os.eventfd_write(wake, 1)
        thread.join(timeout)
        return not thread.is_alive()

    def _run(self, epoll: select.epoll, wake: int) -> None:
        while True:
            events = epoll.poll(DISPATCHER_LINGER_S)
            woken = any(fd == wake for fd, _ in events)
            if not events or woken:
                with self._lock:
                    if not self._handles:
                        self._thread = self._epoll = self._wake = None
                        epoll.close()
                        os.close(wake)
                        return
                if woken:
                    try:
                        os.eventfd_read(wake)
                    except BlockingIOError:
                        pass
            for fd, _ in events:
                with self._lock:
                    h = self._handles.get(fd)
                if h is not None:
                    try:
                        h._progress()
                    except Exception:  # keep serving the other handles
                        log.exception("finishing %r failed", h)


_dispatcher = _Dispatcher()


def stop_dispatcher_if_idle(timeout: float = 2.0) -> bool:
    """Stop kvstate's completion thread now if no transfer is in flight (Importer.close
    and Exporter.stop call this, so a closed worker holds no thread or fd of it)."""
    return _dispatcher.stop_if_idle(timeout)

#: What ``Group.load``/``load_prefix`` and ``Bank.store`` return: one class, two names.
LoadHandle = TransferHandle
StoreHandle = TransferHandle
