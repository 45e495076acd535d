"""What the vLLM suite's tests share: the prompts, and the records of engine runs."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.engines import tiny_llama
from support.engines.memory import MemorySampler
from support.engines.runner import Engine, EngineSpec, Generation

#: Prompt lengths: not multiples of the block size (32), so that ExampleConnector's
#: stored and looked-up prefixes agree; 4,096 is the longest the issue asks for.
PROMPT_LENGTHS = (100, 75, 140, 4096)
#: ExampleConnector cannot store a prompt whose prefill is split over steps (chunked
#: prefill: at most 4,096 tokens per step here), so the ExampleConnector pair runs the
#: short ones; prompts(EXAMPLE_LENGTHS) are the first prompts of prompts().
EXAMPLE_LENGTHS = PROMPT_LENGTHS[:3]
MAX_TOKENS = 16


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = tiny_llama.CONFIG["vocab_size"]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]  # 0-2: pad/bos/eos


@dataclass
class Engines:
    """Starts engines under one work dir and closes them all, checking leftovers."""

    workdir: Path
    sampler: MemorySampler
    started: list[Engine] = field(default_factory=list)

    def make(self, name: str, spec: EngineSpec) -> Engine:
        engine = Engine(spec, self.workdir, name)
        self.started.append(engine)
        self.sampler.engines.append(engine)
        return engine

    def close_all(self) -> list[str]:
        """Close every engine, even after one failed to close (its processes and files
        would outlive the test otherwise), then raise the first failure, the others
        noted on it; else the leftovers of all."""
        leaks: list[str] = []
        errors: list[BaseException] = []
        for engine in self.started:
            try:
                found = engine.close()
            except BaseException as exc:  # noqa: BLE001 - raised below, once every engine is closed
                errors.append(exc)
                continue
            finally:
                if engine in self.sampler.engines:
                    self.sampler.engines.remove(engine)
            leaks += [f"{engine.name}: {leak}" for leak in found.leaks]
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"also failed to close: {other!r}")
            raise errors[0]
        return leaks


@dataclass(frozen=True)
class Run:
    """Outputs of engines that a session fixture started and already closed."""

    generations: dict[str, Generation]
    startup: dict[str, dict[str, Any]]
    probe_dirs: dict[str, Path] = field(default_factory=dict)


@dataclass
class ExamplePair:
    """A producer and a consumer engine with vLLM's ExampleConnector (through the probe),
    sharing one storage dir, both alive."""

    producer: Engine
    consumer: Engine
    storage: Path
    probe_dirs: dict[str, Path]
    produced: Generation
