"""The reuse gates, enforced where the data moves (issue 14, class 9).

:mod:`kvstate.reuse.policy` *advises*: it never recommends a transfer while reuse is off
(INV-POLICY-DISABLED) or from a GPU source without an admitted profile
(INV-POLICY-GPU-GATED). Advice can be ignored, so the importer also *enforces* the same
switches before it decodes a descriptor, connects or opens anything
(:meth:`kvstate.share.importer.Importer.import_group` calls :func:`import_refusal`):

- reuse is off by default: an importer whose settings do not enable decode-to-prefill
  reuse refuses every import;
- a transport over device memory (GPU import) also needs GPU reuse enabled and a
  deployment profile that :func:`kvstate.reuse.profile.admit` admitted with GPU reuse
  allowed, for capabilities that publish this very transport.

The reasons are the policy's own :class:`~kvstate.core.reasons.DecisionReason` values, so
an operator reads one vocabulary whether the policy declined or the importer refused.
"""

from __future__ import annotations

from kvstate.core.capabilities import Capabilities, MemoryKind
from kvstate.reuse.policy import DecisionReason, ReuseSettings
from kvstate.reuse.profile import Admitted


def import_refusal(settings: ReuseSettings, admission: Admitted | None, transport: str,
                   capabilities: Capabilities) -> tuple[DecisionReason, str] | None:
    """Why an importer with ``settings`` and ``admission`` must not import over
    ``transport`` (its name and capabilities), or None when it may."""
    if not isinstance(settings, ReuseSettings) or not settings.enable_decode_to_prefill_reuse:
        return DecisionReason.REUSE_DISABLED, ("decode-to-prefill reuse is off (the default); enable it in "
                                               "ImportConfig.reuse or WorkerConfig.reuse "
                                               "(enable_decode_to_prefill_reuse)")
    if MemoryKind.DEVICE not in capabilities.memory_kinds:
        return None
    if not settings.enable_decode_to_prefill_gpu_reuse:
        return DecisionReason.GPU_REUSE_DISABLED, (f"transport {transport!r} imports device memory and GPU "
                                                   "reuse is off (enable_decode_to_prefill_gpu_reuse)")
    if not isinstance(admission, Admitted) or not admission.gpu_reuse_allowed:
        return DecisionReason.GPU_PROFILE_NOT_ADMITTED, (
            f"GPU import over {transport!r} needs a deployment profile admitted with GPU reuse allowed "
            f"(kvstate.reuse.profile.admit), not {admission!r:.120}")
    if transport not in {t.name for t in admission.capabilities.transports}:
        return DecisionReason.GPU_PROFILE_NOT_ADMITTED, (
            f"the admitted {admission.profile.value} capabilities do not publish transport {transport!r}")
    return None
