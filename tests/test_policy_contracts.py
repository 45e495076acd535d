"""crosshair checks the policy's PEP 316 contracts, and fails on a planted bug.

INV-POLICY-DISABLED, INV-POLICY-GPU-GATED, INV-POLICY-MINIMUMS (``kvstate.reuse.policy.gate``)
and INV-POLICY-MONOTONE (``kvstate.reuse.policy.estimated_saving_ms``).
"""

from __future__ import annotations

from support.crosshair import crosshair

TARGETS = ["kvstate.reuse.policy.estimated_saving_ms", "kvstate.reuse.policy.gate"]


def test_policy_contracts_hold() -> None:
    result = crosshair(TARGETS, per_condition_timeout=4.0, wall_timeout=120.0)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_crosshair_catches_planted_policy_bugs() -> None:
    """Self-test: broken copies with the same contracts must each get a counterexample."""
    result = crosshair(["planted.policy_bugs"], per_condition_timeout=10.0, wall_timeout=120.0)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "estimated_saving_ms(" in result.stdout  # INV-POLICY-MONOTONE broken
    assert "gate(" in result.stdout  # INV-POLICY-GPU-GATED broken


def test_contracts_are_on_the_functions_the_policy_uses() -> None:
    """The checked functions must be the ones choose_transfer_source calls, with contracts."""
    import inspect

    from kvstate.reuse import policy
    source = inspect.getsource(policy.choose_transfer_source) + inspect.getsource(policy.estimate_ttft_saving)
    assert "gate(" in source and "estimated_saving_ms(" in source
    for fn in (policy.gate, policy.estimated_saving_ms):
        assert fn.__doc__ is not None and "post:" in fn.__doc__
