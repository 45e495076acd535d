"""kvstate's threads in an engine process may run on every CPU the process may use.

Why: vLLM's CPU worker binds its thread to its rank's cores (``VLLM_CPU_OMP_THREADS_BIND``,
else one core per rank), and a thread inherits the CPU mask of the thread that starts it.
So every thread kvstate started from a worker's hooks (the native lease server, the op
engine's copy threads, lease renewal, a rank worker's reader, lease and open threads)
was confined to that one core, beside the worker's main thread, which computes during a
step and spins on ``os.sched_yield`` between steps. Measured (issue 28, item 6; two tp=1
FP8 engines on 2 cores, both bound to core 0, without the sleep per step the connector
had then): while the prefill worker's main thread
spun on core 0 waiting for its next step, the decode worker's kvstate threads stayed
runnable on core 0 and ran not once for 10 s, with core 1 idle; the prefill's lease got
no answer within its 10 s timeout, and the first loads were recomputed.

The engine's own binding is left as it is: only the threads kvstate starts meanwhile get
the wider mask (``unpinned``), so its control threads go where a CPU is free and its
compute stays on the engine's cores.

Cost
----

Widening a worker's mask and narrowing it back is not free. Timed in the engine
(``python -m support.engines.decode_cost --hooks``, a decode engine of the test model on 2
cores), the three step hooks that did it on every step took 182 (the stores it hands over
included), 67 and 54 µs per step, 374 µs with the rest of the connector's hooks, about a
tenth of that engine's decode step. Out of the engine, the pair of ``sched_setaffinity`` calls costs 4.6 µs and
``os.cpu_count()`` another 5.7 (it reads ``/sys`` each time). So the CPU count is read
once, and the step hooks unpin only when they hand kvstate work that may start a thread.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


@functools.cache
def allowed_cpus() -> frozenset[int]:
    """Every CPU this process may be scheduled on: the online CPUs (the kernel narrows a
    mask to the process's cpuset when it is set). Read once: CPUs brought online later
    are left out of kvstate's threads' masks."""
    return frozenset(range(os.cpu_count() or 1))


@contextmanager
def unpinned() -> Iterator[None]:
    """Within the block, the calling thread, and so every thread it starts, may run on
    every allowed CPU; afterwards the calling thread gets its own mask back. Where the
    mask cannot be read or set (not Linux, or refused), nothing changes."""
    try:
        own = os.sched_getaffinity(0)
        wide = own | allowed_cpus()
        if wide != own:
            os.sched_setaffinity(0, wide)
    except (AttributeError, OSError):
        yield
        return
    try:
        yield
    finally:
        if wide != own:
            os.sched_setaffinity(0, own)


def starts_unpinned(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` runs :func:`unpinned`: a hook that may start kvstate threads."""
    @functools.wraps(fn)
    def run(*args: object, **kwargs: object) -> T:
        with unpinned():
            return fn(*args, **kwargs)
    return run
