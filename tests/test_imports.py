"""Layer 1: importing kvstate loads no native code and no optional dependency, and only a
missing optional dependency itself disables a backend. The public API at the top of the
package (docs/api.md) is complete, lazy and visible to type checkers."""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvstate
from kvstate.core import errors
from kvstate.core.errors import BackendUnavailable
from kvstate.core.optional import require

PURE = ["kvstate", "kvstate.core.spec", "kvstate.core.machine", "kvstate.core.validate", "kvstate.core.descriptor",
        "kvstate.transport", "kvstate.commands.cli"]


@pytest.mark.multiproc
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


# -- the public API at the top -----------------------------------------------------------

FORBIDDEN_ROOTS = ("cuda", "nixl", "nixl_cu12", "nixl_cu13", "_cffi_backend", "cffi", "numpy", "torch")


def _modules_after(code: str) -> set[str]:
    probe = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


@pytest.mark.multiproc
def test_import_kvstate_loads_nothing_but_the_package() -> None:
    """``import kvstate`` runs only kvstate/__init__.py: no submodule, no transitions, no attrs."""
    loaded = _modules_after("import kvstate")
    assert {m for m in loaded if m.startswith("kvstate.")} == set()
    assert {m for m in loaded if m.split(".")[0] in (*FORBIDDEN_ROOTS, "transitions", "attrs")} == set()


@pytest.mark.multiproc
def test_every_public_name_loads_without_native_code() -> None:
    """Touching every public name (Exporter, HostTransport, ...) imports their modules, and
    still no native module, cffi, numpy, CUDA or NIXL: those load on first use."""
    loaded = _modules_after("import kvstate\nfor name in kvstate.__all__: getattr(kvstate, name)\n"
                            "from kvstate import *")
    assert "kvstate.share.exporter" in loaded and "kvstate.transport.host" in loaded
    assert {m for m in loaded if m == "kvstate._native" or m.split(".")[0] in FORBIDDEN_ROOTS} == set()


def test_public_names_are_the_objects_of_their_home_modules() -> None:
    from kvstate import (Exporter, ExportConfig, Geometry, HostTransport, ImportConfig, Importer, KvStateError,
                         StateChange)

    assert Exporter.__module__ == "kvstate.share.exporter" and ExportConfig.__module__ == "kvstate.share.export_config"
    assert Importer.__module__ == "kvstate.share.importer" and ImportConfig.__module__ == "kvstate.share.import_config"
    assert HostTransport.__module__ == "kvstate.transport.host"
    assert (Geometry.__module__, StateChange.__module__) == ("kvstate.core.geometry", "kvstate.core.machine")
    assert KvStateError is errors.KvStateError
    for name, module in kvstate._HOME.items():
        assert getattr(kvstate, name) is getattr(importlib.import_module(module), name), name
    assert set(kvstate.__all__) <= set(dir(kvstate))
    with pytest.raises(AttributeError, match="no attribute 'Exportr'"):
        getattr(kvstate, "Exportr")


def test_every_error_class_is_public() -> None:
    """Every KvStateError subclass of kvstate.core.errors is importable from kvstate."""
    defined = {name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, errors.KvStateError) and obj.__module__ == errors.__name__}
    assert defined - set(kvstate.__all__) == set()
    assert {n for n, m in kvstate._HOME.items() if m == "kvstate.core.errors"} == defined


def test_every_reason_enum_is_public() -> None:
    """Every enum of kvstate.core.reasons (what an error's ``reason`` is) is importable from kvstate."""
    from kvstate.core import reasons
    defined = {name for name, obj in vars(reasons).items()
               if inspect.isclass(obj) and issubclass(obj, enum.Enum) and obj.__module__ == reasons.__name__
         and not name.startswith("_")}
    assert {n for n, m in kvstate._HOME.items() if m == "kvstate.core.reasons"} == defined


def test_type_checkers_see_exactly_the_lazy_names() -> None:
    """The TYPE_CHECKING block of kvstate/__init__.py imports each public name from its home
    module (as an explicit re-export), and nothing else: mypy and IDEs see the real types."""
    tree = ast.parse(Path(kvstate.__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    seen: dict[str, str] = {}
    for stmt in block.body:
        assert isinstance(stmt, ast.ImportFrom) and stmt.module is not None
        for alias in stmt.names:
            assert alias.asname == alias.name, f"{alias.name}: import it as itself, so mypy re-exports it"
            seen[alias.name] = stmt.module
    assert seen == kvstate._HOME
