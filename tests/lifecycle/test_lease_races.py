"""Races between a lease's grant and its end, found by the churn test (tests/soak/churn.py)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import DEPLOYMENT, make_exporter
from support.waiting import wait_until
from kvstate import channel as chan
from kvstate.core.descriptor import decode
from kvstate.core.machine import StateChange
from kvstate.share.importer import lease_request
from kvstate.transport.host import HostTransport

pytestmark = [pytest.mark.native]


def test_a_lease_ended_the_moment_it_was_granted_is_answered_not_crashed(transport: HostTransport) -> None:
    """A lease may end (peer_died) at any moment: here, as soon as its grant is observed.
    The Python handler used to read the lease back and die on a KeyError; the native
    server builds the grant and its answer in one step under its lock, so the end, from
    another thread, comes after the answer was sent."""
    ex = make_exporter(1, transport, name="racing")
    bank = ex.banks[0]
    ended: list[str] = []

    def end_at_once(change: StateChange) -> None:
        if change.event == "grant_lease":  # this side drops the importer's connection
            for lease in bank.leases.values():
                lease.channel.close()
            ended.append(change.event)

    bank.observe(end_at_once)
    d = decode(ex.descriptor(0), DEPLOYMENT)
    with chan.connect(ex.socket_path, timeout=5.0) as ch:
        ch.send(lease_request(d, None), timeout=5.0)
        with ch.recv(timeout=5.0) as msg:
            reply: dict[str, Any] = chan.decode(msg.payload)
        assert wait_until(lambda: ended == ["grant_lease"])
    assert reply["ok"] is True, reply
    assert bank.leases == {}  # ended, after the answer was sent
