"""The channel's side of the socket-path rule (:mod:`kvstate.core.paths`): refuse with
:class:`UnsafeSocketPath` before binding or connecting."""

from __future__ import annotations

import os
from pathlib import Path

from kvstate.core.errors import UnsafeSocketPath
from kvstate.core.paths import path_problem, socket_dir_problem, socket_path_problem


def check_socket_dir(directory: str | os.PathLike[str], uid: int | None = None) -> Path:
    """Refuse a socket directory that is not ours alone: a symlink anywhere in its path, not
    a directory, not owned by ``uid`` (default: ours) or open to group or others."""
    path = Path(directory)
    problem = socket_dir_problem(str(path), os.getuid() if uid is None else uid)
    if problem is not None:
        raise UnsafeSocketPath(str(path), problem[1])
    return path


def make_socket_dir(directory: str | os.PathLike[str]) -> Path:
    """Create (if needed) a private socket directory with mode 0700, and check it."""
    path = Path(directory)
    problem = path_problem(str(path))
    if problem is not None:
        raise UnsafeSocketPath(str(path), problem[1])
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeSocketPath(str(path), f"cannot create the directory: {exc.strerror}") from None
    return check_socket_dir(path)


def check_socket_path(path: str | os.PathLike[str], *, must_exist: bool) -> Path:
    """Refuse an unsafe socket path; ``must_exist=False`` for a server about to bind."""
    p = Path(path)
    problem = socket_path_problem(str(p), os.getuid(), must_exist=must_exist)
    if problem is not None:
        raise UnsafeSocketPath(str(p), problem[1])
    return p
