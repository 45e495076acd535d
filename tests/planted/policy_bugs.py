"""Deliberately broken copies of the policy's pure core, with the real contracts.

The contract self-test asserts that crosshair reports a counterexample for each. Keep the
docstring contracts identical to ``kvstate.reuse.policy``; only the bodies are wrong.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from kvstate.reuse.policy import Decision, DecisionReason, ReuseSettings
from kvstate.reuse.policy import choose_transfer_source as _real_choose

__all__ = ["DecisionReason", "choose_transfer_source", "estimated_saving_ms", "gate", "math"]


def estimated_saving_ms(saved_blocks: int, block_tokens: int, prefill_token_us: float,
                        block_transfer_us: float, lookup_ms: float) -> float:
    """Planted bug: the gain is not clamped, so a transfer dearer than recompute shrinks it.

    pre: 0 <= saved_blocks <= 2**40
    pre: 1 <= block_tokens <= 2**20
    pre: math.isfinite(prefill_token_us) and prefill_token_us >= 0
    pre: math.isfinite(block_transfer_us) and block_transfer_us >= 0
    pre: math.isfinite(lookup_ms) and lookup_ms >= 0
    post: __return__ <= estimated_saving_ms(saved_blocks + 1, block_tokens, prefill_token_us, block_transfer_us, lookup_ms)
    """
    per_block_net_us = block_tokens * prefill_token_us - block_transfer_us
    return saved_blocks * per_block_net_us / 1000.0 - lookup_ms


def gate(enabled: bool, gpu_enabled: bool, gpu_admitted: bool, gpu_source: bool,
         saved_blocks: int, saving_ms: float, minimum_blocks: int, minimum_saving_ms: float) -> DecisionReason:
    """Planted bug: a GPU source passes when GPU reuse is enabled but no profile is admitted.

    pre: saved_blocks >= 0 and minimum_blocks >= 0
    post: __return__ != DecisionReason.CHOSEN or enabled
    post: __return__ != DecisionReason.CHOSEN or not gpu_source or (gpu_enabled and gpu_admitted)
    post: __return__ != DecisionReason.CHOSEN or saved_blocks >= minimum_blocks
    post: __return__ != DecisionReason.CHOSEN or saving_ms >= minimum_saving_ms
    """
    if not enabled:
        return DecisionReason.REUSE_DISABLED
    if gpu_source and not gpu_enabled:
        return DecisionReason.GPU_REUSE_DISABLED
    if saved_blocks < minimum_blocks:
        return DecisionReason.BELOW_MINIMUM_BLOCKS
    if not saving_ms >= minimum_saving_ms:
        return DecisionReason.BELOW_MINIMUM_SAVING
    return DecisionReason.CHOSEN


def choose_transfer_source(target_prefix_blocks: int, candidates: Any, settings: ReuseSettings,
                           **kwargs: Any) -> Decision:
    """Planted bug: the minimum-blocks gate is forgotten (INV-POLICY-MINIMUMS)."""
    lax = attrs.evolve(settings, minimum_transfer_prefix_blocks=0)
    return _real_choose(target_prefix_blocks, candidates, lax, **kwargs)
