"""One temp root per test session, and the check that nothing escapes it.

Fixtures and helpers make scratch folders with ``tempfile.mkdtemp`` (socket directories,
descriptor files, fuzz corpora) and many never remove them: one suite run used to leave
thousands of ``kvs-*`` folders in /tmp. The session instead points ``tempfile`` (and, via
``TMPDIR``, every child process) at one short root under the system temp dir, removed
when the session ends.

The root must stay short: socket paths under it must fit ``sun_path`` (108 bytes), and
they used to sit directly under /tmp, so the root adds only ``/kvt-XXXXXXXX``.

:class:`EscapeWatch` is the check: an audit hook (``os.mkdir`` is audited) records each
``kvs*`` folder this process makes directly in the system temp dir, so a folder is
attributed by who made it, never by diffing a directory other jobs share; what still
exists at the end is reported.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

#: folder names that are ours (kvs-life-, kvs-fuzz-, kvstate-soak-, ...)
PREFIX = "kvs"


class TempRoot:
    """Make the root and point ``tempfile`` and ``TMPDIR`` at it; :meth:`close` undoes both
    and removes the root with everything in it."""

    def __init__(self, system: Path) -> None:
        self.system = system
        self.path = Path(tempfile.mkdtemp(prefix="kvt-", dir=system))
        # Traversable, not listable: tests that drop to another uid reach folders in here
        # (they used to sit in /tmp, which anyone may enter); each folder is still 0700.
        self.path.chmod(0o711)
        self._saved = (tempfile.tempdir, os.environ.get("TMPDIR"))
        tempfile.tempdir = str(self.path)
        os.environ["TMPDIR"] = str(self.path)

    def close(self) -> None:
        tempdir, env = self._saved
        tempfile.tempdir = tempdir
        if env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = env
        shutil.rmtree(self.path, ignore_errors=True)


class EscapeWatch:
    """Records ``kvs*`` folders made directly in ``system`` by this process, with the test
    that was running (``current()``). Audit hooks cannot be removed, so :meth:`stop` only
    disarms this one."""

    def __init__(self, system: Path, current: Callable[[], str]) -> None:
        self.system = os.path.realpath(system)
        self.current = current
        self.made: dict[str, str] = {}
        self.armed = True
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[object, ...]) -> None:
        if event != "os.mkdir" or not self.armed or not args:  # called for every audit event
            return
        try:
            path = os.fsdecode(args[0])  # str, bytes or a PathLike
        except TypeError:
            return
        name = os.path.basename(path.rstrip("/"))
        if name.startswith(PREFIX) and os.path.dirname(os.path.realpath(path)) == self.system:
            self.made.setdefault(path, self.current())

    def stop(self) -> None:
        self.armed = False

    def left(self) -> list[str]:
        """``path (made by test)`` for each recorded folder that still exists."""
        return [f"{p} (made by {who})" for p, who in sorted(self.made.items()) if os.path.lexists(p)]
