"""NIXL under the name vLLM's NixlConnector imports (``nixl._api``), for the engines of
the bench's NixlConnector rows only (the runner puts this folder on their path).

The vLLM venv has NIXL as the ``nixl-cu12`` wheel, whose module is ``nixl_cu12``. NIXL's
own ``nixl`` package picks its backend by the CUDA version it finds, and in an engine
process it finds cuda-bindings 13 (loaded by ``import vllm``) and looks for
``nixl_cu13``, which is not there. This names ``nixl_cu12``'s modules ``nixl.*`` and
nothing else.
"""

import importlib
import sys

for _name in ("_api", "_bindings", "_utils", "logging"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"nixl_cu12.{_name}")
nixl_agent = sys.modules[f"{__name__}._api"].nixl_agent
nixl_agent_config = sys.modules[f"{__name__}._api"].nixl_agent_config
