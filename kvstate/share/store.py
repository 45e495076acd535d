"""Engine pages into a bank, and a bank as the engine's own cache.

:func:`plan` is ``Bank.store``: for every region, page ``src_block_ids[i]`` of the
engine's tensor is copied into bank block ``bank_block_ids[i]``, one op per region on the
op engine. The ops pin the bank's mapping, so the bank cannot be released under them;
``Bank.drain`` waits for them. This is how a decode worker retains a finished request's
prefix, the way Dynamo and LMCache offload to a host tier.

:func:`views` is ``Bank.tensors``: zero copy, the bank's memory *is* the engine's KV
cache. Each region becomes a tensor (torch) or array (numpy) over the bank's mapping,
with the region's dtype, shape and strides; the engine computes into it, and importers
read the same memory. numpy has no bfloat16 or FP8, so those regions come as ``uint16``
or ``uint8`` arrays of the same bits. The bank refuses to be released while any such
view (or anything derived from one) is alive.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvstate.core import blockmap
from kvstate.core.errors import ArgumentInvalid
from kvstate.core.geometry import DType
from kvstate.core.reasons import ArgumentReason
from kvstate.share import tensors
from kvstate.share.plan import Copy, Plan, block_ids, triples, unique

if TYPE_CHECKING:
    from kvstate.share import bank

    Bank = bank.Bank[Any, Any, Any, Any, Any]

_TORCH = {DType.BF16: "bfloat16", DType.FP16: "float16", DType.FP32: "float32", DType.FP8_E4M3: "float8_e4m3fn",
          DType.FP8_E5M2: "float8_e5m2"}
_NUMPY = {DType.BF16: "uint16", DType.FP16: "float16", DType.FP32: "float32", DType.FP8_E4M3: "uint8",
          DType.FP8_E5M2: "uint8"}


def plan(bank: Bank, src_tensors: object, src_block_ids: object, bank_block_ids: object) -> Plan:
    g = bank.geometry
    if bank.mapping is None:
        raise ArgumentInvalid.transfer(ArgumentReason.STATE, bank.label, f"the bank is {bank.state}, not registered")
    if not isinstance(src_tensors, Mapping) or not src_tensors:
        raise ArgumentInvalid.transfer(ArgumentReason.REGIONS, "src_tensors", "must map region names to tensors")
    missing, unknown = sorted(set(g.names) - set(src_tensors)), sorted(set(src_tensors) - set(g.names), key=str)
    if missing or unknown:
        raise ArgumentInvalid.transfer(ArgumentReason.REGIONS, "src_tensors", f"missing {missing[:5]}, unknown "
                                       f"{unknown[:5]}: one tensor per region")
    dst_ids = block_ids(bank_block_ids, g.num_blocks, "bank_block_ids")
    src_ids = block_ids(src_block_ids, None, "src_block_ids")
    if len(src_ids) != len(dst_ids):
        raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, "src_block_ids", f"{len(src_ids)} ids for "
                                       f"{len(dst_ids)} bank blocks")
    unique(dst_ids, "bank_block_ids")
    out = Plan("store", f"{bank.label} store", dst_ids)
    try:
        top = max(src_ids)
        for region in g.regions:
            where = f"region {region.name!r}"
            ref = tensors.adapt(src_tensors[region.name], where)
            out.refs.append(ref)
            tensors.check(region, ref, where, write=False)
            capacity = ref.shape[region.block_dim]
            if top >= capacity:
                raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, f"src_block_ids[{src_ids.index(top)}]",
                                               f"{top} is outside 0..{capacity - 1}, the pages of {where}")
            pairs = blockmap.pair_runs(tensors.runs(ref, region.block_dim, where), region.runs())
            sstride = ref.strides[region.block_dim] * ref.itemsize
            out.copies.append(Copy(ref.buffer(), bank.mapping,
                                   triples(pairs, [s * sstride for s in src_ids],
                                           [region.offset + b * region.block_stride_bytes for b in dst_ids]),
                                   region.name, bank.rank, len(dst_ids) * region.block_bytes))
    except BaseException:
        out.release()
        raise
    return out


def views(bank: Bank, framework: str, memory: Any) -> dict[str, Any]:
    """Region name -> a tensor or array over ``memory`` (a writable buffer over the bank's
    mapping, which the caller tracks to refuse release while views live)."""
    g = bank.geometry
    if framework == "torch":
        torch = _module("torch")
        base = torch.frombuffer(memory, dtype=torch.uint8)
        out = {}
        for r in g.regions:
            raw = base[r.offset:r.offset + r.span].view(getattr(torch, _TORCH[r.dtype]))
            out[r.name] = raw.as_strided(r.shape, r.strides)
        return out
    if framework == "numpy":
        np = _module("numpy")
        base = np.frombuffer(memory, dtype=np.uint8)
        views_ = {}
        for r in g.regions:
            raw = base[r.offset:r.offset + r.span].view(np.dtype(_NUMPY[r.dtype]))
            views_[r.name] = np.lib.stride_tricks.as_strided(raw, r.shape, tuple(s * r.itemsize for s in r.strides))
        return views_
    raise ArgumentInvalid.transfer(ArgumentReason.TENSOR, "framework", f"{framework!r:.40} is not 'torch' or 'numpy'")


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise ArgumentInvalid.transfer(ArgumentReason.TENSOR, "framework", f"{name} is not installed") from None
