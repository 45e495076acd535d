"""Reuse switched on, as every test that imports must say explicitly (reuse is off by
default and the importer enforces it: kvstate.reuse.gates)."""

from __future__ import annotations

from kvstate.reuse.policy import ReuseSettings

REUSE_ON = ReuseSettings(enable_decode_to_prefill_reuse=True)
