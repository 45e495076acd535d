"""Memory of live engines, sampled from /proc while the suite runs.

vLLM binds engine memory to NUMA node 0 (8.5 GiB here, not the machine's 23 GiB), so the
figure that matters is the peak over all engines alive at once. PSS shares the common
pages (Python, torch) fairly between processes; RSS counts them in each.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from support.engines.runner import Engine


def _rollup(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB, or zeros for a process that is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def system_used_kib() -> int:
    """MemTotal - MemAvailable."""
    info = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0])
    return info["MemTotal"] - info["MemAvailable"]


@dataclass
class Peak:
    engines: int = 0
    rss_kib: int = 0
    pss_kib: int = 0
    used_kib: int = 0   # system used above the baseline at the sampler's start


@dataclass
class MemorySampler:
    """Samples the registered engines every ``interval`` s; keeps the peak per number of
    engines alive at once."""

    interval: float = 0.5
    engines: list[Engine] = field(default_factory=list)
    peaks: dict[int, Peak] = field(default_factory=dict)
    per_engine: dict[str, Peak] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._baseline = system_used_kib()
        self._thread = threading.Thread(target=self._run, name="vllm-memory", daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            live = [e for e in list(self.engines) if e.alive()]
            if not live:
                continue
            rss = pss = 0
            for e in live:
                mine = [_rollup(pid) for pid in e.pids()]
                e_rss, e_pss = sum(r for r, _ in mine), sum(p for _, p in mine)
                one = self.per_engine.setdefault(f"{e.name} (tp={e.spec.tp}, {e.spec.dtype})", Peak(1))
                one.rss_kib, one.pss_kib = max(one.rss_kib, e_rss), max(one.pss_kib, e_pss)
                rss, pss = rss + e_rss, pss + e_pss
            peak = self.peaks.setdefault(len(live), Peak(len(live)))
            peak.rss_kib, peak.pss_kib = max(peak.rss_kib, rss), max(peak.pss_kib, pss)
            peak.used_kib = max(peak.used_kib, system_used_kib() - self._baseline)

    def summary(self) -> list[str]:
        together = [f"{n} engine(s) alive: peak RSS {p.rss_kib / 1024:.0f} MiB, PSS {p.pss_kib / 1024:.0f} MiB, "
                    f"system used +{p.used_kib / 1024:.0f} MiB" for n, p in sorted(self.peaks.items())]
        alone = [f"  {name}: peak RSS {p.rss_kib / 1024:.0f} MiB, PSS {p.pss_kib / 1024:.0f} MiB"
                 for name, p in self.per_engine.items()]
        return together + ["per engine (all its processes):"] + alone
