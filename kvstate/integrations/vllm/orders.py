"""What the scheduler side tells the workers each step (vLLM's connector metadata). Pure.

Plain frozen values: vLLM pickles the step's metadata to every worker process, and every
rank gets the same orders, so all ranks store into the same bank blocks and load into
the same pages.
"""

from __future__ import annotations

import attrs


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

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)
