"""kvstate: formally specified lifecycles for safe KV-cache reuse between engine workers.

The names in ``__all__`` are the public API: they are stable, and importing them from
``kvstate`` is the supported way to reach them. Module paths below the top level
(``kvstate.share.exporter`` and the like) may move between releases. See docs/api.md.

Importing this package loads nothing else: each public name is imported on first use
(PEP 562), so ``import kvstate`` loads no native code, no cffi, no CUDA, no numpy and not
even the state machines. Transports are imported, and registered, explicitly.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: module -> the public names it defines: the one list of the public API. The error
#: classes are every KvStateError subclass in kvstate.core.errors, and the reason enums
#: every enum in kvstate.core.reasons (tests/test_imports.py keeps both complete and the
#: TYPE_CHECKING block below equal to this list).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "kvstate.share.exporter": ("Exporter",),
    "kvstate.share.export_config": ("ExportConfig",),
    "kvstate.share.importer": ("Importer",),
    "kvstate.share.import_config": ("ImportConfig",),
    "kvstate.reuse.policy": ("ReuseSettings",),
    "kvstate.share.coordinator": ("Coordinator", "CoordinatorConfig"),
    "kvstate.share.rank_worker": ("RankWorker", "WorkerConfig"),
    "kvstate.transport.host": ("HostTransport",),
    "kvstate.core.geometry": ("DType", "Geometry", "Layout", "Region"),
    "kvstate.core.identity": ("Deployment",),
    "kvstate.core.machine": ("StateChange",),
    "kvstate.core.errors": (
        "KvStateError", "ConfigInvalid", "ArgumentInvalid", "BackendUnavailable", "DescriptorRejected",
        "GroupRejected", "ReuseRefused", "ImportFailed", "TransferFailed", "GroupFailed", "Busy", "TimedOut",
        "ChannelError", "NativeError", "TransitionError",
    ),
    "kvstate.core.reasons": (
        "ConfigReason", "ArgumentReason", "BackendReason", "RejectReason", "DecisionReason", "ImportReason",
        "ImportDefect", "TransferFailReason", "GroupEvent", "BusyReason", "TimeoutReason", "ChannelReason",
        "NativeReason", "TransitionReason",
    ),
}

_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *sorted(_HOME)]

if TYPE_CHECKING:  # what mypy and IDEs see; at run time __getattr__ imports on first use
    from kvstate.share.exporter import Exporter as Exporter
    from kvstate.share.export_config import ExportConfig as ExportConfig
    from kvstate.share.importer import Importer as Importer
    from kvstate.share.import_config import ImportConfig as ImportConfig
    from kvstate.reuse.policy import ReuseSettings as ReuseSettings
    from kvstate.share.coordinator import Coordinator as Coordinator, CoordinatorConfig as CoordinatorConfig
    from kvstate.share.rank_worker import RankWorker as RankWorker, WorkerConfig as WorkerConfig
    from kvstate.transport.host import HostTransport as HostTransport
    from kvstate.core.geometry import DType as DType, Geometry as Geometry, Layout as Layout, Region as Region
    from kvstate.core.identity import Deployment as Deployment
    from kvstate.core.machine import StateChange as StateChange
    from kvstate.core.errors import (
        KvStateError as KvStateError, ConfigInvalid as ConfigInvalid, ArgumentInvalid as ArgumentInvalid,
        BackendUnavailable as BackendUnavailable, DescriptorRejected as DescriptorRejected,
        GroupRejected as GroupRejected, ReuseRefused as ReuseRefused, ImportFailed as ImportFailed,
        TransferFailed as TransferFailed, GroupFailed as GroupFailed, Busy as Busy, TimedOut as TimedOut,
        ChannelError as ChannelError, NativeError as NativeError, TransitionError as TransitionError,
    )
    from kvstate.core.reasons import (
        ConfigReason as ConfigReason, ArgumentReason as ArgumentReason, BackendReason as BackendReason,
        RejectReason as RejectReason, DecisionReason as DecisionReason, ImportReason as ImportReason,
        ImportDefect as ImportDefect, TransferFailReason as TransferFailReason, GroupEvent as GroupEvent,
        BusyReason as BusyReason, TimeoutReason as TimeoutReason, ChannelReason as ChannelReason,
        NativeReason as NativeReason, TransitionReason as TransitionReason,
    )


def _load(name: str) -> object:
    """Import the public ``name`` from its home module (once; later lookups find it here)."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstate' has no attribute {name!r}")
    value: object = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


if not TYPE_CHECKING:  # hidden from mypy, so a misspelt kvstate.Name stays a type error
    __getattr__ = _load


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
