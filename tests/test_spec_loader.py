"""The loader accepts the real tables and refuses malformed ones, naming file and entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.errors import raises

from kvstate.core.errors import ConfigInvalid
from kvstate.core.reasons import ConfigReason
from kvstate.core.spec import load_spec, parse_machine

MINIMAL = """
[machine]
name = "m"
title = "M"
initial = "a"
terminal = ["b"]
doc = "d"

[states]
a = "A"
b = "B"

[events]
go = { doc = "go" }

[guards]
ok = "ok"

[effects]
act = "act"

[[transitions]]
trigger = "go"
source = "a"
dest = "b"
guards = ["ok"]
effects = ["act"]
"""


def test_real_tables_load() -> None:
    spec = load_spec()
    assert set(spec.machines) == {"bank", "group", "part", "op", "coordinator", "rank"}
    assert "INV-GROUP-COMPLETE" in spec.invariants


def test_minimal_table_parses() -> None:
    m = parse_machine(MINIMAL, "mini.toml")
    assert m.state_names == ("a", "b") and m.terminal == frozenset({"b"})


@pytest.mark.parametrize(("old", "new", "entry", "problem"), [
    ('dest = "b"', 'dest = "b"\ncolour = "red"', "transitions[0]", "unknown key"),
    ('dest = "b"', 'dest = "nowhere"', "transitions[0] (go)", "undeclared dest state 'nowhere'"),
    ('trigger = "go"', 'trigger = "stop"', "transitions[0] (stop)", "undeclared trigger 'stop'"),
    ('guards = ["ok"]', 'guards = ["ok", "maybe"]', "transitions[0] (go)", "undeclared guard 'maybe'"),
    ('effects = ["act"]', 'effects = ["jump"]', "transitions[0] (go)", "undeclared effect 'jump'"),
    ('initial = "a"', 'initial = "z"', "machine.initial", "undeclared state 'z'"),
    ('ok = "ok"', 'ok = "ok"\nunused = "u"', "guards.unused", "used by no transition"),
    ('source = "a"', 'source = "b"', "transitions[0] (go)", "terminal state 'b' cannot be a source"),
])
def test_malformed_tables_name_file_and_entry(old: str, new: str, entry: str, problem: str) -> None:
    with raises(ConfigInvalid, ConfigReason.SPEC) as info:
        parse_machine(MINIMAL.replace(old, new, 1), "mini.toml")
    assert info.value.source == "mini.toml"
    assert info.value.entry == entry
    assert problem in info.value.problem


def test_shadowed_row_is_refused() -> None:
    text = MINIMAL.replace('guards = ["ok"]\n', "") + '\n[[transitions]]\ntrigger = "go"\nsource = "a"\ndest = "a"\n'
    with raises(ConfigInvalid, ConfigReason.SPEC, match="unreachable"):
        parse_machine(text, "mini.toml")


def test_external_event_marker_is_a_reason() -> None:
    m = parse_machine(MINIMAL.replace('go = { doc = "go" }', 'go = { doc = "go", external = "the engine fires it" }'),
                      "mini.toml")
    assert m.events[0].external == "the engine fires it"
    assert parse_machine(MINIMAL, "mini.toml").events[0].external is None
    for bad in ("true", '""', '["x"]'):
        with raises(ConfigInvalid, ConfigReason.SPEC) as info:
            parse_machine(MINIMAL.replace('go = { doc = "go" }', f'go = {{ doc = "go", external = {bad} }}'),
                          "mini.toml")
        assert info.value.entry == "events.go.external"


def test_a_variant_directory_that_cannot_be_read_is_a_spec_error(tmp_path: Path) -> None:
    """`kvstate check --spec DIR` loads a directory the user names: a missing directory, a
    file, a missing table or one that is not UTF-8 is a ConfigInvalid naming the file (it
    was an OSError, a traceback out of the CLI)."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "bank.toml").write_bytes(b"\xff\xfe")
    for directory, why in [(tmp_path / "missing", "No such file"), (tmp_path / "file", "Not a directory"),
                           (tmp_path / "binary", "utf-8")]:
        with raises(ConfigInvalid, ConfigReason.SPEC, match=why) as info:
            load_spec(directory)
        assert info.value.source == str(directory / "bank.toml")
