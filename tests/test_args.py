"""``kvstate.core.args.need_items``: each item checked as ``need`` checks it (bool is not an
int), the refusal naming the first bad item, the items returned as a list. The socket-path
checks of configs: what they take, the channel binds."""

from __future__ import annotations

import pytest

from kvstate.core.args import need, need_items, need_socket_dir, need_socket_path
from kvstate.core.errors import ArgumentInvalid
from kvstate.core.paths import MAX_SOCKET_PATH, path_problem
from kvstate.core.reasons import ArgumentReason
from support.errors import raises

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


@pytest.mark.parametrize("value, reason", [
    ("run/sockets", ArgumentReason.RANGE), ("/run/../sockets", ArgumentReason.RANGE),
    ("/" + "d" * 107, ArgumentReason.LENGTH), (3, ArgumentReason.TYPE), ("/run/\x00", ArgumentReason.ENCODING),
])
def test_need_socket_dir_refuses_a_directory_the_channel_would_refuse_at_bind(value: object,
                                                                               reason: ArgumentReason) -> None:
    with raises(ArgumentInvalid, reason):
        need_socket_dir("socket_dir", value)
    with raises(ArgumentInvalid, reason):
        need_socket_path("path", value)


def _not_there(path: str) -> object:
    raise FileNotFoundError(path)  # the shape alone: nothing on the way exists


@pytest.mark.parametrize("room", [2, 17, 40])
def test_a_socket_dir_it_takes_holds_a_socket_name_of_room_bytes(room: int) -> None:
    """Taken exactly when the socket path ``<dir>/<name of room - 1 bytes>`` passes the
    channel's rule (kvstate.core.paths), around the sun_path bound."""
    for size in range(MAX_SOCKET_PATH - room - 3, MAX_SOCKET_PATH - room + 4):
        directory = "/" + "d" * (size - 1)
        socket = f"{directory}/{'s' * (room - 1)}"
        try:
            need_socket_dir("socket_dir", directory, room=room)
        except ArgumentInvalid:
            taken = False
        else:
            taken = True
        assert taken == (path_problem(socket, _not_there) is None), (size, room)  # type: ignore[arg-type]
