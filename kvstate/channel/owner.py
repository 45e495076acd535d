"""Who owns a socket file, and what a dead server left behind.

A server's socket ``<name>.sock`` has an owner mark beside it, ``<name>.sock.lock``,
locked with ``flock`` for as long as the server lives. The kernel drops a flock when its
process dies however it dies (SIGKILL included), so a mark whose lock can be taken
belongs to a dead server: its pid may have been reused, the clock may have moved, none of
that matters. The mark's text (pid, boot id, start time) is for operators only; no
decision reads it.

Marks appear atomically: a server locks a temporary file first and renames it into place,
so a mark at its final name is either held or its holder is dead. Starting a server,
sweeping a directory, reading what is left in it (:func:`leftovers`) and a closing
server's removal of its socket all hold the directory's own flock, so none of them meets
a start half done: a temporary mark is never judged while its server is being started.

:func:`sweep` runs at every server start: each dead server's socket and mark go (a
temporary mark that a server died holding, too). A live server's files are never
touched, and files without a mark (another tool's) are left alone.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from kvstate.core.identity import host_boot_id

SUFFIX = ".lock"
_TMP_PREFIX = ".kvstate-lock-"


def mark_of(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + SUFFIX)


@contextmanager
def directory_locked(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s own flock: starts and sweeps there happen one at a time."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the flock


class OwnerMark:
    """The held mark of one live server (see the module docstring). Take it with the
    directory locked; :meth:`release` when the server closes."""

    def __init__(self, socket_path: Path) -> None:
        self.path = mark_of(socket_path)
        tmp = self.path.with_name(f"{_TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file, the directory locked: ours
            os.write(fd, f"pid {os.getpid()}\nboot {host_boot_id().hex()}\nstarted {time.time():.3f}\n".encode())
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        self._fd: int | None = fd
        self._ino = os.fstat(fd).st_ino

    def release(self) -> None:
        """Remove the mark (only while it is still ours) and drop its lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _ino(self.path) == self._ino:
                _unlink(self.path)
        finally:
            os.close(fd)


def sweep(directory: Path) -> list[str]:
    """Remove what dead servers left in ``directory`` (call with it locked): each socket
    whose mark nobody holds, with its mark, and temporary marks nobody holds. Returns the
    names removed."""
    try:
        dead = _dead_entries(directory)
    except FileNotFoundError:
        return []
    removed = []
    for name, is_socket in dead:
        path = directory / name
        try:
            if is_socket and not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue  # a file of that name that is no socket: not ours to remove
        except FileNotFoundError:
            continue
        _unlink(path)
        removed.append(name)
    return removed


def leftovers(directory: Path) -> list[str]:
    """What dead servers left in ``directory`` now (nothing is removed): the marks nobody
    holds, and the sockets they mark. Taken with the directory locked, so a server being
    started (its mark locked but not yet in place) is never read as dead."""
    try:
        with directory_locked(directory):
            return [name for name, _ in _dead_entries(directory)]
    except FileNotFoundError:
        return []


def _dead_entries(directory: Path) -> list[tuple[str, bool]]:
    """(name, is a socket) of every dead mark and the socket it marks, in name order."""
    names = sorted(os.listdir(directory))
    out: list[tuple[str, bool]] = []
    for name in names:
        if (name.endswith(".sock" + SUFFIX) or name.startswith(_TMP_PREFIX)) and _dead(directory / name):
            sock = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else None
            if sock is not None and sock in names:
                out.append((sock, True))
            out.append((name, False))
    return out


def _dead(mark: Path) -> bool:
    """Whether ``mark`` is a regular file whose lock nobody holds (its server is dead)."""
    try:
        fd = os.open(mark, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone meanwhile, a symlink (ELOOP), unreadable: not ours to judge
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # held: its server lives
        return _ino(mark) == os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _ino(path: Path) -> int | None:
    try:
        return os.lstat(path).st_ino
    except FileNotFoundError:
        return None


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ChannelError(ChannelReason.FAILED, f"cannot remove {path}: {exc.strerror}") from None
