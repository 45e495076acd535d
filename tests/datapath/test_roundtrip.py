"""Store engine pages into a bank, load them into other block ids of another engine's
pages, compare bit for bit: for the four engine layouts and every kind of tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from support.errors import raises
import torch

from kvstate.core.errors import Busy
from kvstate.core.reasons import BusyReason
from kvstate.core import layouts
from kvstate.core.geometry import DType, Geometry, Region
from kvstate.share.bank import Bank
from datapath.conftest import World

BANK_BLOCKS = 8
SRC_IDS, BANK_IDS, DST_IDS = [3, 7, 1, 10], [5, 0, 6, 2], [9, 4, 15, 1]

LAYOUTS: dict[str, Callable[[int], Geometry]] = {
    "vllm_cpu": lambda nb: layouts.vllm_cpu(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                                            num_blocks=nb, num_kv_heads=2, block_size=32, head_dim=64),
    "flash_attn": lambda nb: layouts.flash_attn(2, num_blocks=nb, block_size=16, num_kv_heads=2, head_dim=64),
    "mla": lambda nb: layouts.mla(3, num_blocks=nb, block_size=16, latent_dim=576),
    "fp8_with_scales": lambda nb: layouts.fp8_with_scales(2, num_blocks=nb, block_size=16, num_kv_heads=2,
                                                           head_dim=64),
}
_TORCH = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16, DType.FP32: torch.float32,
          DType.FP8_E4M3: torch.float8_e4m3fn, DType.FP8_E5M2: torch.float8_e5m2}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def pages(region: Region, capacity: int, *, fill: bool, seed: int = 0) -> torch.Tensor:
    """An engine tensor for ``region`` with ``capacity`` pages: random bits, or zeros."""
    shape = tuple(capacity if i == region.block_dim else n for i, n in enumerate(region.shape))
    bits = _BITS[region.itemsize]
    if fill:
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (int(np.prod(shape)) * region.itemsize,), dtype=torch.uint8, generator=g)
        return raw.view(bits).view(_TORCH[region.dtype]).reshape(shape)
    return torch.zeros(shape, dtype=bits).view(_TORCH[region.dtype])


def page(t: torch.Tensor, region: Region, i: int) -> torch.Tensor:
    """Page ``i`` of an engine tensor as raw bits (NaN patterns compare equal)."""
    return t.view(_BITS[region.itemsize]).select(region.block_dim, i)


def store_then_load(world_of: Callable[..., World], g: Geometry, src: dict[str, Any], dst: dict[str, Any]) -> World:
    world = world_of(g, advertise=False)
    bank = world.banks[0]
    h = bank.store(src, SRC_IDS, BANK_IDS)
    assert h.wait(10.0) and h.result() is not None and h.result().ok  # type: ignore[union-attr]
    h.close()
    bank.fire("advertise")
    group = world.group()
    h = group.load(BANK_IDS, dst, DST_IDS)
    assert h.wait(10.0) and not h.failed_blocks(), h.result()
    h.close()
    return world


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_then_load_into_other_block_ids_is_bit_identical(make_world: Any, layout: str) -> None:
    g = LAYOUTS[layout](BANK_BLOCKS)
    src = {r.name: pages(r, 12, fill=True, seed=i) for i, r in enumerate(g.regions)}
    dst = {r.name: pages(r, 16, fill=False) for r in g.regions}
    store_then_load(make_world, g, src, dst)
    for r in g.regions:
        for s, d in zip(SRC_IDS, DST_IDS):
            assert torch.equal(page(dst[r.name], r, d), page(src[r.name], r, s)), (r.name, s, d)
        untouched = [i for i in range(16) if i not in DST_IDS]
        assert not page(dst[r.name], r, untouched[0]).any() and not page(dst[r.name], r, untouched[-1]).any()


def test_destinations_in_another_memory_order_receive_the_same_elements(make_world: Any) -> None:
    """FlashAttention pages in the bank, a destination laid out heads-outermost: every
    element lands at its logical place, whatever the strides."""
    g = LAYOUTS["flash_attn"](BANK_BLOCKS)
    src = {r.name: pages(r, 12, fill=True, seed=3) for r in g.regions}
    # [2, nb, block_size, heads, head_dim] stored as [heads, 2, nb, head_dim, block_size]
    dst = {r.name: torch.zeros(2, 2, 16, 64, 16, dtype=torch.int16).view(torch.bfloat16).permute(1, 2, 4, 0, 3)
           for r in g.regions}
    store_then_load(make_world, g, src, dst)
    for r in g.regions:
        for s, d in zip(SRC_IDS, DST_IDS):
            assert torch.equal(page(dst[r.name], r, d), page(src[r.name], r, s))


# -- other kinds of tensors ----------------------------------------------------------------


class DLPackOnly:
    """An object that offers nothing but the DLPack protocol (as JAX or CuPy arrays do)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._t = tensor

    def __dlpack__(self, **kw: Any) -> Any:
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()


def _numpy(t: torch.Tensor, region: Region) -> np.ndarray:
    return t.view(_BITS[region.itemsize]).numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32}[region.itemsize])


@pytest.mark.parametrize("kind", ["numpy", "dlpack", "buffer"])
def test_numpy_dlpack_and_buffer_destinations(make_world: Any, kind: str) -> None:
    g = LAYOUTS["vllm_cpu"](BANK_BLOCKS)
    src = {r.name: pages(r, 12, fill=True, seed=5) for r in g.regions}
    backing = {r.name: pages(r, 16, fill=False) for r in g.regions}
    dst: dict[str, Any]
    if kind == "numpy":  # numpy has no bfloat16: uint16 arrays hold the bits
        dst = {r.name: _numpy(backing[r.name], r) for r in g.regions}
    elif kind == "dlpack":
        dst = {n: DLPackOnly(t) for n, t in backing.items()}
    else:  # a bytearray per region, shaped with memoryview.cast
        raw = {r.name: bytearray(16 * r.block_bytes) for r in g.regions}
        dst = {r.name: memoryview(raw[r.name]).cast("H", (16, *r.block_shape)) for r in g.regions}
    store_then_load(make_world, g, {n: _numpy(t, g.region(n)) for n, t in src.items()}, dst)
    for r in g.regions:
        got = backing[r.name] if kind != "buffer" else \
            torch.frombuffer(bytearray(dst[r.name].obj), dtype=torch.int16).view(torch.bfloat16).reshape(16, *r.block_shape)
        for s, d in zip(SRC_IDS, DST_IDS):
            assert torch.equal(page(got, r, d), page(src[r.name], r, s))
    if kind == "buffer":
        for mv in dst.values():
            mv.release()  # no export is left behind: release() would raise BufferError


# -- zero copy ---------------------------------------------------------------------------------


def test_a_bank_can_be_the_engines_cache_and_is_not_released_under_it(make_world: Any) -> None:

    g = LAYOUTS["flash_attn"](BANK_BLOCKS)
    world = make_world(g, advertise=False)
    bank: Bank = world.banks[0]
    cache = bank.tensors("torch")  # the engine computes into these
    assert {n: tuple(t.shape) for n, t in cache.items()} == {r.name: r.shape for r in g.regions}
    src = {r.name: pages(r, BANK_BLOCKS, fill=True, seed=9) for r in g.regions}
    for n in cache:
        cache[n].copy_(src[n])  # "the engine writes its KV"
    bank.fire("advertise")
    group = world.group()
    dst = {r.name: pages(r, 16, fill=False) for r in g.regions}
    h = group.load([1, 2], dst, [7, 8])
    assert h.wait(10.0) and h.result() and h.result().ok  # type: ignore[union-attr]
    for r in g.regions:
        assert torch.equal(page(dst[r.name], r, 7), page(src[r.name], r, 1))
    h.close()
    group.drain(10.0)
    keep = cache["layer.0"][0, 3]  # a slice of the cache outlives the dict
    del cache
    bank.fire("drain")
    bank.fire("quiesce")
    with raises(Busy, BusyReason.VIEWS):
        bank.fire("release")
    assert bank.state == "quiescent" and bank.mapping is not None
    del keep
    bank.fire("release")
    assert bank.state == "released"


def test_exporter_allocate_returns_numpy_views_over_a_registered_bank(make_world: Any) -> None:
    g = LAYOUTS["vllm_cpu"](BANK_BLOCKS)
    world = make_world(g, advertise=False)
    first = world.exporter.banks.pop(0)  # rank 0 (of tp 1) is allocated the zero-copy way instead
    for event in ("drain", "quiesce", "release"):
        first.fire(event)
    bank, cache = world.exporter.allocate(0, g, "numpy")
    assert bank.state == "registered" and cache["model.layers.0.self_attn.attn"].dtype == np.uint16
    cache["model.layers.1.self_attn.attn"][3] = 7
    region = g.regions[1]
    view = bank.view()
    start = region.offset + 3 * region.block_stride_bytes
    assert bytes(view[start:start + 2]) == (7).to_bytes(2, "little")
    del view, cache
