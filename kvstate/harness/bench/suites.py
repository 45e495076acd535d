"""The suites of ``kvstate bench``, at full size or ``quick`` (a smoke run of seconds).

kvstate's rows plug in as one function each: ``b1_import.kvstate_host_import``,
``b2_load.kvstate_op_gather`` and the ``b4_scatter.kvstate_*`` rows.
"""

from __future__ import annotations

from kvstate.harness.bench import b1_import, b2_load, b3_lifecycle, b4_scatter
from kvstate.harness.bench.framework import Case, Suite

MiB = 1 << 20
READINESS_TP = (1, 2, 4, 8, 16, 32, 64)


def suites(quick: bool = False, repeats: int | None = None) -> list[Suite]:
    r = repeats or (2 if quick else 7)
    b1 = {"tp": 8, "bank_bytes": (1 if quick else 64) * MiB, "repeats": r}
    b2 = {"n_blocks": 64 if quick else 4096, "bank_blocks": 128 if quick else 8192,
          "block_bytes": 64 * 1024, "seed": 7, "repeats": r}
    b4 = {"n_blocks": 128 if quick else 4096, "regions": 8 if quick else 32, "block_bytes": 64 * 1024,
          "bank_blocks": 64 if quick else 256, "dst_blocks": 64 if quick else 256, "seed": 11, "repeats": r}
    b3 = {"cycles": 200 if quick else 5000, "groups": 20 if quick else 500, "repeats": r}
    tps = READINESS_TP[:3] if quick else READINESS_TP
    return [
        Suite("B1", f"group import, tp={b1['tp']}, {b1['tp']} banks of {b1['bank_bytes'] // MiB} MiB",
              "kvstate host backend faster than every peer", "kvstate host import", (
                  Case("kvstate host import", b1_import.kvstate_host_import, kvstate=True),
                  Case("multiprocessing.shared_memory attach", b1_import.shm_attach),
                  Case("torch.multiprocessing fd sharing", b1_import.torch_fd_sharing),
                  Case("NIXL register + metadata load", b1_import.nixl_register_and_load),
              ), b1),
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
                  Case("kvstate Group.load (paged scatter)", b4_scatter.kvstate_load, kvstate=True),
                  Case("kvstate first layer usable", b4_scatter.kvstate_first_layer, kvstate=True),
                  Case("kvstate Bank.store (same pages)", b4_scatter.kvstate_store, kvstate=True),
                  Case("torch index_copy_", b4_scatter.torch_index_copy),
                  Case("torch index_put_", b4_scatter.torch_index_put),
                  Case("numpy fancy assignment", b4_scatter.numpy_fancy),
                  Case("NIXL READ (UCX same-node defaults)", b4_scatter.nixl_read),
                  Case("contiguous memcpy", b4_scatter.memcpy),
              ), b4),
        Suite("B3", "lifecycle overhead (kvstate.core.machine on the spec tables)",
              "<= 15 us per transition; readiness cost flat in tp", "readiness check tp=1", (
                  Case("bank transition", b3_lifecycle.bank_transition, kvstate=True),
                  Case("group transition", b3_lifecycle.group_transition, kvstate=True),
                  *(Case(f"readiness check tp={tp}", b3_lifecycle.readiness(tp), kvstate=True) for tp in tps),
                  *(Case(f"importer.Group readiness tp={tp}", b3_lifecycle.real_group_readiness(tp), kvstate=True)
                    for tp in tps),
              ), b3),
    ]
