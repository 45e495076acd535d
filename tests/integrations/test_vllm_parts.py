"""The vLLM connector's parts that need no vLLM: settings, hashing, the slot table, the
index protocol, the counters. (tests/vllm runs the connector in real engines.)"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import attrs
import pytest

from support.errors import raises

from kvstate import channel as chan
from kvstate.core import heads
from kvstate.core.reasons import ChannelReason, ConfigReason
from kvstate.core.errors import ChannelError, ConfigInvalid
from kvstate.core.identity import Deployment
from kvstate.integrations.vllm import config as cfgmod
from kvstate.integrations.vllm import stats, wire
from kvstate.integrations.vllm.hashing import Compat, block_key, block_keys, prefix_hashes, root, source_id
from kvstate.integrations.vllm.layout import (MLA_ISA, bank_blocks, bank_geometry, block_bytes, scales_problem,
                                              tensor_problem)
from kvstate.integrations.vllm.tp import same_tp, source_view
from kvstate.integrations.vllm.orders import LoadFailures, failure_code
from kvstate.integrations.vllm.slots import SlotTable

KEY = bytes(range(32))
ENV = {cfgmod.KEY_ENV: KEY.hex()}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


BASE = Compat(model="tiny", dtype="bf16", block_size=4, head_dim=8, kv_heads=2, layers=("l0", "l1"), tp=1,
              isa="vec", engine="vllm-0.32.0")


def compat(**kw: object) -> Compat:
    return attrs.evolve(BASE, **kw)


def reason(a: Compat, b: Compat) -> str | None:
    found = a.mismatch(b)
    return None if found is None else found[0]


# -- settings ----------------------------------------------------------------------------------


def test_defaults_keep_reuse_off_and_need_a_key() -> None:
    c = cfgmod.parse({}, "kv_consumer", ENV)
    assert not c.policy.enable_decode_to_prefill_reuse
    assert c.consumer and not c.producer and c.sources == ("decode",)
    assert c.socket_dir == Path(f"/tmp/kvstate-{os.getuid()}-kvstate")
    with pytest.raises(ConfigInvalid) as e:
        cfgmod.parse({}, "kv_producer", {})
    assert e.value.field == "deployment_key_file"


@pytest.mark.parametrize(("extra", "field"), [
    ({"nope": 1}, "nope"),
    ({"retain_bytes": 0}, "retain_bytes"),
    ({"retain_bytes": True}, "retain_bytes"),
    ({"sources": []}, "sources"),
    ({"sources": ["a/b"]}, "sources[0]"),
    ({"socket_dir": "relative"}, "socket_dir"),
    ({"load_timeout_s": -1}, "load_timeout_s"),
    ({"policy": {"enable_decode_to_prefill_reuse": "maybe"}}, "policy"),
    ({"policy": {"unknown_setting": 1}}, "policy"),
    ({"deployment": ""}, "deployment"),
    ({"gil_switch_interval_s": 0}, "gil_switch_interval_s"),
    ({"gil_switch_interval_s": -0.001}, "gil_switch_interval_s"),
    ({"gil_switch_interval_s": 0.01}, "gil_switch_interval_s"),
    ({"gil_switch_interval_s": True}, "gil_switch_interval_s"),
    ({"gil_switch_interval_s": "0.001"}, "gil_switch_interval_s"),
])
def test_every_bad_key_is_refused_by_name(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigInvalid) as e:
        cfgmod.parse(extra, "kv_both", ENV)
    assert e.value.field == field


def test_the_switch_interval_is_lowered_never_raised() -> None:
    import subprocess
    import sys

    assert cfgmod.parse({}, "kv_both", ENV).gil_switch_interval_s is None       # Python's own, unless asked
    assert cfgmod.parse({"gil_switch_interval_s": 0.0005}, "kv_both", ENV).gil_switch_interval_s == 0.0005
    probe = ("import sys; from kvstate.integrations.vllm.gil import share_the_gil as s; d = sys.getswitchinterval(); "
             "print(s(None), sys.getswitchinterval() == d, s(0.01), sys.getswitchinterval() == d, "
             "s(0.0005), sys.getswitchinterval(), s(0.001), sys.getswitchinterval())")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True", "False", "True", "True", "0.0005", "False", "0.0005"]


def test_role_must_be_vllms() -> None:
    with pytest.raises(ConfigInvalid):
        cfgmod.parse({}, "kv_decoder", ENV)


def test_key_file_must_be_private(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text(KEY.hex())
    f.chmod(0o644)
    with pytest.raises(ConfigInvalid, match="grant group"):
        cfgmod.parse({"deployment_key_file": str(f)}, "kv_both", {})
    f.chmod(0o600)
    assert cfgmod.parse({"deployment_key_file": str(f)}, "kv_both", {}).deployment.key == KEY
    f.write_bytes(KEY[:31])
    with pytest.raises(ConfigInvalid, match="32 raw bytes"):
        cfgmod.parse({"deployment_key_file": str(f)}, "kv_both", {})


def test_policy_enables_reuse() -> None:
    c = cfgmod.parse({"policy": {"enable_decode_to_prefill_reuse": True}}, "kv_consumer", ENV)
    assert c.policy.enable_decode_to_prefill_reuse


def test_docs_list_every_key_and_counter_with_its_default() -> None:
    text = DOCS.read_text(encoding="utf-8")
    for key in cfgmod.KEYS:
        assert re.search(rf"^\| `{key}` \|", text, re.M), f"docs/vllm.md lacks the key {key}"
    for name in [*stats.COUNTERS, *stats.GROUPS]:
        assert f"`{name}`" in text, f"docs/vllm.md lacks the counter {name}"


# -- hashing -------------------------------------------------------------------------------------


def test_prefix_hashes_chain_like_a_prefix_cache() -> None:
    dep = Deployment("d", KEY)
    r = root(dep, compat())
    toks = list(range(100, 118))                 # 4 full blocks of 4, and 2 tokens
    hs = prefix_hashes(dep, r, toks, 4)
    assert len(hs) == 4 and len(set(hs)) == 4
    changed = toks.copy()
    changed[9] += 1                              # block 2
    hc = prefix_hashes(dep, r, changed, 4)
    assert hc[:2] == hs[:2] and not set(hc[2:]) & set(hs)
    assert prefix_hashes(dep, r, toks[:9], 4) == hs[:2]   # a shorter prompt shares the prefix


@pytest.mark.parametrize("seed", range(20))
def test_the_hashes_are_their_definition(seed: int) -> None:
    """Each prefix hash and inventory key is the keyed, personalised BLAKE2b its docstring
    names, computed here from hashlib directly: decode and prefill engines of different
    kvstate versions must name a block alike (the fast paths copy one keyed hasher)."""
    import hashlib
    import random
    import struct
    rng = random.Random(seed)
    dep = Deployment("d", rng.randbytes(32))
    bs = rng.choice([1, 4, 16, 32])
    toks = [rng.randrange(-2**63, 2**63) for _ in range(rng.randrange(0, 6 * bs))]
    start = rng.randbytes(16)

    def h(data: bytes, size: int) -> bytes:
        return hashlib.blake2b(data, digest_size=size, key=dep.key, person=b"kvstate/inventry").digest()

    want, parent = [], start
    for i in range(len(toks) // bs):
        parent = h(b"B" + parent + struct.pack(f"<{bs}q", *toks[i * bs:(i + 1) * bs]), 16)
        want.append(parent)
    got = prefix_hashes(dep, start, toks, bs)
    assert got == want
    slots = [rng.randrange(2**40) for _ in got]
    assert block_keys(dep, got, slots) == [int.from_bytes(h(b"K" + x + s.to_bytes(8, "little"), 8), "little")
                                           for x, s in zip(got, slots)]
    assert [block_key(dep, x, s) for x, s in zip(got, slots)] == block_keys(dep, got, slots)


def test_hashes_are_keyed_salted_and_compat_bound() -> None:
    dep = Deployment("d", KEY)
    toks = list(range(8))
    base = prefix_hashes(dep, root(dep, compat()), toks, 4)
    others = [
        prefix_hashes(Deployment("d", bytes(32)), root(Deployment("d", bytes(32)), compat()), toks, 4),
        prefix_hashes(dep, root(dep, compat(), salt="tenant"), toks, 4),
        prefix_hashes(dep, root(dep, compat(tp=2)), toks, 4),
        prefix_hashes(dep, root(dep, compat(model="other")), toks, 4),
    ]
    for o in others:
        assert not set(o) & set(base)
    assert block_key(dep, base[0], 1) != block_key(dep, base[0], 2)
    assert 0 <= block_key(dep, base[0], 1) < 2**64
    assert source_id(dep, "decode") != source_id(dep, "decode2") and len(source_id(dep, "decode")) == 16


def test_compat_mismatch_names_the_reason_tp_first() -> None:
    a = compat()
    assert reason(a, compat()) is None
    assert reason(a, compat(tp=2, dtype="fp32")) == "tp_mismatch"
    assert reason(a, compat(dtype="fp32")) == "dtype"
    assert reason(a, compat(isa="amx")) == "attention_isa"
    assert reason(a, compat(layers=("l0",))) == "geometry"
    assert Compat.from_dict(a.as_dict()) == a
    for bad in ({}, {**a.as_dict(), "tp": "2"}, {**a.as_dict(), "layers": "l0"}, {**a.as_dict(), "x": 1}):
        assert Compat.from_dict(bad) is None


def test_bank_geometry_matches_the_cpu_layout() -> None:
    c = compat()
    assert block_bytes(c) == 2 * 2 * 4 * 16 * 2
    assert bank_blocks(c, 10 * block_bytes(c) + 1) == 10 and bank_blocks(c, 1) == 1
    g = bank_geometry(c, 10)
    assert g.names == ("l0", "l1") and g.block_bytes == block_bytes(c)

    class T:
        def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
            self.dtype, self.shape = dtype, shape

    good = {"l0": T("torch.bfloat16", (64, 2, 4, 16)), "l1": T("torch.bfloat16", (64, 2, 4, 16))}
    assert tensor_problem(c, good) is None
    assert "dtype" in str(tensor_problem(c, {**good, "l1": T("torch.float16", (64, 2, 4, 16))}))
    assert "CPU layout" in str(tensor_problem(c, {**good, "l1": T("torch.bfloat16", (2, 64, 4, 2, 8))}))
    assert "layers" in str(tensor_problem(c, {"l0": good["l0"]}))


def test_an_mla_key_is_one_latent_per_token_in_the_cpu_mla_layout() -> None:
    """vLLM's CPU_MLA cache: per layer [num_blocks, 1, block_size, latent], no K/V pair; the
    key says MLA by its isa, and an MLA key never matches a K/V key of the same numbers."""
    c = compat(isa=MLA_ISA, kv_heads=1, head_dim=576)
    assert block_bytes(c) == 2 * 4 * 576 * 2
    g = bank_geometry(c, 3)
    assert g.block_bytes == block_bytes(c) and g.regions[0].shape == (3, 1, 4, 576)

    class T:
        def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
            self.dtype, self.shape = dtype, shape

    good = {"l0": T("torch.bfloat16", (64, 1, 4, 576)), "l1": T("torch.bfloat16", (64, 1, 4, 576))}
    assert tensor_problem(c, good) is None
    assert "CPU MLA layout" in str(tensor_problem(c, {**good, "l1": T("torch.bfloat16", (64, 1, 4, 1152))}))
    assert "CPU MLA layout" in str(tensor_problem(c, {**good, "l1": T("torch.bfloat16", (64, 4, 576))}))
    assert tensor_problem(compat(kv_heads=1, head_dim=576), good) is not None  # K/V of 576 is 1152 wide
    assert reason(c, compat(kv_heads=1, head_dim=576)) == "attention_isa"


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_is_uint8_tensors_and_one_byte_banks(fmt: str) -> None:
    """vLLM's CPU FP8 cache is torch.uint8 holding the FP8 bits: accepted for an FP8 key,
    refused for any other (and a bf16 tensor is refused for an FP8 key)."""
    c = compat(dtype=fmt)
    assert block_bytes(c) == 2 * 2 * 4 * 16 * 1
    assert bank_geometry(c, 4).regions[0].dtype.value == fmt

    class T:
        def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
            self.dtype, self.shape = dtype, shape

    fp8 = {"l0": T("torch.uint8", (64, 2, 4, 16)), "l1": T("torch.uint8", (64, 2, 4, 16))}
    assert tensor_problem(c, fp8) is None
    assert "dtype" in str(tensor_problem(compat(), fp8))
    assert "dtype" in str(tensor_problem(c, {**fp8, "l1": T("torch.bfloat16", (64, 2, 4, 16))}))


def test_fp8_kv_is_shared_only_under_unit_scales() -> None:
    assert scales_problem({"l0": (1.0, 1.0), "l1": (1.0, 1.0)}) is None
    assert "l1" in str(scales_problem({"l0": (1.0, 1.0), "l1": (0.5, 1.0)}))
    assert scales_problem({"l0": (None, None)}) is not None  # a layer without scales is not assumed


@pytest.mark.parametrize("total, own_tp, source_tp, parts", [(2, 1, 2, 2), (2, 2, 1, 2), (8, 2, 4, 4), (2, 4, 2, 4)])
def test_source_view_is_the_decode_engines_key(total: int, own_tp: int, source_tp: int, parts: int) -> None:
    """A prefill engine at own_tp looks blocks up under the decode engine's key (its tp and
    heads per rank), and its coordinator has one part per slice."""
    c = compat(tp=own_tp, kv_heads=heads.rank_heads(total, own_tp, 0)[1])
    view = source_view(c, total, source_tp)
    assert view.compat == compat(tp=source_tp, kv_heads=heads.rank_heads(total, source_tp, 0)[1])
    assert len(view.slices) == parts and view.mixed
    assert source_view(c, total, None) == same_tp(c) and not same_tp(c).mixed


def test_source_view_refuses_what_no_split_divides() -> None:
    with raises(ConfigInvalid, ConfigReason.HEAD_SPLIT):
        source_view(compat(tp=1, kv_heads=6), 6, 4)
    with raises(ConfigInvalid, ConfigReason.FIELD):  # the registered heads are not this split's
        source_view(compat(tp=2, kv_heads=2), 2, 1)


def test_source_tp_is_a_tp_size_or_null() -> None:
    assert cfgmod.parse({"source_tp": 2}, "kv_consumer", ENV).source_tp == 2
    assert cfgmod.parse({}, "kv_consumer", ENV).source_tp is None
    for bad in (0, 65, True, "2", 1.0):
        with raises(ConfigInvalid, ConfigReason.FIELD, match="source_tp"):
            cfgmod.parse({"source_tp": bad}, "kv_consumer", ENV)


# -- the slot table ------------------------------------------------------------------------------


def table(capacity: int = 8, tp: int = 2) -> SlotTable:
    return SlotTable(capacity, tp, lambda h, s: int.from_bytes(h[:4], "little") * 1000 + s)


def H(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_block_is_advertised_only_once_every_rank_stored_it() -> None:
    t = table()
    res = t.reserve([H(1), H(2), H(3)])
    assert [r.index for r in res] == [0, 1, 2] and len({r.slot for r in res}) == 3
    assert t.lookup([H(1)]) == []                       # storing: not advertised
    keys = [r.key for r in res]
    t.stored(0, keys)
    assert t.lookup([H(1)]) == []                       # rank 1 has not stored yet
    t.stored(1, keys)
    assert [h.slot for h in t.lookup([H(1), H(2), H(3), H(4)])] == [r.slot for r in res]
    assert [h.slot for h in t.lookup([H(1), H(9), H(3)])] == [res[0].slot]   # a prefix only
    assert t.reserve([H(1), H(2), H(4)])[0].index == 2  # retained blocks are not stored again


def test_a_store_that_failed_on_one_rank_is_removed_where_it_succeeded() -> None:
    t = table()
    (r,) = t.reserve([H(1)])
    assert t.stored(0, [r.key]) == []
    assert t.store_failed(1, [r.key]) == [r.key]        # rank 0 must drop it
    assert t.lookup([H(1)]) == [] and t.counts()["evicting"] == 1
    t.removed(0, [r.key])
    assert t.counts() == {"capacity": 8, "free": 8, "storing": 0, "stored": 0, "evicting": 0}


def test_a_bank_block_is_reused_only_after_every_rank_dropped_its_key() -> None:
    t = table(capacity=4, tp=2)
    first = t.reserve([H(i) for i in range(4)])
    for rank in (0, 1):
        t.stored(rank, [r.key for r in first])
    t.lookup([H(2), H(3)]) and t.lookup([H(0)])         # recency: 1 is the least recently used
    assert t.reserve([H(10)]) == []                     # full: nothing stored, nothing evicted
    victims = t.choose_evictions()
    assert victims == [first[1].key] and t.lookup([H(1)]) == []
    t.removed(0, victims)                                # rank 1 still holds it (a lease)
    assert t.reserve([H(10)]) == [] and t.evicting() == victims
    t.removed(1, victims)
    (again,) = t.reserve([H(10)])
    assert again.slot == first[1].slot and again.key != first[1].key   # a new key for the old block


def test_storing_blocks_are_never_evicted() -> None:
    t = table(capacity=2, tp=1)
    t.reserve([H(1), H(2)])
    assert t.choose_evictions() == []


def test_reserve_stops_at_the_first_block_without_room() -> None:
    t = table(capacity=2, tp=1)
    assert [r.index for r in t.reserve([H(1), H(2), H(3)])] == [0, 1]


@pytest.mark.parametrize("seed", range(40))
def test_the_counts_kept_as_blocks_move_are_the_counts_of_the_blocks(seed: int) -> None:
    """counts() and evicting() are kept as blocks change state (the scheduler asks for
    every finished request; counting every block made that cost the bank's size): after
    every operation of a random run they equal a count of the blocks themselves."""
    import random

    from kvstate.integrations.vllm.slots import SlotState

    rng = random.Random(seed)
    tp = rng.choice((1, 2, 3))
    t = table(capacity=rng.choice((4, 16, 64)), tp=tp)
    keys: list[int] = []
    for _ in range(400):
        op = rng.randrange(6)
        if op == 0:
            keys += [r.key for r in t.reserve([H(rng.randrange(200)) for _ in range(rng.randrange(1, 6))])]
        elif op in (1, 2) and keys:
            picked = rng.sample(keys, min(len(keys), rng.randrange(1, 4)))
            keys += (t.stored if op == 1 or rng.random() < 0.8 else t.store_failed)(rng.randrange(tp), picked)
        elif op == 3:
            keys += t.choose_evictions()
        elif op == 4 and keys:
            t.removed(rng.randrange(tp), rng.sample(keys, min(len(keys), rng.randrange(1, 4))))
        else:
            t.lookup([H(rng.randrange(200)) for _ in range(3)])
        entries = list(t._slots.values())
        assert t.counts() == {"capacity": t.capacity, "free": t.capacity - len(entries),
                              **{s.value: sum(e.state is s for e in entries) for s in SlotState}}
        assert sorted(t.evicting()) == sorted(e.key for e in entries if e.state is SlotState.EVICTING)


# -- the protocol and the counters --------------------------------------------------------------


def test_key_file_is_checked_before_it_is_read(tmp_path: Path) -> None:
    """A FIFO (it blocked parse for good), a device or a huge file is refused by name,
    before a byte is read; a symlink to a good key file (as secret mounts make) is fine."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    big = tmp_path / "big"
    big.write_bytes(b"0" * (cfgmod.MAX_KEY_FILE_BYTES + 1))
    big.chmod(0o600)
    for bad in (fifo, big, Path("/dev/zero")):
        with pytest.raises(ConfigInvalid, match="regular file"):
            cfgmod.parse({"deployment_key_file": str(bad)}, "kv_both", {})
    good = tmp_path / "key"
    good.write_text(KEY.hex() + "\n")
    good.chmod(0o600)
    (tmp_path / "link").symlink_to(good)
    assert cfgmod.parse({"deployment_key_file": str(tmp_path / "link")}, "kv_both", {}).deployment.key == KEY
    for extra in (["deployment"], "abc", 5):
        with pytest.raises(ConfigInvalid, match="mapping"):
            cfgmod.parse(extra, "kv_both", ENV)  # type: ignore[arg-type]


def test_the_largest_messages_fit_one_socket_send() -> None:
    """Every message kind at its bound, with its largest values, goes through a real
    SOCK_SEQPACKET pair at the default socket buffer (a message over the buffer is refused
    by the kernel whole: it failed as a raw OSError from 8k blocks). And one that does not
    fit is a ChannelError (FRAME), not an OSError."""
    n, top = wire.MAX_BLOCKS, 2**64 - 1
    worst = [wire.encode("found", blocks=n, slots=[10**6 + i for i in range(n)], keys=[top - i for i in range(n)],
                         epochs=[top] * 64, generation=top),
             wire.encode("stored", rank=top, keys=[top - i for i in range(n)], failed=[]),
             wire.encode("evict", keys=[top - i for i in range(n)]),
             wire.encode("lookup", compat=compat().as_dict(), hashes=b"\xff" * (n * 32))]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with chan.Channel(a, limits=wire.LIMITS) as tx, chan.Channel(b, limits=wire.LIMITS) as rx:
        for payload in worst:
            tx.send(payload, timeout=5.0)
            with rx.recv(timeout=5.0) as got:
                assert got.payload == payload
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with chan.Channel(c, limits=chan.Limits(max_payload=chan.HARD_MAX_PAYLOAD)) as tx, chan.Channel(d):
        with raises(ChannelError, ChannelReason.FRAME, match="send buffer"):
            tx.send(b"x" * (chan.HARD_MAX_PAYLOAD - 64), timeout=5.0)


def test_messages_are_checked_field_by_field() -> None:
    payload = wire.encode("found", blocks=1, slots=[3], keys=[2**63], epochs=[1], generation=1)
    assert wire.decode(payload, "found")["keys"] == [2**63]
    for kind, fields in [("found", {"blocks": 1}), ("nope", {}),
                         ("hello", {"rank": 0, "tp": 1, "pid": 1, "epoch": 2**64, "compat": {}}),  # no found carries it
                         ("evict", {"keys": [-1]}), ("evict", {"keys": [2**64]}), ("stored", {"rank": 0, "keys": [],
                                                                                              "failed": "x"})]:
        with raises(ChannelError, ChannelReason.PROTOCOL):
            wire.encode(kind, **fields)
    with raises(ChannelError, ChannelReason.PROTOCOL):
        wire.decode(payload, "refused")
    with raises(ChannelError, ChannelReason.PROTOCOL):
        wire.split_hashes(b"x" * 17, 16)
    assert wire.split_hashes(b"a" * 16 + b"b" * 16, 16) == [b"a" * 16, b"b" * 16]


def test_counters_merge_across_ranks_and_flatten() -> None:
    a = {"hits": 1, "misses": {"unreachable": 2}, "gauges": {"free_blocks": 5}}
    b = {"hits": 2, "misses": {"unreachable": 1, "tp_mismatch": 1}, "gauges": {"free_blocks": 3}, "bytes_loaded": 10}
    m = stats.merge(a, b)
    assert m == {"hits": 3, "misses": {"unreachable": 3, "tp_mismatch": 1}, "gauges": {"free_blocks": 3},
                 "bytes_loaded": 10}
    assert a["misses"] == {"unreachable": 2}            # inputs are not changed
    assert stats.flatten(m)["misses.tp_mismatch"] == 1.0
    t = stats.Tally()
    t.add("hits")
    t.reason("rejections", "timeout")
    assert t.take() == {"hits": 1, "rejections": {"timeout": 1}} and t.take() == {}


def test_a_failed_loads_reason_is_a_ranks_own_cause_before_a_share_that_merely_ended() -> None:
    failures = LoadFailures((("a", 0, "share_failed"), ("b", 0, "timeout")))
    failures = failures.merge(LoadFailures((("a", 1, "stale_incarnation"), ("a", 2, "decode_gone"))))
    assert failures.of("a") == "stale_incarnation"     # the lowest rank with a cause of its own
    assert failures.of("b") == "timeout" and failures.of("c") is None
    assert LoadFailures((("a", 3, "share_aborted"),)).of("a") == "share_aborted"
    assert not LoadFailures() and failures


@pytest.mark.parametrize(("detail", "code"), [
    ("lease: ImportFailed: lease refused (stale_incarnation): bank 3 is of incarnation 7", "stale_incarnation"),
    ("lease: ChannelError: no server at /run/kvstate/x.sock", "decode_gone"),
    ("its exporter's connection closed", "decode_gone"),
    ("ImportFailed: import of rank 1 failed (native): bad map", None),
])
def test_failure_text_names_its_reason(detail: str, code: str | None) -> None:
    assert failure_code(detail) == code
