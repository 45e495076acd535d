"""What the scheduler side and the workers tell each other each step. Pure.

Plain frozen values, pickled by vLLM: the scheduler's orders go to every worker process
(vLLM's connector metadata), so all ranks store into the same bank blocks and load into
the same pages; each worker's :class:`LoadFailures` come back with the step's output
(vLLM's worker metadata, merged across ranks), in the same step as the failed pages.
"""

from __future__ import annotations

import re

import attrs

_LEASE_CODE = re.compile(r"lease refused \((\w+)\)")


@attrs.frozen
class StoreOrder:
    """Decode side: copy pages ``src_blocks`` of a finished request into bank blocks
    ``slots``, then record ``keys`` in the rank's inventory. The request's pages stay
    allocated until every rank reported the store finished (vLLM's delayed free)."""

    req_id: str
    src_blocks: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[int, ...]


@attrs.frozen
class LoadOrder:
    """Prefill side: once this rank's share of group ``gid`` is ready, scatter bank blocks
    ``slots`` into pages ``dst_blocks``. ``gid`` None: the load already failed (``why``);
    the worker reports every block as failed, so vLLM recomputes them."""

    req_id: str
    gid: str | None
    slots: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    why: str = ""


@attrs.frozen
class StepOrders:
    stores: tuple[StoreOrder, ...] = ()
    loads: tuple[LoadOrder, ...] = ()
    #: the step schedules no tokens: the workers run no forward pass, only report transfers
    idle: bool = False

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


@attrs.frozen
class LoadFailures:
    """Why loads failed, as ``(req_id, rank, reason)``: a rank sends its own with the step
    that reports the failed pages, so the scheduler counts the reason at once instead of
    waiting for the coordinator to learn it (a thread that may be starved of the GIL)."""

    reasons: tuple[tuple[str, int, str], ...] = ()

    def merge(self, other: LoadFailures) -> LoadFailures:
        return LoadFailures(self.reasons + other.reasons)

    def of(self, req_id: str) -> str | None:
        """The most telling reason the ranks gave for ``req_id``: a rank's own cause before
        a share that merely ended (``share_*``, another rank's failure); None if none."""
        mine = sorted((not why.startswith("share_"), -rank, why) for r, rank, why in self.reasons if r == req_id)
        return mine[-1][2] if mine else None

    def __bool__(self) -> bool:
        return bool(self.reasons)


def failure_code(detail: str) -> str | None:
    """The reason a failure's text names: the exporter's lease refusal code
    (``stale_incarnation``...), ``decode_gone`` when its socket was gone or closed."""
    code = _LEASE_CODE.search(detail)
    if code is not None:
        return code.group(1)
    if "no server" in detail or "closed" in detail:
        return "decode_gone"
    return None
