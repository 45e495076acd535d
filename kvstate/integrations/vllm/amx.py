"""AMX tile state for vLLM's CPU attention, requested before the first forward.

Why: on a CPU with AMX, vLLM 0.32 packs bfloat16 KV blocks for its "amx" attention
kernel (``cpu_attn._get_attn_isa``), which executes AMX tile instructions without asking
Linux for the tile state first. Linux grants that state per process, on request
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``), and kills a process that uses it unasked with
SIGILL. A worker normally gets it by accident, from oneDNN's first large bfloat16 matmul
in a plain prefill; a worker whose first forward computes a few tokens over a prefix it
did not compute (a connector's load) has not, and dies. Measured on an Intel Xeon with
AMX: vLLM's own ExampleConnector consumer, first forward 96 loaded + 4 computed tokens,
worker exit code -4 inside ``cpu_attention_with_kv_cache``; with the request made when
the KV caches are registered, the same run passes.
"""

from __future__ import annotations


def request_amx_tiles() -> bool:
    """Ask for this process's AMX tile state; True when it is usable (False on CPUs
    without AMX, or without torch). Idempotent."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        return False
    init = getattr(torch.cpu, "_init_amx", None)  # private in torch 2.13; absent means no AMX support
    return bool(init()) if init is not None else False
