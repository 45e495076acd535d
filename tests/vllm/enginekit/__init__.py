"""Support for the vLLM suite: real vLLM engines in their own processes, on a tiny Llama
with seeded weights.

This folder is on ``sys.path`` in the pytest process (tests/vllm has no ``__init__.py``,
so that the real ``vllm`` package is never shadowed) and in every engine process
(through ``PYTHONPATH``), where vLLM imports :mod:`enginekit.probe` by module path.

Modules:

- :mod:`~enginekit.tiny_llama`: the model config and its seeded random weights;
- :mod:`~enginekit.runner` (parent side) and :mod:`~enginekit.child` (engine process):
  an engine per process, driven by commands over a pipe;
- :mod:`~enginekit.kv_configs`: ``KVTransferConfig`` arguments for kvstate's connector,
  vLLM's ExampleConnector and the probe;
- :mod:`~enginekit.evidence`: what a run shows about KV reuse;
- :mod:`~enginekit.leftovers`: what an engine left in /dev/shm and its temp dir, and whose;
- :mod:`~enginekit.probe`: connectors that record the KV tensors vLLM registers;
- :mod:`~enginekit.memory`: memory of the live engines, sampled.

Nothing here imports vLLM or torch at module level except :mod:`~enginekit.child` and
:mod:`~enginekit.probe`, which run inside engine processes.
"""
