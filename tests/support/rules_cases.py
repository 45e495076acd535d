"""Generated descriptor facts for the rules differential, and a batch call of the C rules.

:func:`cases` draws (facts, expectation) pairs as ``spec/rules.toml`` names them: a valid
pair, then 0 to 3 fields set to values near the rules' edges (0, 1, the top of u64, a
power of two and its neighbours, another field's value and its neighbours, another id),
so every check of every rule is broken often, alone and together. :func:`run_c` packs a
batch into the generated C structs (``kvstate.transport.native_rules.Packer``) and runs
``kvs_validate_batch`` once.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import attrs

from kvstate.core import rules as declared
from kvstate.core.handles import HandleKind
from kvstate.core.identity import FabricDomain, FabricKind
from kvstate.transport.native_rules import Packer
from support import descriptors as kit

U64_MAX = declared.U64_MAX
Case = tuple[dict[str, Any], dict[str, Any]]


def _id(rng: random.Random) -> bytes:
    return rng.randbytes(declared.ID_BYTES)


def valid(rng: random.Random, rs: declared.RuleSet) -> Case:
    """A pair every rule accepts, with each optional expectation on or off."""
    max_tp = rng.choice([1, 2, 8, 64, 1024, rng.randint(1, 4096)])
    tp = rng.randint(1, min(max_tp, rs.constants["MAX_TP"]))
    kind = rng.choice(rs.kinds)
    others = rng.getrandbits(len(rs.kinds))
    granularity = 1 << rng.randint(0, 40)
    nbytes = rng.randint(1, 1 << rng.choice([8, 20, 40, 56]))
    size = -(-nbytes // granularity) * granularity
    min_gen = rng.choice([0, rng.randint(0, 100), U64_MAX - 5])
    now = rng.choice([rng.randint(0, 1 << 62), U64_MAX - 10])
    ids = {name: _id(rng) for name in ("deployment", "geometry", "format", "device", "incarnation", "host")}
    fabric_node = rng.randint(0, 1)
    d = {
        "deployment_id": ids["deployment"], "rank": rng.randint(0, tp - 1), "tp": tp,
        "handle_kind": kind.code, "handle_len": rng.randint(kind.min_bytes, min(kind.max_bytes, kind.min_bytes + 64)),
        "size": size, "nbytes": nbytes, "granularity": granularity,
        "generation": rng.randint(min_gen, min(U64_MAX, min_gen + 10)), "expires_at_ns": rng.randint(now + 1, U64_MAX),
        "geometry_fp": ids["geometry"], "format_fp": ids["format"], "device_uuid": ids["device"],
        "incarnation": ids["incarnation"], "host_boot_id": ids["host"], "fabric_node": fabric_node,
    }
    devices = [_id(rng) for _ in range(rng.randint(0, 3))] + [ids["device"]]
    rng.shuffle(devices)
    e = {
        "deployment_id": ids["deployment"], "max_tp": max_tp, "accepted_kinds": others | (1 << kind.code),
        "now_ns": now, "min_generation": min_gen,
        "has_geometry_fp": rng.randint(0, 1), "geometry_fp": ids["geometry"],
        "has_format_fp": rng.randint(0, 1), "format_fp": ids["format"],
        "has_device_uuids": rng.randint(0, 1), "device_uuids": frozenset(devices),
        "has_incarnations": rng.randint(0, 1), "incarnation_known": 1, "incarnation": ids["incarnation"],
        "host_boot_id": ids["host"],
    }
    return d, e


def _edge(rng: random.Random, d: dict[str, Any], e: dict[str, Any]) -> int:
    ints = [v for v in (*d.values(), *e.values()) if type(v) is int]
    pick = rng.randrange(9)
    if pick == 0:
        return rng.choice([0, 1, 2, U64_MAX, U64_MAX - 1])
    if pick == 1:
        k = rng.randint(0, 63)
        return max(0, min(U64_MAX, (1 << k) + rng.choice([-1, 0, 1])))
    if pick == 2:
        return rng.getrandbits(64)
    if pick == 3:
        return rng.randint(0, 70000)
    return max(0, min(U64_MAX, rng.choice(ints) + rng.choice([-1, 0, 0, 1])))


def mutate(rng: random.Random, case: Case, rs: declared.RuleSet) -> Case:
    d, e = dict(case[0]), dict(case[1])
    for _ in range(rng.randint(1, 3)):
        table, types = (d, rs.facts) if rng.random() < 0.6 else (e, rs.expect)
        field = rng.choice(sorted(types))
        kind = types[field]
        if kind == "u64":
            table[field] = rng.choice([0, 1, 2]) if field.startswith("has_") or field.endswith("_known") \
                or field == "fabric_node" else rng.randrange(len(rs.kinds) + 2) if field == "handle_kind" \
                else _edge(rng, d, e)
        elif kind == "id":
            table[field] = _id(rng) if rng.random() < 0.7 else bytes(declared.ID_BYTES)
        else:
            table[field] = frozenset(list(table[field])[:-1]) if table[field] and rng.random() < 0.5 \
                else frozenset({_id(rng)})
    return d, e


def cases(seed: int, n: int, rs: declared.RuleSet, valid_share: float = 0.2) -> list[Case]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        case = valid(rng, rs)
        out.append(case if rng.random() < valid_share else mutate(rng, case, rs))
    return out


# -- the C side ---------------------------------------------------------------------------


def run_c(native: Any, batch: Sequence[Case], rs: declared.RuleSet) -> list[tuple[int, list[int]]]:
    """(first reason code, per-rule reason codes) of each case, from one C batch call."""
    ffi, lib = native.ffi, native.lib
    packed_f, keep_f = Packer(native, "struct kvs_vfacts", rs.facts).pack([d for d, _ in batch])
    packed_e, keep_e = Packer(native, "struct kvs_vexpect", rs.expect).pack([e for _, e in batch])
    facts = ffi.from_buffer("struct kvs_vfacts[]", packed_f)
    expect = ffi.from_buffer("struct kvs_vexpect[]", packed_e)
    n = len(batch)
    first = ffi.new("uint32_t[]", n)
    width = len(rs.rules)
    per_rule = ffi.new("uint8_t[]", n * width)
    lib.kvs_validate_batch(n, facts, expect, first, per_rule)
    flat = bytes(ffi.buffer(per_rule))
    del keep_f, keep_e
    return [(first[i], list(flat[i * width:(i + 1) * width])) for i in range(n)]


def changed(rng: random.Random, d: Any, e: Any) -> tuple[Any, Any]:
    """A real descriptor and expectation with 0 to 2 changes, each of a class some rule
    refuses (or at its edge): rank, tp, size, granularity, generation, expiry, handle,
    device, incarnation, host, geometry and format, deployment."""
    tp = d.tp
    for _ in range(rng.randint(0, 2)):
        change = rng.randrange(12)
        if change == 0:
            d = attrs.evolve(d, rank=rng.choice([tp, tp + 1, 2**32 - 1]))
        elif change == 1:
            d = attrs.evolve(d, tp=rng.choice([0, 65, 1025, 2**32 - 1]))
        elif change == 2:
            d = attrs.evolve(d, size=d.size + rng.choice([-1, 1, kit.GRANULARITY]))
        elif change == 3:
            d = attrs.evolve(d, granularity=rng.choice([0, 3, 2048, 8192]))
        elif change == 4:
            e = attrs.evolve(e, min_generation=d.generation + rng.choice([0, 1]))
        elif change == 5:
            e = attrs.evolve(e, now_ns=d.expires_at_ns + rng.choice([-1, 0, 1]))
        elif change == 6:
            d = attrs.evolve(d, handle_kind=rng.choice(list(HandleKind)), handle=bytes(rng.choice([0, 1, 16, 64])))
        elif change == 7:
            e = attrs.evolve(e, device_uuids=frozenset(rng.sample([kit.DEVICE, b"X" * 16, b"Y" * 16], 2)))
        elif change == 8:
            e = attrs.evolve(e, incarnations=rng.choice([{}, {d.rank: kit.INCARNATION}, {d.rank: b"J" * 16}]))
        elif change == 9:
            d = attrs.evolve(d, host_boot_id=b"H" * 16, fabric=FabricDomain(
                rng.choice([FabricKind.NODE, FabricKind.NVLINK]), "x"))
        elif change == 10:
            e = attrs.evolve(e, geometry_fingerprint=rng.choice([d.geometry.fingerprint(), b"G" * 16]),
                             block_format=rng.choice([None, d.geometry.format_fingerprint(), b"F" * 16]))
        else:
            e = attrs.evolve(e, deployment=rng.choice([e.deployment, kit.Deployment("other", bytes(32))]))
    return d, e
