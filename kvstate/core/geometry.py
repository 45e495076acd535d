"""KV-cache geometry and its stable fingerprint. Pure.

A bank holds ``num_blocks`` blocks of ``block_tokens`` tokens. For each block, each
layer, K and V, each KV head of this rank: ``head_dim`` values of ``dtype``. Two layouts:

- ``block_major``: a block's bytes for all layers are contiguous (vLLM/SGLang paged
  layout with the block as the outer dimension), so a block is one extent;
- ``layer_major``: all blocks of layer 0, then layer 1, ... (a block is ``layers``
  extents), as engines with one cache tensor per layer allocate.

The fingerprint covers everything except ``num_blocks``: two ranks are compatible when
they agree on the layout of a block, whatever their capacity.
"""

from __future__ import annotations

import enum

import attrs

from kvstate.core.identity import Purpose, digest

MAX_DIM = 1 << 20


class DType(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FP32 else 1 if self.value.startswith("fp8") else 2


class Layout(enum.Enum):
    BLOCK_MAJOR = "block_major"
    LAYER_MAJOR = "layer_major"


_positive = [attrs.validators.instance_of(int), attrs.validators.ge(1), attrs.validators.le(MAX_DIM)]


@attrs.frozen
class Geometry:
    layers: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    block_tokens: int = attrs.field(validator=_positive)
    dtype: DType
    layout: Layout
    num_blocks: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.ge(1),
                                             attrs.validators.le(1 << 32)])

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block in one layer: K and V for every head and token."""
        return 2 * self.kv_heads * self.head_dim * self.block_tokens * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.layers * self.layer_block_bytes

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def bank_size(self, granularity: int) -> int:
        """The bank's size: ``nbytes`` rounded up to the allocation granularity."""
        return round_up(self.nbytes, granularity)

    def canonical(self) -> str:
        return (f"layers={self.layers};kv_heads={self.kv_heads};head_dim={self.head_dim};"
                f"block_tokens={self.block_tokens};dtype={self.dtype.value};layout={self.layout.value}")

    def fingerprint(self) -> bytes:
        return digest(Purpose.GEOMETRY, self.canonical().encode(), size=16)

    def block_extents(self, block: int) -> list[tuple[int, int]]:
        """(offset, length) of every extent of ``block`` inside the bank."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside 0..{self.num_blocks - 1}")
        if self.layout is Layout.BLOCK_MAJOR:
            return [(block * self.block_bytes, self.block_bytes)]
        lb = self.layer_block_bytes
        return [((layer * self.num_blocks + block) * lb, lb) for layer in range(self.layers)]


def round_up(n: int, granularity: int) -> int:
    """``n`` rounded up to a multiple of ``granularity`` (a power of two).

    pre: n >= 0
    pre: granularity > 0 and granularity & (granularity - 1) == 0
    post: __return__ % granularity == 0
    post: n <= __return__ < n + granularity
    """
    return (n + granularity - 1) & ~(granularity - 1)
