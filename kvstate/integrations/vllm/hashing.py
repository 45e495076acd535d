"""What makes retained KV reusable by another engine: the compatibility key and the
prefix hashes. Pure.

**Compatibility.** KV computed by one engine is only valid in another that runs the same
model with the same numerics and lays a block out the same way. :class:`Compat` lists
everything that decides that for vLLM's CPU backend: the model, the KV dtype, block size,
head dim, KV heads per rank, the layers, the tensor-parallel size (bf16 KV computed at
tp=1 and tp=2 differs after the first layer: the all-reduce sums in another order), the
attention ISA that packs a block's bytes, and the engine version. Decode and prefill
compare their keys field by field, so a refusal names its reason (``tp_mismatch`` for
another TP size). A prefill engine configured with ``source_tp`` looks blocks up under the
decode engine's key (:mod:`.tp`), so blocks stay keyed by the TP size that computed them.

**Prefix hashes.** Block ``i`` of a prompt is named by a chain, as vLLM's prefix cache
names it: ``h_i = H(h_{i-1}, tokens of block i)``, so a block's hash covers every token
before it. The root ``h_{-1}`` covers the compatibility key and the request's cache salt,
so blocks of incompatible engines or of another salt never share a name. H is BLAKE2b
personalised for the inventory and keyed with the deployment's secret (domain-separated
and keyed per deployment like every kvstate digest); the chain keeps 16 bytes per block.

**Inventory keys.** The retained inventory names a block by a 64-bit key of (prefix hash,
bank block): if a hash is evicted and later retained again in another bank block, the
old key is gone, so a lease naming it is refused as stale instead of reading the wrong
block.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvstate.core.identity import Deployment, Purpose, digest, hasher

HASH_BYTES = 16

#: Compat fields in the order a mismatch is reported (the first one that differs), with
#: the reason each gives. tp first: heterogeneous TP is refused by that name.
COMPAT_FIELDS: tuple[tuple[str, str], ...] = (
    ("tp", "tp_mismatch"),
    ("model", "model"),
    ("dtype", "dtype"),
    ("block_size", "block_size"),
    ("head_dim", "geometry"),
    ("kv_heads", "geometry"),
    ("layers", "geometry"),
    ("isa", "attention_isa"),
    ("engine", "engine_version"),
)


@attrs.frozen
class Compat:
    """The compatibility key of one engine's KV (see the module docstring)."""

    model: str
    dtype: str
    block_size: int
    head_dim: int
    kv_heads: int          # per rank
    layers: tuple[str, ...]
    tp: int
    isa: str
    engine: str

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "block_size": self.block_size, "head_dim": self.head_dim,
                "kv_heads": self.kv_heads, "layers": list(self.layers), "tp": self.tp, "isa": self.isa,
                "engine": self.engine}

    @classmethod
    def from_dict(cls, d: object) -> Compat | None:
        """A peer's key, or None when it is malformed (every field checked)."""
        if not isinstance(d, Mapping) or set(d) != {f for f in attrs.fields_dict(cls)}:
            return None
        ints = ("block_size", "head_dim", "kv_heads", "tp")
        strs = ("model", "dtype", "isa", "engine")
        layers = d["layers"]
        if not all(type(d[k]) is int and d[k] > 0 for k in ints) or not all(isinstance(d[k], str) for k in strs) \
                or not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
            return None
        return cls(model=d["model"], dtype=d["dtype"], block_size=d["block_size"], head_dim=d["head_dim"],
                   kv_heads=d["kv_heads"], layers=tuple(layers), tp=d["tp"], isa=d["isa"], engine=d["engine"])

    def mismatch(self, other: Compat) -> tuple[str, str] | None:
        """``(reason, detail)`` for the first field where ``other`` differs, or None."""
        for name, reason in COMPAT_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                if name == "layers":
                    return reason, f"layers: {len(mine)} named layers here, {len(theirs)} there, or other names"
                return reason, f"{name}: {mine!r} here, {theirs!r} there"
        return None

    def canonical(self) -> bytes:
        """Text covering every field, for the hash root."""
        return repr(sorted(self.as_dict().items())).encode("utf-8")


def _h(deployment: Deployment, tag: bytes, data: bytes, size: int = HASH_BYTES) -> bytes:
    return digest(Purpose.INVENTORY, tag + data, key=deployment.key, size=size)


def root(deployment: Deployment, compat: Compat, salt: str | None = None) -> bytes:
    """``h_{-1}`` for a request: the compatibility key and the request's cache salt."""
    salted = b"\x00" if salt is None else b"\x01" + salt.encode("utf-8")
    return _h(deployment, b"R", compat.canonical() + salted)


def prefix_hashes(deployment: Deployment, start: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of every *full* block of ``tokens`` (a partial last block has none):
    ``_h(deployment, b"B", parent + the block's tokens)``, from one keyed hasher."""
    started = hasher(Purpose.INVENTORY, key=deployment.key, size=HASH_BYTES)
    pack = struct.Struct(f"<{block_size}q").pack
    out: list[bytes] = []
    parent = start
    for i in range(len(tokens) // block_size):
        h = started.copy()
        h.update(b"B" + parent + pack(*tokens[i * block_size:(i + 1) * block_size]))
        parent = h.digest()
        out.append(parent)
    return out


def _key_text(block_hash: bytes, bank_block: int) -> bytes:
    return b"K" + block_hash + bank_block.to_bytes(8, "little")


def block_key(deployment: Deployment, block_hash: bytes, bank_block: int) -> int:
    """The inventory key (unsigned 64-bit) of ``block_hash`` held in ``bank_block``."""
    return int.from_bytes(digest(Purpose.INVENTORY, _key_text(block_hash, bank_block), key=deployment.key, size=8),
                          "little")


def block_keys(deployment: Deployment, block_hashes: Sequence[bytes], bank_blocks: Sequence[int]) -> list[int]:
    """:func:`block_key` of each block hash in its bank block, from one keyed hasher."""
    started = hasher(Purpose.INVENTORY, key=deployment.key, size=8)
    out: list[int] = []
    for block_hash, bank_block in zip(block_hashes, bank_blocks, strict=True):
        h = started.copy()
        h.update(_key_text(block_hash, bank_block))
        out.append(int.from_bytes(h.digest(), "little"))
    return out


def source_id(deployment: Deployment, source: str) -> bytes:
    """The 16-byte KV source id of a decode source's name: stable across restarts (the
    incarnation is what changes), distinct per deployment."""
    return _h(deployment, b"S", source.encode("utf-8"))
