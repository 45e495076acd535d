"""Symmetry reduction of the coordinator model: the Promela that keeps its rank slots sorted.

Theory of operation
-------------------

The concrete model (:mod:`kvstate.derive.promela_coord`) stores every state of tp ranks; a
state whose ranks are a permutation of another's behaves the same up to renaming ranks, so
storing one state per orbit is enough (Ip and Dill's symmetry reduction). The symmetric
model does that by hand: after every step, inside the same atomic step, :func:`canon` sorts
the rank *slots* (every global array of ``TP`` entries, queues included) by their whole
contents, lexicographically, so Spin stores only the sorted representative of each orbit.

Why that is sound here (the argument in full is in docs/coordinator.md, "tp 3 and 4:
the symmetric model"):

* the ranks are interchangeable: no row, guard, effect, world rule or property names a
  particular rank; each rank-bound text is either per slot (``{r}``, the rank of the
  process or the report) or quantified over every slot (``all:``, ``any:``, ``each:``,
  sums); the reaper may kill any slot (the concrete model kills only rank tp-1, itself a
  symmetry argument that a sort would break);
* a permutation must move *everything* of a slot: :func:`slot_arrays` reads the slot
  arrays from the declarations themselves, so a new per-rank variable is sorted too; the
  channels are packed queues (numbers), so they move like any variable;
* the processes of rank r (its worker and engine) hold nothing but ``r``: every step is one
  atomic block at the head of a loop that never ends, so every process is at the same
  place between steps and whichever process serves slot r serves it the same way. A
  process that ended would be at another place, so no process ends; a watchdog does the
  deadlock check that Spin's end-state check did, with each process's end condition;
* every property is symmetric (a condition over all slots), so a violation exists in the
  concrete model iff it exists in the reduced one.

What breaks it: any text that names a rank by number, a per-rank variable that is not a
``[TP]`` global (say, a local of a worker), or a property about one rank. Weak fairness is
per process and the sort moves slots between processes, so liveness is not checked on the
symmetric model. Rank numbers in a counterexample are slots at that step, not stable ranks.
"""

from __future__ import annotations

import re

from kvstate.derive.promela_world import MARK

_SLOT = re.compile(r"^(?:bit|bool|byte|short|int)\s+(\w+)\[TP\];", re.MULTILINE)


def slot_arrays(globals_text: str) -> list[str]:
    """The per-rank arrays (declared ``name[TP]``), in declaration order."""
    return _SLOT.findall(globals_text)


def canon(globals_text: str, tp: int) -> str:
    """``canon()``: sort the slots (a bubble sort network, tp(tp-1)/2 compare-and-swaps)."""
    arrays = slot_arrays(globals_text)
    if "rank" not in arrays:
        raise ValueError("the coordinator model declares no rank[TP] slot array")
    arrays.remove("rank")
    arrays.insert(0, "rank")  # the machine state first: the most telling order
    gt = "0"
    for name in reversed(arrays):
        gt = f"({name}[i] > {name}[j] || {name}[i] == {name}[j] && {gt})"
    swap = "; ".join(f"sw = {a}[i]; {a}[i] = {a}[j]; {a}[j] = sw" for a in arrays)
    pairs = [(j, j + 1) for n in range(tp - 1) for j in range(tp - 1 - n)]
    steps = [f"\tif :: SLOT_GT({i}, {j}) -> swap_slots({i}, {j}) :: else -> skip fi" for i, j in pairs]
    return "\n".join([
        "/* Symmetry reduction: the rank slots, kept sorted by their whole contents. */",
        "hidden int sw;",
        f"#define SLOT_GT(i, j) {gt}",
        f"inline swap_slots(i, j) {{ {swap} }}",
        "inline canon() {", "\td_step {", ";\n".join(steps) or "\tskip", "\t}", "}", ""])


def watchdog(done: list[str]) -> str:
    """The deadlock check: when nothing else can move, every process must be done."""
    cond = " && ".join(f"({d})" for d in done)
    return ("/* No process of the symmetric model ends, so this is its end-state check: when no\n"
            "   other process can move, every process must have been free to end. */\n"
            "proctype watchdog()\n{\nend:\n\tdo\n"
            f"\t:: timeout -> if :: !({cond}) -> printf(\"{MARK} violated deadlock\\n\"); assert(false) "
            ":: else -> skip fi\n\tod\n}\n")
