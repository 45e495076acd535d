"""Plans of prefix loads: bank blocks of imported parts into engine pages.

:func:`paged` is ``Group.load``: for every region of the geometry, bank block
``bank_block_ids[i]`` of the part is copied into page ``dst_block_ids[i]`` of the
engine's tensor for that region, directly (no dense intermediate), one op per (rank,
region), so region ``k`` can be used as soon as its op finished. :func:`dense` is
``Group.load_prefix``: the blocks of each rank back to back into one caller buffer.

Everything is checked before anything is submitted (:mod:`kvstate.share.plan`), in this
order: ranks and their parts, block ids (types, ranges, lengths, no page twice), the
tensors of every region (kind, device, dtype, shape, strides, writability), and every
destination block id against that tensor's capacity.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvstate.core import blockmap
from kvstate.core.errors import ArgumentInvalid
from kvstate.core.geometry import Geometry, Region, contiguous_strides
from kvstate.core.reasons import ArgumentReason
from kvstate.share import tensors
from kvstate.share.plan import Copy, Plan, apart, block_ids, triples, unique

if TYPE_CHECKING:
    from kvstate.share import importer

    Group = importer.Group[Any, Any, Any, Any, Any]
    Part = importer.Part[Any, Any, Any, Any, Any]


def _targets(group: Group, dst: object, rank: object) -> dict[int, Any]:
    """Rank -> what to load into it, from a mapping of one rank's tensors (``rank`` names
    it; optional at tp=1) or a mapping of rank -> tensors."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise ArgumentInvalid.transfer(ArgumentReason.RANK, "rank", f"must be an int, not {rank!r:.40}")
    if not isinstance(dst, Mapping) or not dst:
        raise ArgumentInvalid.transfer(ArgumentReason.REGIONS, "dst_tensors", "must be a non-empty mapping of region "
                                       "name to tensor (or of rank to such a mapping)")
    if all(isinstance(k, int) and not isinstance(k, bool) for k in dst):
        if rank is not None:
            raise ArgumentInvalid.transfer(ArgumentReason.RANK,
                                           "rank", "given twice: by rank= and by dst_tensors' keys")
        targets = dict(dst)
    else:
        if rank is None:
            if group.tp != 1:
                raise ArgumentInvalid.transfer(ArgumentReason.RANK,
                                               "rank", f"required at tp={group.tp}: which rank's part "
                                               "to load from")
            rank = 0
        targets = {rank: dst}
    for r in targets:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < group.tp:
            raise ArgumentInvalid.transfer(ArgumentReason.RANK,
                                           "rank", f"{r!r:.40} is not a rank of this tp={group.tp} group")
    return targets


def _part(group: Group, rank: int) -> Part:
    part = group.parts[rank]
    if part.mapping is None or part.state != "imported":
        raise ArgumentInvalid.transfer(ArgumentReason.STATE, f"rank {rank}", f"its part is {part.state}, not mapped")
    return part


def _geometry(group: Group) -> Geometry:
    if not group.parts:
        raise ArgumentInvalid.transfer(ArgumentReason.STATE,
                                       group.label, f"the group is {group.state} and has no parts")
    return group.parts[0].descriptor.geometry


def paged(group: Group, bank_block_ids: object, dst_tensors: object, dst_block_ids: object,
          rank: object = None) -> Plan:
    """The plan of ``Group.load``; see the module docstring."""
    g = _geometry(group)
    targets = _targets(group, dst_tensors, rank)
    parts = {r: _part(group, r) for r in targets}
    return paged_parts(group.label, g, parts, targets, bank_block_ids, dst_block_ids)


@attrs.frozen
class Sliced:
    """Only indices ``[start, start + count)`` along dimension ``axis`` of every region's
    blocks are loaded (heterogeneous TP: the KV heads one target rank takes from a bank);
    the destination tensors then have ``count`` there (a view of the engine's pages)."""

    axis: int
    start: int
    count: int


def _sliced(region: Region, cut: Sliced | None) -> tuple[Region, int]:
    """The region as the slice sees it (the destinations' shape), and the byte offset of
    the slice within a source block."""
    if cut is None:
        return region, 0
    if not 0 <= cut.axis < len(region.shape) or cut.axis == region.block_dim or cut.count < 1 \
            or cut.start < 0 or cut.start + cut.count > region.shape[cut.axis]:
        raise ArgumentInvalid.transfer(ArgumentReason.SHAPE, f"region {region.name!r}", f"slice {cut} outside its "
                                       f"shape {region.shape} (blocks along dimension {region.block_dim})")
    shape = tuple(cut.count if i == cut.axis else n for i, n in enumerate(region.shape))
    return attrs.evolve(region, shape=shape), cut.start * region.strides[cut.axis] * region.itemsize


def paged_parts(label: str, g: Geometry, parts: Mapping[int, Part], targets: Mapping[int, Any],
                bank_block_ids: object, dst_block_ids: object, cut: Sliced | None = None) -> Plan:
    """:func:`paged` over given mapped parts (rank -> part) and their targets (rank ->
    region name -> tensor): also what one rank's worker loads from its own part, whole or
    (``cut``) a slice of every block."""
    src_ids = block_ids(bank_block_ids, g.num_blocks, "bank_block_ids")
    dst_ids = block_ids(dst_block_ids, None, "dst_block_ids")
    if len(src_ids) != len(dst_ids):
        raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, "dst_block_ids", f"{len(dst_ids)} ids for "
                                       f"{len(src_ids)} bank blocks")
    unique(dst_ids, "dst_block_ids")
    plan = Plan("load", f"{label} load", dst_ids, sources=src_ids)
    written: list[tuple[int, str, int, int]] = []
    try:
        for r, named in targets.items():
            if not isinstance(named, Mapping):
                raise ArgumentInvalid.transfer(ArgumentReason.REGIONS,
                                               f"dst_tensors[{r}]", "must map region names to tensors")
            missing, unknown = sorted(set(g.names) - set(named)), sorted(set(named) - set(g.names), key=str)
            if missing or unknown:
                raise ArgumentInvalid.transfer(ArgumentReason.REGIONS, f"dst_tensors of rank {r}",
                                               f"missing {missing[:5]}, unknown {unknown[:5]}: one tensor per region")
            top = max(dst_ids)
            for whole in g.regions:
                region, skip = _sliced(whole, cut)
                where = f"rank {r} region {region.name!r}"
                ref = tensors.adapt(named[region.name], where)
                plan.refs.append(ref)
                tensors.check(region, ref, where, write=True)
                written.append((r, where, ref.addr, ref.span))
                capacity = ref.shape[region.block_dim]
                if top >= capacity:
                    i = dst_ids.index(top)
                    raise ArgumentInvalid.transfer(ArgumentReason.BLOCK_IDS, f"dst_block_ids[{i}]",
                                                   f"{top} is outside 0..{capacity - 1}, the pages of {where}")
                pairs = blockmap.pair_runs(region.runs(), tensors.runs(ref, region.block_dim, where))
                stride = region.block_stride_bytes
                dstride = ref.strides[region.block_dim] * ref.itemsize
                plan.copies.append(Copy(parts[r].mapping, ref.buffer(),
                                        functools.partial(triples, pairs,
                                                          [region.offset + skip + b * stride for b in src_ids],
                                                          [d * dstride for d in dst_ids]),
                                        region.name, r, len(src_ids) * region.block_bytes))
        apart(written)
    except BaseException:
        plan.release()
        raise
    return plan


def dense(group: Group, blocks: object, destinations: object, host: bool) -> Plan:
    """The plan of ``Group.load_prefix``: ``blocks`` (in order) of each rank back to back
    into its buffer. ``host``: the transport reaches caller memory through tensors.adapt;
    otherwise destinations go to the backend as they are (device buffers)."""
    g = _geometry(group)
    ids = block_ids(blocks, g.num_blocks, "blocks")
    if isinstance(destinations, Mapping):
        targets = dict(destinations)
    elif isinstance(destinations, Sequence) and not isinstance(destinations, (str, bytes, bytearray)):
        if len(destinations) != group.tp:
            raise ArgumentInvalid.transfer(ArgumentReason.RANK,
                                           "destinations", f"{len(destinations)} buffer(s) for a group "
                                           f"of tp {group.tp}")
        targets = dict(enumerate(destinations))
    else:
        raise ArgumentInvalid.transfer(ArgumentReason.TENSOR,
                                       "destinations", "must be one buffer per rank (a sequence) or "
                                       "a mapping of rank to buffer")
    if not targets or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < group.tp for r in targets):
        raise ArgumentInvalid.transfer(ArgumentReason.RANK,
                                       "destinations", f"name ranks {sorted(map(repr, targets))[:5]} "
                                       f"outside 0..{group.tp - 1}")
    parts = {r: _part(group, r) for r in targets}
    return dense_parts(group.label, g, parts, targets, ids, host)


def dense_parts(label: str, g: Geometry, parts: Mapping[int, Part], targets: Mapping[int, Any], ids: tuple[int, ...],
                host: bool) -> Plan:
    """:func:`dense` over given mapped parts (rank -> part) and destinations (rank -> buffer)."""
    extents: list[tuple[int, int, int]] = []
    pos = 0
    for b in ids:
        for off, length in g.block_extents(b):
            extents.append((off, pos, length))
            pos += length
    plan = Plan("load", f"{label} prefix load", ids, sources=ids)
    written: list[tuple[int, str, int, int]] = []
    try:
        for r, dst in sorted(targets.items()):
            part = parts[r]
            where = f"destination of rank {r}"
            if host:
                ref = tensors.adapt(dst, where)
                plan.refs.append(ref)
                if ref.device != "cpu":
                    raise ArgumentInvalid.transfer(ArgumentReason.DEVICE, where, f"on {ref.device}")
                if not ref.writable:
                    raise ArgumentInvalid.transfer(ArgumentReason.READ_ONLY, where, "is read-only")
                if ref.span < pos or ref.strides != contiguous_strides(ref.shape):
                    raise ArgumentInvalid.transfer(ArgumentReason.SHAPE,
                                                   where, f"must be a contiguous buffer of at least "
                                                   f"{pos} bytes, not {ref.span}")
                written.append((r, where, ref.addr, ref.span))
                target: Any = ref.buffer()
            else:
                target = dst
                nbytes = getattr(dst, "nbytes", getattr(dst, "size", None))
                if not isinstance(nbytes, int) or nbytes < pos:
                    raise ArgumentInvalid.transfer(ArgumentReason.SHAPE,
                                                   where, f"holds {nbytes!r:.20} bytes, needs {pos}")
            plan.copies.append(Copy(part.mapping, target, list(extents), "prefix", r, pos))
        apart(written)
    except BaseException:
        plan.release()
        raise
    return plan
