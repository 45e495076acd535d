"""Geometry of named regions: the four engine layouts, the fingerprint, canonical text,
and the run arithmetic that moves blocks between two layouts. Pure (numpy is the oracle)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from support.errors import raises
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.core import blockmap, layouts
from kvstate.core.descriptor import MAGIC, MAC_BYTES, VERSION, _HEAD, decode, encode
from kvstate.core.errors import DescriptorRejected, KvStateError, ConfigInvalid, ArgumentInvalid
from kvstate.core.geometry import MAX_REGIONS, DType, Geometry, Region, contiguous_strides
from kvstate.core.identity import Purpose, digest
from kvstate.core.reasons import RejectReason, ConfigReason, ArgumentReason
from support.descriptors import DEPLOYMENT, descriptor

# -- the four layouts -----------------------------------------------------------------------


def test_vllm_cpu_layout_is_the_engines_register_kv_caches_tensors() -> None:
    """vLLM 0.32 CPU: per layer bf16 [num_blocks, kv_heads, block_size, 2*head_dim],
    contiguous, every layer a view of one buffer right after the previous one."""
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    g = layouts.vllm_cpu(names, num_blocks=4096, num_kv_heads=2, block_size=32, head_dim=64)
    assert g.names == tuple(names)
    r0, r1 = g.regions
    assert (r0.dtype, r0.shape, r0.strides, r0.block_dim) == (DType.BF16, (4096, 2, 32, 128), (8192, 4096, 128, 1), 0)
    assert r0.offset == 0 and r1.offset == 64 << 20  # layer 1 starts 64 MiB in, as in the engine
    assert r0.block_bytes == 16 << 10 and r0.runs() == ((0, 16 << 10),)  # one opaque 16 KiB block
    assert g.nbytes == 128 << 20 and g.block_bytes == 32 << 10


def test_flash_attention_layout_is_k_then_v_along_an_outer_dimension() -> None:
    g = layouts.flash_attn(3, num_blocks=100, block_size=16, num_kv_heads=8, head_dim=128)
    r = g.region("layer.1")
    assert r.shape == (2, 100, 16, 8, 128) and r.block_dim == 1
    half = 16 * 8 * 128 * 2
    assert r.runs() == ((0, half), (100 * half, half))  # K of the block, then V, 100 blocks later
    assert g.block_extents(5)[:2] == [(5 * half, half), (105 * half, half)]


def test_mla_layout_is_one_latent_region_per_layer() -> None:
    g = layouts.mla(61, num_blocks=64, block_size=64, latent_dim=576)
    assert len(g.regions) == 61 and all(r.shape == (64, 64, 576) for r in g.regions)
    assert g.block_bytes == 61 * 64 * 576 * 2


def test_fp8_layout_moves_per_block_scales_with_their_block() -> None:
    g = layouts.fp8_with_scales(2, num_blocks=32, block_size=16, num_kv_heads=4, head_dim=64)
    assert g.names == ("layer.0", "layer.0.scale", "layer.1", "layer.1.scale")
    kv, scale = g.regions[:2]
    assert kv.dtype is DType.FP8_E4M3 and kv.block_bytes == 2 * 16 * 4 * 64
    assert scale.dtype is DType.FP32 and scale.shape == (32, 2, 4) and scale.block_bytes == 2 * 4 * 4
    assert all(r.offset % 256 == 0 for r in g.regions)


def test_the_block_dimension_may_be_inner() -> None:
    r = Region.contiguous("x", DType.FP16, (3, 4, 10, 8), block_dim=2)
    assert r.num_blocks == 10 and r.block_shape == (3, 4, 8)
    assert len(r.runs()) == 12 and r.block_bytes == 3 * 4 * 8 * 2


# -- fingerprint and mismatch --------------------------------------------------------------

BASE = layouts.flash_attn(2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)


def _region1(make: object) -> Geometry:
    regions = list(BASE.regions)
    regions[1] = make(regions[1])  # type: ignore[operator]
    return Geometry(tuple(regions))


MUTATIONS = {
    "name": lambda r: attrs.evolve(r, name="other"),
    "dtype": lambda r: attrs.evolve(r, dtype=DType.FP16),
    "block_dim": lambda r: Region.contiguous(r.name, r.dtype, (16, 2, 4, 2, 8), 0, r.offset),
    "block_shape": lambda r: Region.contiguous(r.name, r.dtype, (2, 16, 4, 2, 16), 1, r.offset),
    "strides": lambda r: Region.like(r.name, r.dtype, r.shape, 1, (5, 4, 3, 1, 2), num_blocks=16, offset=r.offset),
    "offset": lambda r: attrs.evolve(r, offset=r.offset + (1 << 20)),
}


@pytest.mark.parametrize("field", sorted(MUTATIONS))
def test_the_fingerprint_covers_every_field_and_a_mismatch_names_it(field: str) -> None:
    other = _region1(MUTATIONS[field])
    assert other.fingerprint() != BASE.fingerprint()
    differs = BASE.mismatch(other)
    assert differs is not None and differs.startswith(f"regions[1] 'layer.1'.{field}:"), differs


def test_capacity_changes_the_shape_field() -> None:
    other = layouts.flash_attn(2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    assert (BASE.mismatch(other) or "").startswith("regions[0] 'layer.0'.shape: (2, 16, 4, 2, 8) != (2, 8, 4, 2, 8)")


def test_capacity_is_in_the_fingerprint_but_not_in_the_format() -> None:
    small = layouts.flash_attn(2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    assert small.fingerprint() != BASE.fingerprint()
    assert small.format_fingerprint() == BASE.format_fingerprint()
    assert BASE.mismatch(small, capacity=False) is None
    assert BASE.mismatch(BASE) is None
    assert BASE.fingerprint() == digest(Purpose.GEOMETRY, BASE.canonical().encode(), size=16)


def test_region_count_mismatch_is_named() -> None:
    assert BASE.mismatch(layouts.flash_attn(3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)) == \
        "regions: 2 != 3"


# -- validity -----------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "field"), [
    (lambda: Region("bad name", DType.BF16, (4,), 0, (1,)), "name"),
    (lambda: Region("a", "bf16", (4,), 0, (1,)), "dtype"),
    (lambda: Region("a", DType.BF16, (0, 2), 0, (2, 1)), "shape"),
    (lambda: Region("a", DType.BF16, (4, 2), 2, (2, 1)), "block_dim"),
    (lambda: Region("a", DType.BF16, (4, 2), 0, (2,)), "strides"),
    (lambda: Region("a", DType.BF16, (4, 2), 0, (1, 1)), "strides"),       # elements overlap
    (lambda: Region("a", DType.BF16, (4, 2), 0, (2, -1)), "strides"),
    (lambda: Region("a", DType.BF16, (4, 2), 0, (2, 1), 3), "offset"),     # not item-aligned
    (lambda: Region("a", DType.BF16, [4, 2.0], 0, (2, 1)), "shape"),        # type: ignore[list-item]
    (lambda: Geometry(()), "regions"),
    (lambda: Geometry((Region.contiguous("a", DType.BF16, (4, 2)), Region.contiguous("a", DType.BF16, (4, 2), offset=64))),
     "regions"),
    (lambda: Geometry((Region.contiguous("a", DType.BF16, (4, 2)), Region.contiguous("b", DType.BF16, (5, 2), offset=64))),
     "shape"),
    (lambda: Geometry((Region.contiguous("a", DType.BF16, (4, 2)), Region.contiguous("b", DType.BF16, (4, 2), offset=8))),
     "offset"),
    (lambda: Geometry.uniform(layers=0, kv_heads=1, head_dim=1, block_tokens=1, dtype=DType.FP16,
                              layout="layer_major", num_blocks=1), "layers"),  # type: ignore[arg-type]
    # the constructors check what they compute with first (these were TypeError,
    # AttributeError and ZeroDivisionError)
    (lambda: Region.contiguous("a", DType.BF16, "ab"), "shape"),  # type: ignore[arg-type]
    (lambda: Region.contiguous("a", DType.BF16, None), "shape"),  # type: ignore[arg-type]
    (lambda: Region.contiguous("a", DType.BF16, 4), "shape"),  # type: ignore[arg-type]
    (lambda: Region.like("a", DType.BF16, None, 0, (2, 1), num_blocks=4), "shape"),  # type: ignore[arg-type]
    (lambda: Region.like("a", DType.BF16, (4, 2), 0, 5, num_blocks=4), "strides"),  # type: ignore[arg-type]
    (lambda: Geometry.packed([1]), "regions"),  # type: ignore[list-item]
    (lambda: Geometry.packed(None), "regions"),  # type: ignore[arg-type]
    (lambda: Geometry.packed([Region.contiguous("a", DType.BF16, (4, 2))], align=0), "align"),
    (lambda: Geometry.packed([Region.contiguous("a", DType.BF16, (4, 2))], align=True), "align"),
])
def test_malformed_geometries_are_refused_naming_the_field(make: object, field: str) -> None:
    with raises(ConfigInvalid, ConfigReason.GEOMETRY) as info:
        make()  # type: ignore[operator]
    assert field in info.value.field
    assert isinstance(info.value, KvStateError) and isinstance(info.value, ValueError)


def test_too_many_regions_are_refused() -> None:
    with raises(ConfigInvalid, ConfigReason.GEOMETRY):
        layouts.mla(MAX_REGIONS + 1, num_blocks=1, block_size=1, latent_dim=1)


def test_block_ids_outside_the_geometry_are_typed() -> None:
    for bad in (-1, 16, 2.0, True, None):
        with raises(ArgumentInvalid, ArgumentReason.RANGE):
            BASE.block_extents(bad)  # type: ignore[arg-type]


# -- canonical text -----------------------------------------------------------------------


def test_canonical_text_round_trips_and_is_strict() -> None:
    text = BASE.canonical()
    assert Geometry.parse(text) == BASE
    for bad in (text + ";", " " + text, text.replace(",bf16,", ",BF16,"), text.replace(",2x16x", ",02x16x"),
                text.replace(",bf16,", ",int4,"), "", text.replace(";", ";;"), "a,bf16,4,0,1,0;a,bf16,4,0,1,8"):
        with raises(ConfigInvalid, ConfigReason.GEOMETRY):
            Geometry.parse(bad)


@st.composite
def regions(draw: st.DrawFn) -> Geometry:
    n = draw(st.integers(1, 4))
    nb = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        ndim = draw(st.integers(1, 4))
        shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
        bd = draw(st.integers(0, ndim - 1))
        shape[bd] = nb
        order = draw(st.permutations(range(ndim)))
        out.append(Region.like(f"r{i}", draw(st.sampled_from(list(DType))), shape, bd,
                               [order.index(k) for k in range(ndim)], num_blocks=nb))
    return Geometry.packed(out, align=draw(st.sampled_from([1, 4, 64])))


@given(regions())
def test_any_geometry_round_trips_through_text_and_descriptor(g: Geometry) -> None:
    assert Geometry.parse(g.canonical()) == g
    d = descriptor(geometry=g, size=-(-g.nbytes // 4096) * 4096)
    assert decode(encode(d, DEPLOYMENT), DEPLOYMENT) == d


def test_a_version_1_descriptor_is_refused_by_version() -> None:
    wire = bytearray(encode(descriptor(), DEPLOYMENT))
    assert VERSION == 2 and wire[:4] == MAGIC
    wire[4] = 1
    with pytest.raises(DescriptorRejected) as info:
        decode(bytes(wire), DEPLOYMENT)
    assert info.value.reason is RejectReason.VERSION
    assert len(wire) > _HEAD.size + MAC_BYTES


# -- moving blocks between layouts (numpy is the oracle) ---------------------------------------


@st.composite
def two_layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], int, list[int], list[int], int, int]:
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    bd = draw(st.integers(0, ndim - 1))
    return (shape, bd, draw(st.permutations(range(ndim))), draw(st.permutations(range(ndim))),
            draw(st.integers(1, 5)), draw(st.integers(1, 5)))


def _strided(shape: tuple[int, ...], order: list[int], fill: np.ndarray | None) -> np.ndarray:
    """A tensor of ``shape`` whose memory order is ``order`` (outermost first)."""
    dense = np.zeros([shape[k] for k in order], dtype=np.uint16)
    view = dense.transpose(np.argsort(order))
    if fill is not None:
        view[...] = fill
    return view


@settings(max_examples=200)
@given(two_layouts())
def test_paired_runs_move_every_element_to_its_logical_place(case: tuple) -> None:  # type: ignore[type-arg]
    shape, bd, src_order, dst_order, src_nb, dst_nb = case
    sshape = tuple(src_nb if i == bd else n for i, n in enumerate(shape))
    dshape = tuple(dst_nb if i == bd else n for i, n in enumerate(shape))
    values = np.arange(int(np.prod(sshape)), dtype=np.uint16).reshape(sshape) + 1
    src = _strided(sshape, src_order, values)
    dst = _strided(dshape, dst_order, None)
    item = 2
    sstr = tuple(s // item for s in src.strides)
    dstr = tuple(s // item for s in dst.strides)
    pairs = blockmap.pair_runs(blockmap.block_runs(item, sshape, sstr, bd), blockmap.block_runs(item, dshape, dstr, bd))
    sb, db = src_nb - 1, 0
    smem = np.lib.stride_tricks.as_strided(src, (src.size,), (item,)).view(np.uint8) if src.flags.c_contiguous else None
    sraw = _base_bytes(src)
    draw_ = _base_bytes(dst)
    for so, do, n in pairs:
        s0 = sb * sstr[bd] * item + so
        d0 = db * dstr[bd] * item + do
        draw_[d0:d0 + n] = sraw[s0:s0 + n]
    assert np.array_equal(np.take(dst, db, axis=bd), np.take(src, sb, axis=bd))
    del smem


def _base_bytes(a: np.ndarray) -> np.ndarray:
    base = a
    while base.base is not None and isinstance(base.base, np.ndarray):
        base = base.base
    return base.reshape(-1).view(np.uint8)
