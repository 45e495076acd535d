"""ffi/kvs_op_table.h is generated from spec/op.toml and drives the C engine (its freshness
is checked with every other generated file in tests/test_generate.py).

INV-EVENT-DECLARED: the C engine fires only the (state, event) pairs the table declares,
so changing the table changes what C accepts.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from support.errors import raises

from kvstate.derive import header as codegen

from kvstate.core import errors
from kvstate.core.reasons import ConfigReason, TransitionReason
from kvstate.core.errors import ConfigInvalid, TransitionError
from kvstate.core.capabilities import Access
from kvstate.transport.host import HostTransport
from kvstate.transport.native import Native
from kvstate.core.spec import load_machine
from native.helpers import build_variant_lib


def _cancel_only_when_running() -> str:
    """The op table with its cancel row moved from queued to running."""
    m = load_machine("op")
    rows = tuple(attrs.evolve(t, source="running") if t.trigger == "cancel" else t for t in m.transitions)
    return codegen.op_header(attrs.evolve(m, transitions=rows))


def test_header_follows_the_table() -> None:
    header = _cancel_only_when_running()
    assert header != codegen.op_header()
    assert "/* 4: cancel: running -> cancelled */" in header


def test_a_changed_table_changes_the_c_engine(tmp_path: Path) -> None:
    """Built from a table where cancel applies only to running ops, the engine refuses to
    cancel a queued op; the committed table lets it."""
    ffi, lib = build_variant_lib(tmp_path, "kvs_table_variant", op_table_header=_cancel_only_when_running())
    with raises(ConfigInvalid, ConfigReason.SPEC, match="another op table"):
        Native(ffi, lib)  # same names, other rows: the digest tells them apart
    nat = Native(ffi, lib, check_table=False)
    t = HostTransport(granularity=nat.page_size, native=nat)
    alloc = t.create(nat.page_size)
    res = t.reserve(nat.page_size)
    m = t.map(res, 0, alloc)
    t.set_access(m, Access.READ_WRITE)
    nat.pause(True)
    op = nat.submit_copy(m.region, bytearray(8), 8)
    with raises(TransitionError, TransitionReason.ILLEGAL):
        op.cancel()
    nat.pause(False)
    assert op.result(10).state == "done"
    t.unmap(m)
    t.release(alloc)
    t.free(res)


def test_module_from_another_table_is_refused_and_an_unusable_table_refuses_submits(tmp_path: Path) -> None:
    """A module built from a table other than spec/op.toml is refused by the wrapper
    (ConfigInvalid (SPEC)); and a table without the engine's own `start` row makes every submit
    refused in C instead of leaving ops stuck or aborting."""
    from kvstate.core.spec import StateSpec

    m = load_machine("op")
    variant = attrs.evolve(m, states=(*m.states, StateSpec("parked", "a state C never enters", False)),
                           transitions=tuple(t for t in m.transitions if t.trigger != "start"))
    ffi, lib = build_variant_lib(tmp_path, "kvs_table_unusable", op_table_header=codegen.op_header(variant))
    with raises(ConfigInvalid, ConfigReason.SPEC, match="another op table"):
        Native(ffi, lib)
    buf = ffi.new("char[]", 8)
    out = ffi.new("int64_t *")
    rc = lib.kvs_submit_copy(0, int(ffi.cast("uintptr_t", buf)), 8, 0, 0, int(ffi.cast("uintptr_t", buf)), 8, 0,
                             8, 0, out)
    assert rc == lib.KVS_E_ILLEGAL
