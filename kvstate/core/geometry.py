"""KV-cache geometry: the named regions of a bank, and a fingerprint over all of it. Pure.

A bank holds ``num_blocks`` blocks. Engines lay a block out in one or more tensors:
one per layer (vLLM's CPU backend, MLA), one per layer holding K and V along an outer
dimension (FlashAttention's ``[2, num_blocks, block_size, kv_heads, head_dim]``), or a
tensor of KV plus one of per-block scales (FP8). A :class:`Geometry` is therefore an
ordered tuple of named :class:`Region` values, each one such tensor as it lies in the
bank's memory: a dtype, a shape, the dimension that indexes blocks (not necessarily the
outermost), strides in elements and a byte offset into the bank.

Block ``b`` of a region is every element whose index along ``block_dim`` is ``b``.
Copies move a block as the bytes of its elements in logical (row-major) order over the
other dimensions, so a bank region and an engine tensor with the same dtype and block
shape exchange blocks whatever their strides (:mod:`kvstate.core.blockmap`).

Canonical text (one line; regions in order, separated by ``;``)::

    name,dtype,shape,block_dim,strides,offset       e.g.
    layer.0,bf16,4096x2x32x128,0,8192x4096x128x1,0

``shape`` and ``strides`` are ``x``-joined decimals without leading zeros. The text is
what the descriptor carries and what :meth:`Geometry.fingerprint` hashes, so the
fingerprint covers every field of every region, capacity included. Two geometries whose
blocks hold the same things (names, dtypes, block dims and block shapes) but differ in
capacity or memory order share :meth:`Geometry.format_fingerprint`.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Iterable, Sequence

import attrs

from kvstate.core import blockmap
from kvstate.core.reasons import ArgumentReason
from kvstate.core.errors import ConfigInvalid, ArgumentInvalid
from kvstate.core.identity import Purpose, digest

MAX_DIM = 1 << 32           # largest size of one dimension (num_blocks included)
MAX_NDIM = 8
MAX_REGIONS = 1024
MAX_STRIDE = 1 << 48        # elements
MAX_BANK_BYTES = 1 << 56
MAX_CANONICAL = 128 * 1024  # characters of canonical text
_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")


class DType(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"   # torch.float8_e4m3fn (finite, no infinities): the FP8 KV type
    FP8_E5M2 = "fp8_e5m2"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FP32 else 1 if self.value.startswith("fp8") else 2

    @classmethod
    def _missing_(cls, value: object) -> DType:
        raise ConfigInvalid.geometry("dtype", f"{value!r:.40} is not one of {', '.join(d.value for d in cls)}")


class Layout(enum.Enum):
    """The two single-shape layouts of :meth:`Geometry.uniform`."""

    BLOCK_MAJOR = "block_major"   # one region, a block's bytes for every layer contiguous
    LAYER_MAJOR = "layer_major"   # one region per layer, all blocks of layer 0 first

    @classmethod
    def _missing_(cls, value: object) -> Layout:
        raise ConfigInvalid.geometry("layout", f"{value!r:.40} is not one of {', '.join(x.value for x in cls)}")


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a dense tensor of ``shape``."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _ints(what: str, values: object) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)) or not all(type(v) is int for v in values):
        raise ConfigInvalid.geometry(what, f"must be a tuple of ints, not {values!r:.80}")
    return tuple(values)


def _dims(what: str, values: object) -> tuple[int, ...]:
    """``values`` as _ints, from any sequence (a range, torch.Size) but text; checked before
    the constructors below compute with them."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigInvalid.geometry(what, f"must be a tuple of ints, not {values!r:.80}")
    return _ints(what, tuple(values))


@attrs.frozen
class Region:
    """One named tensor of the bank. See the module docstring."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    block_dim: int
    strides: tuple[int, ...]
    offset: int = 0

    def __attrs_post_init__(self) -> None:
        where = f"region {self.name!r:.60}"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigInvalid.geometry(f"{where}.name", "must be 1-128 characters of A-Z a-z 0-9 _ . : / -")
        if not isinstance(self.dtype, DType):
            raise ConfigInvalid.geometry(f"{where}.dtype", f"must be a DType, not {self.dtype!r:.40}")
        shape, strides = _ints(f"{where}.shape", self.shape), _ints(f"{where}.strides", self.strides)
        object.__setattr__(self, "shape", shape)  # lists become tuples: the value is hashable
        object.__setattr__(self, "strides", strides)
        if not 1 <= len(shape) <= MAX_NDIM:
            raise ConfigInvalid.geometry(f"{where}.shape", f"must have 1..{MAX_NDIM} dimensions, not {len(shape)}")
        if not all(1 <= n <= MAX_DIM for n in shape):
            raise ConfigInvalid.geometry(f"{where}.shape", f"every size must be in 1..{MAX_DIM}: {shape}")
        if len(strides) != len(shape):
            raise ConfigInvalid.geometry(f"{where}.strides", f"{len(strides)} strides for {len(shape)} dimensions")
        if not all(0 <= t <= MAX_STRIDE for t in strides):
            raise ConfigInvalid.geometry(f"{where}.strides", f"every stride must be in 0..{MAX_STRIDE}: {strides}")
        if type(self.block_dim) is not int or not 0 <= self.block_dim < len(shape):
            raise ConfigInvalid.geometry(f"{where}.block_dim", f"{self.block_dim!r} is not a dimension of {shape}")
        if type(self.offset) is not int or not 0 <= self.offset <= MAX_BANK_BYTES or self.offset % self.dtype.itemsize:
            raise ConfigInvalid.geometry(f"{where}.offset", f"{self.offset!r} must be in 0..2**56 and a multiple of "
                                         f"the item size {self.dtype.itemsize}")
        if not blockmap.non_overlapping(shape, strides):
            raise ConfigInvalid.geometry(f"{where}.strides", f"{strides} make elements of shape {shape} overlap")
        if self.offset + self.span > MAX_BANK_BYTES:
            raise ConfigInvalid.geometry(f"{where}.offset", "the region ends beyond 2**56 bytes")

    @classmethod
    def contiguous(cls, name: str, dtype: DType, shape: Sequence[int], block_dim: int = 0,
                   offset: int = 0) -> Region:
        """A dense row-major region."""
        dims = _dims(f"region {name!r:.60}.shape", shape)
        return cls(name, dtype, dims, block_dim, contiguous_strides(dims), offset)

    @classmethod
    def like(cls, name: str, dtype: DType, shape: Sequence[int], block_dim: int, strides: Sequence[int], *,
             num_blocks: int, offset: int = 0) -> Region:
        """A dense region with the memory order of ``strides`` (as an engine tensor lays it
        out) and ``num_blocks`` blocks: the bank's copy of an engine tensor, whatever the
        engine's own capacity."""
        shape = list(_dims("shape", shape))
        strides = _dims("strides", strides)
        if len(strides) != len(shape) or type(block_dim) is not int or not 0 <= block_dim < len(shape):
            raise ConfigInvalid.geometry("block_dim", f"{block_dim!r:.20} with shape {shape} and strides {strides}")
        shape[block_dim] = num_blocks
        order = sorted(range(len(shape)), key=lambda i: (strides[i], -i))  # innermost first
        out, step = [0] * len(shape), 1
        for i in order:
            out[i] = step
            step *= shape[i]
        return cls(name, dtype, tuple(shape), block_dim, tuple(out), offset)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.shape[:self.block_dim] + self.shape[self.block_dim + 1:]

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.itemsize

    @property
    def block_stride_bytes(self) -> int:
        return self.strides[self.block_dim] * self.itemsize

    @property
    def span(self) -> int:
        """Bytes from the first element to one past the last."""
        return blockmap.span(self.itemsize, self.shape, self.strides)

    def runs(self) -> tuple[tuple[int, int], ...]:
        """(offset from the block's first element, length) of each contiguous run of one
        block's bytes, in logical order; the same for every block."""
        return _runs(self.itemsize, self.shape, self.strides, self.block_dim)

    def canonical(self) -> str:
        return (f"{self.name},{self.dtype.value},{'x'.join(map(str, self.shape))},{self.block_dim},"
                f"{'x'.join(map(str, self.strides))},{self.offset}")


@functools.lru_cache(maxsize=4096)
def _runs(itemsize: int, shape: tuple[int, ...], strides: tuple[int, ...], block_dim: int) -> tuple[tuple[int, int],
          ...]:
    return blockmap.block_runs(itemsize, shape, strides, block_dim)


_REGION_TEXT = re.compile(
    r"([A-Za-z0-9_.:/-]{1,128}),([a-z0-9_]{1,16}),((?:[1-9][0-9]{0,9}x){0,7}[1-9][0-9]{0,9}),([0-7]),"
    r"((?:(?:0|[1-9][0-9]{0,14})x){0,7}(?:0|[1-9][0-9]{0,14})),(0|[1-9][0-9]{0,16})")


@attrs.frozen
class Geometry:
    """The regions of a bank. See the module docstring."""

    regions: tuple[Region, ...]

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.regions, (tuple, list)):
            raise ConfigInvalid.geometry("regions",
                                         f"must be a tuple of Region values, not {type(self.regions).__name__}")
        rs = tuple(self.regions)
        object.__setattr__(self, "regions", rs)
        if not 1 <= len(rs) <= MAX_REGIONS:
            raise ConfigInvalid.geometry("regions", f"must number 1..{MAX_REGIONS}, not {len(rs)}")
        if not all(isinstance(r, Region) for r in rs):
            raise ConfigInvalid.geometry("regions", "must all be Region values")
        names = [r.name for r in rs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ConfigInvalid.geometry("regions", f"names must be unique; repeated: {dup[:5]}")
        nb = rs[0].num_blocks
        for r in rs[1:]:
            if r.num_blocks != nb:
                raise ConfigInvalid.geometry(f"region {r.name!r}.shape", f"holds {r.num_blocks} blocks, "
                                             f"region {rs[0].name!r} holds {nb}: every region holds num_blocks")
        spans = sorted((r.offset, r.offset + r.span, r.name) for r in rs)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise ConfigInvalid.geometry(f"region {b!r}.offset", f"overlaps region {a!r} in the bank")
        if len(self.canonical()) > MAX_CANONICAL:
            raise ConfigInvalid.geometry("regions", f"canonical text longer than {MAX_CANONICAL} characters")

    # -- constructors ---------------------------------------------------------------------

    @classmethod
    def packed(cls, regions: Iterable[Region], *, align: int = 256) -> Geometry:
        """The regions back to back in the order given (each offset replaced, aligned to
        ``align`` bytes and to the region's item size), as an engine allocating one buffer
        for all of them would."""
        if type(align) is not int or not 1 <= align <= MAX_BANK_BYTES:
            raise ConfigInvalid.geometry("align", f"must be an int in 1..2**56, not {align!r:.40}")
        if isinstance(regions, (str, bytes)) or not isinstance(regions, Iterable):
            raise ConfigInvalid.geometry("regions", f"must be Region values, not {type(regions).__name__}")
        given = tuple(regions)  # taken whole (a generator too) and checked before any arithmetic
        if not all(isinstance(r, Region) for r in given):
            raise ConfigInvalid.geometry("regions", "must all be Region values")
        out, pos = [], 0
        for r in given:
            step = math.lcm(align, r.itemsize)
            pos = -(-pos // step) * step
            out.append(attrs.evolve(r, offset=pos))
            pos += out[-1].span
        return cls(tuple(out))

    @classmethod
    def uniform(cls, *, layers: int, kv_heads: int, head_dim: int, block_tokens: int, dtype: DType,
                layout: Layout, num_blocks: int) -> Geometry:
        """The single-shape geometry: K and V of ``kv_heads`` heads of ``head_dim`` for
        ``block_tokens`` tokens per block and layer. ``BLOCK_MAJOR`` is one region ``kv``
        of shape [num_blocks, layers, 2, block_tokens, kv_heads, head_dim]; ``LAYER_MAJOR``
        is one region ``layer.i`` of [num_blocks, 2, block_tokens, kv_heads, head_dim] per
        layer, back to back."""
        for what, n in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("block_tokens", block_tokens), ("num_blocks", num_blocks)):
            if type(n) is not int or not 1 <= n <= MAX_DIM:
                raise ConfigInvalid.geometry(what, f"must be an int in 1..{MAX_DIM}, not {n!r:.40}")
        if not isinstance(layout, Layout):
            raise ConfigInvalid.geometry("layout", f"must be a Layout, not {layout!r:.40}")
        block = (2, block_tokens, kv_heads, head_dim)
        if layout is Layout.BLOCK_MAJOR:
            return cls((Region.contiguous("kv", dtype, (num_blocks, layers, *block)),))
        return cls.packed((Region.contiguous(f"layer.{i}", dtype, (num_blocks, *block)) for i in range(layers)),
                          align=1)

    @classmethod
    def parse(cls, text: str) -> Geometry:
        """The geometry of a canonical text; anything else is ConfigInvalid (GEOMETRY)."""
        if not isinstance(text, str) or not 0 < len(text) <= MAX_CANONICAL:
            raise ConfigInvalid.geometry("text", f"must be a string of 1..{MAX_CANONICAL} characters")
        regions = []
        for i, part in enumerate(text.split(";")):
            m = _REGION_TEXT.fullmatch(part)
            if m is None:
                raise ConfigInvalid.geometry(f"regions[{i}]", f"not canonical region text: {part[:80]!r}")
            name, dtype, shape, block_dim, strides, offset = m.groups()
            try:
                dt = DType(dtype)
            except ValueError:
                raise ConfigInvalid.geometry(f"regions[{i}].dtype", f"unknown dtype {dtype!r}") from None
            regions.append(Region(name, dt, tuple(int(x) for x in shape.split("x")), int(block_dim),
                                  tuple(int(x) for x in strides.split("x")), int(offset)))
        g = cls(tuple(regions))
        if g.canonical() != text:
            raise ConfigInvalid.geometry("text", "not in canonical form")
        return g

    # -- what the lifecycle code uses -----------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise ConfigInvalid.geometry("regions", f"no region named {name!r:.80}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every region."""
        return sum(r.block_bytes for r in self.regions)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of bank the regions occupy: up to the end of the last one (computed once:
        every validation and open asks)."""
        return max(r.offset + r.span for r in self.regions)

    def bank_size(self, granularity: int) -> int:
        """The bank's size: ``nbytes`` rounded up to the allocation granularity."""
        return round_up(self.nbytes, granularity)

    def block_extents(self, block: int) -> list[tuple[int, int]]:
        """(offset, length) in the bank of every run of ``block``, region by region in
        logical order, adjacent runs merged."""
        if type(block) is not int or not 0 <= block < self.num_blocks:
            raise ArgumentInvalid(ArgumentReason.RANGE, f"block {block!r:.40} outside 0..{self.num_blocks - 1}")
        out: list[tuple[int, int]] = []
        for r in self.regions:
            base = r.offset + block * r.block_stride_bytes
            for off, length in r.runs():
                if out and out[-1][0] + out[-1][1] == base + off:
                    out[-1] = (out[-1][0], out[-1][1] + length)
                else:
                    out.append((base + off, length))
        return out

    # -- identity ---------------------------------------------------------------------------

    def canonical(self) -> str:
        return ";".join(r.canonical() for r in self.regions)

    def fingerprint(self) -> bytes:
        """16 bytes over every field of every region, capacity and offsets included."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> bytes:
        # Asked for on every lease, report check and validation; a geometry is immutable.
        return digest(Purpose.GEOMETRY, self.canonical().encode(), size=16)

    def format_fingerprint(self) -> bytes:
        """16 bytes over what a block holds: region names, dtypes, block dims and block
        shapes, in order. Independent of capacity, strides and offsets."""
        text = ";".join(f"{r.name},{r.dtype.value},{r.block_dim},{'x'.join(map(str, r.block_shape))}"
                        for r in self.regions)
        return digest(Purpose.GEOMETRY, b"format:" + text.encode(), size=16)

    def mismatch(self, other: Geometry, *, capacity: bool = True) -> str | None:
        """The first field in which ``other`` differs, named (``regions[3] 'layer.3'.dtype:
        bf16 != fp16``), or None when they are equal. ``capacity=False`` compares only what
        :meth:`format_fingerprint` covers."""
        if len(self.regions) != len(other.regions):
            return f"regions: {len(self.regions)} != {len(other.regions)}"
        for i, (a, b) in enumerate(zip(self.regions, other.regions)):
            fields = [("name", a.name, b.name), ("dtype", a.dtype.value, b.dtype.value),
                      ("block_dim", a.block_dim, b.block_dim), ("block_shape", a.block_shape, b.block_shape)]
            if capacity:
                fields += [("shape", a.shape, b.shape), ("strides", a.strides, b.strides),
                           ("offset", a.offset, b.offset)]
            for field, x, y in fields:
                if x != y:
                    return f"regions[{i}] {a.name!r}.{field}: {x} != {y}"
        return None


def round_up(n: int, granularity: int) -> int:
    """``n`` rounded up to a multiple of ``granularity`` (a power of two).

    pre: n >= 0
    pre: granularity > 0 and granularity & (granularity - 1) == 0
    post: __return__ % granularity == 0
    post: n <= __return__ < n + granularity
    """
    return (n + granularity - 1) & ~(granularity - 1)
