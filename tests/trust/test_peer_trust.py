"""Peer trust: who may talk to kvstate, and what a peer may make it accept.

Each test names the check it shows; docs/threat-model.md maps threats to these tests.
Foreign-uid tests run as root and fork a child that drops to uid 65534 (nobody).
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from support.errors import raises

from kvstate import channel as chan
from kvstate.core.descriptor import decode, encode
from kvstate.core.errors import DescriptorRejected, GroupRejected, ImportFailed, KvStateError, ChannelError
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.identity import Deployment
from kvstate.share.importer import ImportConfig, Importer
from kvstate.core.reasons import ImportReason, RejectReason, ChannelReason
from kvstate.transport.host import HostTransport
from kvstate.core.validate import socket_path_reason

from support.descriptors import DEPLOYMENT, descriptor
from support.reuse import REUSE_ON

NOBODY = 65534
GEOMETRY = Geometry.uniform(layers=1, kv_heads=2, head_dim=8, block_tokens=4, dtype=DType.BF16,
                    layout=Layout.BLOCK_MAJOR, num_blocks=8)
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root to fork a child with another uid")


def private_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvs-trust-"))
    d.chmod(0o700)
    return d


def as_nobody(body: Callable[[], str]) -> str:
    """Run ``body`` in a forked child that dropped to uid/gid 65534; return what it returns
    (or the name of the exception it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no threads of ours beyond this one
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = body()
        except BaseException as exc:  # report, never return into pytest in the child
            out = f"raised {type(exc).__name__}: {exc}"
        os.write(w, out.encode()[:4096])
        os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            return f.read().decode()
    finally:
        os.waitpid(pid, 0)


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    d = private_dir()
    ex = Exporter(ExportConfig(DEPLOYMENT, d / "sock", os.urandom(16), 1, lease_timeout_s=10.0),
                  HostTransport(granularity=64 * 1024), name="trust")
    bank = ex.add_bank(0, GEOMETRY)
    bank.fire("register")
    bank.fire("advertise")
    ex.start()
    try:
        yield ex
    finally:
        ex.stop()
        for lease in list(ex.banks[0].leases.values()):
            lease.channel.close()
        ex.drain(5.0)
        shutil.rmtree(d, ignore_errors=True)


# -- foreign uids --------------------------------------------------------------------


@pytest.mark.native
@pytest.mark.multiproc
@root_only
def test_foreign_uid_cannot_reach_a_private_socket_dir(exporter: Exporter) -> None:
    """The first barrier: the 0700 socket directory. A foreign uid cannot connect at all,
    and kvstate's own connect refuses the directory as not the caller's."""
    path = str(exporter.socket_path)

    def raw() -> str:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(path)
            return "connected"
        except PermissionError:
            return "EACCES"

    def typed() -> str:
        try:
            chan.connect(path, timeout=1.0)
            return "connected"
        except KvStateError as exc:
            return f"{type(exc).__name__}:{exc.reason.value}"

    assert as_nobody(raw) == "EACCES"
    assert as_nobody(typed) == "ChannelError:unsafe_path"


@pytest.mark.native
@pytest.mark.multiproc
@root_only
def test_foreign_uid_is_refused_by_peer_credentials(exporter: Exporter) -> None:
    """The second barrier: SO_PEERCRED. Even with the directory opened up (a mistake), a
    connection from another uid is closed by the exporter without a reply or an fd."""
    exporter.socket_path.parent.chmod(0o711)
    exporter.socket_path.parent.parent.chmod(0o711)
    exporter.socket_path.chmod(0o777)
    path = str(exporter.socket_path)
    lease = chan.encode({"op": "lease", "rank": 0, "generation": exporter.banks[0].generation,
                         "incarnation": exporter.incarnation.value.hex()})

    def ask_for_a_lease() -> str:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        s.settimeout(5.0)
        try:
            s.send(chan.HEADER.pack(chan.MAGIC, len(lease), 0) + lease)
        except (BrokenPipeError, ConnectionResetError):
            return "closed"
        try:
            data, fds, _, _ = socket.recv_fds(s, 4096, 4)
        except ConnectionResetError:  # closed with our request unread
            return "closed"
        return "closed" if not data and not fds else f"reply with {len(fds)} fd(s)"

    assert as_nobody(ask_for_a_lease) == "closed"
    assert exporter.banks[0].leases == {}


@pytest.mark.native
@pytest.mark.multiproc
@root_only
def test_client_refuses_a_server_of_another_uid() -> None:
    """SO_PEERCRED on the client side: a server run by another uid is not trusted."""
    d = Path(tempfile.mkdtemp(prefix="kvs-trust-"))
    os.chown(d, NOBODY, NOBODY)
    d.chmod(0o700)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with chan.Server(d / "evil.sock") as server:
                os.write(w, b"up")
                try:
                    server.accept(timeout=5.0)
                except KvStateError:
                    pass
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 2) == b"up"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(str(d / "evil.sock"))  # as connect() does once the path checks pass
        with raises(ChannelError, ChannelReason.REJECTED) as info:
            chan.Channel(s, allowed_uids={0})
        assert info.value.uid == NOBODY
    finally:
        os.close(r)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        shutil.rmtree(d, ignore_errors=True)


def test_channel_refuses_uids_outside_allowed() -> None:
    """The uid check itself, on a socketpair (runs as any user)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with raises(ChannelError, ChannelReason.REJECTED):
        chan.Channel(a, allowed_uids={os.getuid() + 1})
    b.close()


# -- the socket directory --------------------------------------------------------------


def test_socket_dir_must_be_private_and_ours() -> None:
    d = private_dir()
    try:
        chan.check_socket_dir(d)  # the good case passes
        d.chmod(0o755)
        with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="mode 755"):
            chan.check_socket_dir(d)
        d.chmod(0o700)
        with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="owned by uid"):
            chan.check_socket_dir(d, uid=os.getuid() + 1)
        link = d.parent / (d.name + "-link")
        link.symlink_to(d)
        with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="symlink"):
            chan.check_socket_dir(link)
        with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="symlink"):
            chan.Server(link / "x.sock")
        link.unlink()
        with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="normalised"):
            chan.check_socket_dir(str(d) + "/../" + d.name)
        f = d / "file"
        f.write_text("")
        with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="not a socket"):
            chan.Server(f)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_descriptor_socket_path_checks() -> None:
    """The importer checks the advertised socket path before it connects (validation)."""
    d = private_dir()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(str(d / "x.sock"))
        uid = os.getuid()
        assert socket_path_reason(str(d / "x.sock"), uid) is None
        assert socket_path_reason(str(d / "x.sock"), uid + 1) is RejectReason.SOCKET_DIR_OWNER
        d.chmod(0o750)
        assert socket_path_reason(str(d / "x.sock"), uid) is RejectReason.SOCKET_DIR_MODE
        d.chmod(0o700)
        (d / "link.sock").symlink_to(d / "x.sock")
        assert socket_path_reason(str(d / "link.sock"), uid) is RejectReason.SOCKET_SYMLINK
        assert socket_path_reason("relative/x.sock", uid) is RejectReason.SOCKET_PATH
        assert socket_path_reason(str(d / "missing.sock"), uid) is RejectReason.SOCKET_PATH
        s.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- descriptors from elsewhere ---------------------------------------------------------


def test_descriptor_from_another_deployment_key_is_rejected() -> None:
    wire = encode(descriptor(), Deployment(DEPLOYMENT.name, os.urandom(32)))
    with pytest.raises(DescriptorRejected) as info:
        decode(wire, DEPLOYMENT)
    assert info.value.reason is RejectReason.AUTHENTICATION


def test_descriptor_naming_another_deployment_is_rejected() -> None:
    """Right key, wrong domain (a key shared by mistake across deployments)."""
    other = Deployment("another-deployment", DEPLOYMENT.key)
    wire = encode(descriptor(deployment_id=other.id), DEPLOYMENT)
    with pytest.raises(DescriptorRejected) as info:
        decode(wire, DEPLOYMENT)
    assert info.value.reason is RejectReason.DOMAIN


def test_every_tampered_byte_is_rejected() -> None:
    """Flipping any single bit of any byte of a descriptor makes it rejected (typed)."""
    wire = encode(descriptor(), DEPLOYMENT)
    for i in range(len(wire)):
        for bit in (0x01, 0x80):
            bad = bytearray(wire)
            bad[i] ^= bit
            with pytest.raises(DescriptorRejected):
                decode(bytes(bad), DEPLOYMENT)


# -- replayed generations -----------------------------------------------------------------


def _import(ex: Exporter, wire: bytes, **expect: object) -> Importer:
    im = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), HostTransport(granularity=64 * 1024))
    try:
        im.import_group([wire], **expect)
    finally:
        im.close()
    return im


def test_replayed_old_generation_is_rejected_at_validation(exporter: Exporter) -> None:
    """INV-REJECT-BEFORE-OPEN: min_generation refuses an older descriptor before connecting."""
    current = decode(exporter.descriptor(0), DEPLOYMENT)
    old = encode(attrs.evolve(current, generation=current.generation - 1), DEPLOYMENT)
    with pytest.raises(GroupRejected) as info:
        _import(exporter, old, min_generation=current.generation)
    assert {p.reason for p in info.value.problems} == {RejectReason.GENERATION}
    assert exporter.banks[0].leases == {}


def test_replayed_old_generation_is_refused_at_lease_time(exporter: Exporter) -> None:
    """Without min_generation the importer connects, and the exporter refuses the lease."""
    current = decode(exporter.descriptor(0), DEPLOYMENT)
    old = encode(attrs.evolve(current, generation=current.generation - 1), DEPLOYMENT)
    with pytest.raises(ImportFailed) as info:
        _import(exporter, old)
    assert (isinstance(info.value.__cause__, ImportFailed) and info.value.__cause__.reason is ImportReason.REFUSED) and info.value.__cause__.code == "stale_generation"
    assert info.value.reason is ImportReason.REFUSED and info.value.cause is info.value.__cause__
    assert exporter.banks[0].leases == {}


def test_descriptor_of_a_previous_exporter_incarnation_is_refused(exporter: Exporter) -> None:
    """A replay after a restart: same socket path, new incarnation."""
    wire = exporter.descriptor(0)
    current = decode(wire, DEPLOYMENT)
    old = encode(attrs.evolve(current, incarnation=os.urandom(16)), DEPLOYMENT)
    with pytest.raises(ImportFailed) as info:
        _import(exporter, old)
    assert (isinstance(info.value.__cause__, ImportFailed) and info.value.__cause__.reason is ImportReason.REFUSED) and info.value.__cause__.code == "stale_incarnation"


# -- no pickle, no eval --------------------------------------------------------------------


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.marker,))


def test_pickles_and_code_are_data_not_instructions(exporter: Exporter, tmp_path: Path) -> None:
    """A pickle that would run code on load, and Python source, are refused as data by
    every decoder, and nothing runs."""
    marker = str(tmp_path / "ran")
    evil = [pickle.dumps(_Boom(marker), protocol=p) for p in (0, 2, 5)]
    evil += [b"__import__('os').mkdir(%r)" % marker.encode(), json.dumps({"op": f"__import__('os').mkdir({marker!r})"}).encode()]
    for payload in evil:
        with pytest.raises(DescriptorRejected):
            decode(payload, DEPLOYMENT)
        try:
            chan.decode(payload)
        except ChannelError as exc:
            if exc.reason is not ChannelReason.FRAME:
                raise
            pass
        with chan.connect(exporter.socket_path) as ch:
            ch.send(payload)
            with ch.recv() as msg:
                reply = chan.decode(msg.payload)
            assert reply["ok"] is False and not msg.fds
    assert not os.path.exists(marker)


FORBIDDEN_MODULES = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "yaml"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_package_source_uses_no_pickle_and_no_eval() -> None:
    """A guard on top of the behavioural test: kvstate never imports a deserialiser that
    runs code, and never evaluates text. (cluster.py uses multiprocessing to start its own
    worker processes; after start-up they speak JSON only.)"""
    root = Path(__file__).resolve().parents[2] / "kvstate"
    found = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{path.name}: from {node.module}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
                found.append(f"{path.name}:{node.lineno}: {node.func.id}()")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("loads", "load") \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in FORBIDDEN_MODULES:
                found.append(f"{path.name}:{node.lineno}: {node.func.value.id}.{node.func.attr}()")
    assert found == []


def test_source_guard_catches_a_planted_eval(tmp_path: Path) -> None:
    tree = ast.parse("import pickle\nx = eval(input())\n")
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    imports = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert "eval" in calls and FORBIDDEN_CALLS & set(calls)
    assert FORBIDDEN_MODULES & set(imports)


def test_channel_close_is_seen_as_closed_not_data() -> None:
    """An empty packet (or EOF) is a closed channel, never an empty message."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with chan.Channel(b) as ch:
        a.close()
        with raises(ChannelError, ChannelReason.CLOSED):
            ch.recv(timeout=1.0)
    time.sleep(0)


@pytest.mark.parametrize("request_", [{"op": "lease", "rank": [0]}, {"op": "lease", "rank": {"a": 1}},
                                      {"op": ["lease"], "rank": 0}, {"op": "release", "rank": 0, "lease": {}},
                                      {"op": "lease", "rank": 0, "generation": True}])
def test_mistyped_request_fields_get_a_typed_refusal(exporter: Exporter, request_: dict[str, object]) -> None:
    """Found by fuzzing: an unhashable rank or lease crashed the connection handler with a
    TypeError. Now every field is type-checked first, and the connection stays usable."""
    with chan.connect(exporter.socket_path) as ch:
        ch.send(chan.encode(request_))
        with ch.recv() as msg:
            reply = chan.decode(msg.payload)
        assert reply["ok"] is False and reply["code"] == ChannelReason.FRAME.value
        ch.send(chan.encode({"op": "nothing", "rank": 0, "lease": 1}))
        with ch.recv() as msg:
            assert chan.decode(msg.payload)["code"] == "unknown_lease"


def test_a_lease_answers_only_to_the_connection_that_took_it(exporter: Exporter) -> None:
    """A lease is bound to its connection: another peer that names its id (ids are small
    integers, easy to guess) can neither return it nor report it mapped, so one importer
    cannot end or move another's lease; the holder still can."""
    current = decode(exporter.descriptor(0), DEPLOYMENT)
    bank = exporter.banks[0]
    with chan.connect(exporter.socket_path) as holder, chan.connect(exporter.socket_path) as other:
        holder.send(chan.encode({"op": "lease", "rank": 0, "generation": current.generation,
                                 "incarnation": current.incarnation.hex(), "blocks": None}))
        with holder.recv() as msg:
            lease = chan.decode(msg.payload)["lease"]
        assert set(bank.leases) == {lease} and bank.state == "importing"
        other.send(chan.encode({"op": "mapped", "rank": 0, "lease": lease}))  # a notification: no answer
        other.send(chan.encode({"op": "release", "rank": 0, "lease": lease}))  # answered after it, in order
        with other.recv() as msg:
            assert chan.decode(msg.payload)["code"] == "unknown_lease"
        assert set(bank.leases) == {lease} and bank.state == "importing"
        holder.send(chan.encode({"op": "release", "rank": 0, "lease": lease}))
        with holder.recv() as msg:
            assert chan.decode(msg.payload)["ok"] is True
        assert bank.leases == {} and bank.state == "advertised"
