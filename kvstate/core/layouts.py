"""Geometries of real engines' paged KV caches. Pure.

Each function returns the geometry of a bank laid out exactly as the engine lays out its
own cache, so a bank can be the engine's cache (``Bank.tensors``) or receive its pages
(``Bank.store``) with one run per block and region wherever the engine's layout allows.

=====================  ======================================================================
:func:`vllm_cpu`       vLLM's CPU attention backend (v0.32): per layer a tensor
                       ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, contiguous,
                       every layer a view of one buffer right after the previous layer.
                       A block is opaque bytes whose packing depends on the CPU's attention
                       ISA (K transposed, V token-major on ``vec``): copy whole blocks only,
                       between engines with the same ISA, dtype, block size, heads and head dim.
:func:`flash_attn`     the GPU FlashAttention layout: per layer ``[2, num_blocks, block_size,
                       num_kv_heads, head_dim]`` (K then V along the outer dimension), so a
                       block is two runs.
:func:`mla`            multi-head latent attention (DeepSeek): one latent region per layer,
                       ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``.
:func:`vllm_cpu_mla`   vLLM's CPU MLA backend (``CPU_MLA``, v0.32): per layer
                       ``[num_blocks, 1, block_size, latent_dim]``, the CPU layout with one
                       "head" holding the latent (written row by row, no ISA packing).
:func:`fp8_with_scales`  FP8 (e4m3) KV in the FlashAttention layout plus one float32 scale
                       region per layer, ``[num_blocks, 2, num_kv_heads]``: a scale per block,
                       K/V and head, moved with the block it scales.
=====================  ======================================================================
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstate.core.geometry import DType, Geometry, Region


def _names(layers: int | Sequence[str]) -> list[str]:
    return [f"layer.{i}" for i in range(layers)] if isinstance(layers, int) else list(layers)


def vllm_cpu(layers: int | Sequence[str], *, num_blocks: int, num_kv_heads: int, block_size: int,
             head_dim: int, dtype: DType = DType.BF16) -> Geometry:
    """vLLM's CPU KV cache; ``layers`` is a count or the layer names of
    ``register_kv_caches`` (``model.layers.0.self_attn.attn``, ...)."""
    return Geometry.packed((Region.contiguous(n, dtype, (num_blocks, num_kv_heads, block_size, 2 * head_dim))
                            for n in _names(layers)), align=1)


def flash_attn(layers: int | Sequence[str], *, num_blocks: int, block_size: int, num_kv_heads: int,
               head_dim: int, dtype: DType = DType.BF16) -> Geometry:
    return Geometry.packed(Region.contiguous(n, dtype, (2, num_blocks, block_size, num_kv_heads, head_dim), 1)
                           for n in _names(layers))


def mla(layers: int | Sequence[str], *, num_blocks: int, block_size: int, latent_dim: int,
        dtype: DType = DType.BF16) -> Geometry:
    """``latent_dim`` is kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3)."""
    return Geometry.packed(Region.contiguous(n, dtype, (num_blocks, block_size, latent_dim))
                           for n in _names(layers))


def vllm_cpu_mla(layers: int | Sequence[str], *, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: DType = DType.BF16) -> Geometry:
    """vLLM's CPU MLA cache (one latent per token, as :func:`mla`, with the head axis of
    :func:`vllm_cpu` kept at 1)."""
    return Geometry.packed((Region.contiguous(n, dtype, (num_blocks, 1, block_size, latent_dim))
                            for n in _names(layers)), align=1)


def fp8_with_scales(layers: int | Sequence[str], *, num_blocks: int, block_size: int, num_kv_heads: int,
                    head_dim: int) -> Geometry:
    """Per layer ``NAME`` (fp8_e4m3 KV) and ``NAME.scale`` (float32 per block, K/V, head)."""
    regions: list[Region] = []
    for n in _names(layers):
        regions.append(Region.contiguous(n, DType.FP8_E4M3, (2, num_blocks, block_size, num_kv_heads, head_dim), 1))
        regions.append(Region.contiguous(f"{n}.scale", DType.FP32, (num_blocks, 2, num_kv_heads)))
    return Geometry.packed(regions)
