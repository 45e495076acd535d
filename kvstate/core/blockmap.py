"""Where a block's bytes lie in a strided tensor, and how to copy between two layouts. Pure.

A block of a tensor (all elements with one index along its block dimension) is copied as
the bytes of its elements in logical, row-major order over the other dimensions. In
memory those bytes form *runs*: maximal stretches that are contiguous. A dense vLLM CPU
block is one run; a FlashAttention block ``[2, ., block_size, heads, head_dim]`` is two
(K and V). :func:`block_runs` finds them once per layout; the runs of block ``b`` are
those of block 0 shifted by ``b`` times the block stride. :func:`pair_runs` cuts the runs
of a source and a destination layout into (source offset, destination offset, length)
copies that move each logical byte to the same logical place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvstate.core.errors import ConfigInvalid

#: Most runs one block may consist of: a layout needing more is refused, not crawled.
MAX_RUNS = 1 << 16

Runs = tuple[tuple[int, int], ...]
Pairs = tuple[tuple[int, int, int], ...]


def span(itemsize: int, shape: Sequence[int], strides: Sequence[int]) -> int:
    """Bytes from the first element (offset 0; strides are never negative) to one past
    the last."""
    return (sum((n - 1) * t for n, t in zip(shape, strides)) + 1) * itemsize


def non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when no two elements share memory. Sufficient test: ordered by stride, every
    dimension of size > 1 steps over everything the smaller ones reach."""
    reach = 1
    for t, n in sorted((t, n) for n, t in zip(shape, strides) if n > 1):
        if t < reach:
            return False
        reach += (n - 1) * t
    return True


def block_runs(itemsize: int, shape: Sequence[int], strides: Sequence[int], block_dim: int) -> Runs:
    """(offset from the block's first element, length) in bytes of each run of one block,
    in logical order, adjacent runs merged. Refuses a layout of more than MAX_RUNS runs."""
    dims = [(n, t * itemsize) for i, (n, t) in enumerate(zip(shape, strides)) if i != block_dim and n > 1]
    run = itemsize
    while dims and dims[-1][1] == run:
        run *= dims[-1][0]
        dims.pop()
    count = math.prod(n for n, _ in dims)
    if count > MAX_RUNS:
        raise ConfigInvalid.geometry("strides", f"a block of shape {tuple(shape)} with strides {tuple(strides)} is "
                                     f"{count} separate runs; at most {MAX_RUNS} are copied per block")
    offsets = [0]
    for n, step in dims:
        offsets = [o + k * step for o in offsets for k in range(n)]
    out: list[tuple[int, int]] = []
    for o in offsets:
        if out and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + run)
        else:
            out.append((o, run))
    return tuple(out)


def pair_runs(src: Runs, dst: Runs) -> Pairs:
    """Copies (source offset, destination offset, length) moving the logical byte stream
    of ``src`` runs onto that of ``dst`` runs, merged where both sides continue.

    pre: sum(n for _, n in src) == sum(n for _, n in dst) > 0
    post: sum(n for _, _, n in __return__) == sum(n for _, n in src)
    """
    out: list[tuple[int, int, int]] = []
    i = j = 0
    so, sl = src[0]
    do, dl = dst[0]
    while True:
        n = min(sl, dl)
        if out and out[-1][0] + out[-1][2] == so and out[-1][1] + out[-1][2] == do:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((so, do, n))
        so, sl, do, dl = so + n, sl - n, do + n, dl - n
        if sl == 0:
            i += 1
            if i == len(src):
                return tuple(out)
            so, sl = src[i]
        if dl == 0:
            j += 1
            do, dl = dst[j]
