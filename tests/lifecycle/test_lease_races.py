"""Races between a lease's grant and its end, found by the churn test (tests/soak/churn.py)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import DEPLOYMENT, make_exporter
from kvstate import channel as chan
from kvstate.core.descriptor import decode
from kvstate.core.machine import StateChange
from kvstate.share.importer import lease_request
from kvstate.transport.host import HostTransport

pytestmark = [pytest.mark.native]


def test_a_lease_ended_the_moment_it_was_granted_is_answered_not_crashed(transport: HostTransport) -> None:
    """The watcher ends a lease whose importer died (peer_died) on its own thread, at any
    moment: here, right after the grant committed and before the answer was built. The
    connection handler used to read the lease back and die on a KeyError; now the grant and
    its answer are one step under the bank's lock, and the end comes after."""
    ex = make_exporter(1, transport, name="racing")
    bank = ex.banks[0]
    ended: list[str] = []

    def end_at_once(change: StateChange) -> None:
        if change.event == "grant_lease":  # what the watcher thread does when the peer is gone
            ex._end_leases("peer_died", lambda lease: True, still_open=False, why="died at once")
            ended.append(change.event)

    bank.observe(end_at_once)
    d = decode(ex.descriptor(0), DEPLOYMENT)
    with chan.connect(ex.socket_path, timeout=5.0) as ch:
        ch.send(lease_request(d, None), timeout=5.0)
        with ch.recv(timeout=5.0) as msg:
            reply: dict[str, Any] = chan.decode(msg.payload)
    assert reply["ok"] is True and ended == ["grant_lease"], reply
    assert bank.leases == {}  # ended, after the answer was built
