"""The public errors are a short catalogue: a class per thing the caller does, each with
a reason enum, documented in docs/api.md, and nothing else derives from KvStateError."""

from __future__ import annotations

import ast
import enum
import inspect
import re
from pathlib import Path

import kvstate
from kvstate.core import errors, reasons

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = {name for name, module in kvstate._HOME.items() if module == "kvstate.core.errors"}
ENUMS = {name: obj for name, obj in vars(reasons).items()
         if inspect.isclass(obj) and issubclass(obj, enum.Enum) and obj.__module__ == reasons.__name__
         and not name.startswith("_")}


def _sources() -> list[Path]:
    return sorted(p for p in (ROOT / "kvstate").rglob("*.py"))


def test_every_public_class_has_a_reason_type_and_says_what_to_do() -> None:
    assert len(PUBLIC) <= 16, sorted(PUBLIC)
    assert {cls.__name__ for cls in errors.REASONS} == PUBLIC - {"KvStateError"}
    for cls, reason_type in errors.REASONS.items():
        assert issubclass(cls, errors.KvStateError)
        assert reason_type.__name__ in ENUMS and ENUMS[reason_type.__name__] is reason_type, cls
        doc = inspect.getdoc(cls)
        assert doc and doc.split(":")[0].strip(), f"{cls.__name__}: no docstring saying what the caller does"
        assert cls.__annotations__.get("reason") == reason_type.__name__, f"{cls.__name__}.reason is not typed"


def test_no_other_class_derives_from_an_error() -> None:
    """No hidden leftovers: a KvStateError subclass outside kvstate/core/errors.py, or a
    subclass of a public class anywhere, would be an error no table documents."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases}
                if bases & PUBLIC and not (path.name == "errors.py" and node.name in PUBLIC):
                    found.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert found == []

    def tree(cls: type) -> set[type]:
        return {cls} | {d for sub in cls.__subclasses__() for d in tree(sub)}
    kvstate_classes = {c for c in tree(errors.KvStateError) if c.__module__.startswith("kvstate")}
    assert {c.__name__ for c in kvstate_classes} == PUBLIC


def test_every_reason_is_raised_somewhere_or_reserved() -> None:
    """A member no code raises (by name, or by its value where it is built from one)
    says so in its comment; a value is snake_case and its enum's own."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in _sources() if p.name != "reasons.py")
    # the declared descriptor rules give their reasons by value (reason = "handle_size")
    text += (ROOT / "spec/rules.toml").read_text(encoding="utf-8")
    source = (ROOT / "kvstate/core/reasons.py").read_text(encoding="utf-8")
    unused = []
    for name, enum_type in ENUMS.items():
        values = [m.value for m in enum_type]
        assert len(set(values)) == len(values), name
        for member in enum_type:
            assert re.fullmatch(r"[a-z][a-z0-9_]*", member.value), f"{name}.{member.name}"
            if f"{name}.{member.name}" in text or f'"{member.value}"' in text:
                continue
            line = next(ln for ln in source.splitlines() if re.match(rf"\s+{member.name} = ", ln))
            if "reserved" not in line:
                unused.append(f"{name}.{member.name}")
    assert unused == []


def test_docs_table_every_class_and_reason() -> None:
    api = (ROOT / "docs/api.md").read_text(encoding="utf-8")
    section = api[api.index("## Errors: what to do about each"):]
    for cls, reason_type in errors.REASONS.items():
        assert f"| `{cls.__name__}` |" in section, cls.__name__
        table = section[section.index(f"### `{reason_type.__name__}`"):]
        table = table[:table.find("\n### ", 1)] if "\n### " in table[1:] else table
        for member in reason_type:
            assert f"| `{member.value}` |" in table, f"{reason_type.__name__}.{member.name} is not in docs/api.md"


def test_an_error_keeps_its_reason_detail_and_message() -> None:
    exc = errors.ImportFailed.lease_refused("stale_inventory", "3 blocks gone")
    assert (exc.reason, exc.detail, exc.code) == (reasons.ImportReason.STALE, "3 blocks gone", "stale_inventory")
    assert str(exc) == "lease refused (stale_inventory): 3 blocks gone"
    wrapped = errors.ImportFailed.wrap(1, exc)  # a refusal keeps its whole text: the code with it
    assert (wrapped.reason, wrapped.detail, wrapped.cause, wrapped.code) == (reasons.ImportReason.STALE, str(exc), exc,
                                                                            "stale_inventory")
    assert str(wrapped) == "import of rank 1 failed (stale): lease refused (stale_inventory): 3 blocks gone"
    again = errors.ImportFailed.wrap(0, wrapped)  # a rank's own failure lends its detail, not its text
    assert again.detail == wrapped.detail and "import of rank 1" not in str(again)
    closed = errors.ChannelError(reasons.ChannelReason.PEER_DIED, "gone")
    assert closed.closed and not errors.ChannelError(reasons.ChannelReason.TIMEOUT, "silent").closed
    assert errors.GroupFailed("part_failed", 2, "x").reason is reasons.GroupEvent.PART_FAILED


def test_a_reason_lookup_of_an_unknown_value_is_typed() -> None:
    """The reason enums are public names, so a lookup by a value they lack is a typed error
    (still a ValueError, as any Enum's)."""
    for enum_type in ENUMS.values():
        try:
            enum_type("no such reason")
        except errors.ArgumentInvalid as exc:
            assert exc.reason is reasons.ArgumentReason.RANGE and exc.argument == enum_type.__name__
            assert isinstance(exc, ValueError)
        else:
            raise AssertionError(f"{enum_type.__name__} took an unknown value")
    assert reasons.ImportReason("stale") is reasons.ImportReason.STALE
