"""Optional backends a test needs: present, or a loud skip; a failure where the run
requires them (``make test`` installs NIXL and sets ``KVSTATE_REQUIRE_NIXL=1``)."""

from __future__ import annotations

import os

import pytest

from kvstate.core.errors import BackendUnavailable


def need_nixl() -> None:
    """NIXL loads here, or the calling test skips (fails under KVSTATE_REQUIRE_NIXL=1)."""
    from kvstate.transport.nixl import load_nixl

    try:
        load_nixl()
    except BackendUnavailable as exc:
        if os.environ.get("KVSTATE_REQUIRE_NIXL") == "1":
            pytest.fail(f"KVSTATE_REQUIRE_NIXL=1 but {exc}")
        pytest.skip(f"NIXL TESTS SKIPPED: {exc}")
