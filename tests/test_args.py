"""``kvstate.core.args.need_items``: each item checked as ``need`` checks it (bool is not an
int), the refusal naming the first bad item, the items returned as a list."""

from __future__ import annotations

import pytest

from kvstate.core.args import need, need_items
from kvstate.core.errors import ArgumentInvalid

VALUES = [0, 1, True, False, 2.5, "x", b"y", None, (), object()]
KINDS: list[object] = [int, (int, float), (int, bool), bytes, (bytes, str), object, bool]


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_need_items_refuses_exactly_what_need_refuses_item_by_item(kind: object) -> None:
    for first in VALUES:
        for second in VALUES:
            items = (first, second)
            want: str | None = None
            for i, item in enumerate(items):
                try:
                    need(f"xs[{i}]", item, kind)  # type: ignore[arg-type]
                except ArgumentInvalid as exc:
                    want = str(exc)
                    break
            try:
                got = need_items("xs", items, kind)  # type: ignore[arg-type]
            except ArgumentInvalid as exc:
                assert str(exc) == want, (items, kind)
            else:
                assert want is None and got == list(items), (items, kind)


def test_a_bool_is_not_an_int_unless_bool_is_named() -> None:
    for kind in (int, (int, float)):
        with pytest.raises(ArgumentInvalid, match=r"xs\[1\].*not bool"):
            need_items("xs", [1, True], kind)  # type: ignore[arg-type]
        with pytest.raises(ArgumentInvalid, match="not bool"):
            need("x", False, kind)  # type: ignore[arg-type]
    assert need_items("xs", [1, True], (int, bool)) == [1, True]


def test_need_items_refuses_what_is_not_a_list_or_too_long() -> None:
    with pytest.raises(ArgumentInvalid, match="list or tuple"):
        need_items("xs", iter([1]), int)
    with pytest.raises(ArgumentInvalid, match="more than 1"):
        need_items("xs", [1, 2], int, max_len=1)
