"""The GPU suite runs only where a CUDA GPU, its driver and cuda-python are present.

Elsewhere every test here is skipped with a reason starting ``NO GPU`` (``-ra`` lists it
in the summary): skipped, never passed.
"""

from __future__ import annotations

import pytest

from kvstate.core.errors import BackendUnavailable


@pytest.fixture(scope="session")
def device() -> bytes:
    from kvstate.transport.cuda import visible_devices

    try:
        devices = visible_devices()
    except BackendUnavailable as exc:
        pytest.skip(f"NO GPU: the GPU suite did not run: {exc.detail}")
    if not devices:
        pytest.skip("NO GPU: the GPU suite did not run: the driver sees no device")
    return devices[0]
