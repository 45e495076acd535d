"""``kvstate policy explain`` prints the decision and its terms; the pure modules stay pure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstate.commands.cli import main
from kvstate.reuse.profile import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_policy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command reads KVSTATE_POLICY_* variables; these tests set their own."""
    for name in list(os.environ):
        if name.startswith("KVSTATE_POLICY_"):
            monkeypatch.delenv(name)


def test_explain_prints_decision_terms_and_gates(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTATE_POLICY_ENABLE_DECODE_TO_PREFILL_REUSE", raising=False)
    code = main(["policy", "explain", "--target-blocks", "8", "--candidate", "d0:host:200",
                 "--candidate", "d1:device:300", "--enable-decode-to-prefill-reuse", "true"])
    out = capsys.readouterr().out
    assert code == 0
    assert "decision: reuse (chosen)" in out
    assert "tokens avoided: 3072" in out and "transfer: 25.920 ms" in out and "lookup: 2.000 ms" in out
    assert "gate minimum blocks: 192 >= 4: pass" in out and "gate minimum saving: 21.232 >= 10.000 ms: pass" in out
    assert "skipped: d1 (device, 300 blocks): gpu_reuse_disabled" in out


def test_explain_json_and_default_off(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTATE_POLICY_ENABLE_DECODE_TO_PREFILL_REUSE", raising=False)
    assert main(["policy", "explain", "--target-blocks", "0", "--candidate", "d0:host:500", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"] is False and doc["reason"] == "reuse_disabled"
    monkeypatch.setenv("KVSTATE_POLICY_ENABLE_DECODE_TO_PREFILL_REUSE", "1")
    assert main(["policy", "explain", "--target-blocks", "0", "--candidate", "d0:host:500", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"] is True and doc["terms"]["saved_blocks"] == 500


def test_explain_with_an_admitted_gpu_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    caps = {
        "device_uuids": ["11" * 16], "handle_kinds": ["posix_fd"], "fabric_trial": "not_run",
        "transports": [{"name": "cuda", "handle_kinds": ["posix_fd"], "memory_kinds": ["device"],
                        "scopes": ["same_node"]}],
        "geometry_fingerprint": "ab" * 16, "protocol_version": PROTOCOL_VERSION,
    }
    path = tmp_path / "caps.json"
    path.write_text(json.dumps(caps))
    args = ["policy", "explain", "--target-blocks", "8", "--candidate", "d1:device:300",
            "--enable-decode-to-prefill-reuse", "true", "--enable-decode-to-prefill-gpu-reuse", "true"]
    assert main(args) == 0
    assert "gpu_profile_not_admitted" in capsys.readouterr().out
    assert main(args + ["--profile", "gpu-single-node", "--capabilities", str(path)]) == 0
    assert "source: d1 (device, 300 blocks)" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--enable-decode-to-prefill-reuse", "yes"], "must be true, false, 1 or 0"),
    (["--minimum-transfer-prefix-blocks", "-3"], "non-negative integer"),
    (["--candidate", "d0:disk:5"], "memory must be host or device"),
    (["--profile", "gpu-everywhere", "--capabilities", "/nonexistent"], "unknown deployment profile"),
    (["--profile", "gpu-single-node"], "--profile and --capabilities go together"),
])
def test_explain_bad_input_is_a_clear_error(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "explain", "--target-blocks", "1", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.multiproc
def test_pure_modules_import_no_native_or_optional_code() -> None:
    code = ("import sys, kvstate.reuse.policy, kvstate.reuse.inventory, kvstate.reuse.profile, kvstate.reuse.handoff, "
            "kvstate.commands.policy\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "{'cffi', '_cffi_backend', 'cuda', 'nixl', 'numpy', 'crosshair', 'hypothesis'}]\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_documented_example_is_what_the_command_prints(capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTATE_POLICY_ENABLE_DECODE_TO_PREFILL_REUSE", raising=False)
    assert main(["policy", "explain", "--target-blocks", "8", "--candidate", "d0:host:200",
                 "--enable-decode-to-prefill-reuse", "true"]) == 0
    page = (ROOT / "docs" / "policy.md").read_text(encoding="utf-8")
    assert capsys.readouterr().out in page, "docs/policy.md's explain example is stale"
