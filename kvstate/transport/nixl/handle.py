"""The handle bytes of a NIXL-exported bank: a strict, versioned binary encoding.

A descriptor of handle kind ``nixl`` carries these bytes; the descriptor's own
authentication covers them, so this format carries no MAC. What it must guarantee is
that an importer never hands NIXL anything but a well-formed record of exactly one
agent's metadata and the regions that one bank exposes, at the generation the
descriptor names. It is pure: decoding imports neither NIXL nor numpy, so descriptor
validation can run it before any backend is touched.

Layout, all integers little-endian, no padding, nothing after the last region::

    offset size  field
    0      4     magic        b"KVNX"
    4      1     version      1
    5      1     memory       0 = DRAM (host), 1 = VRAM (device)
    6      2     flags        0 (no flag is defined; any bit set is rejected)
    8      8     generation   u64, the bank generation this record was exported at
    16     2     name_len     1..MAX_AGENT_NAME
    18     4     md_len       1..NIXL_HANDLE_MAX_BYTES
    22     4     n_regions    1..MAX_REGIONS
    26     ...   agent name   ASCII [A-Za-z0-9._:@-], name_len bytes
    ...    ...   metadata     opaque NIXL agent metadata, md_len bytes
    ...    20*n  regions      (addr u64, length u64, device id u32), sorted, disjoint

The whole record is at most :data:`kvstate.core.handles.NIXL_HANDLE_MAX_BYTES`. Encoding is
canonical: a record that decodes re-encodes to the same bytes, so two descriptors with
equal meaning have equal handle bytes.
"""

from __future__ import annotations

import enum
import re
import struct

import attrs

from kvstate.core.errors import ImportFailed
from kvstate.core.handles import NIXL_HANDLE_MAX_BYTES
from kvstate.core.capabilities import MemoryKind

MAGIC = b"KVNX"
VERSION = 1
MAX_AGENT_NAME = 128
MAX_REGIONS = 1024
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1

_HEADER = struct.Struct("<4sBBHQHII")
_REGION = struct.Struct("<QQI")
HEADER_BYTES = _HEADER.size  # 26
REGION_BYTES = _REGION.size  # 20

_NAME_RE = re.compile(rb"[A-Za-z0-9._:@-]+")
_MEMORY_CODES = {MemoryKind.HOST: 0, MemoryKind.DEVICE: 1}
_MEMORY_BY_CODE = {v: k for k, v in _MEMORY_CODES.items()}


class HandleDefect(enum.Enum):
    """Why handle bytes were rejected; carried by :class:`ImportFailed` (HANDLE)."""

    TOO_LONG = "too_long"
    TRUNCATED = "truncated"
    TRAILING = "trailing_bytes"
    MAGIC = "magic"
    VERSION = "version"
    MEMORY_KIND = "memory_kind"
    FLAGS = "flags"
    AGENT_NAME = "agent_name"
    METADATA = "metadata"
    REGIONS = "regions"
    GENERATION = "generation"
    STALE_GENERATION = "stale_generation"


@attrs.frozen
class RemoteRegion:
    """One registered region of the exporting agent, in its own address space."""

    addr: int
    length: int
    device_id: int = 0

    @property
    def end(self) -> int:
        return self.addr + self.length


@attrs.frozen
class NixlHandle:
    """What an importer needs to READ one bank through NIXL."""

    agent_name: str
    metadata: bytes
    regions: tuple[RemoteRegion, ...]
    generation: int
    memory: MemoryKind = MemoryKind.HOST

    @property
    def size(self) -> int:
        return sum(r.length for r in self.regions)

    @property
    def bank(self) -> tuple[str, int]:
        """Which bank of which agent this record describes, whatever its generation: an
        importer keeps one view per bank (a process may export several)."""
        return self.agent_name, self.regions[0].addr

    def encode(self) -> bytes:
        """The canonical handle bytes; refuses a record that decode would refuse."""
        return encode(self)


def _reject(reason: HandleDefect, detail: str) -> ImportFailed:
    return ImportFailed.nixl_handle(reason, detail)


def _check_name(raw: bytes) -> str:
    if not 1 <= len(raw) <= MAX_AGENT_NAME:
        raise _reject(HandleDefect.AGENT_NAME, f"agent name is {len(raw)} bytes; allowed 1..{MAX_AGENT_NAME}")
    if _NAME_RE.fullmatch(raw) is None:
        raise _reject(HandleDefect.AGENT_NAME, f"agent name {raw!r} has characters outside [A-Za-z0-9._:@-]")
    return raw.decode("ascii")


def _check_regions(regions: tuple[RemoteRegion, ...]) -> None:
    if not 1 <= len(regions) <= MAX_REGIONS:
        raise _reject(HandleDefect.REGIONS, f"{len(regions)} regions; allowed 1..{MAX_REGIONS}")
    previous_end = -1
    for i, r in enumerate(regions):
        if not (0 <= r.addr <= U64_MAX and 0 < r.length <= U64_MAX and 0 <= r.device_id <= U32_MAX):
            raise _reject(HandleDefect.REGIONS,
                          f"region {i} ({r.addr:#x}, {r.length}, dev {r.device_id}) is out of range")
        if r.addr + r.length > U64_MAX + 1:
            raise _reject(HandleDefect.REGIONS, f"region {i} wraps the 64-bit address space")
        if r.addr < previous_end:
            raise _reject(HandleDefect.REGIONS, f"region {i} at {r.addr:#x} is unsorted or overlaps the one before")
        previous_end = r.end


def encode(handle: NixlHandle) -> bytes:
    """Encode ``handle``; the result always decodes back to an equal handle."""
    name = handle.agent_name.encode("ascii", errors="replace")
    _check_name(name)
    if not 1 <= len(handle.metadata) <= NIXL_HANDLE_MAX_BYTES:
        raise _reject(HandleDefect.METADATA, f"metadata is {len(handle.metadata)} bytes")
    _check_regions(handle.regions)
    if not 0 <= handle.generation <= U64_MAX:
        raise _reject(HandleDefect.GENERATION, f"generation {handle.generation} is not a u64")
    parts = [
        _HEADER.pack(MAGIC, VERSION, _MEMORY_CODES[handle.memory], 0, handle.generation,
                     len(name), len(handle.metadata), len(handle.regions)),
        name,
        handle.metadata,
        *(_REGION.pack(r.addr, r.length, r.device_id) for r in handle.regions),
    ]
    data = b"".join(parts)
    if len(data) > NIXL_HANDLE_MAX_BYTES:
        raise _reject(HandleDefect.TOO_LONG, f"record is {len(data)} bytes; the limit is {NIXL_HANDLE_MAX_BYTES}")
    return data


def decode(data: bytes, *, generation: int | None = None) -> NixlHandle:
    """Decode and check handle bytes, before anything is handed to NIXL.

    ``generation`` is the generation the enclosing descriptor names: a record exported
    at an older one is :class:`ImportFailed` (HANDLE, defect STALE_GENERATION), any other mismatch is rejected too.
    Every failure is a :class:`ImportFailed` (HANDLE) with a :class:`HandleDefect`.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"handle bytes must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) > NIXL_HANDLE_MAX_BYTES:
        raise _reject(HandleDefect.TOO_LONG, f"record is {len(data)} bytes; the limit is {NIXL_HANDLE_MAX_BYTES}")
    if len(data) < HEADER_BYTES:
        raise _reject(HandleDefect.TRUNCATED, f"record is {len(data)} bytes; the header alone is {HEADER_BYTES}")
    magic, version, memory, flags, gen, name_len, md_len, n_regions = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise _reject(HandleDefect.MAGIC, f"magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _reject(HandleDefect.VERSION, f"version {version}; this kvstate reads version {VERSION}")
    if memory not in _MEMORY_BY_CODE:
        raise _reject(HandleDefect.MEMORY_KIND, f"memory kind code {memory}")
    if flags:
        raise _reject(HandleDefect.FLAGS, f"flags {flags:#06x}; none are defined")
    if md_len == 0:
        raise _reject(HandleDefect.METADATA, "metadata is empty")
    if not 1 <= n_regions <= MAX_REGIONS:
        raise _reject(HandleDefect.REGIONS, f"{n_regions} regions; allowed 1..{MAX_REGIONS}")
    expected = HEADER_BYTES + name_len + md_len + REGION_BYTES * n_regions
    if len(data) < expected:
        raise _reject(HandleDefect.TRUNCATED, f"record is {len(data)} bytes; its header promises {expected}")
    if len(data) > expected:
        raise _reject(HandleDefect.TRAILING, f"{len(data) - expected} bytes after the last region")
    pos = HEADER_BYTES
    name = _check_name(data[pos:pos + name_len])
    pos += name_len
    metadata = data[pos:pos + md_len]
    pos += md_len
    regions = tuple(RemoteRegion(*_REGION.unpack_from(data, pos + i * REGION_BYTES)) for i in range(n_regions))
    _check_regions(regions)
    if generation is not None and gen != generation:
        if gen < generation:
            raise ImportFailed.nixl_handle(HandleDefect.STALE_GENERATION,
                                           f"record of generation {gen}, but generation {generation} is current")
        raise _reject(HandleDefect.GENERATION,
                      f"record of generation {gen} inside a descriptor of generation {generation}")
    return NixlHandle(agent_name=name, metadata=metadata, regions=regions, generation=gen,
                      memory=_MEMORY_BY_CODE[memory])


def at_generation(data: bytes, generation: int) -> bytes:
    """The same record stamped with ``generation``: an exporter registers a bank once and
    stamps each generation it advertises, so the record's own stale check can fire."""
    return attrs.evolve(decode(data), generation=generation).encode()
