"""Cost of the runtime machines, side by side with their peers, in one run.

    python benchmarks/bench_machines.py [--n 100000]

Rows (each timed in this process, best of 5 repeats):

- per transition: kvstate ``Lifecycle.fire`` (per-object RLock, declared-pair check,
  transitions Event.trigger) against a plain dict table under a plain ``threading.Lock``,
  the same dict table with no lock, and ``transitions``' own LockedMachine trigger.
- creating N bank objects: kvstate (O(1) each, never ``add_model``) against
  ``Machine.add_model`` on one shared machine, at N and 2N to show the quadratic growth.
"""

from __future__ import annotations

import argparse
import threading
import timeit
from typing import Any

from transitions import Machine
from transitions.extensions import LockedMachine

from kvstate.core.machine import Lifecycle, effect, guard
from kvstate.core.spec import load_machine

GROUP = load_machine("group")
BANK = load_machine("bank")


def harness(spec: Any) -> type[Lifecycle]:
    ns: dict[str, Any] = {"table": spec}
    for g in spec.guards:
        ns[f"_g_{g}"] = guard(g)(lambda self, **kw: True)
    for e in spec.effects:
        ns[f"_e_{e}"] = effect(e)(lambda self, **kw: None)
    return type(f"{spec.name}Bench", (Lifecycle,), ns)


def best(fn: Any, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number


def per_transition(n: int) -> list[tuple[str, float]]:
    Group = harness(GROUP)
    g = Group()
    g.fire("begin_import")
    g.fire("complete")  # ready: `load` is a guarded-free self-loop with one effect

    table = {(t.trigger, t.source): t.dest for t in GROUP.transitions}
    state = {"s": "ready"}
    lock = threading.Lock()

    def dict_locked() -> None:
        with lock:
            state["s"] = table[("load", state["s"])]

    def dict_bare() -> None:
        state["s"] = table[("load", state["s"])]

    class Model:
        pass

    locked = LockedMachine(model=Model(), states=list(GROUP.state_names), initial="ready",
                           auto_transitions=False)
    locked.add_transition("load", "ready", "ready")
    model = locked.models[0]

    plain = Group()
    plain.fire("begin_import")
    plain.fire("complete")
    plain._kv_lock = threading.Lock()  # type: ignore[assignment]  # what the RLock costs

    return [
        ("kvstate Lifecycle.fire (RLock per object)", best(lambda: g.fire("load"), n)),
        ("kvstate Lifecycle.fire, plain Lock instead", best(lambda: plain.fire("load"), n)),
        ("plain dict table + threading.Lock", best(dict_locked, n)),
        ("plain dict table, no lock", best(dict_bare, n)),
        ("transitions LockedMachine trigger", best(lambda: model.trigger("load"), n)),
    ]


def creation(n: int) -> list[tuple[str, float]]:
    Bank = harness(BANK)

    def kvstate_objects(count: int) -> None:
        [Bank() for _ in range(count)]

    def add_model(count: int) -> None:
        m = Machine(model=None, states=list(BANK.state_names), initial=BANK.initial, auto_transitions=False)
        for t in BANK.transitions:
            m.add_transition(t.trigger, t.source, t.dest)
        for _ in range(count):
            m.add_model(_Plain())

    rows = []
    for count in (n, 2 * n):
        rows.append((f"kvstate: create {count:,} banks", min(timeit.repeat(lambda: kvstate_objects(count), number=1, repeat=3))))
        rows.append((f"transitions add_model: {count:,} banks", min(timeit.repeat(lambda: add_model(count), number=1, repeat=1))))
    return rows


class _Plain:
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100_000, help="transitions per timing")
    parser.add_argument("--objects", type=int, default=10_000, help="objects to create")
    args = parser.parse_args()

    rows = per_transition(args.n)
    base = rows[2][1]
    print(f"{'per transition':48} {'us':>8} {'vs dict+Lock':>13}")
    for name, sec in rows:
        print(f"{name:48} {sec * 1e6:8.2f} {sec / base:12.2f}x")
    print()
    rows = creation(args.objects)
    print(f"{'object creation':48} {'ms':>8}")
    for name, sec in rows:
        print(f"{name:48} {sec * 1e3:8.1f}")
    k1, a1, k4, a4 = (r[1] for r in rows)
    print(f"\ngrowth from {args.objects:,} to {2 * args.objects:,} objects: kvstate x{k4 / k1:.1f}, "
          f"add_model x{a4 / a1:.1f} (linear would be x2, quadratic x4)")


if __name__ == "__main__":
    main()
