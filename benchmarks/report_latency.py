"""From a store's report to a lookup that finds it: a decode index's two paths, side by side.

A child process serves a tp=1 decode index (:class:`~kvstate.integrations.vllm.index.DecodeIndex`),
optionally beside a Python thread that never sleeps (as the EngineCore's own loop is). This
process is its decode rank: it says hello, opens its report link, and for each block asks the
child to reserve it, then reports it stored, alternately on its main link (the index's Python
handler takes it) and on its report link (the native thread does), and looks it up until a
lookup finds it. A row is the time from the report's send to that lookup's answer.

``python -m benchmarks.report_latency [--blocks N]`` prints the median, p90 and worst of each
path, with the index's process idle and busy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvstate import channel as chan
from kvstate.core.identity import Deployment
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.hashing import Compat, block_key
from kvstate.integrations.vllm.index import DecodeIndex
from kvstate.integrations.vllm.index_client import Found, IndexClient
from kvstate.integrations.vllm.slots import SlotTable

DEPLOYMENT = Deployment("report-latency", bytes(range(32)))
COMPAT = Compat(model="tiny", dtype="bf16", block_size=4, head_dim=8, kv_heads=2, layers=("l.0",), tp=1, isa="vec",
                engine="bench")
PATHS = ("main link (the index's Python)", "report link (native)")


def serve(busy: bool) -> None:
    """The child: an index, a spinning thread when ``busy``, and reservations on request
    (one hex hash a line in, its key a line out)."""
    d = Path(tempfile.mkdtemp(prefix="kvs-lat-"))
    os.chmod(d, 0o700)
    index = DecodeIndex(d / "i.sock", COMPAT, SlotTable(1 << 16, 1, lambda h, s: block_key(DEPLOYMENT, h, s)))
    index.start()
    if busy:
        def spin() -> None:
            x = 0
            while True:
                for i in range(1000):
                    x += i

        threading.Thread(target=spin, daemon=True).start()
    print(json.dumps({"path": str(d / "i.sock")}), flush=True)
    for line in sys.stdin:
        while not index.ready():  # the rank's hello and descriptor come after the path
            time.sleep(0.001)
        (r,) = index.reserve([bytes.fromhex(line.strip())])
        print(json.dumps({"key": r.key}), flush=True)


def measure(busy: bool, blocks: int) -> dict[str, list[float]]:
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.report_latency", "--serve", "busy" if busy else "idle"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    path = json.loads(child.stdout.readline())["path"]
    main = chan.connect(path, timeout=5, limits=wire.LIMITS)
    main.send(wire.encode("hello", rank=0, tp=1, pid=os.getpid(), epoch=1, compat=COMPAT.as_dict()))
    with main.recv(timeout=5) as m:
        wire.decode(m.payload, "welcome")
    link = chan.connect(path, timeout=5, limits=wire.LIMITS)
    link.send(wire.encode("report_link", rank=0))
    with link.recv(timeout=5) as m:
        wire.decode(m.payload, "linked")
    main.send(wire.encode("advertised", rank=0, descriptor=b"d", generation=1))
    client = IndexClient(path, DEPLOYMENT, 5.0)
    out: dict[str, list[float]] = {p: [] for p in PATHS}
    try:
        for i in range(blocks + 20):  # the first 20 warm up
            for name, ch in zip(PATHS, (main, link)):
                h = os.urandom(16)
                child.stdin.write(h.hex() + "\n")
                child.stdin.flush()
                key = json.loads(child.stdout.readline())["key"]
                t0 = time.perf_counter()
                ch.send(wire.encode("stored", rank=0, keys=[key], failed=[]))
                while True:
                    got = client.lookup(COMPAT, [h])
                    if isinstance(got, Found) and got.blocks == 1:
                        break
                if i >= 20:
                    out[name].append(time.perf_counter() - t0)
    finally:
        client.close()
        main.close()
        link.close()
        child.kill()
        child.wait()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=400)
    ap.add_argument("--serve", choices=("idle", "busy"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve == "busy")
        return
    print(f"{'index process':14s} {'report on':32s} {'median':>9s} {'p90':>9s} {'worst':>9s}")
    for busy in (False, True):
        for name, v in measure(busy, args.blocks).items():
            v.sort()
            print(f"{'busy' if busy else 'idle':14s} {name:32s} {statistics.median(v) * 1e6:7.0f}us "
                  f"{v[int(len(v) * 0.9)] * 1e6:7.0f}us {v[-1] * 1e6:7.0f}us")


if __name__ == "__main__":
    main()
