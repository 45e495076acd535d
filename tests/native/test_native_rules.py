"""The import path's validation with the declared rules asked of C first
(:mod:`kvstate.transport.native_rules`): the same verdict as the Python reference on
every group, valid or not.

Groups of 4 and 8 real descriptors, each with 0 to 3 changes drawn from the classes the
rules differential draws per descriptor (rank, tp, size, granularity, generation, expiry,
handle, device, incarnation, host, geometry, format, deployment), on one descriptor or on
the expectation: :func:`native_rules.validate_group` must accept exactly the groups the
Python reference accepts, and refuse the others with the same problems (reason, rank and
words), whichever executor saw them first.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import attrs
import pytest

from kvstate.core import rules, validate
from kvstate.core.errors import GroupRejected
from kvstate.core.handles import HandleKind
from kvstate.transport import native_rules
from kvstate.transport.native import default
from support import descriptors as kit
from support.rules_cases import changed

pytestmark = pytest.mark.native

GROUPS = 1500


def _problems(descriptors: list[Any], e: Any, validate_group: Any) -> Any:
    try:
        return validate_group(descriptors, e).parts
    except GroupRejected as exc:
        return [(p.reason, p.rank, str(p)) for p in exc.problems]


def _group(rng: random.Random) -> tuple[list[Any], Any]:
    """A group of 4 or 8 real descriptors, one of them and the expectation changed as the
    rules differential changes them (``support.rules_cases.changed``)."""
    tp = rng.choice([4, 8])
    group = [kit.descriptor(rank=r, tp=tp) for r in range(tp)]
    e = kit.expectation(check_socket=False, handle_kinds=frozenset({HandleKind.MEMFD, HandleKind.NIXL}))
    rank = rng.randrange(tp)
    group[rank], e = changed(rng, group[rank], e)
    if rng.random() < 0.3:
        e = attrs.evolve(e, incarnations={r: rng.choice([kit.INCARNATION, kit.INCARNATION, b"J" * 16])
                                          for r in range(tp)})
    return group, e


def test_the_native_first_validation_and_the_reference_agree_on_every_group() -> None:
    assert native_rules._native_rules(rules.rules(), default()) is not None, "C was built from these rules"
    rng = random.Random(2812)
    accepted = refused = 0
    for _ in range(GROUPS):
        group, e = _group(rng)
        want = _problems(group, e, validate.validate_group)
        assert _problems(group, e, native_rules.validate_group) == want, (group, e)
        if isinstance(want, tuple):
            accepted += 1
            assert native_rules.rules_pass(group, e) is True
        else:
            refused += 1
    assert accepted >= GROUPS // 5 and refused >= GROUPS // 5, (accepted, refused)


def test_c_is_not_asked_when_it_was_built_from_other_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module whose digest is not the installed declaration's: the Python rules decide
    (``rules_pass`` cannot say), and a broken rule is still refused."""
    from kvstate.derive import rules_c

    group = [kit.descriptor(rank=r, tp=4) for r in range(4)]
    e = kit.expectation(check_socket=False)
    monkeypatch.setattr(native_rules, "_checked", None)
    monkeypatch.setattr(rules_c, "digest", lambda rs: -1)
    assert native_rules.rules_pass(group, e) is None
    group[2] = attrs.evolve(group[2], expires_at_ns=e.now_ns)
    with pytest.raises(GroupRejected) as info:
        native_rules.validate_group(group, e)
    assert [(p.reason.value, p.rank) for p in info.value.problems] == [("expired", 2)]


def test_a_value_c_cannot_hold_leaves_the_verdict_to_python() -> None:
    rs = rules.rules()
    packer = native_rules.Packer(default(), "struct kvs_vexpect", rs.expect)
    row = validate.expected_for(0, kit.expectation())
    with pytest.raises(struct.error):
        packer.pack([{**row, "now_ns": -1}])


@pytest.mark.parametrize("field", ["host_boot_id", "device_uuid"])
def test_an_id_c_would_pad_is_left_to_python(field: str) -> None:
    """struct pads a short id with zeros: C would find ``b"H" * 15`` equal to a
    descriptor's ``b"H" * 15 + b"\\0"``, which Python refuses. Such a value is not packed
    (``rules_pass`` cannot say), and the Python rules give the verdict."""
    group = [kit.descriptor(rank=r, tp=4) for r in range(4)]
    e = kit.expectation(check_socket=False)
    short = b"H" * 15
    if field == "host_boot_id":
        group = [attrs.evolve(d, host_boot_id=short + b"\0") for d in group]
        e = attrs.evolve(e, host_boot_id=short)
    else:
        group = [attrs.evolve(d, device_uuid=short + b"\0") for d in group]
        e = attrs.evolve(e, device_uuids=frozenset({short}))
    assert native_rules.rules_pass(group, e) is None
    want = _problems(group, e, validate.validate_group)
    assert not isinstance(want, tuple), "the Python rules refuse the group"
    assert _problems(group, e, native_rules.validate_group) == want
