"""The channel's side of the socket-path rule (:mod:`kvstate.core.paths`): refuse with
:class:`ChannelError` (UNSAFE_PATH) before binding or connecting."""

from __future__ import annotations

import os
from pathlib import Path

from kvstate.core.errors import ChannelError
from kvstate.core.paths import path_problem, socket_dir_problem, socket_path_problem


def as_path(value: object) -> Path:
    """``value`` as a Path, or ChannelError (UNSAFE_PATH): only str and PathLike of str are paths."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ChannelError.unsafe_path(repr(value)[:60],
                                       f"a path must be a str or PathLike, not {type(value).__name__}")
    return Path(value)


def check_socket_dir(directory: str | os.PathLike[str], uid: int | None = None) -> Path:
    """Refuse a socket directory that is not ours alone: a symlink anywhere in its path, not
    a directory, not owned by ``uid`` (default: ours) or open to group or others."""
    path = as_path(directory)
    if uid is not None and (type(uid) is not int or uid < 0):
        raise ChannelError.unsafe_path(str(path), f"uid must be an int >= 0, not {uid!r:.40}")
    problem = socket_dir_problem(str(path), os.getuid() if uid is None else uid)
    if problem is not None:
        raise ChannelError.unsafe_path(str(path), problem[1])
    return path


def make_socket_dir(directory: str | os.PathLike[str]) -> Path:
    """Create (if needed) a private socket directory with mode 0700, and check it."""
    path = as_path(directory)
    problem = path_problem(str(path))
    if problem is not None:
        raise ChannelError.unsafe_path(str(path), problem[1])
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ChannelError.unsafe_path(str(path), f"cannot create the directory: {exc.strerror}") from None
    return check_socket_dir(path)


def check_socket_path(path: str | os.PathLike[str], *, must_exist: bool) -> Path:
    """Refuse an unsafe socket path; ``must_exist=False`` for a server about to bind."""
    p = as_path(path)
    problem = socket_path_problem(str(p), os.getuid(), must_exist=must_exist)
    if problem is not None:
        raise ChannelError.unsafe_path(str(p), problem[1])
    return p
