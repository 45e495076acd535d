"""Prefix load is not decode handoff (INV-HANDOFF-UNTOUCHED), and child engine ids.

The handoff parameters below have the shapes real engines use:

- NIXL-style: what vLLM's NixlConnector returns from ``request_finished`` on the prefill
  side for the decode worker (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py):
  do_remote_prefill, do_remote_decode, remote_block_ids, remote_engine_id, remote_host,
  remote_port, tp_size.
- Mooncake-style: what vLLM's MooncakeConnector proxy sends (the connector reads
  transfer_id, remote_engine_id and remote_bootstrap_addr in
  vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py); the
  proxy takes remote_engine_id from the prefill bootstrap server's /query, one engine id
  per data-parallel rank.
- Child engine ids: vLLM gives each data-parallel rank the engine id
  ``<engine_id>_dp<rank>`` (vllm/v1/engine/core.py).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import pytest

from support.errors import raises

from kvstate.reuse import handoff
from kvstate.core.errors import KvStateError, ArgumentInvalid, TransitionError
from kvstate.core.reasons import ArgumentReason, TransitionReason
from kvstate.reuse.handoff import PrefixLoaded, fingerprint, load_prefix, resolve_child_engine
from kvstate.reuse.inventory import Inventory, LeaseGrant
from kvstate.reuse.policy import Candidate, ReuseSettings, choose_transfer_source
from kvstate.core.capabilities import MemoryKind

NIXL_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 4, 5, 9, 17],
    "remote_engine_id": "prefill-7f3a_dp1",  # the child engine of data-parallel rank 1
    "remote_host": "10.0.0.12",
    "remote_port": 5600,
    "tp_size": 2,
}

MOONCAKE_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "transfer_id": "xfer-6c1d9e02-44b1",
    "remote_engine_id": "prefill-b2_dp3",
    "remote_bootstrap_addr": "http://10.0.0.21:8998",
    # newer vLLM sends one block list per KV cache group
    "remote_block_ids": [[100, 101, 102], [7]],
    "remote_num_tokens": 1031,
    "load_fraction": 0.1,  # a float, to check bits and type
}


def wire_bytes(params: Any) -> bytes:
    return json.dumps(params, separators=(",", ":")).encode()


def prefix_load_path(params: Any) -> PrefixLoaded[tuple[str, LeaseGrant], Any]:
    """kvstate's whole prefix-load path: policy, child engine, lease, load, release."""
    inv = Inventory(budget_blocks=256)
    inv.store("decode-a_dp1/rank-group", list(range(1000, 1200)))
    settings = ReuseSettings(enable_decode_to_prefill_reuse=True)
    decision = choose_transfer_source(8, [Candidate("decode-a", 200, MemoryKind.HOST)], settings, block_tokens=16)
    assert decision.recommended and decision.source is not None and decision.terms is not None
    engine = resolve_child_engine(decision.source.source_id, ["decode-a_dp0", "decode-a_dp1", "decode-b"],
                                  dp_rank=1)
    wanted = list(range(1000 + 8, 1000 + 8 + decision.terms.saved_blocks))
    grant = inv.lease(f"{engine}/rank-group", 0, wanted)
    assert isinstance(grant, LeaseGrant)

    def load() -> tuple[str, LeaseGrant]:
        try:
            return engine, grant  # the native import of the leased blocks goes here
        finally:
            inv.release(grant)

    return load_prefix(params, load)


@pytest.mark.parametrize("params", [NIXL_PARAMS, MOONCAKE_PARAMS, None], ids=["nixl", "mooncake", "none"])
def test_prefix_load_leaves_handoff_params_bit_identical(params: Any) -> None:
    """INV-HANDOFF-UNTOUCHED."""
    before_bytes, before_copy, before_digest = wire_bytes(params), copy.deepcopy(params), fingerprint(params)
    loaded = prefix_load_path(params)
    assert loaded.handoff_params is params  # the same object, handed back
    assert wire_bytes(params) == before_bytes
    assert fingerprint(params) == before_digest
    assert params == before_copy and list(params or ()) == list(before_copy or ())  # key order too
    assert loaded.result[0] == "decode-a_dp1"


def _reorder(p: dict[str, Any]) -> None:
    p["remote_engine_id"] = p.pop("remote_engine_id")


@pytest.mark.parametrize("mutate", [
    _reorder,  # same content, other key order
    lambda p: p.update(remote_num_tokens=1031.0),  # == but another type
    lambda p: p.update(do_remote_prefill=1),  # == True but another type
    lambda p: p.update(remote_block_ids=((100, 101, 102), (7,))),  # list -> tuple
    lambda p: p["remote_block_ids"][1].append(8),  # nested change
    lambda p: p.update(load_fraction=math.nextafter(0.1, 1.0)),  # one ulp
    lambda p: p.update(remote_engine_id="prefill-b2_dp0"),  # a rewritten child engine id
], ids=["order", "int-float", "bool-int", "list-tuple", "nested", "ulp", "engine-id"])
def test_a_planted_mutating_load_is_caught(mutate: Callable[[dict[str, Any]], None]) -> None:
    """Self-test: a prefix load that rewrites the handoff parameters must be refused."""
    params = copy.deepcopy(MOONCAKE_PARAMS)
    with raises(TransitionError, TransitionReason.HANDOFF_MODIFIED):
        load_prefix(params, lambda: mutate(params))


def test_fingerprint_refuses_what_it_cannot_see() -> None:
    with raises(ArgumentInvalid, ArgumentReason.HANDOFF_PARAMS):
        fingerprint({"x": {1, 2}})
    with raises(ArgumentInvalid, ArgumentReason.HANDOFF_PARAMS):
        load_prefix({"x": object()}, lambda: None)
    deep: list[Any] = []
    cur = deep
    for _ in range(100):
        cur.append([])
        cur = cur[0]
    with raises(ArgumentInvalid, ArgumentReason.HANDOFF_PARAMS):
        fingerprint(deep)


def test_child_engine_ids_resolve_to_exactly_one() -> None:
    advertised = ["decode-a_dp0", "decode-a_dp1", "decode-b", "decode-ab_dp0", "decode-a_dpx"]
    assert resolve_child_engine("decode-b", advertised) == "decode-b"
    assert resolve_child_engine("decode-ab", advertised) == "decode-ab_dp0"
    assert resolve_child_engine("decode-a", advertised, dp_rank=1) == "decode-a_dp1"
    assert resolve_child_engine("decode-a_dp0", advertised) == "decode-a_dp0"
    with raises(ArgumentInvalid, ArgumentReason.ENGINE_AMBIGUOUS) as info:
        resolve_child_engine("decode-a", advertised)
    assert info.value.matches == ("decode-a_dp0", "decode-a_dp1")
    with raises(ArgumentInvalid, ArgumentReason.ENGINE_MISSING):
        resolve_child_engine("decode-a", advertised, dp_rank=2)
    with raises(ArgumentInvalid, ArgumentReason.ENGINE_MISSING):
        resolve_child_engine("decode-c", advertised)
    with raises(ArgumentInvalid, ArgumentReason.ENGINE_MISSING):
        resolve_child_engine("", advertised)
    with raises(ArgumentInvalid, ArgumentReason.ENGINE_MISSING):
        resolve_child_engine("decode-a", advertised, dp_rank=-1)
    with raises(ArgumentInvalid, ArgumentReason.ENGINE_AMBIGUOUS):  # a parent advertised next to its own child
        resolve_child_engine("decode-b", ["decode-b", "decode-b_dp0"])


def test_handoff_module_does_not_name_connector_fields() -> None:
    """kvstate never interprets handoff parameters: no connector field names in the module."""
    import inspect

    source = inspect.getsource(handoff)
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    for field in ("remote_block_ids", "remote_host", "transfer_id", "remote_bootstrap_addr", "do_remote"):
        assert f'"{field}"' not in code and f"'{field}'" not in code
