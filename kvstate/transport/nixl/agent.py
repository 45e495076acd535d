"""Finding NIXL and making this process's agent: which Python module provides NIXL's API
(:func:`load_nixl`, ``BackendUnavailable`` where none is installed), calls into it with
its exceptions made kvstate's (:func:`nixl_call`), and the agent's configuration
(:func:`make_agent`). :mod:`kvstate.transport.nixl.transport` builds on these."""

from __future__ import annotations

import importlib
import os
import threading
import uuid
from types import ModuleType
from typing import Any

from kvstate.core.errors import BackendUnavailable, KvStateError, NativeError
from kvstate.core.optional import is_missing, require

#: Python modules that provide NIXL's API, in order of preference: the ``nixl`` meta
#: package picks the CUDA variant itself; ``nixl_cu12`` is what ``pip install --no-deps
#: nixl-cu12`` provides (see the README); ``nixl_cu13`` its CUDA 13 twin.
NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
#: Missing modules that mean "the nixl extra is not installed" (numpy is NIXL's own
#: hard dependency). Any other import error propagates.
_OPTIONAL = frozenset(NIXL_MODULES) | {"numpy"}
INSTALL_HINT = "pip install --no-deps 'nixl-cu12==1.5.1' numpy   (see README: NIXL transport)"
BACKEND = "UCX"


def load_nixl() -> ModuleType:
    """The module that provides ``nixl_agent``; :class:`BackendUnavailable` if none is installed."""
    missing: list[str] = []
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not any(is_missing(exc, dependency) for dependency in _OPTIONAL):
                raise
            missing.append(f"{name} (missing {exc.name})")
            continue
        if hasattr(module, "nixl_agent"):
            return module
        missing.append(f"{name} (has no nixl_agent)")
    raise BackendUnavailable.missing("nixl", "no NIXL Python API found: tried " + ", ".join(missing)
                                     + f"; install with: {INSTALL_HINT}")


def numpy_api() -> ModuleType:
    return require("numpy", "nixl", hint=f"install with: {INSTALL_HINT}")


def host_uuid() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return uuid.uuid5(uuid.NAMESPACE_DNS, os.uname().nodename).bytes


def nixl_call(op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call into NIXL, turning its exceptions into a :class:`NativeError` (reason NIXL)."""
    try:
        return fn(*args, **kwargs)
    except KvStateError:
        raise
    except Exception as exc:  # NIXL raises its own binding exceptions (nixlBind.*Error)
        raise NativeError.nixl(op, f"{type(exc).__name__}: {exc}") from exc


#: How long NIXL's UCX progress thread waits for events when it has nothing to do, in
#: microseconds. NIXL's Python API hard-codes 0, a busy spin: measured here, an idle
#: agent burnt a whole core (2.97 s of CPU in 3 s), in every engine worker with an agent,
#: and starved the engines on a small machine. The thread is needed (an exporter's UCX
#: worker must progress for a peer's READ over TCP to complete: without it, the READ
#: timed out); with a wait it costs 0.05 s of CPU in 3 s idle.
PROGRESS_DELAY_US = int(os.environ.get("KVSTATE_NIXL_PROGRESS_DELAY_US", "100"))
_config_lock = threading.Lock()


def make_agent(nixl: ModuleType, agent_name: str, num_threads: int) -> Any:
    """A NIXL agent that several threads may call (sync mode STRICT: kvstate's ranks,
    importer threads and remote loads share the process's one agent, and NIXL's default
    without a listener thread is no locking at all: concurrent calls crashed the process),
    and whose progress thread waits ``PROGRESS_DELAY_US`` instead of spinning."""
    api = importlib.import_module(nixl.__name__ + "._api")
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        """NIXL's config, but the wrapper's ``pthrDelay = 0`` sets ours."""

        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, PROGRESS_DELAY_US)

    config = nixl.nixl_agent_config(backends=[BACKEND], num_threads=num_threads,
                                    sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    with _config_lock:  # the wrapper builds its config from the module attribute
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return nixl.nixl_agent(agent_name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base
