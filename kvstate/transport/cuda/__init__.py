"""The CUDA backend: VMM (POSIX fd or FABRIC) and legacy IPC on ``cuda.bindings``.

Importing this package loads neither cuda-python nor the driver; constructing a
:class:`CudaTransport` does (``BackendUnavailable`` where either is missing).
"""

from kvstate.transport.cuda.driver import load_driver, visible_devices
from kvstate.transport.cuda.transport import CudaTransport

__all__ = ["CudaTransport", "load_driver", "visible_devices"]
