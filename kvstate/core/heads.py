"""KV heads across tensor-parallel ranks, and the slices that move them between two TP
sizes (heterogeneous TP). Pure.

An engine with ``total`` KV heads at ``tp`` ranks gives rank ``r`` the heads
``[r*total/tp, (r+1)*total/tp)`` when ``tp`` divides ``total``, and one head,
``r // (tp/total)``, when ``total`` divides ``tp`` (the head is replicated on
``tp/total`` ranks: Megatron-style column parallelism, as vLLM does it). No other split
exists: :func:`rank_heads` refuses it (``ConfigInvalid``, reason ``head_split``).

:func:`split` pairs the ranks of a source group (``src_tp``, the decode engine) with those
of a target group (``dst_tp``, the prefill engine): one :class:`Slice` per (target rank,
source rank) pair whose heads meet, each head taken from the first source rank that holds
it. Every target rank's heads are covered exactly once, so a target group is complete
when every slice was imported and loaded. A slice is what the coordinator calls a part:
at equal TP sizes the slices are the ranks themselves.
"""

from __future__ import annotations

import attrs

from kvstate.core.errors import ConfigInvalid
from kvstate.core.reasons import ConfigReason


@attrs.frozen
class Slice:
    """Heads ``[src_head, src_head + count)`` of source rank ``src_rank``'s bank go to
    heads ``[dst_head, dst_head + count)`` of target rank ``dst_rank``'s pages (both
    counted within the rank's own heads)."""

    dst_rank: int
    src_rank: int
    src_head: int
    dst_head: int
    count: int


def rank_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    """The global heads ``(first, count)`` rank ``rank`` of ``tp`` holds."""
    if total < 1 or tp < 1 or not 0 <= rank < tp:
        raise ConfigInvalid(ConfigReason.HEAD_SPLIT, f"rank {rank} of tp={tp} with {total} KV heads",
                            field="tp", value=tp)
    if total % tp == 0:
        n = total // tp
        return rank * n, n
    if tp % total == 0:
        return rank // (tp // total), 1
    raise ConfigInvalid(ConfigReason.HEAD_SPLIT, f"{total} KV heads cannot be split over tp={tp}: neither "
                        "divides the other", field="tp", value=tp)


def split(total: int, src_tp: int, dst_tp: int) -> tuple[Slice, ...]:
    """The slices that give every rank of a ``dst_tp`` group its heads from the banks of a
    ``src_tp`` group, in (target rank, source rank) order; ConfigInvalid (``head_split``)
    when either TP size cannot split ``total`` heads."""
    src = [rank_heads(total, src_tp, r) for r in range(src_tp)]
    out: list[Slice] = []
    for p in range(dst_tp):
        first, count = rank_heads(total, dst_tp, p)
        head = first
        while head < first + count:
            d = next(r for r, (a, n) in enumerate(src) if a <= head < a + n)  # the first holder
            a, n = src[d]
            run = min(a + n, first + count) - head
            if out and out[-1].dst_rank == p and out[-1].src_rank == d:
                last = out[-1]
                out[-1] = attrs.evolve(last, count=last.count + run)
            else:
                out.append(Slice(p, d, head - a, head - first, run))
            head += run
    return tuple(out)


def slices_of(slices: tuple[Slice, ...], dst_rank: int) -> list[tuple[int, Slice]]:
    """``(index, slice)`` of the slices target rank ``dst_rank`` loads."""
    return [(i, s) for i, s in enumerate(slices) if s.dst_rank == dst_rank]
