"""Remembered verdicts (:mod:`kvstate.core.verdicts`): the same descriptors imported again
re-check only the clock rules and the socket path rule, and anything else that changed
sends the group back to the whole validation, which names every problem.

Each test first lets a group pass (remembered), then changes one thing an import could
meet next time, and checks the import-path validation (``native_rules.validate_group``,
which works with or without the native module) refuses it as the reference does.
"""

from __future__ import annotations

import time

import attrs
import pytest

from kvstate.core import rules, validate
from kvstate.core.errors import GroupRejected
from kvstate.core.reasons import RejectReason
from kvstate.core.verdicts import MOVING, Verdicts, clock_rules, still
from kvstate.transport import native_rules
from support.descriptors import expectation, group, socket_dir


@pytest.fixture
def sock() -> str:
    return socket_dir()[1]


def _reasons(parts: list, e: validate.Expectation) -> frozenset[RejectReason]:  # type: ignore[type-arg]
    with pytest.raises(GroupRejected) as info:
        native_rules.validate_group(parts, e)
    return info.value.reasons


def _problems(parts: list, e: validate.Expectation) -> list[tuple[RejectReason, int | None]]:  # type: ignore[type-arg]
    with pytest.raises(GroupRejected) as info:
        native_rules.validate_group(parts, e)
    return [(p.reason, p.rank) for p in info.value.problems]


def test_the_clock_rules_come_from_the_declaration() -> None:
    """Exactly the declared rules that read ``now_ns`` are re-checked: today freshness."""
    assert MOVING == {"now_ns"}
    assert clock_rules() == tuple(r.id for r in rules.rules().rules if ("e", "now_ns") in rules.reads(r))
    assert clock_rules() == ("freshness",)
    assert rules.reads(rules.rules().rule("size")) == {("d", "granularity"), ("d", "nbytes"), ("d", "size")}


def test_a_group_that_passed_passes_again_without_the_rules(sock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same objects, a later clock: the remembered verdict, the whole rules not run."""
    parts = group(4, sock)
    first = native_rules.validate_group(parts, expectation())
    calls = []
    monkeypatch.setattr(validate, "validate_group", lambda *a, **k: calls.append(a))
    later = expectation(now_ns=time.time_ns() + 10**9)
    assert native_rules.validate_group(parts, later) is first and calls == []


def test_an_expired_group_is_refused_after_it_passed(sock: str) -> None:
    parts = group(4, sock)
    native_rules.validate_group(parts, expectation())
    assert _reasons(parts, expectation(now_ns=parts[0].expires_at_ns)) == {RejectReason.EXPIRED}


def test_every_rank_s_expiry_is_checked_again(sock: str) -> None:
    """The last rank expires first: each part's clock rules run, not one part's."""
    now = time.time_ns()
    parts = [attrs.evolve(d, expires_at_ns=now + (60 - d.rank) * 10**9) for d in group(4, sock)]
    native_rules.validate_group(parts, expectation(now_ns=now))
    problems = _problems(parts, expectation(now_ns=parts[3].expires_at_ns))
    assert problems == [(RejectReason.EXPIRED, 3)]


def test_an_incarnations_mapping_updated_in_place_is_seen(sock: str) -> None:
    """A caller that keeps its known incarnations in one dict and learns a restart: the
    remembered key holds the mapping as it was, not the caller's dict."""
    parts = group(2, sock)
    known = {d.rank: d.incarnation for d in parts}
    native_rules.validate_group(parts, expectation(incarnations=known))
    known[1] = b"N" * 16  # rank 1's exporter restarted since
    assert _problems(parts, expectation(incarnations=known)) == [(RejectReason.INCARNATION, 1)]


@pytest.mark.parametrize("field", sorted(f.name for f in attrs.fields(validate.Expectation) if f.name not in MOVING))
def test_every_other_expectation_field_is_part_of_the_key(field: str, sock: str) -> None:
    """Another value of any field but the clock misses the remembered verdict."""
    parts = group(2, sock)
    e = expectation()
    v = Verdicts()
    v.remember(parts, e, validate.validate_group(parts, e))
    assert v.recheck(parts, e) is not None
    other = {"deployment": attrs.evolve(e.deployment, name="another"), "handle_kinds": frozenset(),
             "host_boot_id": b"x" * 16, "uid": e.uid + 1, "geometry_fingerprint": b"g" * 16,
             "block_format": b"f" * 16, "device_uuids": frozenset({b"u" * 16}), "incarnations": {0: b"i" * 16},
             "min_generation": 99, "max_tp": 1, "check_socket": not e.check_socket}[field]
    changed = attrs.evolve(e, **{field: other})
    assert still(changed) != still(e) and v.recheck(parts, changed) is None


def test_a_changed_expectation_refuses_a_group_that_passed(sock: str) -> None:
    """Fields no clock rule reads: the geometry the importer wants, its largest tp."""
    parts = group(4, sock)
    native_rules.validate_group(parts, expectation())
    assert _reasons(parts, expectation(geometry_fingerprint=b"g" * 16)) == {RejectReason.GEOMETRY}
    assert RejectReason.TP_SIZE in _reasons(parts, expectation(max_tp=2))
    assert _reasons(parts, expectation(min_generation=parts[0].generation + 1)) == {RejectReason.GENERATION}


def test_a_socket_directory_opened_to_others_refuses_a_group_that_passed(sock: str) -> None:
    """The filesystem rule reads the directory on every import."""
    import os

    parts = group(4, sock)
    native_rules.validate_group(parts, expectation())
    os.chmod(os.path.dirname(sock), 0o777)
    try:
        assert _reasons(parts, expectation()) == {RejectReason.SOCKET_DIR_MODE}
    finally:
        os.chmod(os.path.dirname(sock), 0o700)


def test_every_socket_path_of_a_group_is_checked_again() -> None:
    """Ranks behind two exporters' sockets: the second one's directory opened to others."""
    import os

    first, second = socket_dir()[1], socket_dir()[1]
    parts = group(2, first)
    parts[1] = attrs.evolve(parts[1], socket_path=second)
    native_rules.validate_group(parts, expectation())
    os.chmod(os.path.dirname(second), 0o777)
    try:
        assert _problems(parts, expectation()) == [(RejectReason.SOCKET_DIR_MODE, 1)]
    finally:
        os.chmod(os.path.dirname(second), 0o700)


def test_an_entry_holds_its_descriptors(sock: str) -> None:
    """No other object can take a remembered descriptor's id while its entry lives."""
    import gc
    import weakref

    parts = group(2, sock)
    v = Verdicts()
    e = expectation()
    v.remember(parts, e, validate.validate_group(parts, e))
    refs = [weakref.ref(d) for d in parts]
    del parts
    gc.collect()
    assert all(r() is not None for r in refs)


def test_equal_descriptors_that_are_other_objects_are_validated_whole(sock: str) -> None:
    parts = group(4, sock)
    e = expectation()
    v = Verdicts()
    v.remember(parts, e, validate.validate_group(parts, e))
    copies = [attrs.evolve(d) for d in parts]
    assert copies == parts and v.recheck(copies, e) is None
    assert v.recheck(list(reversed(parts)), e) is None  # another order is another key


def test_a_refusal_is_not_remembered(sock: str) -> None:
    """A group refused once is refused again, with every problem named each time."""
    parts = group(4, sock, generation=1)
    e = expectation(min_generation=2)
    for _ in range(2):
        assert _reasons(parts, e) == {RejectReason.GENERATION}
    assert native_rules._verdicts.recheck(parts, e) is None


def test_the_table_is_bounded_by_the_descriptors_it_holds() -> None:
    v = Verdicts(limit=4)
    e = expectation(check_socket=False)
    groups = [group(2, "/nonexistent/export.sock") for _ in range(3)]
    for parts in groups[:2]:
        v.remember(parts, e, validate.validate_group(parts, e))
        v.remember(parts, e, validate.validate_group(parts, e))  # again: held once
    assert v.recheck(groups[0], e) is not None and v.recheck(groups[1], e) is not None
    v.remember(groups[2], e, validate.validate_group(groups[2], e))  # a fifth and sixth: full
    assert v.recheck(groups[2], e) is not None and v.recheck(groups[0], e) is None
