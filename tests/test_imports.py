"""Layer 1: importing kvstate loads no native code and no optional dependency, and only a
missing optional dependency itself disables a backend."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstate.core.errors import BackendUnavailable
from kvstate.core.optional import require

PURE = ["kvstate", "kvstate.core.spec", "kvstate.core.machine", "kvstate.core.validate", "kvstate.core.descriptor",
        "kvstate.transport", "kvstate.commands.cli"]


def test_import_kvstate_loads_no_native_or_cuda_module() -> None:
    code = textwrap.dedent(f"""
        import importlib, json, sys
        for m in {PURE!r}:
            importlib.import_module(m)
        print(json.dumps(sorted(sys.modules)))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded = set(json.loads(out))
    forbidden = {m for m in loaded if m == "kvstate._native" or m.split(".")[0] in ("cuda", "nixl", "nixl_cu12",
                                                                                     "_cffi_backend", "numpy", "torch")}
    assert forbidden == set()


def test_missing_dependency_disables_only_its_backend() -> None:
    with pytest.raises(BackendUnavailable) as info:
        require("kvstate_no_such_dependency", "imaginary", hint="pip install it")
    assert info.value.backend == "imaginary" and "pip install it" in str(info.value)


def test_unrelated_import_error_inside_a_backend_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dependency is present but itself fails to import something else: that is a bug,
    not a missing backend, and it must propagate."""
    pkg = tmp_path / "fakedep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import kvstate_helper_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        require("fakedep", "fake")
    assert info.value.name == "kvstate_helper_that_is_not_there"
    (pkg / "__init__.py").write_text("raise ImportError('broken build')\n")
    sys.modules.pop("fakedep", None)
    with pytest.raises(ImportError, match="broken build"):
        require("fakedep", "fake")
