"""Real vLLM engines in their own processes, on a tiny Llama with seeded weights: what the
vLLM suite (tests/vllm), ``make demo-vllm`` and ``kvstate bench --suite vllm`` run. It
needs the vLLM venv (``.venv-vllm``); vLLM imports :mod:`.probe` by module path inside
the engine processes, which import this same source tree.

Modules:

- :mod:`~kvstate.harness.engines.tiny_llama`: the model config and its seeded random weights;
- :mod:`~kvstate.harness.engines.runner` (parent side) and :mod:`~kvstate.harness.engines.child` (engine process):
  an engine per process, driven by commands over a pipe;
- :mod:`~kvstate.harness.engines.kv_configs`: ``KVTransferConfig`` arguments for kvstate's connector,
  vLLM's ExampleConnector and the probe;
- :mod:`~kvstate.harness.engines.evidence`: what a run shows about KV reuse;
- :mod:`~kvstate.harness.engines.leftovers`: what an engine left in /dev/shm and its temp dir, and whose;
- :mod:`~kvstate.harness.engines.probe`: connectors that record the KV tensors vLLM registers;
- :mod:`~kvstate.harness.engines.memory`: memory of the live engines, sampled.

Nothing here imports vLLM or torch at module level except :mod:`~kvstate.harness.engines.child` and
:mod:`~kvstate.harness.engines.probe`, which run inside engine processes.
"""
