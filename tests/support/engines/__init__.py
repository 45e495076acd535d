"""Real vLLM engines in their own processes, on a tiny Llama with seeded weights: what the
vLLM suite (tests/vllm), ``make demo-vllm`` and ``kvstate bench --suite vllm`` run. It
needs the vLLM venv (``.venv-vllm``); vLLM imports :mod:`.probe` by module path inside
the engine processes, which import this same source tree.

Modules:

- :mod:`~support.engines.tiny_llama`: the model config and its seeded random weights;
- :mod:`~support.engines.runner` (parent side) and :mod:`~support.engines.child` (engine process):
  an engine per process, driven by commands over a pipe;
- :mod:`~support.engines.kv_configs`: ``KVTransferConfig`` arguments for kvstate's connector,
  vLLM's ExampleConnector and the probe;
- :mod:`~support.engines.evidence`: what a run shows about KV reuse;
- :mod:`~support.engines.leftovers`: what an engine left in /dev/shm and its temp dir, and whose;
- :mod:`~support.engines.probe`: connectors that record the KV tensors vLLM registers;
- :mod:`~support.engines.memory`: memory of the live engines, sampled.

Nothing here imports vLLM or torch at module level except :mod:`~support.engines.child` and
:mod:`~support.engines.probe`, which run inside engine processes.
"""
