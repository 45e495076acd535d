"""Every bad load or store argument is a typed error with a reason, raised before any op
is submitted: nothing written, nothing in flight, the group still usable afterwards."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from support.errors import raises
import torch

from kvstate.core.errors import KvStateError, ArgumentInvalid, TransitionError
from kvstate.core.reasons import ArgumentReason as R, TransitionReason
from datapath.support import GEOMETRY, bank_pattern, collected, engine, untouched, zeros

GOOD_BANK, GOOD_DST = [1, 2], [3, 4]


class OnGpu:
    """A DLPack producer whose memory is on a CUDA device."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __dlpack__(self, **kw: Any) -> Any:
        raise AssertionError("a device this transport cannot reach must be refused before export")


def _replace(name: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(dst: dict[str, Any]) -> dict[str, Any]:
        return {**dst, name: value}
    return edit


def _read_only() -> np.ndarray:
    a = np.zeros((2, 16, 16, 2, 32), dtype=np.uint16)
    a.flags.writeable = False
    return a


BLOCK_CASES = [
    ("negative bank id", [-1, 2], GOOD_DST, R.BLOCK_IDS, "bank_block_ids[0]"),
    ("bank id past the bank", [1, 8], GOOD_DST, R.BLOCK_IDS, "bank_block_ids[1]"),
    ("dst id past the pages", GOOD_BANK, [3, 16], R.BLOCK_IDS, "dst_block_ids[1]"),
    ("None", [None, 2], GOOD_DST, R.BLOCK_IDS, "bank_block_ids[0]"),
    ("str id", GOOD_BANK, ["3", 4], R.BLOCK_IDS, "dst_block_ids[0]"),
    ("float id", [1.0, 2], GOOD_DST, R.BLOCK_IDS, "bank_block_ids[0]"),
    ("bool id", GOOD_BANK, [True, 4], R.BLOCK_IDS, "dst_block_ids[0]"),
    ("numpy bool id", [np.True_, 2], GOOD_DST, R.BLOCK_IDS, "bank_block_ids[0]"),
    ("a string of ids", "12", GOOD_DST, R.BLOCK_IDS, "bank_block_ids"),
    ("not iterable", 5, GOOD_DST, R.BLOCK_IDS, "bank_block_ids"),
    ("empty", [], [], R.BLOCK_IDS, "bank_block_ids"),
    ("lengths differ", GOOD_BANK, [3], R.BLOCK_IDS, "dst_block_ids"),
    ("one page twice", GOOD_BANK, [3, 3], R.BLOCK_IDS, "dst_block_ids[1]"),
]


@pytest.mark.parametrize(("bank_ids", "dst_ids", "reason", "where"),
                         [c[1:] for c in BLOCK_CASES], ids=[c[0] for c in BLOCK_CASES])
def test_bad_block_ids_are_refused_before_submit(make_world: Any, bank_ids: Any, dst_ids: Any, reason: R,
                                                 where: str) -> None:
    world = make_world(GEOMETRY, fill=bank_pattern)
    group = world.group()
    _refused(group, lambda dst: group.load(bank_ids, dst, dst_ids), reason, where)


def _released() -> memoryview:
    mv = memoryview(bytearray(2 * 16 * 16 * 2 * 32 * 2))
    mv.release()
    return mv


def _closed_mmap() -> mmap.mmap:
    m = mmap.mmap(-1, 2 * 16 * 16 * 2 * 32 * 2)
    m.close()
    return m


TENSOR_CASES: list[tuple[str, Callable[[dict[str, Any]], Any], R, str]] = [
    ("not a tensor", _replace("layer.1", object()), R.TENSOR, "region 'layer.1'"),
    ("read-only numpy", _replace("layer.0", _read_only()), R.READ_ONLY, "region 'layer.0'"),
    ("read-only buffer", _replace("layer.0", memoryview(bytes(2 * 16 * 16 * 2 * 32 * 2)).cast(
        "H", (2, 16, 16, 2, 32))), R.READ_ONLY, "region 'layer.0'"),
    ("wrong dtype", _replace("layer.2", torch.zeros(2, 16, 16, 2, 32, dtype=torch.float16)), R.DTYPE, "layer.2"),
    ("signed bits", _replace("layer.2", torch.zeros(2, 16, 16, 2, 32, dtype=torch.int16)), R.DTYPE, "layer.2"),
    ("wrong shape", _replace("layer.3", torch.zeros(2, 16, 16, 2, 64, dtype=torch.bfloat16)), R.SHAPE, "layer.3"),
    ("wrong rank", _replace("layer.3", torch.zeros(16, 16, 2, 32, dtype=torch.bfloat16)), R.SHAPE, "layer.3"),
    ("overlapping strides", _replace("layer.0", torch.zeros(1, 16, 16, 2, 32, dtype=torch.bfloat16).expand(
        2, 16, 16, 2, 32)), R.STRIDES, "layer.0"),
    ("negative strides", _replace("layer.0", np.zeros((2, 16, 16, 2, 32), dtype=np.uint16)[:, :, ::-1]),
     R.STRIDES, "layer.0"),
    ("strided buffer", _replace("layer.0", memoryview(np.zeros((2, 32, 16, 2, 32), dtype=np.uint16)[:, ::2])),
     R.STRIDES, "layer.0"),
    ("CUDA memory", _replace("layer.1", OnGpu()), R.DEVICE, "layer.1"),
    ("meta tensor", _replace("layer.1", torch.zeros(2, 16, 16, 2, 32, dtype=torch.bfloat16, device="meta")),
     R.DEVICE, "layer.1"),
    ("sparse tensor", _replace("layer.1", torch.zeros(2, 16, 16, 2, 32, dtype=torch.bfloat16).to_sparse()),
     R.TENSOR, "layer.1"),
    ("datetime64 pages", _replace("layer.2", np.zeros((2, 16, 16, 2, 32), dtype="M8[ns]")), R.DTYPE, "layer.2"),
    ("a released buffer", _replace("layer.1", _released()), R.TENSOR, "layer.1"),
    ("a closed mmap", _replace("layer.1", _closed_mmap()), R.TENSOR, "layer.1"),
    ("one tensor for two regions", lambda dst: {**dst, "layer.1": dst["layer.0"]}, R.TENSOR, "layer."),
    ("missing region", lambda dst: {k: v for k, v in dst.items() if k != "layer.3"}, R.REGIONS, "dst_tensors"),
    ("unknown region", _replace("layer.9", torch.zeros(1)), R.REGIONS, "dst_tensors"),
    ("not a mapping", lambda dst: list(dst.values()), R.REGIONS, "dst_tensors"),
    ("empty mapping", lambda dst: {}, R.REGIONS, "dst_tensors"),
    ("bad rank key", lambda dst: {1: dst}, R.RANK, "rank"),
    ("bool rank key", lambda dst: {True: dst}, R.REGIONS, "dst_tensors"),
]


@pytest.mark.parametrize(("edit", "reason", "where"), [c[1:] for c in TENSOR_CASES], ids=[c[0] for c in TENSOR_CASES])
def test_bad_destinations_are_refused_before_submit(make_world: Any, edit: Callable[[dict[str, Any]], Any],
                                                    reason: R, where: str) -> None:
    world = make_world(GEOMETRY, fill=bank_pattern)
    group = world.group()
    _refused(group, lambda dst: group.load(GOOD_BANK, edit(dst), GOOD_DST), reason, where)


def test_bad_ranks_are_refused(make_world: Any) -> None:
    world = make_world(GEOMETRY, tp=2, fill=bank_pattern)
    group = world.group()
    _refused(group, lambda dst: group.load(GOOD_BANK, dst, GOOD_DST), R.RANK, "rank")  # required at tp=2
    _refused(group, lambda dst: group.load(GOOD_BANK, dst, GOOD_DST, rank=2), R.RANK, "rank")
    _refused(group, lambda dst: group.load(GOOD_BANK, {0: dst}, GOOD_DST, rank=0), R.RANK, "rank")
    h = group.load(GOOD_BANK, zeros(), GOOD_DST, rank=1)
    assert h.wait(10.0) and not h.failed_blocks()
    h.close()
    shared = zeros()  # two ranks' copies into one engine's pages: the last writer would win
    _refused(group, lambda dst: group.load(GOOD_BANK, {0: shared, 1: shared}, GOOD_DST), R.TENSOR, "rank 1")
    whole = bytearray(2 * GEOMETRY.block_bytes + 64)
    _refused(group, lambda dst: group.load_prefix(GOOD_BANK, [whole, memoryview(whole)[64:]]), R.TENSOR, "rank 1")


def _refused(group: Any, call: Callable[[dict[str, Any]], Any], reason: R, where: str) -> None:
    nat = engine()
    before = nat.stats()
    loads_before = set(group.loads)  # an earlier load may still be in its `loaded` change
    dst = zeros()
    with pytest.raises(ArgumentInvalid) as info:
        call(dst)
    assert info.value.reason is reason, info.value
    assert where in info.value.argument, info.value
    after = nat.stats()
    assert after.submitted == before.submitted and after.ops_live == before.ops_live
    assert untouched(dst) and group.loads <= loads_before and group.state == "ready"
    h = group.load(GOOD_BANK, zeros(), GOOD_DST, rank=0)  # the group still works
    assert h.wait(10.0) and not h.failed_blocks()
    h.close()


def test_states_and_plans_are_typed(make_world: Any) -> None:
    world = make_world(GEOMETRY, fill=bank_pattern)
    group = world.group()
    with pytest.raises(ArgumentInvalid) as info:
        group.fire("load")  # no plan: typed, not a TypeError
    assert info.value.reason is R.PLAN
    with pytest.raises(ArgumentInvalid) as info:
        world.banks[0].fire("store", plan="a plan")
    assert info.value.reason is R.PLAN
    for bad in (-1.0, float("nan"), float("inf"), 1e10, True, "1", None):  # 1e10 s: more than C's int64 ns
        with pytest.raises(ArgumentInvalid) as info:
            group.load_prefix(GOOD_BANK, {0: bytearray(2 * GEOMETRY.block_bytes)}, timeout=bad)
        assert info.value.reason is R.TIMEOUT
    h = group.load(GOOD_BANK, zeros(), GOOD_DST)
    for bad in (-1, float("nan"), 1e300, None):
        with pytest.raises(ArgumentInvalid):
            h.wait(bad)  # type: ignore[arg-type]
        with pytest.raises(ArgumentInvalid):
            h.wait_region("layer.0", bad)  # type: ignore[arg-type]
    with pytest.raises(ArgumentInvalid):
        h.add_done_callback(None)  # type: ignore[arg-type]  # else the dispatcher would log a TypeError later
    with pytest.raises(ArgumentInvalid) as info:
        h.wait_region("no.such.region", 1.0)
    assert info.value.reason is R.REGIONS
    assert h.wait(10.0)
    h.close()
    with raises(TransitionError, TransitionReason.GUARD, match="group_releasing"):
        group.parts[0].fire("close")  # a part of a ready group never closes on its own (issue 14, class 5)
    assert group.state == "ready" and group.parts[0].mapping is not None
    group.drain(10.0)
    with raises(TransitionError, TransitionReason.ILLEGAL):
        group.load(GOOD_BANK, zeros(), GOOD_DST)  # closed group
    with raises(TransitionError, TransitionReason.ILLEGAL):
        group.load_prefix(GOOD_BANK, [bytearray(2 * GEOMETRY.block_bytes)])


def test_load_prefix_refuses_bad_buffers_by_type(make_world: Any) -> None:
    world = make_world(GEOMETRY, fill=bank_pattern)
    group = world.group()
    need = 2 * GEOMETRY.block_bytes
    cases: list[tuple[Any, R]] = [
        ({0: bytearray(need - 1)}, R.SHAPE), ({0: bytes(need)}, R.READ_ONLY), ({0: object()}, R.TENSOR),
        ({3: bytearray(need)}, R.RANK), ([bytearray(need)] * 2, R.RANK), ("buffer", R.TENSOR),
        ({0: np.zeros(need, dtype=np.uint8)[::-1]}, R.SHAPE),
    ]
    for dst, reason in cases:
        with pytest.raises(ArgumentInvalid) as info:
            group.load_prefix(GOOD_BANK, dst)
        assert info.value.reason is reason, (dst, info.value)
    out = bytearray(need)
    assert group.load_prefix(GOOD_BANK, {0: out}).bytes == need


def test_store_arguments_are_checked_like_loads(make_world: Any) -> None:
    world = make_world(GEOMETRY, advertise=False)
    bank = world.banks[0]
    src = zeros(capacity=12)
    cases: list[tuple[Callable[[], Any], R]] = [
        (lambda: bank.store(src, [1, 2], [3, 3]), R.BLOCK_IDS),       # one bank block twice
        (lambda: bank.store(src, [1, 12], [3, 4]), R.BLOCK_IDS),      # past the engine's pages
        (lambda: bank.store(src, [1, 2], [3, 8]), R.BLOCK_IDS),       # past the bank
        (lambda: bank.store({**src, "layer.0": torch.zeros(3, dtype=torch.bfloat16)}, [1], [3]), R.SHAPE),
        (lambda: bank.store({**src, "layer.0": object()}, [1], [3]), R.TENSOR),
        (lambda: bank.store({}, [1], [3]), R.REGIONS),
        (lambda: bank.store(src, [1], [3], report=(-1, b"ok", b"bad")), R.TYPE),   # no socket fd
        (lambda: bank.store(src, [1], [3], report=(0, "ok", b"bad")), R.TYPE),    # text, not bytes
        (lambda: bank.store(src, [1], [3], report=[0, b"ok", b"bad"]), R.TYPE),   # type: ignore[arg-type]
        (lambda: bank.store(src, [1], [3], report=(2**31, b"ok", b"bad")), R.TYPE),  # no C int
    ]
    before = engine().stats()
    for call, reason in cases:
        with pytest.raises(ArgumentInvalid) as info:
            call()
        assert info.value.reason is reason, info.value
    assert engine().stats().submitted == before.submitted
    read_only = {n: t.numpy() if False else _ro(t) for n, t in src.items()}
    h = bank.store(read_only, [1], [3])  # a source may be read-only
    assert h.wait(10.0) and not h.failed_blocks()
    h.close()
    bank.fire("drain")
    with raises(TransitionError, TransitionReason.ILLEGAL):
        bank.store(src, [1], [3])


def _ro(t: torch.Tensor) -> np.ndarray:
    a = t.view(torch.int16).numpy().view(np.uint16)
    a.flags.writeable = False
    return a


def test_only_kvstate_errors_escape_for_arbitrary_arguments(make_world: Any) -> None:
    """A sweep of odd values in every argument position: only KvStateError subclasses."""
    world = make_world(GEOMETRY, fill=bank_pattern)
    group = world.group()
    odd: list[Any] = [None, 0, -1, 1.5, "x", b"x", [], {}, [None], [[1]], object(), float("nan"), 2**70, [2**70],
                      {"layer.0": None}, memoryview(b"ro"), bytearray(3), np.zeros(3), torch.zeros(3)]
    before = engine().stats()
    for a in odd:
        for call in (lambda: group.load(a, zeros(), GOOD_DST), lambda: group.load(GOOD_BANK, a, GOOD_DST),
                     lambda: group.load(GOOD_BANK, zeros(), a), lambda: group.load(GOOD_BANK, zeros(), GOOD_DST, rank=a),
                     lambda: group.load_prefix(a, [bytearray(64)]), lambda: group.load_prefix(GOOD_BANK, a),
                     lambda: world.banks[0].store(a, GOOD_BANK, GOOD_DST),
                     lambda: world.banks[0].store(zeros(), a, GOOD_DST)):
            try:
                r = call()
            except KvStateError:
                continue
            if hasattr(r, "close"):
                assert r.wait(10.0)
                r.close()
    after = engine().stats()
    assert after.ops_live == before.ops_live and collected(group)
