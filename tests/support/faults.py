"""A real transport with faults injected at chosen calls: every other call goes through.

A fault is typed (:func:`InjectedFault`, a NativeError with reason OS) or untyped: an OSError, a
RuntimeError or a MemoryError, as a backend or the runtime may raise them. The lifecycle
must roll back the same way for every kind (issue 14, class 6)."""

from __future__ import annotations

from kvstate.core.errors import NativeError
from kvstate.core.reasons import NativeReason
import threading
from typing import Any



def InjectedFault(method: str) -> NativeError:
    """A typed OS failure of ``method``, as the native layer reports one."""
    return NativeError.native(method, -5, f"injected fault in {method}", NativeReason.OS, errno=5)


#: fault kind -> what the call raises
KINDS = {
    "typed": lambda method: InjectedFault(method),
    "oserror": lambda method: OSError(5, f"injected EIO in {method}"),
    "runtime": lambda method: RuntimeError(f"injected bug in {method}"),
    "memory": lambda method: MemoryError(f"injected out of memory in {method}"),
}


class FaultyTransport:
    """Wraps a transport; ``fail(method, after=n)`` makes the (n+1)-th next call raise."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._plan: dict[str, int] = {}
        self._kind: dict[str, str] = {}
        self._lock = threading.Lock()  # parts are opened from several threads
        self.name = inner.name

    def fail(self, method: str, after: int = 0, kind: str = "typed") -> None:
        self._plan[method] = after
        self._kind[method] = kind

    def clear(self) -> None:
        self._plan.clear()
        self._kind.clear()

    def __getattr__(self, method: str) -> Any:
        target = getattr(self._inner, method)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                fail = self._plan.get(method) == 0
                kind = self._kind.get(method, "typed")
                if fail:
                    del self._plan[method]
                elif method in self._plan:
                    self._plan[method] -= 1
            if fail:
                raise KINDS[kind](method)
            return target(*args, **kwargs)
        return call

    @property
    def capabilities(self) -> Any:
        return self._inner.capabilities
