"""The suites of ``kvstate bench``, at full size or ``quick`` (a smoke run of seconds).

kvstate's rows plug in as one function each: ``b1_import.kvstate_host_import``,
``b2_load.kvstate_op_gather`` and the ``b4_scatter.kvstate_*`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks import b1_bound, b1_floor, b1_import, b2_load, b3_lifecycle, b4_scatter
from benchmarks.framework import Case, Comparison, Figure, Suite
from benchmarks.procs import split_cpus

MiB = 1 << 20
READINESS_TP = (1, 2, 4, 8, 16, 32, 64)
IMPORT_TP = (1, 8, 64)
#: Bank size per tp in B1: 64 MiB, but 8 MiB at tp=64 (64 banks of 64 MiB would take 4 GiB in
#: each of two processes per row). No row populates page tables, so mapping costs do not
#: grow with the bank size; the per-rank rows compare like with like at every tp.
B1_BANK_MIB = {1: 64, 8: 64, 64: 8}


def _at(fn: Callable[[dict[str, Any]], Figure], tp: int, bank_mib: int) -> Callable[[dict[str, Any]], Figure]:
    def run(params: dict[str, Any]) -> Figure:
        return fn({**params, "tp": tp, "bank_bytes": bank_mib * MiB})
    return run


def b1_rows(tp: int) -> dict[str, str]:
    """The names of B1's rows at ``tp``."""
    return {"group": f"kvstate whole-group import tp={tp}", "rank": f"kvstate per-rank import tp={tp}",
            "parked": f"kvstate whole-group import, leases parked tp={tp}",
            "floor_group": f"floor: SCM_RIGHTS + mmap, whole group tp={tp}",
            "floor_rank": f"floor: SCM_RIGHTS + mmap, per rank tp={tp}",
            "shm": f"shared_memory attach tp={tp}", "nixl": f"NIXL register + metadata load tp={tp}",
            "nixl_ask": f"NIXL register + metadata load + a round trip tp={tp}",
            "bound_group": f"bound: floor + rules + machines, whole group tp={tp}",
            "bound_rank": f"bound: floor + rules + machines, per rank tp={tp}"}


def b1_suite(quick: bool, repeats: int) -> Suite:
    tps = (1, 8) if quick else IMPORT_TP
    cases: list[Case] = []
    comparisons: list[Comparison] = []
    for tp in tps:
        mib = 1 if quick else B1_BANK_MIB[tp]
        n = b1_rows(tp)
        cases += [
            Case(n["group"], _at(b1_import.kvstate_group_import, tp, mib), kvstate=True, reference=n["floor_group"]),
            Case(n["parked"], _at(b1_import.kvstate_group_import_parked, tp, mib), kvstate=True,
                 reference=n["floor_group"]),
            Case(n["rank"], _at(b1_import.kvstate_rank_import, tp, mib), kvstate=True, reference=n["floor_rank"]),
            Case(n["floor_group"], _at(b1_floor.floor_group, tp, mib), reference=n["floor_group"]),
            Case(n["floor_rank"], _at(b1_floor.floor_rank, tp, mib), reference=n["floor_rank"]),
            Case(n["shm"], _at(b1_import.shm_attach, tp, mib), reference=n["floor_group"]),
            Case(n["nixl"], _at(b1_import.nixl_register_and_load, tp, mib), reference=n["floor_group"]),
            Case(n["nixl_ask"], _at(b1_import.nixl_register_load_and_ask, tp, mib), reference=n["floor_group"]),
            Case(n["bound_group"], _at(b1_bound.bound_group, tp, mib), reference=n["floor_group"]),
            Case(n["bound_rank"], _at(b1_bound.bound_rank, tp, mib), reference=n["floor_rank"]),
        ]
        if tp == 8:
            cases.append(Case("torch.multiprocessing fd sharing tp=8", _at(b1_import.torch_fd_sharing, tp, mib),
                              reference=n["floor_group"]))
        comparisons += [
            Comparison(n["group"], n["nixl"], 1.0 if tp == 8 else None),
            Comparison(n["group"], n["shm"], 3.0 if tp == 8 else None),
            # kvstate asks its exporter for a lease; the goal's NIXL row asks nobody.
            Comparison(n["group"], n["nixl_ask"], None, "against a NIXL import that asks its peer once"),
            Comparison(n["group"], n["floor_group"]),
            # The next import of the same banks, its leases parked (kvstate.share.parked):
            # no round trip, no fd, no mapping. Not the goal's row: the goal's peers map anew.
            Comparison(n["parked"], n["nixl"], None, "leases parked: the next import of the same banks"),
            Comparison(n["parked"], n["shm"], None, "leases parked: the next import of the same banks"),
            Comparison(n["rank"], n["floor_rank"], 2.0),
            # What kvstate's design alone costs (b1_bound), against the same goals, and how
            # much of kvstate's time is its own code beyond it.
            Comparison(n["bound_group"], n["nixl"], 1.0 if tp == 8 else None, "the design's floor vs the goal"),
            Comparison(n["bound_group"], n["shm"], 3.0 if tp == 8 else None, "the design's floor vs the goal"),
            Comparison(n["bound_rank"], n["floor_rank"], 2.0, "the design's floor vs the goal"),
            Comparison(n["group"], n["bound_group"]),
            Comparison(n["rank"], n["bound_rank"]),
        ]
    first, last = b1_rows(tps[0])["rank"], b1_rows(tps[-1])["rank"]
    comparisons.append(Comparison(last, first, 1.5, "per-rank cost flat in tp"))
    cpus = split_cpus()
    placement = "importer and exporter on one CPU each, " + (f"{cpus[0]} and {cpus[1]}" if cpus else "(one CPU: shared)")
    return Suite("B1", f"group import at tp {', '.join(map(str, tps))}: one bank per rank of "
                 + ("1 MiB" if quick else ", ".join(f"{B1_BANK_MIB[t]} MiB at tp={t}" for t in tps)) + f"; {placement}",
                 "tp=8 whole group no slower than NIXL and <= 3x shared_memory; per rank <= 2x the floor, flat in tp",
                 b1_rows(8)["floor_group"], tuple(cases), {"repeats": repeats, "placement": "split"},
                 tuple(comparisons))


#: B4's kvstate row and the rows it is compared with: the memcpy limit, then its peers.
B4_LOAD = "kvstate Group.load (paged scatter)"
B4_MEMCPY = "contiguous memcpy"
B4_PEERS = ("numpy fancy assignment", "NIXL READ (UCX same-node defaults)", "torch index_copy_", "torch index_put_")


def b4_comparisons() -> tuple[Comparison, ...]:
    """B4's goals as time multiples: at least 90% of memcpy's speed is at most 1/0.9 of its
    time, and ahead of a peer is at most 1x its time."""
    return (Comparison(B4_LOAD, B4_MEMCPY, 1 / 0.9, ">= 90% of memcpy's speed"),
            *(Comparison(B4_LOAD, peer, 1.0, "ahead of the peer") for peer in B4_PEERS))


def suites(quick: bool = False, repeats: int | None = None) -> list[Suite]:
    r = repeats or (2 if quick else 7)
    b2 = {"n_blocks": 64 if quick else 4096, "bank_blocks": 128 if quick else 8192,
          "block_bytes": 64 * 1024, "seed": 7, "repeats": r}
    b4 = {"n_blocks": 128 if quick else 4096, "regions": 8 if quick else 32, "block_bytes": 64 * 1024,
          "bank_blocks": 64 if quick else 256, "dst_blocks": 64 if quick else 256, "seed": 11, "repeats": r}
    b3 = {"cycles": 200 if quick else 5000, "groups": 20 if quick else 500, "repeats": r}
    tps = READINESS_TP[:3] if quick else READINESS_TP
    return [
        b1_suite(quick, r),
        Suite("B2", f"prefix load, {b2['n_blocks']} random blocks of {b2['block_bytes'] // 1024} KiB",
              ">= 90% of memcpy and ahead of every peer", "contiguous memcpy", (
                  Case("kvstate op engine gather", b2_load.kvstate_op_gather, kvstate=True),
                  Case("numpy gather", b2_load.numpy_gather),
                  Case("NIXL READ (UCX tcp, lo)", b2_load.nixl_read_loopback),
                  Case("NIXL READ (UCX same-node defaults)", b2_load.nixl_read_same_node),
                  Case("contiguous memcpy", b2_load.memcpy),
              ), b2),
        Suite("B4", f"paged scatter, {b4['n_blocks']} random blocks of {b4['block_bytes'] // 1024} KiB over "
              f"{b4['regions']} layer regions", ">= 90% of memcpy and ahead of every peer", "contiguous memcpy", (
                  Case(B4_LOAD, b4_scatter.kvstate_load, kvstate=True),
                  Case("kvstate first layer usable", b4_scatter.kvstate_first_layer, kvstate=True),
                  Case("kvstate Bank.store (same pages)", b4_scatter.kvstate_store, kvstate=True),
                  Case("torch index_copy_", b4_scatter.torch_index_copy),
                  Case("torch index_put_", b4_scatter.torch_index_put),
                  Case("numpy fancy assignment", b4_scatter.numpy_fancy),
                  Case("NIXL READ (UCX same-node defaults)", b4_scatter.nixl_read),
                  Case("contiguous memcpy", b4_scatter.memcpy),
              ), b4, b4_comparisons()),
        Suite("B3", "lifecycle overhead (kvstate.core.machine on the spec tables)",
              "<= 15 us per transition; readiness cost flat in tp", "readiness check tp=1", (
                  Case("bank transition", b3_lifecycle.bank_transition, kvstate=True),
                  Case("group transition", b3_lifecycle.group_transition, kvstate=True),
                  *(Case(f"readiness check tp={tp}", b3_lifecycle.readiness(tp), kvstate=True) for tp in tps),
                  *(Case(f"importer.Group readiness tp={tp}", b3_lifecycle.real_group_readiness(tp), kvstate=True)
                    for tp in tps),
              ), b3),
    ]
