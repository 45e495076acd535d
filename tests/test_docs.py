"""The generated spec pages: a Mermaid diagram, every row, and every row linked to the code
that implements it and the code that fires its event. (Freshness: tests/test_generate.py.)"""

from __future__ import annotations

import re

import pytest

from kvstate.core.spec import load_spec
from kvstate.derive import codemap, docs as render
from support.variants import ROOT


def _page(name: str) -> str:
    spec = load_spec()
    return render.machine_page(spec, name, codemap.scan(ROOT, spec))


def _rows(page: str) -> list[list[str]]:
    """The cells of the transitions table."""
    section = page.split("## Transitions", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| `")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


@pytest.mark.parametrize("name", ["bank", "group", "part", "op", "coordinator", "rank"])
def test_pages_carry_mermaid_and_every_transition_linked_to_code(name: str) -> None:
    m = load_spec()[name]
    page = _page(name)
    assert "```mermaid\nstateDiagram-v2" in page
    rows = _rows(page)
    assert len(rows) == len(m.transitions)
    for row, t in zip(rows, m.transitions):
        assert len(row) == 7 and row[0].startswith(f"`{t.trigger}`")
        implemented, fired = row[5], row[6]
        assert (implemented != "—") == bool(t.guards or t.unless or t.effects), row
        assert fired != "—" and (fired.startswith("external: ") or "](../../" in fired), row


def test_release_row_links_straight_to_its_effect_and_fire_site() -> None:
    rows = [r for r in _rows(_page("bank")) if r[0] == "`release`"]
    assert rows and all("[`kvstate.share.bank:Bank._release`](../../kvstate/share/bank.py)" in r[5]
                        for r in rows)
    assert all("kvstate.share.exporter:Exporter.drain" in r[6] for r in rows)


def test_bank_and_part_pages_say_their_rows_run_natively_too() -> None:
    for name in ("bank", "part"):
        page = _page(name)
        assert f"generated into C ([`ffi/kvs_{name}_table.h`](../../ffi/kvs_{name}_table.h))" in page
        assert "[`ffi/kvs_machine.c:kvs_machine_fire`](../../ffi/kvs_machine.c)" in page
    assert "native executor" not in _page("group") and "native executor" not in _page("op")


def test_op_rows_link_to_the_c_engine() -> None:
    page = _page("op")
    assert "Every row is run by [`ffi/kvs_op_table.c:kvs_op_step`](../../ffi/kvs_op_table.c)." in page
    submit = next(r for r in _rows(page) if r[0] == "`submit`")
    assert "ffi/kvs_op_table.c:guard_holds" in submit[5] and "ffi/kvs_op_table.c:effect" in submit[5]
    assert "ffi/kvs_ops.c:kvs_submit" in submit[6]
