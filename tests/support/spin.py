"""Spin availability for the model tests: skip loudly where it cannot run, never in CI."""

from __future__ import annotations

import os
import warnings

import pytest

from kvstate.core.errors import BackendUnavailable
from kvstate.core.reasons import BackendReason
from kvstate.harness.modelcheck import INSTALL_HINT, tools


def require_spin() -> None:
    try:
        tools()
    except BackendUnavailable as exc:
        if exc.reason is not BackendReason.SPIN:
            raise
        if os.environ.get("CI"):
            pytest.fail(f"CI is set, so the model tests may not skip: {exc}")
        message = f"MODEL CHECKING SKIPPED: Spin is not installed. {INSTALL_HINT}"
        warnings.warn(message, stacklevel=2)
        pytest.skip(message)
