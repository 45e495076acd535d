"""The KV geometry fixture (tests/vllm/data/kv_geometry.json): what vLLM registers.

The probe connector records, per worker rank, the tensors vLLM hands to
``register_kv_caches``. This module turns those records into the fixture's form and
compares. The data-path geometry code can be checked against the fixture without
starting vLLM; test_vllm_geometry.py keeps the fixture true for the pinned vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parent / "data" / "kv_geometry.json"
VOLATILE = ("pid",)  # differs per run


def host_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AMX tiles (the ``amx_tile`` flag)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines())


def for_this_host(fixture: dict[str, Any], amx: bool) -> dict[str, Any]:
    """The fixture as this host's engines register it. It was recorded on a CPU without
    AMX; the one field that depends on the host is the attention ISA that packs a block:
    vLLM 0.32 (``cpu_attn._get_attn_isa``) picks "amx" for bfloat16 with blocks of a
    multiple of 32 tokens where the CPU has AMX tiles, and "vec" there otherwise. (The
    connector puts the ISA in its compatibility key, so engines on different ISAs never
    share blocks.)"""
    out = json.loads(json.dumps(fixture))
    block = out["engine"]["block_size"]
    for run, records in out["runs"].items():
        if amx and run.endswith("-bfloat16") and block % 32 == 0:
            for rec in records:
                rec["attn_isa"] = "amx"
    return out


def read_records(probe_dir: Path, tp: int) -> list[dict[str, Any]]:
    """The probe's records for ranks 0..tp-1, in rank order, without volatile fields."""
    records = []
    for rank in range(tp):
        rec = json.loads((probe_dir / f"geometry-rank{rank}.json").read_text())
        records.append({k: v for k, v in rec.items() if k not in VOLATILE})
    return records


def differences(want: Any, got: Any, path: str = "") -> list[str]:
    """Paths where two JSON values differ (for a readable failure)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got)):
            if k not in got:
                out.append(f"{path}/{k}: missing now")
            elif k not in want:
                out.append(f"{path}/{k}: new ({got[k]!r})")
            else:
                out += differences(want[k], got[k], f"{path}/{k}")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in differences(w, g, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: fixture {want!r}, now {got!r}"]
