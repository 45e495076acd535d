"""The public surface, as (name, callable) targets, and arbitrary arguments for them.

A *world* is a real exporter (tp 2, banks registered and advertised, serving) and a real
importer with one ready group, on the host transport. :func:`targets` lists every public
method of the objects the API hands out (Exporter, Bank, Importer, Group, Part, the
transport), every public constructor and function of ``kvstate`` (the lazy API), and the
public functions of the channel, policy, inventory, profile and descriptor modules.
"""

from __future__ import annotations

import enum
import inspect
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

import kvstate
from kvstate import channel
from kvstate.core import descriptor
from kvstate.core.errors import KvStateError
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.identity import Deployment
from kvstate.reuse import inventory, policy, profile
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostTransport

DEPLOYMENT = Deployment("api-fuzz", bytes(range(32)))
GEOMETRY = Geometry.uniform(layers=2, kv_heads=2, head_dim=16, block_tokens=8, dtype=DType.BF16,
                            layout=Layout.LAYER_MAJOR, num_blocks=16)
GRANULARITY = 64 * 1024
REUSE = policy.ReuseSettings(enable_decode_to_prefill_reuse=True)

#: Strange values of every kind: the arguments a caller must never crash kvstate with.
WEIRD: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 7, 2**31, 2**63, 2**64, -2**63, 10**30, 0.5, -0.0, float("nan"),
    float("inf"), "", "x", "\x00", "a\x00b", "\ud800", "/tmp/\udcff.sock", "x" * 5000, "draining", "load",
    "close", "lease", "peer_died", "expired", b"", b"\x00" * 16, b"x" * 64, bytearray(64), memoryview(b"ro"),
    [], [0], [1, 2], [-1], [None], [0.5], ["a"], {}, {0: bytearray(8)}, {"a": 1}, (), object(), Path("/"),
    [b"x"], DType.BF16, GEOMETRY,
]


def arbitrary() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(WEIRD), st.integers(-2**70, 2**70), st.text(max_size=8),
                     st.binary(max_size=24), st.lists(st.integers(-3, 20), max_size=4))


class World:
    """A real exporter and importer with one ready group, torn down by :meth:`close`."""

    def __init__(self) -> None:
        self.transport = HostTransport(granularity=GRANULARITY)
        d = Path(tempfile.mkdtemp(prefix="kvs-fuzz-"))
        os.chmod(d, 0o700)
        self.dir = d
        self.exporter = self.make_exporter(d / "sock")
        self.importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE), self.transport)
        self.group = self.importer.import_group([self.exporter.descriptor(r) for r in range(2)])
        self.inventory = inventory.Inventory(16)

    def make_exporter(self, socket_dir: Path) -> Exporter:  # type: ignore[type-arg]
        ex = Exporter(ExportConfig(DEPLOYMENT, socket_dir, os.urandom(16), 2), self.transport)
        for r in range(2):
            bank = ex.add_bank(r, GEOMETRY)
            bank.register()
            bank.view()[:GEOMETRY.nbytes] = bytes([r + 1]) * GEOMETRY.nbytes
            bank.advertise()
        ex.start()
        return ex

    def close(self) -> None:
        """Release everything, whatever state the calls left it in (typed errors only)."""
        import gc
        gc.collect()  # views a call handed out and the test dropped
        for g in list(self.importer.groups):
            if not g.is_terminal:
                g.drain(5.0)
        self.importer.close()
        self.exporter.stop()
        for bank in self.exporter.banks.values():
            for lease in list(bank.leases.values()):
                lease.channel.close()
        self.exporter.drain(5.0)
        for bank in self.exporter.banks.values():
            if bank.state != "released":
                raise AssertionError(f"{bank.label} left {bank.state}")


def _methods(obj: Any, prefix: str) -> list[tuple[str, Callable[..., Any]]]:
    out = []
    for name in sorted(dir(obj)):
        if name.startswith("_"):
            continue
        value = getattr(obj, name, None)
        if callable(value) and not inspect.isclass(value):
            out.append((f"{prefix}.{name}", value))
    return out


def targets(w: World) -> list[tuple[str, Callable[..., Any]]]:
    found: list[tuple[str, Callable[..., Any]]] = []
    for name in kvstate.__all__:
        value = getattr(kvstate, name)
        if inspect.isclass(value) and issubclass(value, KvStateError) or not callable(value):
            continue
        found.append((f"kvstate.{name}", value))
    found += _methods(w.exporter, "Exporter")
    found += _methods(w.exporter.banks[0], "Bank")
    found += _methods(w.importer, "Importer")
    found += _methods(w.group, "Group")
    found += _methods(w.group.parts[0], "Part")
    found += _methods(w.transport, "HostTransport")
    found += _methods(w.inventory, "Inventory")
    for module, names in ((channel, ("connect", "encode", "decode", "make_socket_dir", "check_socket_dir")),
                          (descriptor, ("encode", "decode")),
                          (policy, ("choose_transfer_source", "estimate_ttft_saving", "Candidate")),
                          (profile, ("parse_capabilities", "admit"))):
        found += [(f"{module.__name__}.{n}", getattr(module, n)) for n in names if hasattr(module, n)]
    found += [("ReuseSettings.from_mapping", policy.ReuseSettings.from_mapping),
              ("ReuseSettings.from_env", policy.ReuseSettings.from_env),
              ("ReuseSettings.from_cli", policy.ReuseSettings.from_cli),
              ("DeploymentProfile.parse", profile.DeploymentProfile.parse)]
    return found


#: Calls that would block the test for their whole timeout or end the world's usefulness
#: in ways a test cannot tell apart from a hang; each is exercised by its own tests.
SKIP = {"Exporter.serve_forever"}


def call_with(fn: Callable[..., Any], draw: Callable[[st.SearchStrategy[Any]], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments for every parameter fn declares (the arity is right; the values are not)."""
    if inspect.isclass(fn) and issubclass(fn, enum.Enum):  # Enum(value); its functional API is the stdlib's
        return (draw(arbitrary()),), {}
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return tuple(draw(st.lists(arbitrary(), max_size=3))), {}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        required = p.default is p.empty
        if not required and not draw(st.booleans()):
            continue
        value = draw(arbitrary())
        if p.kind is p.KEYWORD_ONLY or (not required and draw(st.booleans())):
            kwargs[p.name] = value
        elif p.kind is p.POSITIONAL_ONLY or not kwargs:
            args.append(value)
        else:
            kwargs[p.name] = value
    return tuple(args), kwargs
