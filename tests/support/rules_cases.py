"""Generated descriptor facts for the rules differential, and a batch call of the C rules.

:func:`cases` draws (facts, expectation) pairs as ``spec/rules.toml`` names them: a valid
pair, then 0 to 3 fields set to values near the rules' edges (0, 1, the top of u64, a
power of two and its neighbours, another field's value and its neighbours, another id),
so every check of every rule is broken often, alone and together. :func:`run_c` packs a
batch into the generated C structs (offsets read from the compiled module) and runs
``kvs_validate_batch`` once.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from typing import Any

from kvstate.core import rules as declared

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


class Packer:
    """Packs facts or expectations into the compiled struct's bytes, field by field at the
    offsets the C compiler chose (an idset is a pointer into one shared buffer, and a count)."""

    def __init__(self, ffi: Any, struct_name: str, types: dict[str, str]) -> None:
        self.ffi, self.struct_name, self.types = ffi, struct_name, types
        self.size = ffi.sizeof(struct_name)
        layout: list[tuple[int, str, str]] = []
        for field, kind in types.items():
            if kind == "u64":
                layout.append((ffi.offsetof(struct_name, field), "Q", field))
            elif kind == "id":
                layout.append((ffi.offsetof(struct_name, field), f"{declared.ID_BYTES}s", field))
            else:
                layout.append((ffi.offsetof(struct_name, field), "Q", field + "@ptr"))
                layout.append((ffi.offsetof(struct_name, "n_" + field), "Q", field + "@n"))
        layout.sort()
        fmt, pos = "<", 0
        for offset, code, _ in layout:
            fmt += f"{offset - pos}x" if offset > pos else ""
            fmt += code
            pos = offset + struct.calcsize("<" + code)
        fmt += f"{self.size - pos}x" if self.size > pos else ""
        self.struct = struct.Struct(fmt)
        assert self.struct.size == self.size, (self.struct.size, self.size)
        self.order = [name for _, _, name in layout]

    def pack(self, rows: Sequence[dict[str, Any]]) -> tuple[Any, Any]:
        """The cdata array of ``rows`` and the buffer of their id sets (keep both alive)."""
        sets = [f for f, kind in self.types.items() if kind == "idset"]
        total = sum(len(row[f]) for row in rows for f in sets) * declared.ID_BYTES
        idbuf = self.ffi.new("uint8_t[]", max(total, 1))
        base = int(self.ffi.cast("uintptr_t", idbuf))
        blob = bytearray(self.size * len(rows))
        at = 0
        for i, row in enumerate(rows):
            values = []
            for name in self.order:
                field, _, part = name.partition("@")
                if part == "ptr":
                    ids = sorted(row[field])
                    self.ffi.memmove(idbuf + at, b"".join(ids), len(ids) * declared.ID_BYTES)
                    values.append(base + at)
                    at += len(ids) * declared.ID_BYTES
                elif part == "n":
                    values.append(len(row[field]))
                else:
                    values.append(row[field])
            self.struct.pack_into(blob, i * self.size, *values)
        return self.ffi.from_buffer(f"struct {self.struct_name.split()[-1]}[]", blob), (blob, idbuf)


def run_c(native: Any, batch: Sequence[Case], rs: declared.RuleSet) -> list[tuple[int, list[int]]]:
    """(first reason code, per-rule reason codes) of each case, from one C batch call."""
    ffi, lib = native.ffi, native.lib
    facts, keep_f = Packer(ffi, "struct kvs_vfacts", rs.facts).pack([d for d, _ in batch])
    expect, keep_e = Packer(ffi, "struct kvs_vexpect", rs.expect).pack([e for _, e in batch])
    n = len(batch)
    first = ffi.new("uint32_t[]", n)
    width = len(rs.rules)
    per_rule = ffi.new("uint8_t[]", n * width)
    lib.kvs_validate_batch(n, facts, expect, first, per_rule)
    flat = bytes(ffi.buffer(per_rule))
    del keep_f, keep_e
    return [(first[i], list(flat[i * width:(i + 1) * width])) for i in range(n)]
