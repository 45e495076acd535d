"""The CUDA backend: VMM (POSIX fd or FABRIC) and legacy IPC, on the C engine, which loads
the CUDA driver at run time (``KVSTATE_LIBCUDA``, default ``libcuda.so.1``).

Importing this package loads neither the native module nor the driver; constructing a
:class:`CudaTransport` does (``BackendUnavailable`` where either, or a device, is missing).
"""

from kvstate.transport.cuda.driver import devices, driver_info, load_driver, visible_devices
from kvstate.transport.cuda.transport import CudaTransport

__all__ = ["CudaTransport", "devices", "driver_info", "load_driver", "visible_devices"]
