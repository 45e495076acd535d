"""crosshair checks the PEP 316 contracts of the pure core, and is shown to catch a planted bug."""

from __future__ import annotations

from support.crosshair import crosshair


def test_validators_and_geometry_contracts_hold() -> None:
    """INV-GROUP-COMPLETE (group_complete), INV-REJECT-BEFORE-OPEN and INV-STALE-REJECTED
    (the rules never accept what they reject), checked symbolically."""
    result = crosshair(["kvstate/core/validate.py", "kvstate/core/geometry.py"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_self_test_crosshair_finds_empty_group_counted_complete() -> None:
    result = crosshair(["tests/planted/contracts_group.py"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "group_complete" in result.stdout and "false when calling" in result.stdout.lower()
