"""A deliberately broken admission, for the profile suite's self-test."""

from __future__ import annotations

from kvstate.reuse import profile
from kvstate.core.handles import HandleKind
from kvstate.reuse.profile import Admitted, DeploymentProfile, PublishedCapabilities, Refused, Rule
from kvstate.core.capabilities import MemoryKind


def admit(declared: DeploymentProfile, capabilities: PublishedCapabilities) -> Admitted | Refused:
    """Planted bug: gpu-single-node forgets that its transport must be same-node."""
    outcome = profile.admit(declared, capabilities)
    local_kinds = {HandleKind.POSIX_FD, HandleKind.CUDA_IPC} & capabilities.handle_kinds
    if isinstance(outcome, Refused) and outcome.rules == {Rule.DEVICE_SAME_NODE_TRANSPORT} and any(
            t.capabilities.handle_kinds & local_kinds and MemoryKind.DEVICE in t.capabilities.memory_kinds
            for t in capabilities.transports):
        return Admitted(declared, capabilities, gpu_reuse_allowed=True)
    return outcome
