"""The socket-path rule, in one place: the channel enforces it before it binds or
connects, and descriptor validation applies it before an importer opens anything.

A control socket must sit at an absolute, normalised path that fits ``sun_path``, with no
symlink anywhere on the way, in a directory owned by the expected uid that grants group
and others nothing. In such a directory only its owner (or root) can swap the entries
checked here. The rule reads the filesystem (``lstat``) and opens nothing.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from kvstate.core.reasons import RejectReason

#: ``sun_path`` holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107

Lstat = Callable[[str], os.stat_result]
Problem = tuple[RejectReason, str]


def _walk(path: str, lstat: Lstat) -> tuple[Problem | None, os.stat_result | None, bool]:
    """Check every existing component for symlinks. Returns a problem, the last
    component's stat (None if it does not exist) and whether the whole path exists."""
    current = ""
    st: os.stat_result | None = None
    for part in path.split("/")[1:]:
        current += "/" + part
        try:
            st = lstat(current)
        except FileNotFoundError:
            return None, None, False
        except OSError as exc:  # e.g. EACCES: a directory on the way is not ours to search
            return (RejectReason.SOCKET_PATH, f"cannot inspect {current}: {exc.strerror}"), None, False
        if stat.S_ISLNK(st.st_mode):
            return (RejectReason.SOCKET_SYMLINK, f"{current} is a symlink"), None, False
    return None, st, True


def _shape(path: str) -> Problem | None:
    if "\0" in path:
        return RejectReason.SOCKET_PATH, "the path contains a NUL byte"
    if not os.path.isabs(path):
        return RejectReason.SOCKET_PATH, "the path must be absolute"
    if os.path.normpath(path) != path:
        return RejectReason.SOCKET_PATH, "the path must be normalised (no '.', '..' or '//')"
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError:
        return RejectReason.SOCKET_PATH, "the path cannot be encoded for the filesystem"
    if len(encoded) > MAX_SOCKET_PATH:
        return RejectReason.SOCKET_PATH, f"longer than {MAX_SOCKET_PATH} bytes"
    return None


def path_problem(path: str, lstat: Lstat = os.lstat) -> Problem | None:
    """Why ``path`` cannot hold a socket or its directory: its shape, or a symlink on the
    part of it that exists. Checked before creating anything there."""
    problem = _shape(path)
    return problem if problem is not None else _walk(path, lstat)[0]


def socket_dir_problem(directory: str, uid: int, lstat: Lstat = os.lstat) -> Problem | None:
    """Why ``directory`` is not a private socket directory of ``uid``, or None."""
    problem = _shape(directory)
    if problem is not None:
        return problem
    problem, st, exists = _walk(directory, lstat)
    if problem is not None:
        return problem
    if not exists or st is None:
        return RejectReason.SOCKET_PATH, "the directory does not exist"
    if not stat.S_ISDIR(st.st_mode):
        return RejectReason.SOCKET_PATH, "not a directory"
    if st.st_uid != uid:
        return RejectReason.SOCKET_DIR_OWNER, f"owned by uid {st.st_uid}, expected {uid}"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return RejectReason.SOCKET_DIR_MODE, f"mode {stat.S_IMODE(st.st_mode):o}, expected 700"
    return None


def socket_path_problem(path: str, uid: int, *, must_exist: bool = True,
                        lstat: Lstat = os.lstat) -> Problem | None:
    """Why ``path`` is not a safe control socket of ``uid``, or None. ``must_exist=False``
    admits a path where a server is about to bind (nothing there yet, or a stale socket)."""
    problem = _shape(path)
    if problem is not None:
        return problem
    directory = os.path.dirname(path)
    problem = socket_dir_problem(directory, uid, lstat)
    if problem is not None:
        return problem
    try:
        st = lstat(path)
    except FileNotFoundError:
        return (RejectReason.SOCKET_PATH, "no socket there") if must_exist else None
    except OSError as exc:
        return RejectReason.SOCKET_PATH, f"cannot inspect {path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return RejectReason.SOCKET_SYMLINK, f"{path} is a symlink"
    if not stat.S_ISSOCK(st.st_mode):
        return RejectReason.SOCKET_PATH, "exists and is not a socket"
    return None
