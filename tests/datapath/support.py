"""Helpers of the data-path tests: a transport that fails chosen ops, engine counters."""

from __future__ import annotations

from typing import Any

import torch

from kvstate.core.errors import NativeError
from kvstate.core.reasons import NativeReason
from kvstate.core import layouts
from kvstate.core.geometry import Geometry
from kvstate.transport.native import default

GEOMETRY: Geometry = layouts.flash_attn(4, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=32)


def InjectedSubmitFault() -> NativeError:
    """A typed OS failure of a submit, as the native layer reports one."""
    return NativeError.native("kvs_submit", -5, "injected submit fault", NativeReason.OS, errno=5)


class Wrapped:
    """A transport that is ``inner`` except where a subclass says otherwise."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.name = inner.name

    @property
    def capabilities(self) -> Any:
        return self._inner.capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FailingOps(Wrapped):
    """A host transport whose k-th submit of a transfer raises (``raise_at``) or whose
    chosen ops fail on the worker (``fail_at``, the op engine's fault injection).
    Call indices count from the last :meth:`arm`."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls = 0
        self.raise_at: int | None = None
        self.fail_at: frozenset[int] = frozenset()

    def arm(self, *, raise_at: int | None = None, fail_at: frozenset[int] = frozenset()) -> None:
        self.calls, self.raise_at, self.fail_at = 0, raise_at, fail_at

    def submit_blocks(self, src: Any, dst: Any, blocks: Any, **kw: Any) -> Any:
        i = self.calls
        self.calls += 1
        if i == self.raise_at:
            raise InjectedSubmitFault()
        return self._inner.submit_blocks(src, dst, blocks, fail=i in self.fail_at, **kw)


def engine() -> Any:
    return default()


def live_ops() -> int:
    return int(default().stats().ops_live)


def bank_pattern(bank: Any) -> None:
    """Every bank byte set to a value that depends on its block: easy to recognise."""
    view = bank.view()
    view[:bank.geometry.nbytes] = bytes((i * 13 + 1) % 251 for i in range(256)) * (bank.geometry.nbytes // 256)
    del view


def zeros(g: Geometry = GEOMETRY, capacity: int = 16) -> dict[str, torch.Tensor]:
    out = {}
    for r in g.regions:
        shape = tuple(capacity if i == r.block_dim else n for i, n in enumerate(r.shape))
        out[r.name] = torch.zeros(shape, dtype=torch.bfloat16)
    return out


def untouched(dst: dict[str, torch.Tensor]) -> bool:
    return not any(t.view(torch.int16).any() for t in dst.values())


def collected(owner: Any, timeout: float = 10.0) -> bool:
    """True once a group (bank) forgot every finished load (store): its `loaded`
    (`stored`) change runs just after the waiters of the transfer woke up."""
    import time
    pending = owner.loads if hasattr(owner, "loads") else owner.stores
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        time.sleep(0.001)
    return not pending
