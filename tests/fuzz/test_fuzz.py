"""Hypothesis fuzzing of every input boundary (targets in ``targets.py``), and replay of
the corpus of interesting inputs under ``tests/fuzz/corpus``.

The ``ci`` profile runs 100 cases per target (a few seconds in all); ``make fuzz`` runs
the ``fuzz`` profile (20,000 per target) and prints the case count of each target.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from kvstate import channel as chan
from kvstate.channel import HEADER, MAGIC
from kvstate.core.descriptor import encode
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.reuse.policy import SETTING_NAMES, cli_flag, env_var
from kvstate.reuse.profile import PROTOCOL_VERSION
from kvstate.transport.host import HostTransport

from fuzz import targets
from support.descriptors import DEPLOYMENT, descriptor

CORPUS = Path(__file__).parent / "corpus"
VALID_WIRE = encode(descriptor(), DEPLOYMENT)
VALID_BODY = json.loads(VALID_WIRE[9:-32])
VALID_CAPS: dict[str, Any] = {
    "device_uuids": ["11" * 16, "22" * 16], "handle_kinds": ["memfd"], "fabric_trial": "passed",
    "transports": [{"name": "host", "handle_kinds": ["memfd"], "memory_kinds": ["host"], "scopes": ["same_node"]}],
    "geometry_fingerprint": Geometry.uniform(layers=2, kv_heads=2, head_dim=8, block_tokens=4, dtype=DType.BF16,
                                     layout=Layout.BLOCK_MAJOR, num_blocks=16).fingerprint().hex(),
    "protocol_version": PROTOCOL_VERSION,
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


# -- descriptors ---------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    """``base`` with a few bytes flipped, cut, inserted or appended."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "cut", "insert", "append"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if how == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del data[at:]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            data += draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


@given(st.one_of(st.binary(max_size=400), mutated(VALID_WIRE)))
def test_descriptor_wire(data: bytes) -> None:
    targets.descriptor_wire(data)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """Bodies that pass the MAC: valid ones with fields changed, dropped or added, and raw text."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=300))
    body: dict[str, Any] = dict(VALID_BODY)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(body) + ["extra"]))
        how = draw(st.sampled_from(["replace", "drop", "int", "hex"]))
        if how == "drop":
            body.pop(key, None)
        elif how == "int":
            body[key] = draw(st.integers(-(2**70), 2**70))
        elif how == "hex":
            body[key] = draw(st.binary(max_size=40)).hex()
        else:
            body[key] = draw(json_values)
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@given(bodies())
def test_descriptor_body_behind_a_valid_mac(body: bytes) -> None:
    targets.descriptor_body(body)


# -- channel -------------------------------------------------------------------------


@st.composite
def packets(draw: st.DrawFn) -> bytes:
    """Frames with a plausible or broken header (magic, length, fd count) and any payload."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=64))
    payload = draw(st.one_of(st.binary(max_size=64), json_values.map(lambda v: json.dumps({"v": v}).encode()),
                             st.binary(min_size=1025, max_size=1100)))
    magic = draw(st.sampled_from([MAGIC, b"KVS\x02", b"\0\0\0\0"]))
    length = draw(st.one_of(st.just(len(payload)), st.integers(0, 2**32 - 1)))
    nfds = draw(st.integers(0, 2**16 - 1))
    return struct.pack("<4sIH2x", magic, length, nfds) + payload


@given(packets(), st.integers(0, 6))
def test_channel_frames(packet: bytes, nfds: int) -> None:
    targets.frame(packet, nfds)


@given(st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                 st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n)))
def test_channel_messages(data: bytes) -> None:
    targets.message(data)


# -- settings and profiles -----------------------------------------------------------

setting_names = st.one_of(st.sampled_from(sorted(SETTING_NAMES)), st.text(max_size=12))
setting_values = st.one_of(json_values, st.text(alphabet="0123456789.-+eEinfatrux ", max_size=30),
                           st.integers(1, 10_000).map(lambda n: "9" * n))


@given(st.dictionaries(setting_names, setting_values, max_size=5))
def test_settings_from_mapping(mapping: dict[str, Any]) -> None:
    targets.settings_mapping(mapping)


@given(st.dictionaries(st.one_of(setting_names.map(lambda n: env_var(n) if n in SETTING_NAMES else n),
                                 st.text(max_size=20).map(lambda t: "KVSTATE_POLICY_" + t)),
                       setting_values.map(str), max_size=5))
def test_settings_from_env(environ: dict[str, str]) -> None:
    targets.settings_env(environ)


@given(st.lists(st.one_of(setting_names.map(lambda n: cli_flag(n) if n in SETTING_NAMES else n),
                          setting_values.map(str),
                          st.tuples(st.sampled_from(sorted(SETTING_NAMES)), setting_values.map(str))
                          .map(lambda p: f"{cli_flag(p[0])}={p[1]}")), max_size=6))
def test_settings_from_cli(argv: list[str]) -> None:
    targets.settings_cli(argv)


@st.composite
def capability_sets(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 4)) == 0:
        return draw(json_values)
    wire: dict[str, Any] = json.loads(json.dumps(VALID_CAPS))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(wire) + ["extra"]))
        if draw(st.booleans()):
            wire.pop(key, None)
        elif key == "transports" and draw(st.booleans()):
            entry = dict(VALID_CAPS["transports"][0])
            entry[draw(st.sampled_from(sorted(entry) + ["x"]))] = draw(json_values)
            wire[key] = [entry]
        else:
            wire[key] = draw(json_values)
    return wire


@given(capability_sets())
def test_capabilities(wire: Any) -> None:
    targets.capabilities(wire)


@given(st.binary(max_size=200))
def test_capabilities_json_text(text: bytes) -> None:
    targets.capabilities_json(text)


# -- exporter requests ----------------------------------------------------------------


@pytest.fixture
def exporter_channel() -> Iterator[chan.Channel]:
    """A real exporter serving one bank, and one connection to it."""
    d = Path(tempfile.mkdtemp(prefix="kvs-fuzz-"))
    os.chmod(d, 0o700)
    t = HostTransport(granularity=64 * 1024)
    ex = Exporter(ExportConfig(DEPLOYMENT, d / "sock", os.urandom(16), 1, lease_timeout_s=30.0), t, name="fuzz")
    bank = ex.add_bank(0, Geometry.uniform(layers=1, kv_heads=1, head_dim=8, block_tokens=4, dtype=DType.BF16,
                                   layout=Layout.BLOCK_MAJOR, num_blocks=4))
    bank.fire("register")
    bank.fire("advertise")
    ex.start()
    ch = chan.connect(ex.socket_path)
    try:
        yield ch
    finally:
        ch.close()
        ex.stop()
        ex.drain(10.0)


requests = st.one_of(
    st.binary(max_size=100),
    st.fixed_dictionaries({}, optional={"op": st.one_of(st.sampled_from(["lease", "mapped", "release", "x"]), json_values),
                                        "rank": st.one_of(st.just(0), json_values),
                                        "lease": json_values, "generation": st.one_of(st.just(1), json_values),
                                        "incarnation": json_values, "blocks": json_values})
    .map(lambda r: json.dumps(r).encode()))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests)
def test_exporter_requests(exporter_channel: chan.Channel, payload: bytes) -> None:
    targets.request(exporter_channel, payload)


# -- the corpus -------------------------------------------------------------------------

REPLAY = {
    "descriptor": lambda raw: targets.descriptor_wire(raw),
    "descriptor_body": lambda raw: targets.descriptor_body(raw),
    "frame": lambda raw: targets.frame(raw[1:], raw[0]),  # first byte: the fd count to attach
    "message": lambda raw: targets.message(raw),
    "settings_mapping": lambda raw: targets.settings_mapping(json.loads(raw)),
    "settings_env": lambda raw: targets.settings_env(json.loads(raw)),
    "settings_cli": lambda raw: targets.settings_cli(json.loads(raw)),
    "capabilities": lambda raw: targets.capabilities_json(raw),
}


def corpus() -> list[Path]:
    return sorted(p for p in CORPUS.glob("*/*") if p.is_file())


@pytest.mark.parametrize("path", corpus(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_replays(path: Path) -> None:
    """Every saved interesting input still gets a typed answer (or is accepted)."""
    REPLAY[path.parent.name](path.read_bytes())


def test_corpus_covers_every_target() -> None:
    assert {p.parent.name for p in corpus()} == set(REPLAY)


# -- the harness itself catches what it claims to -------------------------------------------


def test_harness_fails_an_untyped_exception() -> None:
    with pytest.raises(targets.Untyped):
        targets.run("planted", lambda: int("not a number"))


def test_harness_fails_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(targets, "HANG_S", 0.05)
    with pytest.raises(targets.Hang):
        targets.run("planted", lambda: time.sleep(5))


def test_harness_passes_typed_rejections() -> None:
    err = targets.run("planted", lambda: chan.decode(b"["))
    assert isinstance(err, ChannelError) and err.reason is ChannelReason.FRAME
