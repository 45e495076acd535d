"""The banks' geometry, derived from the compatibility key and checked against the KV
tensors vLLM registers. Pure (tensors are read through their ``dtype`` and ``shape``).

vLLM's CPU backend (0.32) gives each attention layer a tensor
``[num_blocks, kv_heads, block_size, 2 * head_dim]``; every layer is a view of one buffer
and a block ``T[b]`` is opaque bytes packed by the attention ISA. Its CPU MLA backend
(``CPU_MLA``, DeepSeek-style models) gives each layer ``[num_blocks, 1, block_size, latent]``:
one latent per token (``kv_lora_rank + qk_rope_head_dim``), no K/V pair, the same on every
TP rank; the key says so with ``isa`` :data:`MLA_ISA`, ``kv_heads`` 1 and
``head_dim`` the latent. A bank has the same regions with its own number of blocks, so
``Bank.store`` and a load copy whole blocks. Any other layout (a GPU backend, a hybrid
model) is refused, and the connector stays inactive on that engine: only these are tested.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstate.core import layouts
from kvstate.core.geometry import DType, Geometry
from kvstate.integrations.vllm.hashing import Compat

#: torch dtype names -> kvstate dtypes (the KV dtypes vLLM's CPU backend uses).
TORCH_DTYPES: Mapping[str, DType] = {"torch.bfloat16": DType.BF16, "torch.float16": DType.FP16,
                                     "torch.float32": DType.FP32}

#: vLLM's FP8 ``kv_cache_dtype`` names -> kvstate dtypes. On CPU the cache tensor is
#: ``torch.uint8`` holding the FP8 bits, and every layer has one K and one V scale (floats,
#: 1 unless the checkpoint sets them): blocks are only the same KV under the same scales.
FP8_CACHE_DTYPES: Mapping[str, DType] = {"fp8": DType.FP8_E4M3, "fp8_e4m3": DType.FP8_E4M3,
                                         "fp8_e5m2": DType.FP8_E5M2}

#: The key's ``isa`` for vLLM's CPU MLA cache: rows of latents written by plain tensor
#: indexing (``CPUMLAImpl.do_kv_cache_update``), not packed for an attention ISA.
MLA_ISA = "cpu-mla"

#: The inventory group every rank's exporter records prefix blocks under.
INVENTORY_GROUP = "vllm-prefix"


def dtype_of(compat: Compat) -> DType:
    return DType(compat.dtype)


def is_mla(compat: Compat) -> bool:
    return compat.isa == MLA_ISA


def block_bytes(compat: Compat) -> int:
    """Bytes of one block in every layer of one rank."""
    per_token = compat.head_dim if is_mla(compat) else compat.kv_heads * 2 * compat.head_dim
    return len(compat.layers) * compat.block_size * per_token * dtype_of(compat).itemsize


def bank_blocks(compat: Compat, retain_bytes: int) -> int:
    """Blocks a bank of ``retain_bytes`` holds (at least one)."""
    return max(1, retain_bytes // block_bytes(compat))


def bank_geometry(compat: Compat, num_blocks: int) -> Geometry:
    if is_mla(compat):
        return layouts.vllm_cpu_mla(list(compat.layers), num_blocks=num_blocks, block_size=compat.block_size,
                                    latent_dim=compat.head_dim, dtype=dtype_of(compat))
    return layouts.vllm_cpu(list(compat.layers), num_blocks=num_blocks, num_kv_heads=compat.kv_heads,
                            block_size=compat.block_size, head_dim=compat.head_dim, dtype=dtype_of(compat))


def tensor_problem(compat: Compat, kv_caches: Mapping[str, Any]) -> str | None:
    """Why the registered tensors are not the layout ``compat`` describes, or None."""
    if list(kv_caches) != list(compat.layers):
        return f"layers {list(kv_caches)[:4]} registered, {list(compat.layers)[:4]} configured"
    mla = is_mla(compat)
    want = (compat.kv_heads, compat.block_size, (1 if mla else 2) * compat.head_dim)
    layout = "the CPU MLA layout" if mla else "the CPU layout"
    for name, t in kv_caches.items():
        torch_dtype = str(getattr(t, "dtype", None))
        fp8 = compat.dtype in (d.value for d in FP8_CACHE_DTYPES.values())
        dtype = DType(compat.dtype) if fp8 and torch_dtype == "torch.uint8" else TORCH_DTYPES.get(torch_dtype)
        shape = tuple(getattr(t, "shape", ()))
        if dtype is None or dtype.value != compat.dtype:
            return f"{name}: dtype {getattr(t, 'dtype', None)}, configured {compat.dtype}"
        if len(shape) != 4 or tuple(shape[1:]) != want:
            return (f"{name}: shape {list(shape)}; {layout} [num_blocks, {want[0]}, {want[1]}, {want[2]}] is the "
                    "one kvstate supports")
    return None


def scales_problem(scales: Mapping[str, tuple[object, object]]) -> str | None:
    """Why FP8 KV under these per-layer (K, V) scales is not shared, or None. Only scales
    of 1 are: a block is its bits, and two engines read the same bits as the same KV only
    under the same scales, which the prefill side cannot see (its scheduler never loads the
    model); scales of 1 are what vLLM uses unless the checkpoint sets others."""
    odd = [name for name, pair in scales.items() if pair != (1.0, 1.0)]
    if odd:
        return (f"FP8 KV with scales other than 1 ({odd[0]}: {scales[odd[0]]}) is not shared: engines could "
                "read the same bits under different scales")
    return None
