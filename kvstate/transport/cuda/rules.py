"""The driver-free rules of the cuda backend, testable on any machine.

:mod:`kvstate.transport.cuda.transport` talks to the driver; everything it decides without the
driver lives here, as plain functions over ints and bytes:

- which kvstate error a ``CUresult`` becomes (:func:`cuda_error`);
- what a received handle must look like for its kind (:func:`check_received`);
- the FABRIC trial decision table (:func:`fabric_decision`);
- the fields of ``CUmemAllocationProp`` and ``CUmemAccessDesc`` (:func:`allocation_fields`,
  :func:`access_flags`);
- how a gather's block list becomes the fewest device copies (:func:`coalesce`);
- device UUID text (:func:`format_uuid`, :func:`parse_uuid`).

The CUresult and enum values below are the driver ABI (``cuda.h``); a CPU test checks
each against cuda-python's enums where cuda-python is installed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Final

import attrs

from kvstate.core import errors
from kvstate.core.errors import HandleFdsMismatch, HandleWrongSize, OutOfRange
from kvstate.core.handles import FD_KINDS, HANDLE_BYTES, HandleKind
from kvstate.core.capabilities import FabricTrial
from kvstate.core.capabilities import Access

# -- CUresult values (cuda.h) ------------------------------------------------------------

CUDA_SUCCESS: Final = 0
CUDA_ERROR_INVALID_VALUE: Final = 1
CUDA_ERROR_OUT_OF_MEMORY: Final = 2
CUDA_ERROR_NOT_INITIALIZED: Final = 3
CUDA_ERROR_DEINITIALIZED: Final = 4
CUDA_ERROR_NO_DEVICE: Final = 100
CUDA_ERROR_INVALID_DEVICE: Final = 101
CUDA_ERROR_INVALID_CONTEXT: Final = 201
CUDA_ERROR_MAP_FAILED: Final = 205
CUDA_ERROR_ALREADY_MAPPED: Final = 208
CUDA_ERROR_INVALID_HANDLE: Final = 400
CUDA_ERROR_NOT_FOUND: Final = 500
CUDA_ERROR_NOT_READY: Final = 600
CUDA_ERROR_ILLEGAL_ADDRESS: Final = 700
CUDA_ERROR_LAUNCH_FAILED: Final = 719
CUDA_ERROR_NOT_PERMITTED: Final = 800
CUDA_ERROR_NOT_SUPPORTED: Final = 801

_ERROR_CLASS: Final[dict[int, type[errors.CudaError]]] = {
    CUDA_ERROR_INVALID_VALUE: errors.CudaInvalidArgument,
    CUDA_ERROR_INVALID_DEVICE: errors.CudaInvalidArgument,
    CUDA_ERROR_INVALID_HANDLE: errors.CudaInvalidArgument,
    CUDA_ERROR_NOT_FOUND: errors.CudaInvalidArgument,
    CUDA_ERROR_ALREADY_MAPPED: errors.CudaInvalidArgument,
    CUDA_ERROR_OUT_OF_MEMORY: errors.CudaOutOfMemory,
    CUDA_ERROR_MAP_FAILED: errors.CudaOutOfMemory,
    CUDA_ERROR_NOT_SUPPORTED: errors.CudaNotSupported,
    CUDA_ERROR_NOT_PERMITTED: errors.CudaNotPermitted,
    CUDA_ERROR_NOT_INITIALIZED: errors.CudaContextError,
    CUDA_ERROR_DEINITIALIZED: errors.CudaContextError,
    CUDA_ERROR_INVALID_CONTEXT: errors.CudaContextError,
    CUDA_ERROR_ILLEGAL_ADDRESS: errors.CudaDeviceFault,
    CUDA_ERROR_LAUNCH_FAILED: errors.CudaDeviceFault,
}


def cuda_error(call: str, result: int, name: str = "", detail: str = "") -> errors.CudaError:
    """The typed error for a failed driver call (``result`` != CUDA_SUCCESS)."""
    if result == CUDA_SUCCESS:
        raise ValueError(f"{call} succeeded; CUDA_SUCCESS is not an error")
    cls = _ERROR_CLASS.get(result, errors.CudaError)
    return cls(call, result, name or f"CUresult {result}", detail)


# -- handles -----------------------------------------------------------------------------

#: The kinds this backend carries. MEMFD is the host backend's; NIXL is nixl's.
CUDA_KINDS: Final = frozenset({HandleKind.POSIX_FD, HandleKind.FABRIC, HandleKind.CUDA_IPC})


def check_received(kind: HandleKind, data: bytes, nfds: int) -> None:
    """A received handle is exactly its kind's shape: fd kinds carry one fd and 16 identity
    bytes; FABRIC and CUDA_IPC carry exactly 64 bytes and no fd. Raises before any open."""
    if kind not in CUDA_KINDS:
        raise errors.HandleRefused(f"the cuda backend does not carry {kind.value} handles")
    exact = HANDLE_BYTES[kind]
    if len(data) != exact:
        raise HandleWrongSize(f"{kind.value} handle bytes are {len(data)} long, expected {exact}")
    want = 1 if kind in FD_KINDS else 0
    if nfds != want:
        raise HandleFdsMismatch(f"{kind.value} handle arrived with {nfds} fd(s), expected {want}")


# -- FABRIC trial ------------------------------------------------------------------------


@attrs.frozen
class FabricDecision:
    trial: FabricTrial
    why: str


def fabric_decision(*, requested: bool, attribute: bool, export_result: int | None,
                    import_result: int | None) -> FabricDecision:
    """Whether FABRIC handles may be published. The device attribute alone is unreliable
    (IMEX channels, permissions, driver configuration), so only a trial export *and*
    import that both return CUDA_SUCCESS passes; ``None`` means that step did not run."""
    if not requested:
        return FabricDecision(FabricTrial.NOT_RUN, "FABRIC was not requested")
    if not attribute:
        return FabricDecision(FabricTrial.FAILED, "the device reports no FABRIC handle support")
    if export_result is None:
        return FabricDecision(FabricTrial.FAILED, "the trial export did not run")
    if export_result != CUDA_SUCCESS:
        return FabricDecision(FabricTrial.FAILED, f"the trial export failed with CUresult {export_result}")
    if import_result is None:
        return FabricDecision(FabricTrial.FAILED, "the trial import did not run")
    if import_result != CUDA_SUCCESS:
        return FabricDecision(FabricTrial.FAILED, f"the trial import failed with CUresult {import_result}")
    return FabricDecision(FabricTrial.PASSED, "trial export and import succeeded")


# -- struct fields -----------------------------------------------------------------------

CU_MEM_ALLOCATION_TYPE_PINNED: Final = 1
CU_MEM_LOCATION_TYPE_DEVICE: Final = 1
CU_MEM_HANDLE_TYPE_NONE: Final = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: Final = 1
CU_MEM_HANDLE_TYPE_FABRIC: Final = 8
CU_MEM_ACCESS_FLAGS_PROT_NONE: Final = 0
CU_MEM_ACCESS_FLAGS_PROT_READ: Final = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE: Final = 3

_VMM_HANDLE_TYPE: Final = {
    HandleKind.POSIX_FD: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    HandleKind.FABRIC: CU_MEM_HANDLE_TYPE_FABRIC,
}


def vmm_handle_type(kind: HandleKind) -> int:
    """The CUmemAllocationHandleType of a VMM kind (legacy CUDA_IPC is not VMM)."""
    try:
        return _VMM_HANDLE_TYPE[kind]
    except KeyError:
        raise errors.HandleRefused(f"{kind.value} is not a VMM shareable handle type") from None


@attrs.frozen
class AllocationFields:
    """The fields kvstate sets in CUmemAllocationProp; every other field stays zero."""

    type: int
    location_type: int
    location_id: int
    requested_handle_types: int


def allocation_fields(device_ordinal: int, kinds: Iterable[HandleKind]) -> AllocationFields:
    """Pinned device memory on one device, exportable as every VMM kind in ``kinds``.
    The ordinal is the driver's handle for the device the transport found by UUID."""
    mask = 0
    for k in kinds:
        mask |= vmm_handle_type(k)
    if device_ordinal < 0:
        raise errors.CudaDeviceNotFound(f"device ordinal {device_ordinal} is not a device")
    return AllocationFields(CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE,
                            device_ordinal, mask)


def access_flags(access: Access) -> int:
    """CUmemAccess_flags for an Access level."""
    return {Access.NONE: CU_MEM_ACCESS_FLAGS_PROT_NONE, Access.READ: CU_MEM_ACCESS_FLAGS_PROT_READ,
            Access.READ_WRITE: CU_MEM_ACCESS_FLAGS_PROT_READWRITE}[access]


# -- gather ------------------------------------------------------------------------------


def coalesce(blocks: Sequence[tuple[int, int, int]], src_size: int, dst_size: int) -> list[tuple[int, int, int]]:
    """Check every (src_off, dst_off, len) against both extents, then merge neighbours that
    are contiguous on both sides, so a gather issues the fewest device copies."""
    runs: list[tuple[int, int, int]] = []
    for i, (s, d, n) in enumerate(blocks):
        if n <= 0 or s < 0 or d < 0 or s + n > src_size or d + n > dst_size:
            raise OutOfRange("gather", -1, f"block {i} ({s}, {d}, {n}) outside source of {src_size} "
                             f"bytes or destination of {dst_size} bytes")
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            ps, pd, pn = runs[-1]
            runs[-1] = (ps, pd, pn + n)
        else:
            runs.append((s, d, n))
    return runs


@attrs.frozen
class Copy:
    """``height`` rows of ``width`` bytes; row ``i`` goes from ``src + i * src_pitch`` to
    ``dst + i * dst_pitch``. One row is a plain 1D copy; more is one cuMemcpy2DAsync."""

    src: int
    dst: int
    width: int
    height: int = 1
    src_pitch: int = 0
    dst_pitch: int = 0

    def rows(self) -> Iterable[tuple[int, int, int]]:
        for i in range(self.height):
            yield self.src + i * self.src_pitch, self.dst + i * self.dst_pitch, self.width


def plan_copies(runs: Sequence[tuple[int, int, int]], max_pitch: int = (1 << 31) - 1) -> list[Copy]:
    """Fold runs of equal length at constant source and destination strides into 2D copies.

    A layer-major KV bank stores one block as ``layers`` equal extents a layer apart; a
    gather writes them back to back. That is one 2D copy per block instead of one copy
    per extent, which keeps the number of driver calls (each costs microseconds from
    Python) independent of the layer count. Pitches must be at least the width (rows
    never overlap) and at most the device's maximum pitch.
    """
    plan: list[Copy] = []
    for s, d, n in runs:
        if plan:
            c = plan[-1]
            if c.width == n:
                if c.height == 1:
                    sp, dp = s - c.src, d - c.dst
                    if n <= sp <= max_pitch and n <= dp <= max_pitch:
                        plan[-1] = Copy(c.src, c.dst, n, 2, sp, dp)
                        continue
                elif s == c.src + c.height * c.src_pitch and d == c.dst + c.height * c.dst_pitch:
                    plan[-1] = attrs.evolve(c, height=c.height + 1)
                    continue
        plan.append(Copy(s, d, n))
    return plan


# -- device UUIDs ------------------------------------------------------------------------

_UUID_TEXT = re.compile(r"^(?:GPU-|MIG-)?([0-9a-f]{8})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{12})$", re.IGNORECASE)


def format_uuid(uuid: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi prints it."""
    if len(uuid) != 16:
        raise errors.CudaDeviceNotFound(f"a device UUID is 16 bytes, not {len(uuid)}")
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def parse_uuid(uuid: bytes | str) -> bytes:
    """16 UUID bytes from bytes or from nvidia-smi text (``GPU-…`` or ``MIG-…``)."""
    if isinstance(uuid, bytes):
        if len(uuid) != 16:
            raise errors.CudaDeviceNotFound(f"a device UUID is 16 bytes, not {len(uuid)}")
        return uuid
    m = _UUID_TEXT.match(uuid.strip())
    if m is None:
        raise errors.CudaDeviceNotFound(f"{uuid!r} is not a device UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    return bytes.fromhex("".join(m.groups()).lower())
