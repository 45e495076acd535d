"""A tiny Llama whose greedy tokens depend on its KV cache.

vLLM's dummy load format (``load_format`` set to "dummy") fills every weight with
uniform(-1e-3, 1e-3): the KV values are then ~1e-6 and greedy tokens come out the same
whatever the KV holds, so token identity proves nothing about reuse. These weights are
random but seeded, with scales chosen so that attention matters: projections std 0.1,
embeddings std 1 (so that activations are O(1) from the first layer), norms 1. The
negative control in test_vllm_example_connector.py shows that corrupted KV then changes
the tokens.

The geometry is the smallest the CPU attention backend accepts: head_dim 64 (it has no
kernel for 16), 4 query heads over 2 KV heads (so tp=2 gives each rank one KV head), and
``max_position_embeddings`` 8192 so that prompts of 4,096 tokens fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

PROJECTION_STD = 0.1
EMBEDDING_STD = 1.0


def weight_shapes(config: dict[str, Any] = CONFIG) -> dict[str, tuple[int, ...]]:
    """Every tensor LlamaForCausalLM loads, by its checkpoint name."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    return shapes


def write_model(directory: Path, *, seed: int = 0, config: dict[str, Any] = CONFIG) -> Path:
    """Write ``config.json`` and seeded ``model.safetensors`` into ``directory``; return it.

    The same seed gives the same bytes (torch's CPU generator is deterministic), so two
    engines, or two test runs, load identical weights.
    """
    return write_tensors(directory, weight_shapes(config), config, seed=seed)


def write_tensors(directory: Path, shapes: dict[str, tuple[int, ...]], config: dict[str, Any], *,
                  seed: int) -> Path:
    """Seeded weights of ``shapes`` (norms 1, embeddings std 1, the rest std 0.1) and
    ``config`` as a checkpoint in ``directory`` (shared by the tiny models)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):  # sorted: draw order is fixed
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            std = EMBEDDING_STD if name == "model.embed_tokens.weight" else PROJECTION_STD
            t = torch.randn(shape, generator=gen) * std
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
