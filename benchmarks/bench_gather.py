"""Gather of KV blocks out of an imported host bank, against its peers, in one run.

    .venv/bin/python benchmarks/bench_gather.py [--blocks 4096] [--block-kib 64] [--repeat 7]

A bank of ``blocks`` x ``block-kib`` KiB is created as a sealed memfd, exported, imported
(the importer checks and maps the fd, exactly as across processes) and mapped read-only.
Then the same bytes are moved into a local, pre-faulted numpy buffer by:

- the op engine: one gather op of every block in random order (2 workers by default);
- ``ctypes.memmove`` of the whole bank at once: the contiguous-copy limit;
- ``numpy.copyto`` of the whole bank at once: the same limit through numpy;
- ``numpy.take(..., out=...)``: numpy's fancy-index gather of the same random order.

Every repeat runs every method once (round-robin), and each method's median is reported.
It prints the median bandwidth of each and the ratios the goals are stated in (gather
>= 90% of contiguous copy; gather faster than numpy's gather), then the cost of
submitting one small op through the Python wrapper, and through the raw cffi call.
Figures come from this run on this machine; nothing is estimated.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import time

import numpy as np

from kvstate.core.handles import HandleKind
from kvstate.core.capabilities import Access
from kvstate.transport.host import HostTransport


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--submits", type=int, default=20000)
    args = ap.parse_args()

    t = HostTransport()
    nat = t.native
    nat.configure(args.workers)
    block = args.block_kib << 10
    total = args.blocks * block
    size = -(-total // t.granularity()) * t.granularity()

    # Exporter side: a patterned bank.
    alloc = t.create(size)
    res = t.reserve(size)
    mapping = t.map(res, 0, alloc)
    t.set_access(mapping, Access.READ_WRITE)
    np.frombuffer(t.view(mapping), dtype=np.uint8)[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)

    # Importer side: the fd checked, adopted and mapped read-only elsewhere.
    handle = t.export(alloc, HandleKind.MEMFD)
    imported = t.import_(handle, size)
    ires = t.reserve(size)
    imap = t.map(ires, 0, imported)
    t.set_access(imap, Access.READ)
    src = np.frombuffer(t.view(imap), dtype=np.uint8)[:total]

    dst = np.empty(total, dtype=np.uint8)
    dst[:] = 0  # fault every page in before timing
    rng = np.random.default_rng(12345)
    order = rng.permutation(args.blocks)
    blocks = np.empty((args.blocks, 3), dtype=np.uint64)
    blocks[:, 0] = order.astype(np.uint64) * block
    blocks[:, 1] = np.arange(args.blocks, dtype=np.uint64) * block
    blocks[:, 2] = block
    src2d, dst2d = src.reshape(args.blocks, block), dst.reshape(args.blocks, block)
    src_addr, dst_addr = src.ctypes.data, dst.ctypes.data

    def engine_gather() -> None:
        nat.submit_gather(imap.region, dst, blocks).result(60)

    def engine_copy() -> None:
        nat.submit_copy(imap.region, dst, total).result(60)

    def memmove() -> None:
        ctypes.memmove(dst_addr, src_addr, total)

    def np_copy() -> None:
        np.copyto(dst, src)

    def np_gather() -> None:
        np.take(src2d, order, axis=0, out=dst2d)

    runs = {
        "op engine gather (random order)": engine_gather,
        "op engine contiguous copy": engine_copy,
        "ctypes.memmove contiguous": memmove,
        "numpy.copyto contiguous": np_copy,
        "numpy.take fancy-index gather": np_gather,
    }
    # Round-robin: every repeat runs every method once, so a change in the machine's load
    # (it is shared) hits all of them alike instead of skewing one.
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm: page faults, caches, thread start-up
    for _ in range(args.repeat):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    results = {name: statistics.median(s) for name, s in samples.items()}
    engine_gather()
    assert np.array_equal(dst2d, src2d[order]), "the engine's gather moved the wrong bytes"

    gib = total / (1 << 30)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}; "
          f"workers {args.workers}")
    print(f"moved: {args.blocks} blocks x {args.block_kib} KiB = {total >> 20} MiB per run, "
          f"median of {args.repeat}")
    print(f"{'method':<36} {'ms':>9} {'GiB/s':>8}")
    for name, sec in results.items():
        print(f"{name:<36} {sec * 1e3:>9.2f} {gib / sec:>8.2f}")
    limit = min(results["ctypes.memmove contiguous"], results["numpy.copyto contiguous"])
    g = results["op engine gather (random order)"]
    print(f"gather / best contiguous copy (memmove, copyto): {limit / g:6.1%}   (goal >= 90%)")
    print(f"gather / op engine contiguous copy (same workers): {results['op engine contiguous copy'] / g:6.1%}")
    print(f"gather / numpy gather speed: {results['numpy.take fancy-index gather'] / g:6.2f}x  (goal > 1)")

    # Submit cost: ops queue while the engine is paused, so only submission is timed. They
    # are submitted in batches of 100 and cancelled and reaped (untimed) between batches,
    # as a caller would reap its ops: thousands of live unreaped ops would mostly time the
    # garbage collector walking them.
    small = bytearray(64)
    ffi, lib = nat.ffi, nat.lib
    out = ffi.new("int64_t *")
    sbuf = ffi.from_buffer(small)
    saddr = int(ffi.cast("uintptr_t", sbuf))
    batch, rounds = 100, max(1, args.submits // 100)
    wrapped_s = raw_s = 0.0
    nat.pause(True)
    for _ in range(rounds):
        start = time.perf_counter()
        ops = [nat.submit_copy(imap.region, small, 64) for _ in range(batch)]
        wrapped_s += time.perf_counter() - start
        raw_ids = []
        start = time.perf_counter()
        for _ in range(batch):
            lib.kvs_submit_copy(imap.region, 0, 0, 0, 0, saddr, 64, 0, 64, 0, out)
            raw_ids.append(out[0])
        raw_s += time.perf_counter() - start
        for op_id in [op.id for op in ops] + raw_ids:
            nat.cancel(op_id)
            nat.reap(op_id)
    nat.pause(False)
    wrapped, raw = wrapped_s / (rounds * batch), raw_s / (rounds * batch)
    print(f"submit one op, Python wrapper:       {wrapped * 1e6:6.2f} us  (goal <= 5 us)")
    print(f"submit one op, raw cffi call:        {raw * 1e6:6.2f} us")

    t.unmap(imap)
    t.release(imported)
    t.free(ires)
    t.unmap(mapping)
    t.release(alloc)
    t.free(res)


if __name__ == "__main__":
    main()
