"""Resource bounds: every table, queue and wait a peer can grow has a cap, and hitting the
cap gives a typed refusal, never unbounded growth. (The audit is in docs/threat-model.md.)"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from support.errors import raises

from kvstate.core.reasons import ImportReason
from kvstate import channel as chan
from kvstate.reuse import profile
from kvstate.core.descriptor import MAX_DESCRIPTOR_BYTES, decode, encode
from kvstate.core.errors import (
    KvStateError, DescriptorRejected, GroupRejected, ImportFailed, Busy, ConfigInvalid, ArgumentInvalid,
    ChannelError,
)
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.share.importer import ImportConfig, Importer
from kvstate.reuse.inventory import Inventory
from kvstate.reuse.policy import MAX_SETTING_TEXT, ReuseSettings
from kvstate.core.reasons import RejectReason, ConfigReason, ArgumentReason, ChannelReason
from kvstate.transport.host import HostTransport
from kvstate.core.validate import MAX_TP, validate_group

from support.descriptors import DEPLOYMENT, descriptor, expectation
from support.reuse import REUSE_ON

GEOMETRY = Geometry.uniform(layers=1, kv_heads=2, head_dim=8, block_tokens=4, dtype=DType.BF16,
                    layout=Layout.BLOCK_MAJOR, num_blocks=8)


def private_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvs-bounds-"))
    d.chmod(0o700)
    return d


@pytest.fixture
def make_exporter() -> Iterator[type[Exporter]]:
    made: list[Exporter] = []

    def make(**config: object) -> Exporter:
        ex = Exporter(ExportConfig(DEPLOYMENT, private_dir() / "sock", os.urandom(16), 1, **config),  # type: ignore[arg-type]
                      HostTransport(granularity=64 * 1024), name="bounds")
        bank = ex.add_bank(0, GEOMETRY)
        bank.fire("register")
        bank.fire("advertise")
        ex.start()
        made.append(ex)
        return ex

    yield make  # type: ignore[misc]
    for ex in made:
        ex.stop()
        for lease in list(ex.banks[0].leases.values()):
            lease.channel.close()
        ex.drain(5.0)


def _lease(ch: chan.Channel, ex: Exporter) -> dict[str, object]:
    ch.send(chan.encode({"op": "lease", "rank": 0, "generation": ex.banks[0].generation,
                         "incarnation": ex.incarnation.value.hex()}))
    with ch.recv() as msg:
        return chan.decode(msg.payload)


# -- exporter tables ------------------------------------------------------------------


def test_lease_table_is_capped_per_bank(make_exporter: type[Exporter]) -> None:
    ex = make_exporter(max_leases=2)  # type: ignore[call-arg]
    with chan.connect(ex.socket_path) as ch:
        assert _lease(ch, ex)["ok"] and _lease(ch, ex)["ok"]
        refused = _lease(ch, ex)
        assert refused["ok"] is False and refused["code"] == "not_leasing"
        assert len(ex.banks[0].leases) == 2
    deadline = time.monotonic() + 5
    while ex.banks[0].leases and time.monotonic() < deadline:  # the connection's leases end with it
        time.sleep(0.01)
    assert ex.banks[0].leases == {}


def test_connection_handlers_are_capped_with_a_typed_refusal(make_exporter: type[Exporter]) -> None:
    """channel.Server.serve_in_thread: at most max_connections handler threads; one more
    connection gets a ConnectionLimit refusal and is closed. The importer sees a typed error."""
    ex = make_exporter(max_connections=2)  # type: ignore[call-arg]
    held = [chan.connect(ex.socket_path) for _ in range(2)]
    try:
        for ch in held:
            assert _lease(ch, ex)["ok"]  # both handlers run
        threads = threading.active_count()
        with chan.connect(ex.socket_path) as extra:
            with extra.recv() as msg:
                reply = chan.decode(msg.payload)
            assert reply == {"ok": False, "code": "ConnectionLimit", "detail": str(Busy.connections(2))}
            with raises(ChannelError, ChannelReason.CLOSED):
                extra.recv(timeout=2.0)
        assert threading.active_count() <= threads
        im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), HostTransport(granularity=64 * 1024))
        try:
            with pytest.raises(ImportFailed) as info:
                im.import_group([ex.descriptor(0)])
            assert (isinstance(info.value.__cause__, ImportFailed) and info.value.__cause__.reason is ImportReason.REFUSED) and info.value.__cause__.code == "ConnectionLimit"
        finally:
            im.close()
    finally:
        for ch in held:
            ch.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # a slot frees when a handler ends
        with chan.connect(ex.socket_path) as ch:
            if _lease_or_none(ch, ex):
                break
        time.sleep(0.05)
    else:
        pytest.fail("no connection slot came back after the held connections closed")


def _lease_or_none(ch: chan.Channel, ex: Exporter) -> bool:
    try:
        return bool(_lease(ch, ex).get("ok"))
    except ChannelError as exc:
        if exc.reason is not ChannelReason.CLOSED:
            raise
        return False


def test_server_rejects_a_zero_connection_cap() -> None:
    with pytest.raises(KvStateError):  # typed, with a reason (issue 14, class 1)
        chan.Server(private_dir() / "x.sock", max_connections=0)


# -- the channel ----------------------------------------------------------------------


def test_channel_payload_and_fd_caps() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    small = chan.Limits(max_payload=100, max_fds=1)
    with chan.Channel(a) as big_end, chan.Channel(b, limits=small) as small_end:
        with raises(ChannelError, ChannelReason.FRAME, match="exceeds the cap"):
            small_end.send(b"x" * 101)
        with raises(ChannelError, ChannelReason.FRAME, match="fds exceed"):
            small_end.send(b"x", [0, 1])
        big_end.send(b"x" * 101)
        with raises(ChannelError, ChannelReason.FRAME, match="larger than the cap"):
            small_end.recv(timeout=1.0)
        fds_before = len(os.listdir("/proc/self/fd"))
        big_end.send(b"x", [0, 1, 2])
        with raises(ChannelError, ChannelReason.FRAME):
            small_end.recv(timeout=1.0)
        assert len(os.listdir("/proc/self/fd")) == fds_before  # refused fds were closed
        big_end.send(b"ok")  # the channel still works after refusals
        with small_end.recv(timeout=1.0) as msg:
            assert msg.payload == b"ok"
    with pytest.raises(KvStateError):  # typed, with a reason (issue 14, class 1)
        chan.Limits(max_payload=chan.HARD_MAX_PAYLOAD + 1)
    with pytest.raises(KvStateError):  # typed, with a reason (issue 14, class 1)
        chan.Limits(max_fds=chan.HARD_MAX_FDS + 1)


def test_every_channel_wait_has_a_timeout() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with chan.Channel(a) as ch:
        start = time.monotonic()
        with raises(ChannelError, ChannelReason.TIMEOUT):
            ch.recv(timeout=0.05)
        assert time.monotonic() - start < 1.0
        with pytest.raises(KvStateError):  # typed, with a reason (issue 14, class 1)
            ch.recv(timeout=float("inf"))
    b.close()


# -- descriptors and groups ------------------------------------------------------------


def test_descriptor_size_cap() -> None:
    with pytest.raises(DescriptorRejected) as info:
        decode(b"K" * (MAX_DESCRIPTOR_BYTES + 1), DEPLOYMENT)
    assert info.value.reason is RejectReason.OVERSIZE
    huge = descriptor(handle_kind=HandleKind.NIXL, handle=b"h" * (MAX_DESCRIPTOR_BYTES // 2 + 1))
    with pytest.raises(DescriptorRejected) as info:
        encode(huge, DEPLOYMENT)
    assert info.value.reason is RejectReason.OVERSIZE


def test_tp_cap() -> None:
    with pytest.raises(GroupRejected) as info:
        validate_group([descriptor(rank=r, tp=65) for r in range(65)], expectation(check_socket=False))
    assert {p.reason for p in info.value.problems} == {RejectReason.TP_SIZE}
    with pytest.raises(GroupRejected) as info:
        validate_group([descriptor(rank=0, tp=MAX_TP + 1)], expectation(check_socket=False, max_tp=MAX_TP * 2))
    assert RejectReason.TP_SIZE in {p.reason for p in info.value.problems}


def test_importer_keeps_no_terminal_groups() -> None:
    """The importer's group list holds only live groups: rejected imports do not pile up."""
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), HostTransport(granularity=64 * 1024))
    try:
        for _ in range(50):
            with pytest.raises(GroupRejected):
                im.import_group([b"not a descriptor"])
        assert len(im.groups) <= 1
    finally:
        im.close()


# -- inventory, native, settings, capabilities --------------------------------------------


def test_inventory_budget_is_never_exceeded() -> None:
    inv = Inventory(budget_blocks=10)
    for g in range(5):
        inv.store(f"g{g}", list(range(g * 100, g * 100 + 7)))
        assert len(inv) <= 10


def test_native_worker_count_is_capped() -> None:
    native = HostTransport(granularity=64 * 1024).native
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        native.configure(65)
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        native.configure(0)


def test_setting_text_cap() -> None:
    with raises(ConfigInvalid, ConfigReason.INVALID_SETTING, match="longer than"):
        ReuseSettings.from_env({"KVSTATE_POLICY_MINIMUM_TRANSFER_PREFIX_BLOCKS": "9" * (MAX_SETTING_TEXT + 1)})
    with raises(ConfigInvalid, ConfigReason.INVALID_SETTING):  # 5000 digits: typed, not Python's int-string limit
        ReuseSettings.from_cli(["--minimum-transfer-prefix-blocks", "9" * 5000])


def test_capability_caps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wire = {"device_uuids": ["11" * 16] * (profile.MAX_DEVICES + 1), "handle_kinds": ["memfd"],
            "fabric_trial": "passed", "transports": [], "geometry_fingerprint": "00" * 16, "protocol_version": 1}
    with raises(ConfigInvalid, ConfigReason.CAPABILITIES_INVALID, match="more than"):
        profile.parse_capabilities(wire)
    wire = {**wire, "device_uuids": ["11" * 16], "transports": [{}] * (profile.MAX_TRANSPORTS + 1)}
    with raises(ConfigInvalid, ConfigReason.CAPABILITIES_INVALID, match="more than"):
        profile.parse_capabilities(wire)
    from kvstate.commands.cli import main

    for name, text in [("big.json", " " * (profile.MAX_CAPABILITIES_BYTES + 1)),
                       ("deep.json", "[" * 100_000 + "]" * 100_000)]:
        path = tmp_path / name
        path.write_text(text)
        assert main(["policy", "explain", "--target-blocks", "8", "--candidate", "d1:device:300",
                     "--profile", "gpu-single-node", "--capabilities", str(path)]) != 0
        err = capsys.readouterr().err
        assert "--capabilities" in err and ("larger than" in err or "recursion" in err), err
    assert json.dumps(attrs.asdict(chan.Limits()))  # the default caps are plain data


def test_a_huge_tp_is_rejected_without_listing_every_missing_rank() -> None:
    """Found by fuzzing: a descriptor claiming tp 2**32-1 made validation list billions of
    missing ranks (memory without bound, then the fuzz watchdog's hang)."""
    start = time.monotonic()
    with pytest.raises(GroupRejected) as info:
        validate_group([descriptor(rank=0, tp=2**32 - 1)], expectation(check_socket=False))
    assert time.monotonic() - start < 1.0
    assert {p.reason for p in info.value.problems} == {RejectReason.TP_SIZE}
