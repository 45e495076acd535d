"""Engine integrations: kvstate wired into serving engines through their own extension
points. Each lives in its own subpackage and imports its engine only where it must (the
engine is an optional extra: ``kvstate[vllm]``)."""
