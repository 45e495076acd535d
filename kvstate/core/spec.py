"""Strict loader of the transition tables in ``spec/``.

The tables are data, reviewed by humans; everything else is generated from or checked
against them. This loader is deliberately unforgiving: an unknown key, an undeclared
state, trigger, guard or effect, or a row that can never fire is a :class:`ConfigInvalid` (SPEC)
naming the file and the entry. What it returns is frozen: nothing downstream can edit
the specification by accident.

Installed wheels carry the tables as the package ``kvstate.tables`` (mapped from the
top-level ``spec/`` directory by ``pyproject.toml``), so the loader reads them with
:mod:`importlib.resources` rather than from a path next to the source tree.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs

from kvstate.core.errors import ConfigInvalid

MACHINE_NAMES = ("bank", "group", "part", "op", "coordinator", "rank")


def _frozen_map(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


@attrs.frozen
class StateSpec:
    name: str
    doc: str
    terminal: bool


@attrs.frozen
class EventSpec:
    name: str
    doc: str
    fault: bool
    #: Why no code in kvstate fires this event (the caller or the world does), or None.
    external: str | None = None


@attrs.frozen
class TransitionSpec:
    trigger: str
    source: str
    dest: str
    guards: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    effects: tuple[str, ...] = ()

    @property
    def guarded(self) -> bool:
        return bool(self.guards or self.unless)


@attrs.frozen
class MachineSpec:
    name: str
    title: str
    doc: str
    initial: str
    states: tuple[StateSpec, ...]
    events: tuple[EventSpec, ...]
    guards: Mapping[str, str] = attrs.field(converter=_frozen_map)
    effects: Mapping[str, str] = attrs.field(converter=_frozen_map)
    transitions: tuple[TransitionSpec, ...]
    source: str

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def event_names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.events)

    @property
    def terminal(self) -> frozenset[str]:
        return frozenset(s.name for s in self.states if s.terminal)

    def rows(self, trigger: str, source: str) -> tuple[TransitionSpec, ...]:
        """The rows that may fire ``trigger`` in ``source``, in the order they are tried."""
        return tuple(t for t in self.transitions if t.trigger == trigger and t.source == source)

    def declared(self, trigger: str, source: str) -> bool:
        return any(t.trigger == trigger and t.source == source for t in self.transitions)


@attrs.frozen
class InvariantSpec:
    id: str
    statement: str
    machines: tuple[str, ...]


@attrs.frozen
class Spec:
    machines: Mapping[str, MachineSpec] = attrs.field(converter=_frozen_map)
    invariants: Mapping[str, InvariantSpec] = attrs.field(converter=_frozen_map)

    def __getitem__(self, name: str) -> MachineSpec:
        return self.machines[name]


# -- parsing helpers -----------------------------------------------------------------


def _keys(source: str, entry: str, table: Mapping[str, Any], required: set[str], optional: set[str]) -> None:
    unknown = set(table) - required - optional
    if unknown:
        raise ConfigInvalid.spec(source, entry, f"unknown key(s) {sorted(unknown)}")
    missing = required - set(table)
    if missing:
        raise ConfigInvalid.spec(source, entry, f"missing key(s) {sorted(missing)}")


def _text(source: str, entry: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigInvalid.spec(source, entry, "expected a non-empty string")
    return value.strip()


def _names(source: str, entry: str, value: Any, declared: Iterable[str], kind: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigInvalid.spec(source, entry, f"{kind} must be a list of names")
    known = set(declared)
    for name in value:
        if name not in known:
            raise ConfigInvalid.spec(source, entry, f"undeclared {kind[:-1] if kind.endswith('s') else kind} {name!r}")
    if len(set(value)) != len(value):
        raise ConfigInvalid.spec(source, entry, f"repeated name in {kind}")
    return tuple(value)


def _name_table(source: str, section: str, raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise ConfigInvalid.spec(source, f"[{section}]", "expected a table of name = description")
    return {name: _text(source, f"{section}.{name}", doc) for name, doc in raw.items()}


def parse_machine(text: str, source: str) -> MachineSpec:
    """Parse one machine table. ``source`` names the file in every error."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigInvalid.spec(source, "toml", str(exc)) from None
    _keys(source, "top level", raw, {"machine", "states", "events", "transitions"}, {"guards", "effects"})

    head = raw["machine"]
    if not isinstance(head, dict):
        raise ConfigInvalid.spec(source, "[machine]", "expected a table")
    _keys(source, "[machine]", head, {"name", "title", "initial", "terminal", "doc"}, set())
    name = _text(source, "machine.name", head["name"])

    state_docs = _name_table(source, "states", raw["states"])
    terminal = _names(source, "machine.terminal", head["terminal"], state_docs, "states")
    initial = _text(source, "machine.initial", head["initial"])
    if initial not in state_docs:
        raise ConfigInvalid.spec(source, "machine.initial", f"undeclared state {initial!r}")
    states = tuple(StateSpec(n, d, n in terminal) for n, d in state_docs.items())

    if not isinstance(raw["events"], dict):
        raise ConfigInvalid.spec(source, "[events]", "expected a table")
    events = []
    for ev, body in raw["events"].items():
        entry = f"events.{ev}"
        if not isinstance(body, dict):
            raise ConfigInvalid.spec(source, entry, "expected { doc = ..., fault = ..., external = ... }")
        _keys(source, entry, body, {"doc"}, {"fault", "external"})
        fault = body.get("fault", False)
        if not isinstance(fault, bool):
            raise ConfigInvalid.spec(source, entry, "fault must be true or false")
        external = _text(source, f"{entry}.external", body["external"]) if "external" in body else None
        events.append(EventSpec(ev, _text(source, entry, body["doc"]), fault, external))

    guards = _name_table(source, "guards", raw.get("guards", {}))
    effects = _name_table(source, "effects", raw.get("effects", {}))

    rows = raw["transitions"]
    if not isinstance(rows, list) or not rows:
        raise ConfigInvalid.spec(source, "[[transitions]]", "expected at least one transition")
    transitions = []
    event_names = {e.name for e in events}
    for i, row in enumerate(rows):
        entry = f"transitions[{i}]"
        if not isinstance(row, dict):
            raise ConfigInvalid.spec(source, entry, "expected a table")
        _keys(source, entry, row, {"trigger", "source", "dest"}, {"guards", "unless", "effects"})
        trigger = _text(source, entry, row["trigger"])
        entry = f"transitions[{i}] ({trigger})"
        if trigger not in event_names:
            raise ConfigInvalid.spec(source, entry, f"undeclared trigger {trigger!r}")
        for key in ("source", "dest"):
            if row[key] not in state_docs:
                raise ConfigInvalid.spec(source, entry, f"undeclared {key} state {row[key]!r}")
        if row["source"] in terminal:
            raise ConfigInvalid.spec(source, entry, f"terminal state {row['source']!r} cannot be a source")
        transitions.append(TransitionSpec(
            trigger=trigger,
            source=row["source"],
            dest=row["dest"],
            guards=_names(source, entry, row.get("guards", []), guards, "guards"),
            unless=_names(source, entry, row.get("unless", []), guards, "guards"),
            effects=_names(source, entry, row.get("effects", []), effects, "effects"),
        ))

    _check_shadowing(source, transitions)
    _check_usage(source, events, guards, effects, transitions)
    return MachineSpec(
        name=name, title=_text(source, "machine.title", head["title"]),
        doc=_text(source, "machine.doc", head["doc"]), initial=initial,
        states=states, events=tuple(events), guards=guards, effects=effects,
        transitions=tuple(transitions), source=source,
    )


def _check_shadowing(source: str, transitions: list[TransitionSpec]) -> None:
    """A row after an unguarded row with the same trigger and source could never fire."""
    open_rows: set[tuple[str, str]] = set()
    for i, t in enumerate(transitions):
        key = (t.trigger, t.source)
        if key in open_rows:
            raise ConfigInvalid.spec(source, f"transitions[{i}] ({t.trigger})",
                                     f"unreachable: an earlier unguarded row already fires {t.trigger!r} in {t.source!r}")
        if not t.guarded:
            open_rows.add(key)


def _check_usage(source: str, events: list[EventSpec], guards: Mapping[str, str],
                 effects: Mapping[str, str], transitions: list[TransitionSpec]) -> None:
    """Every declared event, guard and effect is used by some row: dead declarations rot."""
    used_events = {t.trigger for t in transitions}
    used_guards = {g for t in transitions for g in (*t.guards, *t.unless)}
    used_effects = {e for t in transitions for e in t.effects}
    for kind, declared, used in (("events", [e.name for e in events], used_events),
                                 ("guards", list(guards), used_guards),
                                 ("effects", list(effects), used_effects)):
        for name in declared:
            if name not in used:
                raise ConfigInvalid.spec(source, f"{kind}.{name}", "declared but used by no transition")


def parse_invariants(text: str, source: str, machines: Iterable[str]) -> dict[str, InvariantSpec]:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigInvalid.spec(source, "toml", str(exc)) from None
    _keys(source, "top level", raw, {"invariants"}, set())
    known = set(machines)
    out: dict[str, InvariantSpec] = {}
    for i, row in enumerate(raw["invariants"]):
        entry = f"invariants[{i}]"
        if not isinstance(row, dict):
            raise ConfigInvalid.spec(source, entry, "expected a table")
        _keys(source, entry, row, {"id", "statement", "machines"}, set())
        inv_id = _text(source, entry, row["id"])
        if not inv_id.startswith("INV-") or inv_id != inv_id.upper():
            raise ConfigInvalid.spec(source, entry, f"id {inv_id!r} must be 'INV-' then upper-case words")
        if inv_id in out:
            raise ConfigInvalid.spec(source, entry, f"duplicate id {inv_id!r}")
        out[inv_id] = InvariantSpec(
            id=inv_id,
            statement=_text(source, f"{inv_id}.statement", row["statement"]),
            machines=_names(source, inv_id, row["machines"], known, "machines"),
        )
    return out


# -- entry points --------------------------------------------------------------------


def load_spec(directory: Path | None = None) -> Spec:
    """Load every table. ``directory`` overrides the installed tables (used for variants)."""
    if directory is None:
        return _installed_spec()
    return _load_from(directory)


@cache
def _installed_spec() -> Spec:
    root = resources.files("kvstate.tables")
    machines = {}
    for name in MACHINE_NAMES:
        text = (root / f"{name}.toml").read_text(encoding="utf-8")
        machines[name] = parse_machine(text, f"spec/{name}.toml")
    inv = parse_invariants((root / "invariants.toml").read_text(encoding="utf-8"),
                           "spec/invariants.toml", machines)
    return _checked(machines, inv)


def _read(path: Path) -> str:
    # a variant directory comes from the user (``kvstate check --spec``): a missing or
    # unreadable table is a refused spec, not an OSError out of the public API
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigInvalid.spec(str(path), "file", f"cannot read the table: {why}") from None


def _load_from(directory: Path) -> Spec:
    machines = {}
    for name in MACHINE_NAMES:
        path = directory / f"{name}.toml"
        machines[name] = parse_machine(_read(path), str(path))
    path = directory / "invariants.toml"
    inv = parse_invariants(_read(path), str(path), machines)
    return _checked(machines, inv)


def _checked(machines: dict[str, MachineSpec], inv: dict[str, InvariantSpec]) -> Spec:
    for name, m in machines.items():
        if m.name != name:
            raise ConfigInvalid.spec(m.source, "machine.name", f"expected {name!r}, found {m.name!r}")
    return Spec(machines=machines, invariants=inv)


def load_machine(name: str) -> MachineSpec:
    return load_spec().machines[name]
