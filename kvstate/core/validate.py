"""Reject before import: every rule a descriptor and a group must pass. Pure.

Validation runs completely before any handle is opened. The per-descriptor rules are
declared once, in ``spec/rules.toml``: :mod:`kvstate.core.rules` evaluates them here, and
the same declaration is generated into C (``ffi/kvs_validate.c``) for native callers, so
both give one verdict and one reason (``tests/test_rules_differential.py``). The
one-rule functions below carry PEP 316 contracts that ``crosshair`` checks
(``tests/test_contracts.py``): a validator never accepts what its rule rejects.
:func:`validate_group` applies every rule to every part, adds the group rules (ranks,
sources, geometries and generations agree), collects *all* problems, and accepts the
group whole or not at all (INV-GROUP-ATOMIC).

The socket path rule reads the filesystem (``lstat``) but opens nothing; it is the one
per-descriptor rule that stays in Python.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvstate.core.args import need_kinds, typed
from kvstate.core.descriptor import Descriptor
from kvstate.core.errors import DescriptorRejected, GroupRejected
from kvstate.core import rules
from kvstate.core.geometry import Geometry
from kvstate.core.handles import FD_KINDS, HANDLE_BYTES, NIXL_HANDLE_MAX_BYTES, HandleKind
from kvstate.core.identity import Deployment, FabricKind
from kvstate.core.paths import socket_path_problem
from kvstate.core.reasons import RejectReason

#: Largest tensor-parallel group kvstate accepts at all; an Expectation may lower it.
MAX_TP: int = rules.rules().constants["MAX_TP"]
# Compiled at import, not on the first validation, so crosshair's analysis of the
# contracts below starts from compiled rules (see kvstate.core.rules).
rules.compiled()

# -- the declared rules, one at a time (contract-checked) -----------------------------------------------------


def rank_reason(rank: int, tp: int, max_tp: int) -> RejectReason | None:
    """tp within 1..max_tp and rank within 0..tp-1 (the declared rule ``rank``).

    pre: 1 <= max_tp <= 1024
    post: __return__ is not None or (1 <= tp <= max_tp and 0 <= rank < tp)
    """
    return rules.check("rank", {"rank": rank, "tp": tp}, {"max_tp": max_tp})


def handle_reason(kind: HandleKind, length: int, accepted: frozenset[HandleKind]) -> RejectReason | None:
    """An accepted kind, with handle bytes of exactly its size, bounded when variable
    (the declared rule ``handle``).

    post: __return__ is not None or kind in accepted
    post: __return__ is not None or HANDLE_BYTES[kind] in (None, length)
    post: __return__ is not None or 0 < length <= NIXL_HANDLE_MAX_BYTES
    """
    return rules.check("handle", {"handle_kind": kind_code(kind), "handle_len": length},
                       {"accepted_kinds": kinds_mask(accepted)})


def size_reason(size: int, nbytes: int, granularity: int) -> RejectReason | None:
    """The bank size is the geometry's bytes rounded up to a power-of-two granularity
    (the declared rule ``size``).

    pre: nbytes >= 1
    post: __return__ is not None or (granularity > 0 and size % granularity == 0)
    post: __return__ is not None or nbytes <= size < nbytes + granularity
    """
    return rules.check("size", {"size": size, "nbytes": nbytes, "granularity": granularity}, {})


def freshness_reason(generation: int, min_generation: int, expires_at_ns: int, now_ns: int) -> RejectReason | None:
    """Not older than a generation already seen, and not expired (the declared rule ``freshness``).

    post: __return__ is not None or generation >= min_generation
    post: __return__ is not None or now_ns < expires_at_ns
    """
    return rules.check("freshness", {"generation": generation, "expires_at_ns": expires_at_ns},
                       {"min_generation": min_generation, "now_ns": now_ns})


_KIND_CODES = {kind: code for code, kind in enumerate(HandleKind)}


def kind_code(kind: HandleKind) -> int:
    """A handle kind's code in the declaration (``[kinds]`` lists them in HandleKind order)."""
    return _KIND_CODES[kind]


def kinds_mask(kinds: Iterable[HandleKind]) -> int:
    mask = 0
    for kind in kinds:
        mask |= 1 << _KIND_CODES[kind]
    return mask


def group_complete(tp: int, ranks: Sequence[int]) -> bool:
    """Every rank 0..tp-1 present exactly once (INV-GROUP-COMPLETE).

    post: not __return__ or (tp >= 1 and len(ranks) == tp)
    post: not __return__ or all(0 <= r < tp for r in ranks)
    post: not __return__ or len(set(ranks)) == len(ranks)
    """
    return tp >= 1 and len(ranks) == tp and sorted(ranks) == list(range(tp))


def rank_set_problems(tp: int, ranks: Sequence[int]) -> list[tuple[RejectReason, int]]:
    """(reason, rank) for every duplicate and every missing rank of a group.

    post: (len(__return__) == 0) == (len(set(ranks)) == len(ranks) and set(range(tp)) <= set(ranks))
    """
    seen: set[int] = set()
    problems: list[tuple[RejectReason, int]] = []
    for r in ranks:
        if r in seen:
            problems.append((RejectReason.DUPLICATE_RANK, r))
        seen.add(r)
    problems += [(RejectReason.MISSING_RANK, r) for r in range(tp) if r not in seen]
    return problems


def geometry_problem(a: Geometry, b: Geometry) -> tuple[RejectReason, str] | None:
    """Why two ranks' geometries cannot form one group, or None when every field of every
    region agrees (the group's ``parts_compatible`` guard compares the same: all of
    them). A dtype difference has its own reason: the bytes would be read as another
    number format."""
    if a is b or a.regions == b.regions:  # the common case, without naming each field
        return None
    differs = a.mismatch(b)
    if differs is None:
        return None
    field = differs.split(":", 1)[0]
    reason = RejectReason.DTYPE if field.endswith(".dtype") else RejectReason.GEOMETRY
    return reason, f"geometry differs within the group: {differs}"


# -- socket path -------------------------------------------------------------------------


def socket_path_reason(path: str, uid: int, lstat: Callable[[str], os.stat_result] = os.lstat) -> RejectReason | None:
    """The reason ``path`` fails the socket-path rule (:mod:`kvstate.core.paths`), or None."""
    problem = socket_path_problem(path, uid, must_exist=True, lstat=lstat)
    return None if problem is None else problem[0]


# -- descriptors and groups ----------------------------------------------------------------


def _set_of(kind: type, *, optional: bool = False) -> Any:
    """An attrs validator: a non-empty frozenset of ``kind`` (or None when ``optional``),
    refused as ArgumentInvalid naming the field (the rules index these sets by kind)."""
    def check(inst: object, attribute: Any, value: object) -> None:
        if not (optional and value is None):
            need_kinds(f"{type(inst).__name__}.{attribute.name}", value, kind)
    return check


@attrs.frozen
class Expectation:
    """What an importer accepts. Built by the importer from its own identity and config."""

    deployment: Deployment = attrs.field(validator=typed(Deployment))
    now_ns: int = attrs.field(validator=typed(int))
    handle_kinds: frozenset[HandleKind] = attrs.field(validator=_set_of(HandleKind))
    host_boot_id: bytes = attrs.field(validator=typed(bytes))
    uid: int = attrs.field(validator=typed(int))
    geometry_fingerprint: bytes | None = attrs.field(default=None, validator=typed(bytes, optional=True))
    block_format: bytes | None = attrs.field(default=None, validator=typed(bytes, optional=True))
    device_uuids: frozenset[bytes] | None = attrs.field(default=None, validator=_set_of(bytes, optional=True))
    incarnations: Mapping[int, bytes] | None = attrs.field(default=None, validator=typed(dict, optional=True))
    min_generation: int = attrs.field(default=0, validator=typed(int))
    max_tp: int = attrs.field(default=64, validator=typed(int))
    check_socket: bool = attrs.field(default=True, validator=typed(bool))


def facts_of(d: Descriptor, expect: Expectation | None = None) -> dict[str, object]:
    """The descriptor as the declared rules read it (``[facts]`` of spec/rules.toml).
    Given ``expect``, a fingerprint it does not ask for is not computed (zeros: no rule
    reads it then)."""
    geometry_fp = _NO_ID if expect is not None and expect.geometry_fingerprint is None else d.geometry.fingerprint()
    format_fp = _NO_ID if expect is not None and expect.block_format is None else d.geometry.format_fingerprint()
    return {
        "deployment_id": d.deployment_id, "rank": d.rank, "tp": d.tp,
        "handle_kind": kind_code(d.handle_kind), "handle_len": len(d.handle),
        "size": d.size, "nbytes": d.geometry.nbytes, "granularity": d.granularity,
        "generation": d.generation, "expires_at_ns": d.expires_at_ns,
        "geometry_fp": geometry_fp, "format_fp": format_fp,
        "device_uuid": d.device_uuid, "incarnation": d.incarnation, "host_boot_id": d.host_boot_id,
        "fabric_node": int(d.fabric.kind is FabricKind.NODE),
    }


_NO_ID = bytes(rules.ID_BYTES)


def expected_of(expect: Expectation) -> dict[str, object]:
    """What ``expect`` accepts from any part (``[expect]`` of spec/rules.toml, less the
    per-rank incarnation): computed once per group."""
    return {
        "deployment_id": expect.deployment.id, "max_tp": expect.max_tp,
        "accepted_kinds": kinds_mask(expect.handle_kinds), "now_ns": expect.now_ns,
        "min_generation": expect.min_generation,
        "has_geometry_fp": int(expect.geometry_fingerprint is not None),
        "geometry_fp": expect.geometry_fingerprint or _NO_ID,
        "has_format_fp": int(expect.block_format is not None), "format_fp": expect.block_format or _NO_ID,
        "has_device_uuids": int(expect.device_uuids is not None),
        "device_uuids": expect.device_uuids or frozenset(),
        "has_incarnations": int(expect.incarnations is not None),
        "host_boot_id": expect.host_boot_id,
    }


def expected_for(rank: int, expect: Expectation, base: dict[str, object] | None = None) -> dict[str, object]:
    """What ``expect`` accepts from the part of ``rank``: ``base`` (:func:`expected_of`)
    and the incarnation it knows for that rank."""
    incarnation = None if expect.incarnations is None else expect.incarnations.get(rank)
    return {**(expected_of(expect) if base is None else base),
            "incarnation_known": int(incarnation is not None),
            "incarnation": incarnation if incarnation is not None else _NO_ID}


def _details(d: Descriptor, expect: Expectation) -> dict[str, Callable[[], str]]:
    """Per declared rule, the text of its refusal (written only for a rule that is broken)."""
    return {
        "domain": lambda: "names another deployment",
        "rank": lambda: f"rank {d.rank} of tp {d.tp} (max tp {expect.max_tp})",
        "handle": lambda: f"{d.handle_kind.value} handle of {len(d.handle)} bytes",
        "size": lambda: f"size {d.size} for {d.geometry.nbytes} bytes at granularity {d.granularity}",
        "freshness": lambda: (f"generation {d.generation} (min {expect.min_generation}), "
                              f"expires {d.expires_at_ns} (now {expect.now_ns})"),
        "geometry": lambda: "geometry fingerprint differs from the importer's",
        "block_format": lambda: "blocks hold other regions, dtypes or shapes than the importer's "
                                "(format fingerprint differs)",
        "device": lambda: f"device {d.device_uuid.hex()} not acceptable",
        "incarnation": lambda: "the exporter of this rank restarted since",
        "host": lambda: "same-node handle from another host or boot",
    }


def descriptor_problems(d: Descriptor, expect: Expectation,
                        socket_reasons: dict[str, RejectReason | None] | None = None,
                        expected: dict[str, object] | None = None, *,
                        rules_checked: bool = False) -> list[DescriptorRejected]:
    """Every rule one descriptor breaks on its own, in the declaration's order, then the
    socket path rule. Empty means it passes.

    ``socket_reasons`` caches the socket path rule per path, and ``expected`` (from
    :func:`expected_of`) the expectation, across one group's parts. ``rules_checked``: the
    declared rules' other executor (the generated C, :mod:`kvstate.transport.native_rules`)
    found none broken under ``expect``, so only the socket path rule runs here.
    """
    found: list[DescriptorRejected] = []
    broken = [] if rules_checked else rules.broken(facts_of(d, expect), expected_for(d.rank, expect, expected))
    if broken:
        details = _details(d, expect)
        found += [DescriptorRejected(reason, details.get(rule.id, lambda: rule.doc)(), d.rank)
                  for rule, reason in broken]
    # The filesystem rule: it reads the socket path's directories, so it runs here only.
    if d.handle_kind in FD_KINDS and expect.check_socket:
        cache = {} if socket_reasons is None else socket_reasons
        if d.socket_path not in cache:
            cache[d.socket_path] = socket_path_reason(d.socket_path, expect.uid)
        reason = cache[d.socket_path]
        if reason is not None:
            found.append(DescriptorRejected(reason, f"socket path {d.socket_path!r}", d.rank))
    return found


@attrs.frozen
class ValidatedGroup:
    """A group that passed every rule together. Only :func:`validate_group` makes one."""

    parts: tuple[Descriptor, ...]  # sorted by rank, exactly ranks 0..tp-1

    @property
    def tp(self) -> int:
        return len(self.parts)

    @property
    def source_id(self) -> bytes:
        return self.parts[0].source_id


def validate_group(descriptors: Iterable[Descriptor], expect: Expectation, *,
                   rules_checked: bool = False) -> ValidatedGroup:
    """Accept the group whole or raise GroupRejected listing every problem.
    ``rules_checked``: as :func:`descriptor_problems` says, for every descriptor."""
    parts = list(descriptors)
    if not parts:
        raise GroupRejected([DescriptorRejected(RejectReason.MISSING_RANK, "empty group")])
    if len(parts) > min(expect.max_tp, MAX_TP):
        raise GroupRejected([DescriptorRejected(RejectReason.TP_SIZE, f"{len(parts)} descriptors > max tp {expect.max_tp}")])
    socket_reasons: dict[str, RejectReason | None] = {}
    expected = expected_of(expect)
    problems = [p for d in parts for p in descriptor_problems(d, expect, socket_reasons, expected,
                                                             rules_checked=rules_checked)]
    first = parts[0]
    for d in parts[1:]:
        if d.tp != first.tp:
            problems.append(DescriptorRejected(RejectReason.TP_SIZE, f"tp {d.tp} differs from {first.tp}", d.rank))
        if d.source_id != first.source_id:
            problems.append(DescriptorRejected(RejectReason.MIXED_GROUP, "parts of different sources", d.rank))
        differs = geometry_problem(first.geometry, d.geometry)
        if differs is not None:
            reason, detail = differs
            problems.append(DescriptorRejected(reason, f"{detail} (rank {first.rank} vs rank {d.rank})", d.rank))
        if d.generation != first.generation:
            problems.append(DescriptorRejected(
                RejectReason.GENERATION, f"generation {d.generation} differs from rank {first.rank}'s "
                f"{first.generation}: every rank of a group is advertised with one generation", d.rank))
    if 1 <= first.tp <= min(expect.max_tp, MAX_TP):  # else TP_SIZE is reported per part already;
        # listing every missing rank of a tp of 2**32 would take memory without bound
        problems += [DescriptorRejected(reason, f"rank {rank}", rank)
                     for reason, rank in rank_set_problems(first.tp, [d.rank for d in parts])]
    if problems:
        raise GroupRejected(problems)
    return ValidatedGroup(tuple(sorted(parts, key=lambda d: d.rank)))
