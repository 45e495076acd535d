"""Heterogeneous TP through the coordinator, on real sockets and the host transport: an
exporting group at one TP size feeds an importing group at another. The coordinator's parts
are the (importing rank, exporting rank) slices of ``kvstate.core.heads.split``; a group is
ready only once every slice is imported, and each slice loads its heads into its rank's
pages (vLLM's CPU layout, ``[blocks, heads, block_size, 2 * head_dim]``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import DEPLOYMENT
from support.errors import raises
from kvstate.core import heads, layouts
from kvstate.core.errors import ArgumentInvalid, ConfigInvalid, GroupFailed, GroupRejected
from kvstate.core.geometry import DType
from kvstate.core.reasons import ArgumentReason, ConfigReason, RejectReason
from kvstate.share.coordinator import Coordinator, CoordinatorConfig
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.share.load import Sliced
from kvstate.share.rank_worker import RankWorker, WorkerConfig
from kvstate.transport.host import HostTransport
from support.coordinated import socket_path
from support.reuse import REUSE_ON

TOTAL_HEADS, BLOCK, HEAD_DIM, LAYERS, BLOCKS = 4, 4, 8, 2, 6
FAST = {"heartbeat_s": 0.05, "silence_s": 0.5, "phase_timeout_s": 2.0}


def head_values(block: int, head: int) -> np.ndarray:
    """What global head ``head`` of bank block ``block`` holds in every layer (float32)."""
    return np.full((BLOCK, 2 * HEAD_DIM), 100.0 * block + head, dtype=np.float32)


@pytest.fixture
def exporter() -> Iterator[Any]:
    made: list[Exporter[Any, Any, Any, Any, Any]] = []

    def make(tp: int) -> Exporter[Any, Any, Any, Any, Any]:
        d = Path(tempfile.mkdtemp(prefix="kvs-mixed-"))
        os.chmod(d, 0o700)
        ex: Exporter[Any, Any, Any, Any, Any] = Exporter(ExportConfig(DEPLOYMENT, d / "sock", os.urandom(16), tp),
                                                         HostTransport(granularity=64 * 1024), name="mixed")
        for r in range(tp):
            first, count = heads.rank_heads(TOTAL_HEADS, tp, r)
            g = layouts.vllm_cpu(LAYERS, num_blocks=BLOCKS, num_kv_heads=count, block_size=BLOCK, head_dim=HEAD_DIM,
                                 dtype=DType.FP32)
            bank = ex.add_bank(r, g)
            bank.fire("register")
            layer = np.stack([np.stack([head_values(b, first + h) for h in range(count)]) for b in range(BLOCKS)])
            bank.view()[:g.nbytes] = np.concatenate([layer.ravel()] * LAYERS).tobytes()
            bank.fire("advertise")
        ex.start()
        made.append(ex)
        return ex
    yield make
    for ex in made:
        ex.stop()
        for bank in ex.banks.values():
            for lease in list(bank.leases.values()):
                lease.channel.close()
        ex.drain(5.0)


@pytest.fixture
def importing() -> Iterator[Any]:
    made: list[tuple[Coordinator, list[RankWorker[Any, Any, Any, Any, Any]]]] = []

    def make(src_tp: int, dst_tp: int) -> tuple[Coordinator, list[tuple[heads.Slice, RankWorker[Any, Any, Any, Any,
                                                                                                  Any]]]]:
        slices = heads.split(TOTAL_HEADS, src_tp, dst_tp)
        coordinator = Coordinator(CoordinatorConfig(DEPLOYMENT, len(slices), socket_path(), source_tp=src_tp,
                                                    sources=tuple(s.src_rank for s in slices), **FAST))
        coordinator.start()
        workers = [RankWorker(WorkerConfig(DEPLOYMENT, i, len(slices), coordinator.socket_path, reuse=REUSE_ON,
                                           source_rank=s.src_rank, source_tp=src_tp), HostTransport(granularity=64 * 1024))
                   for i, s in enumerate(slices)]
        for w in workers:
            w.start()
        coordinator.wait_for_workers(5.0)
        made.append((coordinator, workers))
        return coordinator, list(zip(slices, workers))
    yield make
    for coordinator, workers in made:
        for w in workers:
            w.close()
        coordinator.close()


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (4, 8), (1, 4)])
def test_every_rank_gets_exactly_its_heads(exporter: Any, importing: Any, src_tp: int, dst_tp: int) -> None:
    """INV-COORD-READY-COMPLETE over slices: the group is ready once every (importing rank,
    exporting rank) slice imported, and each importing rank's pages then hold its own
    heads, each from a bank that holds it (INV-LOAD-BYTES)."""
    ex = exporter(src_tp)
    coordinator, parts = importing(src_tp, dst_tp)
    group = coordinator.import_group([ex.descriptor(r) for r in range(src_tp)])
    assert group.state == "ready" and group.reports["imported"] == set(range(len(parts)))
    pages = {}
    for p in range(dst_tp):
        first, count = heads.rank_heads(TOTAL_HEADS, dst_tp, p)
        pages[p] = {f"layer.{i}": np.zeros((8, count, BLOCK, 2 * HEAD_DIM), np.float32) for i in range(LAYERS)}
    for cut, worker in parts:
        share = worker.wait(group.gid, ("ready",), 5.0)
        assert share is not None and share.state == "ready"
        dst = {n: t[:, cut.dst_head:cut.dst_head + cut.count] for n, t in pages[cut.dst_rank].items()}
        with share.load([3, 5], dst, [1, 7], Sliced(1, cut.src_head, cut.count)) as handle:
            assert handle.wait(5.0) and not handle.failed_blocks()
    for p, tensors in pages.items():
        first, count = heads.rank_heads(TOTAL_HEADS, dst_tp, p)
        for t in tensors.values():
            for page, block in ((1, 3), (7, 5)):
                assert np.array_equal(t[page], np.stack([head_values(block, first + h) for h in range(count)]))
            assert not t[0].any() and not t[2].any()  # pages not loaded stay untouched
    group.drain(5.0)
    assert group.state == "closed"


def test_a_missing_slice_keeps_the_group_from_ready(exporter: Any, importing: Any) -> None:
    """INV-COORD-READY-COMPLETE: the one importing rank of a tp=2 -> tp=1 group has two
    slices; with the worker of the second gone the group fails, and the first slice, which
    imported fine on its own, never becomes ready (no partial load)."""
    ex = exporter(2)
    coordinator, parts = importing(2, 1)
    parts[1][1].close()
    with pytest.raises(GroupFailed):
        coordinator.import_group([ex.descriptor(0), ex.descriptor(1)])
    share = parts[0][1].share(next(iter(coordinator.groups)))
    assert share is None or share.state != "ready"


def test_a_short_group_is_refused(exporter: Any, importing: Any) -> None:
    ex = exporter(2)
    coordinator, _ = importing(2, 1)
    with raises(GroupRejected, RejectReason.TP_MISMATCH):
        coordinator.import_group([ex.descriptor(0)])  # one descriptor of a tp=2 group


def test_descriptors_of_another_exporting_size_are_refused(exporter: Any, importing: Any) -> None:
    ex = exporter(4)
    coordinator, _ = importing(2, 1)
    with raises(GroupRejected, RejectReason.TP_MISMATCH):
        coordinator.import_group([ex.descriptor(r) for r in range(4)])


@pytest.mark.parametrize("total, src_tp, dst_tp", [(6, 4, 1), (4, 3, 2), (2, 2, 3)])
def test_a_split_no_size_divides_is_refused_with_its_reason(total: int, src_tp: int, dst_tp: int) -> None:
    with raises(ConfigInvalid, ConfigReason.HEAD_SPLIT):
        heads.split(total, src_tp, dst_tp)


@pytest.mark.parametrize("total", [1, 2, 4, 8])
@pytest.mark.parametrize("src_tp", [1, 2, 4, 8])
@pytest.mark.parametrize("dst_tp", [1, 2, 4, 8])
def test_split_covers_every_rank_once(total: int, src_tp: int, dst_tp: int) -> None:
    """Every target rank's heads are covered exactly once, each from a source rank that
    holds that head; replicated heads (heads < tp) included."""
    slices = heads.split(total, src_tp, dst_tp)
    for p in range(dst_tp):
        first, count = heads.rank_heads(total, dst_tp, p)
        got = sorted(h for s in slices if s.dst_rank == p for h in range(s.dst_head, s.dst_head + s.count))
        assert got == list(range(count))
        for s in slices:
            if s.dst_rank == p:
                a, n = heads.rank_heads(total, src_tp, s.src_rank)
                assert a + s.src_head == first + s.dst_head and s.src_head + s.count <= n
    pairs = [(s.dst_rank, s.src_rank) for s in slices]
    assert len(pairs) == len(set(pairs)) and len(slices) <= max(src_tp, dst_tp)


def test_config_names_every_exporting_rank() -> None:
    with raises(ConfigInvalid, ConfigReason.FIELD, match="CoordinatorConfig.sources"):
        CoordinatorConfig(DEPLOYMENT, 2, socket_path(), source_tp=2, sources=(0, 0))
    with raises(ConfigInvalid, ConfigReason.FIELD, match="CoordinatorConfig.sources"):
        CoordinatorConfig(DEPLOYMENT, 1, socket_path(), source_tp=2)


def test_a_slice_outside_the_region_is_refused(exporter: Any, importing: Any) -> None:
    ex = exporter(1)
    coordinator, parts = importing(1, 2)
    group = coordinator.import_group([ex.descriptor(0)])
    cut, worker = parts[0]
    share = worker.wait(group.gid, ("ready",), 5.0)
    assert share is not None
    dst = {f"layer.{i}": np.zeros((8, 1, BLOCK, 2 * HEAD_DIM), np.float32) for i in range(LAYERS)}
    with raises(ArgumentInvalid, ArgumentReason.SHAPE):
        share.load([0], dst, [0], Sliced(1, 4, 1))  # the bank has heads 0..3
    group.drain(5.0)
