"""Loading cuda-python and the driver, and the driver calls the CUDA backend shares:
error mapping, device lookup by UUID, and the VMM structs built from :mod:`.rules`.

Nothing here runs at import; :func:`load_driver` loads ``cuda.bindings.driver`` on first
use and raises :class:`BackendUnavailable` when it (or the driver library) is missing.
"""

from __future__ import annotations

import ctypes
from types import ModuleType
from typing import Any

from kvstate.core import errors
from kvstate.core.capabilities import Access
from kvstate.core.errors import BackendUnavailable
from kvstate.core.optional import require
from kvstate.transport.cuda import rules





def load_driver() -> ModuleType:
    """``cuda.bindings.driver`` with ``cuInit`` done, or BackendUnavailable.

    Unavailable means: cuda-python not installed (ModuleNotFoundError for ``cuda``), no
    driver library (cuda-python's ``cuda.pathfinder.DynamicLibNotFoundError`` from
    ``cuInit``), or no device (CUDA_ERROR_NO_DEVICE). Anything else propagates.
    """
    driver = require("cuda.bindings.driver", "cuda", hint="install kvstate[cuda]")
    not_found = _no_driver_errors()
    try:
        (err,) = driver.cuInit(0)
    except not_found as exc:
        raise BackendUnavailable("cuda", f"no CUDA driver library: {exc}") from exc
    if int(err) == rules.CUDA_ERROR_NO_DEVICE:
        raise BackendUnavailable("cuda", "the driver sees no CUDA device")
    check(driver, "cuInit", err)
    return driver


def _no_driver_errors() -> tuple[type[BaseException], ...]:
    """The exception cuda-python raises when libcuda cannot be loaded. cuda-bindings 12.9
    and 13.x raise ``cuda.pathfinder.DynamicLibNotFoundError`` (a RuntimeError); an older
    cuda-bindings without cuda.pathfinder has no such class to catch."""
    try:
        from cuda.pathfinder import DynamicLibNotFoundError
    except ModuleNotFoundError as exc:
        if exc.name in ("cuda.pathfinder", "cuda"):
            return ()
        raise
    return (DynamicLibNotFoundError,)


def check(driver: ModuleType, call: str, err: Any, detail: str = "") -> None:
    code = int(err)
    if code != rules.CUDA_SUCCESS:
        name = getattr(err, "name", "")
        if not name:
            e, s = driver.cuGetErrorName(err)
            name = s.decode() if int(e) == 0 and s else ""
        raise rules.cuda_error(call, code, name, detail)


def visible_devices() -> list[bytes]:
    """The UUIDs of the devices this process can see, in no meaningful order."""
    driver = load_driver()
    (err, n) = driver.cuDeviceGetCount()
    check(driver, "cuDeviceGetCount", err)
    return [uuid_of(driver, device_at(driver, i)) for i in range(n)]


def device_at(driver: ModuleType, ordinal: int) -> Any:
    err, dev = driver.cuDeviceGet(ordinal)
    check(driver, "cuDeviceGet", err)
    return dev


def uuid_of(driver: ModuleType, dev: Any) -> bytes:
    err, uuid = driver.cuDeviceGetUuid(dev)
    check(driver, "cuDeviceGetUuid", err)
    return bytes(uuid.bytes)[:16]


def struct_bytes(obj: Any, n: int) -> bytes:
    """The first ``n`` bytes of a cuda-python struct (CUmemFabricHandle, CUipcMemHandle)."""
    data = getattr(obj, "data", None)
    if isinstance(data, bytes) and len(data) == n:
        return data
    return ctypes.string_at(int(obj.getPtr()), n)


def struct_from(cls: Any, data: bytes) -> Any:
    obj = cls()
    ctypes.memmove(int(obj.getPtr()), data, len(data))
    return obj


def allocation_prop(driver: ModuleType, fields: rules.AllocationFields) -> Any:
    """A CUmemAllocationProp with exactly ``fields`` set (one VMM handle type)."""
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType(fields.type)
    prop.location.type = driver.CUmemLocationType(fields.location_type)
    prop.location.id = fields.location_id
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType(fields.requested_handle_types)
    return prop


def access_desc(driver: ModuleType, device_ordinal: int, access: Access) -> Any:
    """A CUmemAccessDesc granting ``access`` to one device."""
    desc = driver.CUmemAccessDesc()
    desc.location.type = driver.CUmemLocationType(rules.CU_MEM_LOCATION_TYPE_DEVICE)
    desc.location.id = device_ordinal
    desc.flags = driver.CUmemAccess_flags(rules.access_flags(access))
    return desc


