"""The fast import path (kvstate.share.peers): one persistent channel per exporter, one
batched lease per exporter with every fd in one message, and the rules that stay: leases
bound to the connection, all-or-nothing batches, refusals naming their rank."""

from __future__ import annotations


import pytest

from kvstate.core.reasons import ChannelReason
from kvstate import channel as chan
from kvstate.harness import leaks
from kvstate.core.errors import ImportFailed
from kvstate.core.reasons import ImportReason
from kvstate.share import native_import, peers
from kvstate.share.importer import ImportConfig, Importer, lease_fields
from kvstate.core.descriptor import decode
from kvstate.transport.host import HostTransport

from conftest import DEPLOYMENT, GRANULARITY, make_exporter
from support.reuse import REUSE_ON
from support.waiting import wait_until



def test_imports_reuse_one_channel_and_lease_every_rank_in_one_request(transport: HostTransport,
                                                                      importer: Importer) -> None:
    ex = make_exporter(4, transport)
    wire = [ex.descriptor(r) for r in range(4)]
    before = ex.lease_server.lease_requests()
    links = set()
    for _ in range(3):
        group = importer.import_group(wire)
        assert group.state == "ready" and len({p.lease_id for p in group.parts}) == 4
        links |= {id(p.link) for p in group.parts}
        group.drain()
    assert ex.lease_server.lease_requests() - before == 3  # one request per import, for all four ranks
    assert len(links) == 1 and len(importer.peers) == 1
    assert ex.connections() == 1  # one connection served all three imports


@pytest.mark.parametrize("spin_s", [0.0, 0.004])
def test_an_importers_links_wait_with_its_answer_spin(transport: HostTransport, spin_s: float) -> None:
    ex = make_exporter(2, transport)
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, answer_spin_s=spin_s), transport)
    try:
        group = im.import_group([ex.descriptor(r) for r in range(2)])
        assert {p.link.native.spin_s for p in group.parts if p.link is not None} == {spin_s}
        group.drain()
    finally:
        im.close()


def test_a_batch_refused_for_one_rank_leases_none_and_names_that_rank(transport: HostTransport,
                                                                     importer: Importer) -> None:
    ex = make_exporter(3, transport)
    wire = [ex.descriptor(r) for r in range(3)]
    ex.banks[1].generation += 1  # rank 1 moved on (as a re-advertise does): its descriptor is stale
    with pytest.raises(ImportFailed) as info:
        importer.import_group(wire)
    assert info.value.rank == 1 and (isinstance(info.value.__cause__, ImportFailed) and info.value.__cause__.reason is ImportReason.REFUSED)
    assert info.value.__cause__.code == "stale_generation"
    assert all(not b.leases for b in ex.banks.values())  # all or nothing on the exporter


def test_leases_end_when_the_link_closes(transport: HostTransport) -> None:
    ex = make_exporter(2, transport)
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), transport)
    group = im.import_group([ex.descriptor(r) for r in range(2)])
    assert all(len(b.leases) == 1 for b in ex.banks.values())
    link = group.parts[0].link
    assert link is not None
    link.close()  # what the importer's death does: the exporter ends every lease on it
    assert wait_until(lambda: all(not b.leases for b in ex.banks.values()))
    assert wait_until(lambda: group.state in ("draining", "quiescent", "closed", "failed"))
    group.drain()
    im.close()


def test_an_idle_link_closes_and_a_new_import_reconnects(transport: HostTransport) -> None:
    ex = make_exporter(1, transport)
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, link_idle_s=0.1), transport)
    try:
        im.import_group([ex.descriptor(0)]).drain()
        assert len(im.peers) == 1
        assert wait_until(lambda: len(im.peers) == 0)  # closed by the expiry thread once idle
        group = im.import_group([ex.descriptor(0)])
        assert group.state == "ready"
        group.drain()
    finally:
        im.close()
    assert wait_until(lambda: ex.connections() == 0)  # the importer's close closed its idle link


def test_exporter_refuses_malformed_batches(transport: HostTransport) -> None:
    ex = make_exporter(2, transport)
    d = decode(ex.descriptor(0), DEPLOYMENT)
    ch = chan.connect(ex.socket_path)
    try:
        item = lease_fields(d, None)
        for bad in ([], [item, item], [{**item, "op": "release"}], "x", [item] * 3):
            ch.send(chan.encode({"op": "leases", "items": bad}))
            with ch.recv() as msg:
                reply = chan.decode(msg.payload)
                assert not msg.fds
            assert reply["ok"] is False and reply["code"] == ChannelReason.FRAME.value, (bad, reply)
        assert all(not b.leases for b in ex.banks.values())
    finally:
        ch.close()


def test_a_malformed_batched_answer_gives_every_grant_back(transport: HostTransport) -> None:
    """The exporter is a peer: an answer whose fd counts do not add up is refused and its
    leases are returned."""
    ex = make_exporter(2, transport)
    ds = [decode(ex.descriptor(r), DEPLOYMENT) for r in range(2)]
    ch = chan.connect(ex.socket_path, limits=peers.LINK_LIMITS)
    link = peers.PeerLink(str(ex.socket_path), ch)
    try:
        items = [lease_fields(d, None) for d in ds]
        msg = link.request(peers.lease_payload(items), 5.0)
        short = chan.Message(msg.payload, msg.fds[:1])  # one fd "lost"
        for fd in msg.fds[1:]:
            chan.framing.close_quietly(fd)
        with pytest.raises(ImportFailed):
            peers.grants(link, items, short)
        assert wait_until(lambda: all(not b.leases for b in ex.banks.values()))
    finally:
        ch.close()


def test_an_importer_closed_during_a_lease_keeps_no_fd_and_no_lease(transport: HostTransport,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The close lands between the grant and the watch (phase 1 on the Python path, whose
    receive_handle is hooked here; the native import watches before it sends): the part
    fails, its received fd is closed, its lease returned, and the link closes with its
    last holder."""
    monkeypatch.setattr(native_import, "eligible", lambda *a: False)
    ex = make_exporter(2, transport)
    closing = HostTransport(granularity=GRANULARITY)
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), closing)
    receive = closing.receive_handle

    def close_first(*args: object, **kw: object) -> object:
        im.close()
        return receive(*args, **kw)  # type: ignore[arg-type]
    closing.receive_handle = close_first  # type: ignore[method-assign]
    before = memfds()
    with pytest.raises(ImportFailed, match="watcher is closed") as info:
        im.import_group([ex.descriptor(r) for r in range(2)])
    assert info.value.reason is ImportReason.INTERRUPTED  # this importer closed, not the exporter
    assert [p.state for p in im.groups[-1].parts] == ["failed", "failed"]
    assert memfds() == before
    assert wait_until(lambda: all(not b.leases for b in ex.banks.values()))
    assert wait_until(lambda: ex.connections() == 0)  # the link closed


def test_a_link_is_held_by_its_grants_and_closes_idle_once_they_go(transport: HostTransport) -> None:
    ex = make_exporter(2, transport)
    links = peers.Peers(lambda address, timeout: chan.connect(address, timeout=timeout, limits=peers.LINK_LIMITS), 60.0)
    items = [lease_fields(decode(ex.descriptor(r), DEPLOYMENT), None) for r in range(2)]
    (granted,) = links.leases([(str(ex.socket_path), items)], 5.0)
    assert isinstance(granted, list) and [g.link.users for g in granted] == [2, 2]
    links.close_idle(everything=True)
    assert len(links) == 1 and not granted[0].link.closed  # a lease's link is never idle
    for g in granted:
        g.give_back()
    assert granted[0].link.users == 0 and all(not b.leases for b in ex.banks.values())
    links.close_idle(everything=True)
    assert len(links) == 0 and granted[0].link.closed


def memfds() -> set[int]:
    """This process's open memfds (the links' sockets stay open by design)."""
    return {fd for fd, target in leaks.snapshot().fds.items() if target.startswith("/memfd:")}


def test_a_pipelined_request_to_a_peer_that_said_why_and_hung_up_gets_what_it_said() -> None:
    """exchange() sends every request before reading: an exporter over its connection
    limit refused at accept and closed, so the send fails (EPIPE), and the refusal waiting
    in the socket is the answer (the importer then says ConnectionLimit, not a hang-up)."""
    import socket

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link = peers.PeerLink("refusing", chan.Channel(a))
    refusal = chan.encode({"ok": False, "code": "ConnectionLimit", "detail": "2 connections"})
    b.send(chan.HEADER.pack(chan.MAGIC, len(refusal), 0) + refusal)
    b.close()
    [answer] = peers.exchange([(link, chan.encode({"op": "leases"}))], 5.0)
    assert isinstance(answer, chan.Message), answer
    with answer:
        assert chan.decode(answer.payload)["code"] == "ConnectionLimit"
    assert link.closed


def test_a_link_the_watcher_saw_hang_up_stays_open_for_the_request_holding_it() -> None:
    """The importer's watcher sees the exporter's hang-up (after its refusal at accept)
    and forgets the link while a lease request holds it: the request still reads the
    refusal, and the link closes when the request lets go (the full suite saw a bare
    hang-up instead of ConnectionLimit)."""
    import socket

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    refusal = chan.encode({"ok": False, "code": "ConnectionLimit", "detail": "2 connections"})
    b.send(chan.HEADER.pack(chan.MAGIC, len(refusal), 0) + refusal)
    b.close()
    table = peers.Peers(lambda address, timeout: chan.Channel(a), idle_s=60.0)
    link, reused = table._take("refusing", 5.0, fresh=False)
    assert not reused
    table.forget(link.channel)                       # the watcher's _peer_closed
    assert not link.closed
    [answer] = peers.exchange([(link, chan.encode({"op": "leases"}))], 5.0)
    assert isinstance(answer, chan.Message), answer
    with answer:
        assert chan.decode(answer.payload)["code"] == "ConnectionLimit"
    table.let_go(link)
    assert link.closed and len(table) == 0


def test_the_mapped_note_is_what_the_channel_s_encoder_writes() -> None:
    """``peers.mapped_payload`` writes its ints directly, without the general encoder: the
    bytes must be what ``chan.encode`` writes (keys sorted), in both forms; a value that is
    not an int is refused, not written."""
    import random

    from kvstate.core.errors import ChannelError

    rng = random.Random(7)
    for n in (1, 2, 8, 64):
        for _ in range(20):
            leases = [(rng.randrange(1024), rng.randrange(-2 ** 63, 2 ** 63)) for _ in range(n)]
            if n == 1:
                encoded = chan.encode({"op": "mapped", "rank": leases[0][0], "lease": leases[0][1]})
            else:
                encoded = chan.encode({"op": "mapped", "items": [{"rank": r, "lease": x} for r, x in leases]})
            assert peers.mapped_payload(leases) == encoded
            assert chan.decode(encoded)["op"] == "mapped"
    for bad in ([(0, 1.5)], [(True, 3)], [(0, 1), ("1", 2)]):
        with pytest.raises(ChannelError):
            peers.mapped_payload(bad)  # type: ignore[arg-type]
