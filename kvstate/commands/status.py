"""``kvstate status``: what the kvstate servers of this node hold right now.

Asks every socket of each ``--socket-dir`` for its snapshot (:mod:`kvstate.share.status`):
exporters with their banks, leases (importer pid, time left), holds, pins and retained
blocks; coordinators with their groups and each rank's part. It changes nothing. A
draining bank says what it waits for; a socket nobody listens on is named a leftover.
Exit status 0, or 2 when the directory cannot be read safely.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from kvstate.share import status

help = "show the banks, leases, pins and groups of the kvstate servers in a socket directory"


def _interval(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0.05 <= seconds <= 3600:
        raise argparse.ArgumentTypeError("must be between 0.05 and 3600 seconds")
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket-dir", type=Path, required=True, action="append", dest="socket_dirs",
                        help="a directory the exporters or coordinators serve in (their socket_dir); repeat for more")
    parser.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    parser.add_argument("--watch", type=_interval, metavar="SECONDS",
                        help="print a new snapshot every SECONDS until interrupted")
    parser.add_argument("--timeout", type=_interval, default=2.0, help="seconds to wait for each server (default 2)")


def run(args: argparse.Namespace) -> int:
    def show() -> None:
        snapshot = status.node_status(args.socket_dirs, args.timeout)
        print(json.dumps(snapshot) if args.json else status.render(snapshot), flush=True)

    if args.watch is None:
        show()
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Python raises KeyboardInterrupt on SIGINT only where its parent did not ignore it, and
    # a shell ignores SIGINT in what it starts in the background: a watch started so
    # (`make test &` ran the test that does this) went on after SIGINT. It stops on SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            show()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
