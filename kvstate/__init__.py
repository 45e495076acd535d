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

#: module -> the public names it defines. The error classes are every KvStateError
#: subclass in kvstate.core.errors (tests/test_imports.py keeps this list complete).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "kvstate.share.exporter": ("ExportConfig", "Exporter"),
    "kvstate.share.importer": ("ImportConfig", "Importer"),
    "kvstate.reuse.policy": ("ReuseSettings",),
    "kvstate.share.coordinator": ("Coordinator", "CoordinatorConfig"),
    "kvstate.share.rank_worker": ("RankWorker", "WorkerConfig"),
    "kvstate.transport.host": ("HostTransport",),
    "kvstate.core.geometry": ("DType", "Geometry", "Layout", "Region"),
    "kvstate.core.identity": ("Deployment",),
    "kvstate.core.machine": ("StateChange",),
    "kvstate.core.errors": (
        "KvStateError", "SpecError", "BindingError", "TransitionError", "IllegalTransition",
        "GuardRejected", "ReentrantTransition", "BackendUnavailable", "TransportUnsuitable",
        "DescriptorRejected", "GroupRejected", "NativeError", "NativeInvalidArgument",
        "NativeOSError", "NativeNoMemory", "UnknownNativeObject", "RegionPinned", "StillMapped",
        "OutOfRange", "MappingOverlap", "ImportRefused", "FdWrongSize", "FdUnsealed",
        "FdNotMemfd", "FdIdentityMismatch", "OpWaitTimeout", "OpFailed", "EngineBusy",
        "ChannelError", "ChannelClosed", "PeerDied", "ChannelTimeout", "PeerRejected",
        "UnsafeSocketPath", "FrameError", "RegistrationFailed", "LeaseRefused", "ImportFailed",
        "ReuseStale", "LoadFailed", "DrainTimeout", "SettingsError", "UnknownSetting",
        "InvalidSetting", "PolicyInputError", "InventoryError", "InvalidBlockHash", "BlockBusy",
        "UnknownLease", "NotPinned", "CapabilitiesRejected", "CapabilitiesIncomplete",
        "CapabilitiesInvalid", "UnknownProfile", "HandoffError", "ChildEngineMissing",
        "ChildEngineAmbiguous", "HandoffParamsUnsupported", "HandoffParamsModified",
        "HandleRefused", "HandleWrongSize", "HandleFdsMismatch", "CudaError",
        "CudaInvalidArgument", "CudaOutOfMemory", "CudaNotSupported", "CudaNotPermitted",
        "CudaContextError", "CudaDeviceFault", "CudaDeviceNotFound", "FabricUnavailable",
        "LegacyIpcRefused", "NixlError", "NixlHandleRejected", "NixlStaleGeneration",
        "NixlOperationFailed", "NixlTimeout", "NixlUnsupported", "LeaseEnded",
        "ModelGenerationError", "ModelCheckError", "SpinUnavailable", "ConnectionLimit",
        "GeometryInvalid", "ConfigInvalid", "BlockOutOfRange", "TransferError", "TransferRejected",
        "StoreFailed", "ViewsOutstanding",
        "ProtocolError", "CoordinatorRefused", "GroupFailed", "PeerUnauthenticated",
        "EffectFailed", "ReuseRefused", "ArgumentInvalid",
    ),
}

_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *sorted(_HOME)]

if TYPE_CHECKING:  # what mypy and IDEs see; at run time __getattr__ imports on first use
    from kvstate.share.exporter import ExportConfig as ExportConfig, Exporter as Exporter
    from kvstate.share.importer import ImportConfig as ImportConfig, Importer as Importer
    from kvstate.reuse.policy import ReuseSettings as ReuseSettings
    from kvstate.share.coordinator import Coordinator as Coordinator, CoordinatorConfig as CoordinatorConfig
    from kvstate.share.rank_worker import RankWorker as RankWorker, WorkerConfig as WorkerConfig
    from kvstate.transport.host import HostTransport as HostTransport
    from kvstate.core.geometry import DType as DType, Geometry as Geometry, Layout as Layout, Region as Region
    from kvstate.core.identity import Deployment as Deployment
    from kvstate.core.machine import StateChange as StateChange
    from kvstate.core.errors import (
        KvStateError as KvStateError, SpecError as SpecError, BindingError as BindingError,
        TransitionError as TransitionError, IllegalTransition as IllegalTransition,
        GuardRejected as GuardRejected, ReentrantTransition as ReentrantTransition,
        BackendUnavailable as BackendUnavailable, TransportUnsuitable as TransportUnsuitable,
        DescriptorRejected as DescriptorRejected, GroupRejected as GroupRejected,
        NativeError as NativeError, NativeInvalidArgument as NativeInvalidArgument,
        NativeOSError as NativeOSError, NativeNoMemory as NativeNoMemory,
        UnknownNativeObject as UnknownNativeObject, RegionPinned as RegionPinned,
        StillMapped as StillMapped, OutOfRange as OutOfRange, MappingOverlap as MappingOverlap,
        ImportRefused as ImportRefused, FdWrongSize as FdWrongSize, FdUnsealed as FdUnsealed,
        FdNotMemfd as FdNotMemfd, FdIdentityMismatch as FdIdentityMismatch,
        OpWaitTimeout as OpWaitTimeout, OpFailed as OpFailed, EngineBusy as EngineBusy,
        ChannelError as ChannelError, ChannelClosed as ChannelClosed, PeerDied as PeerDied,
        ChannelTimeout as ChannelTimeout, PeerRejected as PeerRejected,
        UnsafeSocketPath as UnsafeSocketPath, FrameError as FrameError,
        RegistrationFailed as RegistrationFailed, LeaseRefused as LeaseRefused,
        ImportFailed as ImportFailed, ReuseStale as ReuseStale, LoadFailed as LoadFailed,
        DrainTimeout as DrainTimeout, SettingsError as SettingsError,
        UnknownSetting as UnknownSetting, InvalidSetting as InvalidSetting,
        PolicyInputError as PolicyInputError, InventoryError as InventoryError,
        InvalidBlockHash as InvalidBlockHash, BlockBusy as BlockBusy,
        UnknownLease as UnknownLease, NotPinned as NotPinned,
        CapabilitiesRejected as CapabilitiesRejected,
        CapabilitiesIncomplete as CapabilitiesIncomplete,
        CapabilitiesInvalid as CapabilitiesInvalid, UnknownProfile as UnknownProfile,
        HandoffError as HandoffError, ChildEngineMissing as ChildEngineMissing,
        ChildEngineAmbiguous as ChildEngineAmbiguous,
        HandoffParamsUnsupported as HandoffParamsUnsupported,
        HandoffParamsModified as HandoffParamsModified, HandleRefused as HandleRefused,
        HandleWrongSize as HandleWrongSize, HandleFdsMismatch as HandleFdsMismatch,
        CudaError as CudaError, CudaInvalidArgument as CudaInvalidArgument,
        CudaOutOfMemory as CudaOutOfMemory, CudaNotSupported as CudaNotSupported,
        CudaNotPermitted as CudaNotPermitted, CudaContextError as CudaContextError,
        CudaDeviceFault as CudaDeviceFault, CudaDeviceNotFound as CudaDeviceNotFound,
        FabricUnavailable as FabricUnavailable, LegacyIpcRefused as LegacyIpcRefused,
        NixlError as NixlError, NixlHandleRejected as NixlHandleRejected,
        NixlStaleGeneration as NixlStaleGeneration, NixlOperationFailed as NixlOperationFailed,
        NixlTimeout as NixlTimeout, NixlUnsupported as NixlUnsupported,
        LeaseEnded as LeaseEnded, ModelGenerationError as ModelGenerationError,
        ModelCheckError as ModelCheckError, SpinUnavailable as SpinUnavailable,
        ConnectionLimit as ConnectionLimit, GeometryInvalid as GeometryInvalid,
        ConfigInvalid as ConfigInvalid, BlockOutOfRange as BlockOutOfRange,
        TransferError as TransferError, TransferRejected as TransferRejected,
        StoreFailed as StoreFailed, ViewsOutstanding as ViewsOutstanding,
        EffectFailed as EffectFailed, ReuseRefused as ReuseRefused, ArgumentInvalid as ArgumentInvalid,
        ProtocolError as ProtocolError,
        CoordinatorRefused as CoordinatorRefused, GroupFailed as GroupFailed,
        PeerUnauthenticated as PeerUnauthenticated,
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
