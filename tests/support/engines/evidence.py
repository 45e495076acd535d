"""What a generation shows about KV reuse.

vLLM counts reused tokens when a load is *scheduled*: ``num_cached_tokens``, the
``vllm:external_prefix_cache_hits`` counter and ``vllm:prompt_tokens_by_source`` all
include a load that then failed and was recomputed under
``kv_load_failure_policy="recompute"``. The only trace of such a failure is the
scheduler's log line "Recovered from KV load failure: N request(s) rescheduled (T tokens
affected)". Evidence of reuse therefore needs both: the counters, and no such line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from support.engines.runner import Generation

RECOVERED = re.compile(r"Recovered from KV load failure[^\n]*")
FAILED = re.compile(r"Failing \d+ request\(s\) due to KV load failure[^\n]*")

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
LOCAL_HITS = "vllm:prefix_cache_hits"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def delta(g: Generation, name: str) -> float:
    """How much the counter ``name`` grew during the generation."""
    return g.metrics.get(name, 0.0) - g.metrics_before.get(name, 0.0)


@dataclass(frozen=True)
class Reuse:
    """The reuse evidence of one generation (counter values are deltas over it)."""

    num_cached_tokens: tuple[int, ...]
    external_hits: float
    local_hits: float
    by_source: dict[str, float]       # vllm:prompt_tokens_by_source, per source
    recovered: tuple[str, ...]        # "Recovered from KV load failure" lines
    failed: tuple[str, ...]           # "Failing ... due to KV load failure" lines

    def external_problems(self, expected_tokens: list[int] | None = None) -> list[str]:
        """Why this generation is *not* evidence that every prompt's prefix came from the
        connector (empty when it is). ``expected_tokens``: exact reused tokens per prompt."""
        problems = []
        if self.recovered or self.failed:
            problems.append(f"load failures in the log: {list(self.recovered + self.failed)}")
        if any(n <= 0 for n in self.num_cached_tokens):
            problems.append(f"a prompt reused nothing: num_cached_tokens={list(self.num_cached_tokens)}")
        if expected_tokens is not None and list(self.num_cached_tokens) != expected_tokens:
            problems.append(f"num_cached_tokens={list(self.num_cached_tokens)}, expected {expected_tokens}")
        total = sum(self.num_cached_tokens)
        if self.external_hits != total:
            problems.append(f"{EXTERNAL_HITS} grew by {self.external_hits:g}, not by the {total} cached tokens")
        if self.by_source.get("external_kv_transfer", 0.0) != total:
            problems.append(f"prompt tokens from external_kv_transfer: {self.by_source.get('external_kv_transfer')}"
                            f", not {total}")
        if self.local_hits:
            problems.append(f"{LOCAL_HITS} grew by {self.local_hits:g}: the local prefix cache served tokens")
        return problems

    def none_problems(self) -> list[str]:
        """Why this generation is not a plain computation without any reuse."""
        problems = []
        if any(self.num_cached_tokens):
            problems.append(f"num_cached_tokens={list(self.num_cached_tokens)}")
        if self.external_hits or self.local_hits:
            problems.append(f"hits: external {self.external_hits:g}, local {self.local_hits:g}")
        if self.recovered or self.failed:
            problems.append(f"load failures in the log: {list(self.recovered + self.failed)}")
        return problems


def reuse(g: Generation) -> Reuse:
    return Reuse(
        num_cached_tokens=tuple(g.num_cached_tokens),
        external_hits=delta(g, EXTERNAL_HITS),
        local_hits=delta(g, LOCAL_HITS),
        by_source={s: delta(g, f"vllm:prompt_tokens_by_source{{source={s}}}") for s in SOURCES},
        recovered=tuple(RECOVERED.findall(g.log)),
        failed=tuple(FAILED.findall(g.log)),
    )
