"""Heterogeneous TP in the connector: what a prefill engine at one TP size expects of the
decode engines it loads from at another (``source_tp``). Pure.

The decode engine keys its blocks with its own :class:`~.hashing.Compat` (its tp, its KV
heads per rank), so the prefill side looks them up, and validates their descriptors, under
the decode engine's key: :attr:`SourceView.compat`. Each prefill rank then imports one part
per :class:`~kvstate.core.heads.Slice` it has (a decode rank whose heads it needs) and
scatters the slice's heads into its own pages. At equal sizes the view is the engine's own
key and every rank has one whole slice: the behaviour without ``source_tp``.

Reuse across TP sizes is opted into (``source_tp``): KV computed at another TP size is
laid out the same per head but is not bitwise what this engine computes past the first
layer (the all-reduce sums in another order), which float32 absorbs and bf16 may not.
"""

from __future__ import annotations

import attrs

from kvstate.core import heads
from kvstate.core.errors import ConfigInvalid
from kvstate.integrations.vllm.hashing import Compat


@attrs.frozen
class SourceView:
    """The decode engines' key as this engine expects it, and the slices of its ranks."""

    compat: Compat
    slices: tuple[heads.Slice, ...]

    @property
    def mixed(self) -> bool:
        """Heterogeneous TP: the coordinator's parts are slices, not ranks."""
        return len(self.slices) != self.compat.tp or any(s.src_rank != s.dst_rank for s in self.slices)

    def of_rank(self, rank: int) -> list[tuple[int, heads.Slice]]:
        return heads.slices_of(self.slices, rank)


def same_tp(compat: Compat) -> SourceView:
    """Decode engines of this engine's own TP size: every rank its own whole part."""
    return SourceView(compat, tuple(heads.Slice(r, r, 0, 0, compat.kv_heads) for r in range(compat.tp)))


def source_view(compat: Compat, total_heads: int, source_tp: int | None) -> SourceView:
    """The view for an engine of key ``compat`` with ``total_heads`` KV heads loading from
    decode engines at ``source_tp`` (None: its own size). ConfigInvalid (``head_split``)
    when that size cannot split the heads."""
    tp = compat.tp if source_tp is None else source_tp
    own = heads.rank_heads(total_heads, compat.tp, 0)[1]
    if own != compat.kv_heads:
        raise ConfigInvalid.of("kv_heads", f"{compat.kv_heads} KV heads per rank registered, {own} expected "
                                     f"of {total_heads} heads at tp={compat.tp}")
    if tp == compat.tp:
        return same_tp(compat)
    per_rank = heads.rank_heads(total_heads, tp, 0)[1]
    return SourceView(attrs.evolve(compat, tp=tp, kv_heads=per_rank), heads.split(total_heads, tp, compat.tp))
