"""The driver-free rules of the cuda backend, testable on any machine.

:mod:`kvstate.transport.cuda.transport` talks to the driver; everything it decides without the
driver lives here, as plain functions over ints and bytes:

- which kvstate error a ``CUresult`` becomes (:func:`cuda_error`);
- what a received handle must look like for its kind (:func:`check_received`);
- the FABRIC trial decision table (:func:`fabric_decision`);
- device UUID text (:func:`format_uuid`, :func:`parse_uuid`).

What the driver structs hold and how a gather becomes device copies is the C engine's
(``ffi/kvs_cuda_*.c``). The CUresult values below are the driver ABI (``cuda.h``); a CPU
test checks each against cuda-python's enums where cuda-python is installed.
"""

from __future__ import annotations

import re
from typing import Final

import attrs

from kvstate.core import errors
from kvstate.core.reasons import ArgumentReason, BackendReason, ImportDefect, NativeReason
from kvstate.core.capabilities import FabricTrial
from kvstate.core.errors import ImportFailed
from kvstate.core.handles import FD_KINDS, HANDLE_BYTES, HandleKind

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

#: CUresult -> the NativeError reason of its kind (any other CUresult is NativeReason.CUDA).
_RESULT_REASON: Final[dict[int, NativeReason]] = {
    CUDA_ERROR_INVALID_VALUE: NativeReason.CUDA_INVALID,
    CUDA_ERROR_INVALID_DEVICE: NativeReason.CUDA_INVALID,
    CUDA_ERROR_INVALID_HANDLE: NativeReason.CUDA_INVALID,
    CUDA_ERROR_NOT_FOUND: NativeReason.CUDA_INVALID,
    CUDA_ERROR_ALREADY_MAPPED: NativeReason.CUDA_INVALID,
    CUDA_ERROR_OUT_OF_MEMORY: NativeReason.CUDA_MEMORY,
    CUDA_ERROR_MAP_FAILED: NativeReason.CUDA_MEMORY,
    CUDA_ERROR_NOT_SUPPORTED: NativeReason.CUDA_UNSUPPORTED,
    CUDA_ERROR_NOT_PERMITTED: NativeReason.CUDA_NOT_PERMITTED,
    CUDA_ERROR_NOT_INITIALIZED: NativeReason.CUDA_CONTEXT,
    CUDA_ERROR_DEINITIALIZED: NativeReason.CUDA_CONTEXT,
    CUDA_ERROR_INVALID_CONTEXT: NativeReason.CUDA_CONTEXT,
    CUDA_ERROR_ILLEGAL_ADDRESS: NativeReason.CUDA_FAULT,
    CUDA_ERROR_LAUNCH_FAILED: NativeReason.CUDA_FAULT,
}


def cuda_error(call: str, result: int, name: str = "", detail: str = "") -> errors.NativeError:
    """The typed error for a failed driver call (``result`` != CUDA_SUCCESS)."""
    if result == CUDA_SUCCESS:
        raise ValueError(f"{call} succeeded; CUDA_SUCCESS is not an error")
    return errors.NativeError.cuda(call, result, name or f"CUresult {result}", detail,
                                   _RESULT_REASON.get(result, NativeReason.CUDA))


# -- handles -----------------------------------------------------------------------------

#: The kinds this backend carries. MEMFD is the host backend's; NIXL is nixl's.
CUDA_KINDS: Final = frozenset({HandleKind.POSIX_FD, HandleKind.FABRIC, HandleKind.CUDA_IPC})


def check_received(kind: HandleKind, data: bytes, nfds: int) -> None:
    """A received handle is exactly its kind's shape: fd kinds carry one fd and 16 identity
    bytes; FABRIC and CUDA_IPC carry exactly 64 bytes and no fd. Raises before any open."""
    if kind not in CUDA_KINDS:
        raise errors.ImportFailed.handle(ImportDefect.KIND, f"the cuda backend does not carry {kind.value} handles")
    exact = HANDLE_BYTES[kind]
    if len(data) != exact:
        raise ImportFailed.handle(ImportDefect.SIZE,
                                  f"{kind.value} handle bytes are {len(data)} long, expected {exact}")
    want = 1 if kind in FD_KINDS else 0
    if nfds != want:
        raise ImportFailed.handle(ImportDefect.FDS, f"{kind.value} handle arrived with {nfds} fd(s), expected {want}")


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


# -- device UUIDs ------------------------------------------------------------------------

_UUID_TEXT = re.compile(r"^(?:GPU-|MIG-)?([0-9a-f]{8})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{12})$",
                        re.IGNORECASE)


def format_uuid(uuid: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi prints it."""
    if len(uuid) != 16:
        raise errors.BackendUnavailable(BackendReason.NO_DEVICE, f"a device UUID is 16 bytes, not {len(uuid)}")
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def parse_uuid(uuid: bytes | str) -> bytes:
    """16 UUID bytes from bytes or from nvidia-smi text (``GPU-…`` or ``MIG-…``)."""
    if isinstance(uuid, bytes):
        if len(uuid) != 16:
            raise errors.ArgumentInvalid.of("device", ArgumentReason.LENGTH, f"a device UUID is 16 bytes, not {len(uuid)}")
        return uuid
    m = _UUID_TEXT.match(uuid.strip())
    if m is None:
        raise errors.ArgumentInvalid.of("device", ArgumentReason.ENCODING,
                                        f"{uuid!r} is not a device UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    return bytes.fromhex("".join(m.groups()).lower())
