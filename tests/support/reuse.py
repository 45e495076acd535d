"""Reuse switched on, as every test that imports must say explicitly (reuse is off by
default and the importer enforces it: kvstate.reuse.gates)."""

from __future__ import annotations

from typing import Any

from kvstate.core.capabilities import MemoryKind
from kvstate.reuse.policy import ReuseSettings

REUSE_ON = ReuseSettings(enable_decode_to_prefill_reuse=True)

#: Reuse and GPU reuse switched on (a GPU import also needs an admitted profile).
GPU_REUSE_ON = ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True)


def reuse_for(transport: Any) -> dict[str, Any]:
    """The ImportConfig fields an importer over ``transport`` needs: reuse on and, for a
    transport over device memory, GPU reuse under a gpu-single-node admission that
    publishes this very transport (what kvstate.reuse.gates enforces)."""
    if MemoryKind.DEVICE not in transport.capabilities.memory_kinds:
        return {"reuse": REUSE_ON}
    from kvstate.harness.gpucheck import gpu_admission
    return {"reuse": GPU_REUSE_ON, "admission": gpu_admission(transport, transport.device_uuid())}
