"""The descriptor rules' verdict from the generated C (``ffi/kvs_validate.c``), for the
import path.

Why
---

``spec/rules.toml`` is generated both into Python (``kvstate.core.rules_table``) and into C,
and the two agree on every verdict and reason (``tests/native/test_rules_differential.py``:
100k generated pairs, and real descriptors). In Python the rules cost about 5 µs per
descriptor on the import path, 40 µs for a tp=8 group; the C batch takes the same group in
one call. So an importer asks C first (:func:`validate_group`, from tp 4: below, packing
the expectation costs what the Python rules cost): when every descriptor passes, the
Python rules are not run again; when any breaks one, the Python reference runs whole and
names every problem, with its details, as before. C never decides a refusal, and it is
asked only when it was built from the declaration the Python side runs (a digest).

What a descriptor says is packed once per descriptor (:class:`ByIdentity`: the decoded
descriptors of a group come back as the same objects); what the importer accepts is
packed once per import (``now_ns`` moves), and once more per rank only when the
expectation names incarnations.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any, cast

from kvstate.core import rules
from kvstate.core.descriptor import Descriptor
from kvstate.core.errors import BackendUnavailable
from kvstate.core.remembered import ByIdentity
from kvstate.core import validate
from kvstate.core.validate import Expectation, ValidatedGroup, expected_for, expected_of, facts_of
from kvstate.transport.native import Native, default

#: Each descriptor's packed facts (both fingerprints: C reads one only when asked for it).
_facts: ByIdentity[bytes] = ByIdentity(1024)


class Packer:
    """Packs facts or expectations into a compiled struct's bytes, field by field at the
    offsets the C compiler chose (an id set is a pointer into one shared buffer, and a
    count)."""

    def __init__(self, nat: Native, struct_name: Any, types: Mapping[str, str]) -> None:
        ffi = nat.ffi
        self.ffi, self.types = ffi, dict(types)
        self.size = ffi.sizeof(struct_name)
        layout: list[tuple[int, str, str]] = []
        for field, kind in types.items():
            if kind == "u64":
                layout.append((ffi.offsetof(struct_name, field), "Q", field))
            elif kind == "id":
                layout.append((ffi.offsetof(struct_name, field), f"{rules.ID_BYTES}s", field))
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
        #: (field, what of it: the value, an id set's pointer or its count), in packing order.
        self.plan = [(name.partition("@")[0], name.partition("@")[2]) for _, _, name in layout]
        self.sets = [field for field, part in self.plan if part == "ptr"]

    def pack(self, rows: Sequence[Mapping[str, Any]]) -> tuple[bytearray, Any]:
        """The bytes of ``rows`` and the buffer of their id sets (keep it alive while C
        reads the bytes). struct.error for a value the field cannot hold exactly: an int
        outside u64 or not an int (a bool), an id that is not bytes of ``ID_BYTES`` (struct
        would pad or cut it, and C would compare another value than Python)."""
        for row in rows:
            for field, part in self.plan:
                value = row[field]
                if part == "ptr":
                    exact = all(type(v) is bytes and len(v) == rules.ID_BYTES for v in value)
                else:
                    exact = part == "n" or (type(value) is int if self.types[field] == "u64"
                                            else type(value) is bytes and len(value) == rules.ID_BYTES)
                if not exact:
                    raise struct.error(f"{field}: {type(value).__name__} C cannot hold exactly")
        ids = bytearray(b"".join(b"".join(sorted(row[f])) for row in rows for f in self.sets) or bytes(1))
        idbuf = self.ffi.from_buffer(ids)
        base = int(self.ffi.cast("uintptr_t", idbuf))
        blob = bytearray(self.size * len(rows))
        at = 0
        for i, row in enumerate(rows):
            values = []
            for field, part in self.plan:
                if not part:
                    values.append(row[field])
                elif part == "ptr":
                    values.append(base + at)
                    at += len(row[field]) * rules.ID_BYTES
                else:
                    values.append(len(row[field]))
            self.struct.pack_into(blob, i * self.size, *values)
        return blob, (ids, idbuf)


class NativeRules:
    """The C rules of one native module, with the packers of its structs."""

    def __init__(self, nat: Native, rs: rules.RuleSet) -> None:
        self.nat = nat
        self.facts = Packer(nat, "struct kvs_vfacts", rs.facts)
        self.expect = Packer(nat, "struct kvs_vexpect", rs.expect)

    def _pack_facts(self, d: Descriptor) -> bytes:
        return bytes(self.facts.pack([facts_of(d)])[0])

    def first_reasons(self, descriptors: Sequence[Descriptor], expect: Expectation) -> list[int]:
        """The C code of the first rule each descriptor breaks (0: none). struct.error
        for a value C cannot hold."""
        n = len(descriptors)
        base = expected_of(expect)
        if expect.incarnations is None:  # one expectation for every rank
            row, ids = self.expect.pack([expected_for(0, expect, base)])
            expects, keep = row * n, ids
        else:
            expects, keep = self.expect.pack([expected_for(d.rank, expect, base) for d in descriptors])
        facts = bytearray(b"".join([_facts.one(d, self._pack_facts) for d in descriptors]))
        ffi = self.nat.ffi
        first = ffi.new("uint32_t[]", n)
        self.nat.lib.kvs_validate_batch(n, ffi.from_buffer("struct kvs_vfacts[]", facts),
                                        ffi.from_buffer("struct kvs_vexpect[]", expects), first,
                                        cast(bytes, ffi.NULL))  # no per-rule reasons wanted
        del keep  # the id sets the expectations point into: read by now
        return [first[i] for i in range(n)]


#: The declaration last asked about, and its C rules (None: C was built from another one).
_checked: tuple[rules.RuleSet, NativeRules | None] | None = None


def _native_rules(rs: rules.RuleSet, nat: Native) -> NativeRules | None:
    """The C rules of ``nat`` when it was built from ``rs`` (its digest), else None."""
    global _checked
    held = _checked
    if held is not None and held[0] is rs:
        return held[1]
    from kvstate.derive import rules_c  # the digest's one definition, as the build wrote it

    native = NativeRules(nat, rs) if nat.lib.kvs_validate_digest() == rules_c.digest(rs) else None
    _checked = (rs, native)
    return native


def rules_pass(descriptors: Sequence[Descriptor], expect: Expectation) -> bool | None:
    """Whether every descriptor passes every declared rule, by the C batch; None when C
    cannot say (no module built from these rules, no descriptors, or a value outside what
    its fields hold): the Python rules then decide, as they do on False."""
    if not descriptors:
        return None
    try:
        nat = default()
    except BackendUnavailable:  # no native module here: the Python rules decide alone
        return None
    native = _native_rules(rules.rules(), nat)
    if native is None:
        return None
    try:
        return not any(native.first_reasons(descriptors, expect))
    except struct.error:
        return None


#: The group size from which C is asked first: packing the expectation costs about what
#: the Python rules cost for three descriptors.
NATIVE_FROM_TP = 4


def validate_group(descriptors: Sequence[Descriptor], expect: Expectation) -> ValidatedGroup:
    """:func:`kvstate.core.validate.validate_group`, the declared rules asked of C first
    for a group of :data:`NATIVE_FROM_TP` or more."""
    checked = len(descriptors) >= NATIVE_FROM_TP and rules_pass(descriptors, expect) is True
    return validate.validate_group(descriptors, expect, rules_checked=checked)

