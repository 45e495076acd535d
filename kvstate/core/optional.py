"""Optional dependencies: a missing one disables only its backend.

Only a ``ModuleNotFoundError`` for the dependency itself (or one of its submodules) means
"not installed". Any other import error, including a missing module *inside* kvstate or a
broken dependency, propagates: it is a bug to fix, not a backend to switch off.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvstate.core.errors import BackendUnavailable


def is_missing(exc: ModuleNotFoundError, dependency: str) -> bool:
    """Whether ``exc`` says that ``dependency`` itself is not installed."""
    name = exc.name or ""
    return name == dependency or name.startswith(dependency + ".")


def require(dependency: str, backend: str, *, hint: str = "") -> ModuleType:
    """Import ``dependency`` for ``backend``, or raise BackendUnavailable if not installed."""
    try:
        return importlib.import_module(dependency)
    except ModuleNotFoundError as exc:
        if is_missing(exc, dependency.split(".")[0]):
            raise BackendUnavailable.missing(backend,
                                             f"{dependency} is not installed{'; ' + hint if hint else ''}") from exc
        raise
