"""Owner tokens (``kvstate.share.owned.new_owner``), drawn 64 at a time: nonzero, within
what the native layer takes, not repeated, and not shared with a forked child."""

from __future__ import annotations

import os

from kvstate.share import owned
from kvstate.transport.host import OWNER_MAX


def test_tokens_are_in_range_and_not_repeated() -> None:
    drawn = [owned.new_owner() for _ in range(1000)]
    assert all(1 <= t <= OWNER_MAX for t in drawn)
    assert len(set(drawn)) == len(drawn)


def test_a_forked_child_draws_its_own_tokens() -> None:
    owned.new_owner()  # the pool holds tokens drawn ahead now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(r)
        os.write(w, b"".join(owned.new_owner().to_bytes(8, "little") for _ in range(8)))
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    child = {int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)}
    parent = {owned.new_owner() for _ in range(64)}
    assert len(child) == 8 and not child & parent
