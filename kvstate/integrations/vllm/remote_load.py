"""One prefill rank's load from a bank on another node: NIXL READs into a staging
buffer, then a scatter into the engine's pages.

The bank keeps vLLM's CPU layout (one region per layer, block-major within it), so a
block of one layer is one run of the bank and one READ unit
(:func:`kvstate.share.remote_part.block_chunks`). READing straight into the pages would
need the engine's KV tensors registered with NIXL and one descriptor per layer and page;
the staging buffer is registered once per load and read in one transfer, and the scatter
is one indexed copy per layer.

A :class:`RemoteLoad` runs on its own thread (``RankShare.load_prefix`` waits for its
READs) and answers the :class:`~kvstate.share.transfer.TransferHandle` calls
:class:`~.prefill_rank.PrefillRank` polls: ``done``, ``result``, ``cancel``, ``close``.
The READs end within the timeout given (NIXL's wait); the share's part stays pinned
until they do, so a drain waits for them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvstate.core.errors import KvStateError

log = logging.getLogger(__name__)


@attrs.frozen
class Outcome:
    """What a finished remote load reports (the fields PrefillRank reads)."""

    ok: bool
    bytes: int
    why: str = ""


class RemoteLoad:
    """See the module docstring. ``share``: a ready RankShare whose part is remote;
    ``nixl``: this worker's NixlTransport."""

    def __init__(self, share: Any, nixl: Any, slots: Sequence[int], kv_caches: Mapping[str, Any],
                 dst_pages: Sequence[int], *, timeout: float) -> None:
        self.share, self.nixl = share, nixl
        self.slots, self.dst_pages = list(slots), list(dst_pages)
        self.kv_caches = kv_caches
        self.timeout = timeout
        self._outcome: Outcome | None = None
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstate-remote-load", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Outcome | None:
        return self._outcome

    def cancel(self) -> None:
        """Nothing is scattered after this; READs in flight end within their timeout."""
        self._cancelled.set()

    def close(self) -> None:
        self._cancelled.set()

    def _run(self) -> None:
        try:
            self._outcome = self._load()
        except KvStateError as exc:
            log.warning("kvstate: remote load failed: %s", exc)
            self._outcome = Outcome(False, 0, exc.reason.value)
        except Exception as exc:  # noqa: BLE001 - a thread's failure must reach the poller
            log.exception("kvstate: remote load failed")
            self._outcome = Outcome(False, 0, type(exc).__name__)
        finally:
            self._done.set()

    def _load(self) -> Outcome:
        g = self.share.part.descriptor.geometry
        n = len(self.slots)
        gran = self.nixl.granularity()
        size = -(-n * g.block_bytes // gran) * gran
        staging = self.nixl.create(size)
        try:
            result = self.share.load_prefix(self.slots, staging, timeout=self.timeout)
            if self._cancelled.is_set():
                return Outcome(False, 0, "cancelled")
            scatter(staging.view(), g, self.kv_caches, self.dst_pages)
            return Outcome(True, result.bytes)
        finally:
            try:
                self.nixl.release(staging)
            except KvStateError as exc:  # a READ NIXL could not cancel keeps its target
                log.warning("kvstate: a staging buffer stays registered: %s", exc)


def scatter(staged: memoryview, g: Any, kv_caches: Mapping[str, Any], dst_pages: Sequence[int]) -> None:
    """Copy staged blocks (block i's regions back to back, in the geometry's order) into
    page ``dst_pages[i]`` of each region's tensor ``kv_caches[region.name]``."""
    import torch

    n = len(dst_pages)
    per = [r.block_bytes for r in g.regions]
    src = torch.frombuffer(staged, dtype=torch.uint8, count=n * sum(per)).view(n, sum(per))
    pages = torch.tensor(list(dst_pages), dtype=torch.long)
    at = 0
    for r, nbytes in zip(g.regions, per):
        t = kv_caches[r.name]
        dst = t.view(torch.uint8)                    # [num_blocks, ..., last dim in bytes], a view
        dst[pages] = src[:, at:at + nbytes].reshape((n,) + tuple(dst.shape[1:]))
        at += nbytes
