"""The CUDA driver, loaded by the native layer at run time, and device discovery.

The C engine (``ffi/kvs_cuda_*.c``) opens the driver library itself (``dlopen``, never a
link-time dependency) and makes every driver call kvstate needs, discovery included: a
device's UUID, name and attributes are a handful of calls on the same resolved table, so
cuda-python is not needed at all. One loader per process also means one driver: a test
that points ``KVSTATE_LIBCUDA`` at the CPU shim (``tests/cudashim``) runs every CUDA code
path, discovery too, against it.

Nothing here runs at import. :func:`load_driver` loads the native module, then the driver
library named by ``KVSTATE_LIBCUDA`` (default ``libcuda.so.1``), and raises
:class:`BackendUnavailable` when either is missing or the driver sees no device.
"""

from __future__ import annotations

import os

import attrs

from kvstate.core.errors import BackendUnavailable
from kvstate.transport import native as native_layer
from kvstate.transport.cuda import rules
from kvstate.transport.native import Native

#: The environment variable naming the driver library (a path, or a name dlopen searches).
LIBCUDA_ENV = "KVSTATE_LIBCUDA"
DEFAULT_LIBRARY = "libcuda.so.1"


def library() -> str:
    """The driver library this process loads: ``$KVSTATE_LIBCUDA`` or ``libcuda.so.1``."""
    return os.environ.get(LIBCUDA_ENV) or DEFAULT_LIBRARY


@attrs.frozen
class DriverInfo:
    version: int      # cuDriverGetVersion: 12080 is CUDA 12.8
    devices: int
    batch: bool       # cuMemcpyBatchAsync is used for gathers
    library: str


@attrs.frozen
class DeviceInfo:
    uuid: bytes
    name: str
    vmm: bool
    posix_fd: bool
    fabric: bool      # the device reports FABRIC support; only a trial decides (rules.fabric_decision)
    max_pitch: int


def load_driver(nat: Native | None = None) -> Native:
    """The native layer (``nat``, default the process's) with the driver loaded and
    initialised, or BackendUnavailable: no native module, no driver library (or one
    without a call kvstate needs), or no device."""
    if nat is None:
        try:
            nat = native_layer.default()
        except BackendUnavailable as exc:
            raise BackendUnavailable.missing("cuda", exc.detail) from None
    path = library()
    lib, ffi = nat.lib, nat.ffi
    rc = lib.kvs_cuda_load(ffi.new("char[]", path.encode()))
    if rc == lib.KVS_E_CUDA and lib.kvs_cuda_last_result() == rules.CUDA_ERROR_NO_DEVICE:
        raise BackendUnavailable.missing("cuda", "the driver sees no CUDA device")
    if rc == lib.KVS_E_BUSY:
        raise BackendUnavailable.missing("cuda", f"this process already loaded another CUDA driver library, not {path}")
    if rc == lib.KVS_E_NODRIVER:
        raise BackendUnavailable.missing("cuda",
                                         f"no CUDA driver library: {ffi.string(lib.kvs_cuda_load_error()).decode()}")
    if rc:
        raise nat.error(rc, "kvs_cuda_load", path)
    return nat


def driver_info(nat: Native | None = None) -> DriverInfo:
    nat = load_driver(nat)
    out = nat.ffi.new("kvs_cuda_driver_info *")
    rc = nat.lib.kvs_cuda_driver_info_get(out)
    if rc:
        raise nat.error(rc, "kvs_cuda_driver_info_get", "the driver")
    return DriverInfo(out.version, out.devices, bool(out.batch), library())


def device_info(nat: Native, ordinal: int) -> DeviceInfo:
    out = nat.ffi.new("kvs_cuda_device_info *")
    rc = nat.lib.kvs_cuda_device_info_get(ordinal, out)
    if rc:
        raise nat.error(rc, "kvs_cuda_device_info_get", f"device ordinal {ordinal}")
    ffi = nat.ffi
    return DeviceInfo(bytes(ffi.buffer(out.uuid, 16)), ffi.string(out.name).decode(errors="replace"),
                      bool(out.vmm), bool(out.posix_fd), bool(out.fabric), int(out.max_pitch))


def devices() -> list[DeviceInfo]:
    """Every device the driver sees, in the driver's order (name them by UUID, not position)."""
    nat = load_driver()
    return [device_info(nat, i) for i in range(driver_info().devices)]


def visible_devices() -> list[bytes]:
    """The UUIDs of the devices this process can see."""
    return [d.uuid for d in devices()]


def find_device(nat: Native, uuid: bytes) -> DeviceInfo | None:
    for i in range(driver_info(nat).devices):
        info = device_info(nat, i)
        if info.uuid == uuid:
            return info
    return None
