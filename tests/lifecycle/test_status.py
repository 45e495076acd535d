"""`kvstate status` as an operator runs it: a separate process reading live servers.

The snapshot is checked against the real objects (banks, leases, pins), a draining bank
says what it waits for, the query fires no event, a dead process's socket reads as a
leftover, and a directory that fails the channel's checks is refused without a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import DEPLOYMENT, make_exporter
from kvstate.core.machine import StateChange
from kvstate.share import status
from kvstate.share.coordinator import Coordinator, CoordinatorConfig
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostTransport
from support.reuse import REUSE_ON
from support.waiting import wait_until


@pytest.fixture
def importer(transport: HostTransport) -> Iterator[Importer]:  # type: ignore[type-arg]
    """An importer that renews its 30 s leases only after 15 s: what a status run shows
    (and fires) is then the status request's doing alone, however slow the machine; a
    renewal of a draining bank's lease would be refused and end it mid-test."""
    im: Importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON, renew_interval_s=60.0),  # type: ignore[type-arg]
                            transport)
    yield im
    im.close()

pytestmark = [pytest.mark.multiproc]

STATUS = [sys.executable, "-m", "kvstate", "status"]


def run_status(*dirs: Path, json_out: bool = True) -> subprocess.CompletedProcess[str]:
    args = [a for d in dirs for a in ("--socket-dir", str(d))]
    # A generous per-server timeout: on a loaded machine a live server may answer slowly, and
    # the tests check what it says, not how fast.
    return subprocess.run([*STATUS, *args, "--timeout", "30", *(["--json"] if json_out else [])],
                          capture_output=True, text=True, timeout=120)


def snapshot(*dirs: Path) -> dict[str, Any]:
    out = run_status(*dirs)
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_status_shows_banks_and_leases_as_they_are(transport: HostTransport, importer: Importer) -> None:
    ex = make_exporter(2, transport, name="decode")
    changes: list[StateChange] = []
    for bank in ex.banks.values():
        bank.observe(changes.append)
    group = importer.import_group([ex.descriptor(0), ex.descriptor(1)])
    try:
        # the importer's "mapped" note moves each bank to ready after the import returns
        assert wait_until(lambda: all(b.state == "ready" for b in ex.banks.values()))
        ex.lease_server.pump()  # the lease server's transitions reach observers after its state moved
        changes.clear()
        snap = snapshot(ex.config.socket_dir)
        assert changes == []  # a status request fires nothing
        check_exporter(snap, ex)
    finally:
        group.drain(10.0)


def check_exporter(snap: dict[str, Any], ex: Any) -> None:
    (ep,) = snap["endpoints"]
    assert ep["kind"] == "exporter" and ep["pid"] == os.getpid() and ep["tp"] == 2
    assert ep["incarnation"] == ex.incarnation.value.hex() and ep["path"] == str(ex.socket_path)
    for shown, bank in zip(ep["banks"], [ex.banks[0], ex.banks[1]]):
        assert (shown["rank"], shown["state"], shown["generation"]) == (bank.rank, bank.state, bank.generation)
        assert shown["pins"] == bank.pins() and shown["holds"] == len(bank.holds) == 0
        assert shown["lease_count"] == len(bank.leases) == 1
        (lease,) = shown["leases"]
        real = next(iter(bank.leases.values()))
        assert lease["id"] == real.id and lease["pid"] == real.channel.peer.pid == os.getpid()
        assert 0 < lease["expires_in_s"] <= ex.config.lease_timeout_s and not lease["expired"]
        assert shown["waiting_for"] == ""


def test_a_draining_bank_says_what_it_waits_for(transport: HostTransport, importer: Importer) -> None:
    ex = make_exporter(1, transport, name="decode")
    group = importer.import_group([ex.descriptor(0)])
    bank = ex.banks[0]
    try:
        assert wait_until(lambda: bank.state == "ready")
        bank.fire("drain")  # the importer still holds its lease: the bank cannot quiesce
        (ep,) = snapshot(ex.config.socket_dir)["endpoints"]
        (shown,) = ep["banks"]
        assert shown["state"] == "draining"
        assert shown["waiting_for"].startswith(f"1 lease: pid {os.getpid()} expires in "), shown
        text = run_status(ex.config.socket_dir, json_out=False)
        assert text.returncode == 0 and "draining, waits for 1 lease: pid" in text.stdout, text.stdout
    finally:
        group.drain(10.0)
    assert snapshot(ex.config.socket_dir)["endpoints"][0]["banks"][0]["waiting_for"] == ""


def test_a_dead_process_socket_is_a_leftover(tmp_path: Path) -> None:
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    left = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    left.bind(str(d / "gone.sock"))
    left.close()  # bound, never listened, not unlinked: what a SIGKILLed server leaves
    (ep,) = snapshot(d)["endpoints"]
    assert ep["kind"] == "stale" and ep["path"].endswith("gone.sock")
    assert "nobody listens" in run_status(d, json_out=False).stdout


def test_a_coordinator_shows_its_workers_and_groups(transport: HostTransport) -> None:
    from conftest import DEPLOYMENT, GRANULARITY
    from support.coordinated import Prefill

    ex = make_exporter(2, transport, name="decode")
    prefill = Prefill(DEPLOYMENT, 2, granularity=GRANULARITY)
    coord = prefill.coordinator
    try:
        group = coord.import_group([ex.descriptor(0), ex.descriptor(1)], timeout=10.0)
        snap = snapshot(ex.config.socket_dir, coord.socket_path.parent)
        exporter, shown = snap["endpoints"]
        assert exporter["kind"] == "exporter" and shown["kind"] == "coordinator"
        assert shown["tp"] == 2 and shown["pid"] == os.getpid() and shown["path"] == str(coord.socket_path)
        assert [(w["rank"], w["alive"]) for w in shown["workers"]] == [(0, True), (1, True)]
        (g,) = shown["groups"]
        assert (g["gid"], g["state"], g["failure"]) == (group.gid, group.state, None)
        assert [(p["rank"], p["state"], p["dead"]) for p in g["parts"]] == \
            [(r.rank, r.state, r.dead) for r in group.ranks()]
        assert sorted(coord.links) == [0, 1]  # the status connection was not taken for a worker
        group.drain(10.0)
    finally:
        prefill.close()


def test_status_refuses_an_unsafe_directory_without_a_traceback(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    out = run_status(d)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("kvstate status: error:") and "Traceback" not in out.stderr


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_watch_prints_snapshots_until_stopped(transport: HostTransport, sigint: str) -> None:
    """SIGINT stops the watch, also where it was started with SIGINT ignored, as a shell
    starts what it runs in the background (``make test &`` once made this test hang)."""
    ex = make_exporter(1, transport, name="decode")
    command = [*STATUS, "--socket-dir", str(ex.config.socket_dir), "--json", "--watch", "0.1", "--timeout", "30"]
    if sigint == "ignored":  # an ignored signal stays ignored across exec
        command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        assert all(json.loads(line)["endpoints"][0]["banks"][0]["state"] == "advertised" for line in lines)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        proc.stdout.close() if proc.stdout else None
        proc.stderr.close() if proc.stderr else None


def test_waiting_for_names_every_cause() -> None:
    leases = [{"pid": 11, "expired": False, "expires_in_s": 12.2}, {"pid": 12, "expired": True, "expires_in_s": -1}]
    assert status.waiting_for(leases, 1, 3, 2) == ("2 leases: pid 11 expires in 12 s, pid 12 expired, not returned; "
                                                   "1 hold (importers that may have it open); 3 pins; "
                                                   "2 stores in flight")
    assert status.waiting_for([], 0, 0, 0) == ""


def test_a_status_request_mid_serving_leaves_leasing_intact(transport: HostTransport, importer: Importer) -> None:
    """Status queries racing a group import: every import still succeeds."""
    ex = make_exporter(2, transport, name="decode")
    stop = threading.Event()
    answers: list[int] = []

    def poll() -> None:
        while not stop.is_set():
            answers.append(len(status.query(ex.socket_path, timeout=30.0)["banks"]))

    t = threading.Thread(target=poll)
    t.start()
    try:
        for _ in range(5):
            importer.import_group([ex.descriptor(0), ex.descriptor(1)]).drain(10.0)
    finally:
        stop.set()
        t.join(10)
    assert answers and set(answers) == {2}


def test_a_live_server_of_another_protocol_is_not_a_leftover(tmp_path: Path) -> None:
    """A live server that does not answer status (the vLLM index, say) hangs up on the
    request: it is named 'other', never a dead process's leftover."""
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    from kvstate import channel as chan

    server = chan.Server(d / "index.sock")
    server.serve_in_thread(lambda ch: ch.close())  # reads nothing, answers nothing
    try:
        (ep,) = snapshot(d)["endpoints"]
        assert ep["kind"] == "other" and ep["path"].endswith("index.sock"), ep
    finally:
        server.close()


def test_a_snapshot_too_large_for_one_frame_keeps_its_counts(transport: HostTransport) -> None:
    ex = make_exporter(1, transport, name="decode")
    full = status.exporter_status(ex)
    small = status.exporter_status(ex, max_bytes=len(__import__("json").dumps(full)) // 2)
    assert small["truncated"] and small["banks"][0]["leases"] == []
    assert small["banks"][0]["lease_count"] == full["banks"][0]["lease_count"]


def _exporter_answer(**fields: Any) -> dict[str, Any]:
    bank = {"rank": 0, "state": "ready", "generation": 1, "epoch": 0, "lease_count": 0, "holds": 0, "pins": 0,
            "waiting_for": "", "leases": []}
    return {"version": status.VERSION, "kind": "exporter", "path": "x", "pid": 1, "tp": 1, "incarnation": "ab",
            "connections": 0, "retained_blocks": None, "banks": [bank], **fields}


@pytest.mark.parametrize(("answer", "problem"), [
    ({"version": status.VERSION, "kind": "exporter", "path": "x"}, "exporter has no 'pid'"),
    ({"version": status.VERSION, "kind": "coordinator", "path": "x", "pid": 1, "tp": 1},
     "coordinator has no 'groups'"),
    (_exporter_answer(incarnation=5), "exporter.incarnation is int, not str"),
    (_exporter_answer(pid="x"), "exporter.pid is str, not int"),
    (_exporter_answer(banks=[{"rank": 0}]), "exporter.banks[0] has no 'state'"),
    (_exporter_answer(banks="none"), "exporter.banks is not a list"),
    (_exporter_answer(banks=[{**_exporter_answer()["banks"][0], "leases": [
        {"id": 1, "pid": 2, "expires_in_s": "soon", "expired": False, "blocks": 0}]}]),
     "exporter.banks[0].leases[0].expires_in_s is str, not int or float"),
    ({"version": status.VERSION, "kind": "coordinator", "path": "x", "pid": 1, "tp": 1, "workers": [7],
      "groups": []}, "coordinator.workers[0] is not an object"),
    ({"version": status.VERSION, "kind": "zzz", "path": "x"}, "not a status answer (kind 'zzz')"),
    ({"version": status.VERSION, "kind": "stale", "path": "x"}, "not a status answer (kind 'stale')"),
])
def test_a_malformed_answer_is_that_socket_alone(transport: HostTransport, answer: dict[str, Any],
                                                 problem: str) -> None:
    """A same-uid server answering the right version and kind with fields missing or of
    other types reads as 'other' for its socket; the rest of the snapshot prints (the
    text form crashed with KeyError or TypeError on the first such field)."""
    from kvstate import channel as chan

    ex = make_exporter(1, transport, name="decode")
    d = ex.config.socket_dir

    def answer_status(ch: chan.Channel) -> None:
        with ch:
            with ch.recv(timeout=30):
                pass
            ch.send(chan.encode(answer), timeout=30)

    server = chan.Server(d / "hostile.sock")
    server.serve_in_thread(answer_status)
    try:
        out = run_status(d, json_out=False)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert f"hostile.sock: {d / 'hostile.sock'}: " in out.stdout and problem in out.stdout, out.stdout
        assert f"exporter {ex.socket_path.name}  pid {os.getpid()}" in out.stdout, out.stdout
    finally:
        server.close()
