"""kvstate: formally specified lifecycles for safe KV-cache reuse between engine workers.

Importing this package loads no native code and no CUDA module: the pure core
(identity, geometry, descriptors, validation, policy) and the spec-driven machines are
plain Python. Transports are imported, and registered, explicitly.
"""

from kvstate.core.errors import (
    BackendUnavailable,
    DescriptorRejected,
    GroupRejected,
    GuardRejected,
    IllegalTransition,
    KvStateError,
    ReentrantTransition,
    SpecError,
    TransitionError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "DescriptorRejected",
    "GroupRejected",
    "GuardRejected",
    "IllegalTransition",
    "KvStateError",
    "ReentrantTransition",
    "SpecError",
    "TransitionError",
    "__version__",
]
