"""A tiny DeepSeek-V2-style model with MLA (multi-head latent attention), seeded weights.

Its KV cache is one latent per token (``kv_lora_rank`` + ``qk_rope_head_dim`` values,
shared by every head), the layout MLA engines cache. vLLM's CPU MLA backend (``CPU_MLA``,
which :data:`BACKEND` pins; vLLM would pick ``AMX_MLA`` on a CPU with AMX) has a decode
kernel only for a latent of 576 (``kv_lora_rank`` 512 + rope 64) and blocks of 16 tokens,
so those two are DeepSeek's
sizes; everything else is small. ``first_k_dense_replace`` covers every layer: each MLP is
dense (no MoE, which is not what this model is for). Weights are drawn as in :mod:`.tiny_llama` (seeded,
projections std 0.1, embeddings std 1) so that attention matters to the tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.engines import tiny_llama

CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "n_routed_experts": 4,        # unused: first_k_dense_replace makes every layer dense
    "n_shared_experts": 1,
    "first_k_dense_replace": 2,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

#: The cached latent per token and layer: what one KV "head" of an MLA cache holds.
LATENT = CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"]
BLOCK_TOKENS = 16  # vLLM's CPU MLA backend forces it
#: Pinned: on a CPU with AMX tiles vLLM picks AMX_MLA, whose blocks must be a multiple of
#: 32, and an engine with blocks of 16 then fails to start ("No common block size for 16",
#: seen on an Intel Xeon with AMX, 2026-12-07). CPU_MLA runs on every x86 CPU.
BACKEND = "CPU_MLA"


def weight_shapes(config: dict[str, Any] = CONFIG) -> dict[str, tuple[int, ...]]:
    """Every tensor DeepseekV2ForCausalLM loads for this config, by its checkpoint name."""
    h, i, v, n = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_attention_heads"]
    nope, rope, vd, rank = (config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"],
                            config["kv_lora_rank"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for k in range(config["num_hidden_layers"]):
        p = f"model.layers.{k}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (n * (nope + rope), h),
            p + "self_attn.kv_a_proj_with_mqa.weight": (rank + rope, h),
            p + "self_attn.kv_a_layernorm.weight": (rank,),
            p + "self_attn.kv_b_proj.weight": (n * (nope + vd), rank),
            p + "self_attn.o_proj.weight": (h, n * vd),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    return shapes


def write_model(directory: Path, *, seed: int = 0, config: dict[str, Any] = CONFIG) -> Path:
    """Write ``config.json`` and seeded ``model.safetensors`` into ``directory``; return it."""
    return tiny_llama.write_tensors(directory, weight_shapes(config), config, seed=seed)
