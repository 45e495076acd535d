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
