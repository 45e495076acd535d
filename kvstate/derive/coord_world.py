"""What the coordinator and rank tables do not say, for the Promela model of the coordinator
protocol (:mod:`kvstate.derive.promela_coord`): what each guard and effect means, when the
world lets an event happen, and the properties with their invariant ids.

Placeholders in the Promela texts: ``{r}`` is the rank the event concerns (the worker's own
rank for the rank machine; the reporting or dead rank for the coordinator); ``{dest}`` is
the row's destination state; ``{trigger}`` its event. A text ``all: ...``, ``any: ...`` or
``each: ...`` (whole, or parenthesised) is expanded over every rank ``{q}``.

The world of the model:

* every process (the coordinator, each worker, each exporter) can die once the reaper picks
  it, up to :data:`MAX_DEATHS` deaths per run; the kernel then does what it does for real:
  a dead worker's mapping, pins and lease end with it, a dead exporter's leases end with it
  (a worker's mapping of its memory stays readable), and the peers notice by EOF or pidfd
  at a moment of their choosing (after reading what was already queued, or before);
* each worker's own check of its descriptor passes or fails; opening a part fails or, while
  its exporter lives, succeeds; the coordinator's validation of the whole group passes or
  fails, and the imported parts are compatible or not;
* a phase timer may fire at any moment; the engine may drain the group once, at any moment;
* the channels are reliable and FIFO per connection (SOCK_SEQPACKET), but the coordinator
  must not rely on a rank reporting once: a worker's imported report can arrive twice (a
  retry, or a second connection for the same rank), so "every rank" means distinct ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

#: tp of the committed concrete coordinator models (files models/coordinator_tp{n}.pml).
#: tp=2 is checked exhaustively (about 4 million states); tp=3 did not finish: 110 million
#: states stored after 15 minutes and 4.9 GB with hash compaction, so it is not committed.
COORD_TPS = (2,)
#: tp of the committed symmetric models (models/coordinator_sym_tp{n}.pml, see
#: kvstate.derive.coord_symmetry): about 73 thousand states at tp=3, 434 thousand at tp=4
SYMMETRIC_TPS = (3, 4)
#: deaths per run (any process, at any step); one death per run covers every single failure
MAX_DEATHS = 1
#: queue bounds of each connection; the model asserts a send never finds its queue full
CMD_CAPACITY = 6
REP_CAPACITY = 7

LIVENESS_CLAIM = "unmapped_after_death"

#: (machine, "guard"|"effect", name) -> Promela. Coordinator bookkeeping: v_ok/i_ok/q_ok
#: per rank (validated, imported, quiescent reported), gone[r] (reported its part gone),
#: dead[r] (death noted), n_imported (imported reports received, repeats included).
REGISTRY: Mapping[tuple[str, str, str], str] = {
    ("coordinator", "guard", "group_validated"): "!bad_group",
    ("coordinator", "guard", "all_parts_validated"): "all: v_ok[{q}]",
    ("coordinator", "guard", "all_parts_imported"): "all: i_ok[{q}]",
    ("coordinator", "guard", "report_compatible"): "!incompatible",
    ("coordinator", "guard", "all_parts_quiescent"): "all: dead[{q}] || q_ok[{q}] || gone[{q}]",
    ("coordinator", "guard", "all_parts_closed"): "all: dead[{q}] || gone[{q}]",
    ("coordinator", "guard", "all_parts_gone"): "all: dead[{q}] || gone[{q}]",
    ("coordinator", "effect", "send_check"): "each: command({q}, CMD_check)",
    ("coordinator", "effect", "send_open"): "each: command({q}, CMD_open)",
    ("coordinator", "effect", "send_ready"): "each: command({q}, CMD_ready)",
    ("coordinator", "effect", "send_drain"): "each: command({q}, CMD_drain)",
    ("coordinator", "effect", "send_close"): "each: command({q}, CMD_close)",
    ("coordinator", "effect", "send_abort"): "each: command({q}, CMD_abort)",
    ("coordinator", "effect", "note_report"): "note_{trigger}({r})",
    ("coordinator", "effect", "note_death"): "dead[{r}] = 1",
    ("rank", "guard", "part_unpinned"): "pins[{r}] == 0",
    ("rank", "guard", "coordinator_gone"): "c_noticed[{r}]",
    ("rank", "effect", "report"): "report({r}, REP_{dest})",
    ("rank", "effect", "lease_part"): "leases[{r}]++",
    ("rank", "effect", "import_part"): "mapped[{r}] = 1; g_imported[{r}] = 1",
    ("rank", "effect", "rollback_part"): "unmap({r})",
    ("rank", "effect", "unmap_part"): "unmap({r})",
    ("rank", "effect", "submit_load"): "pins[{r}] = 1",
}

#: The coordinator's bookkeeping of each report (the ``note_report`` effect).
NOTES: Mapping[str, str] = {
    "part_validated": "v_ok[r] = 1",
    "part_rejected": "gone[r] = 1",
    "part_imported": "i_ok[r] = 1; n_imported++",
    "part_failed": "gone[r] = 1",
    "part_draining": "skip",
    "part_quiescent": "q_ok[r] = 1",
    "part_closed": "gone[r] = 1",
}

#: (machine, event) -> when the world can produce a local event at all
WORLD_RULES: Mapping[tuple[str, str], str] = {
    ("coordinator", "reject"): "bad_group",
    ("coordinator", "drain"): "!g_drain_asked",
    ("coordinator", "worker_died"): "!w_alive[{r}] && !dead[{r}]",
    ("rank", "validate"): "e_alive[{r}]",    # phase 1 leases: a dead exporter grants nothing
    ("rank", "mapped"): "e_alive[{r}]",
    ("rank", "load"): "pins[{r}] == 0",
    ("rank", "exporter_died"): "!e_alive[{r}] && !e_noticed[{r}]",
    ("rank", "coordinator_died"): "!c_alive && !c_noticed[{r}]",
}

#: ghost updates after a commit: (machine, "event"|"enter", name) -> statement
POST: Mapping[tuple[str, str, str], str] = {
    ("coordinator", "event", "drain"): "g_drain_asked = 1",
    ("coordinator", "event", "begin_check"): "g_checked = 1",
    ("coordinator", "enter", "ready"): "g_ready = 1",
    ("rank", "event", "exporter_died"): "e_noticed[{r}] = 1",
    ("rank", "event", "coordinator_died"): "c_noticed[{r}] = 1",
    ("rank", "enter", "validated"): "g_validated[{r}] = 1",
}

#: transition monitors: (machine, event) -> (invariant, condition asserted before the effects)
PRE: Mapping[tuple[str, str], tuple[str, str]] = {
    ("rank", "load"): ("INV-COORD-LOAD-AFTER-READY", "g_ready && (all: g_imported[{q}])"),
    # two-phase: every rank validated under a lease, and each lease is still held unless
    # that rank ended or a process died (the kernel then ended it)
    ("rank", "mapped"): ("INV-COORD-VALIDATE-BEFORE-OPEN",
                         "g_checked && (all: g_validated[{q}]) && all: LEASE_OR_GONE({q})"),
}

#: state invariants, asserted after every step
STATE: tuple[tuple[str, str], ...] = (
    ("INV-COORD-READY-COMPLETE", "coord != COORD_ready || ((all: g_imported[{q}]) && !incompatible)"),
    ("INV-COORD-NO-ORPHAN-MAPPING", "all: !RANK_ENDED({q}) || (!mapped[{q}] && leases[{q}] == 0)"),
    ("INV-COORD-LEASES", "LEASES_HELD <= TP"),
)

#: What the symmetric model forgets once nothing can read it, the same reduction a dead
#: variable analysis makes (exact: no behaviour or property changes): (when, statements),
#: ``{r}`` for each slot. A dead or ended coordinator reads no report and none of its
#: bookkeeping (its commands need c_alive and a state with rows; properties never read
#: them); a dead worker, or one whose share ended, reads nothing off its command queue (a
#: received command is dropped) and is sent nothing more. The generator refuses a property,
#: rank text or world rule that reads a forgotten name.
FORGET: tuple[tuple[str, str], ...] = (
    ("!c_alive || COORD_ENDED", "n_imported = 0; g_drain_asked = 0; each: repq[{q}] = 0; repn[{q}] = 0; "
                                "v_ok[{q}] = 0; i_ok[{q}] = 0; q_ok[{q}] = 0; gone[{q}] = 0; dead[{q}] = 0"),
    ("!w_alive[{r}] || RANK_ENDED({r})", "cmdq[{r}] = 0; cmdn[{r}] = 0"),
)

#: the liveness property (checked with pan -a -f under weak fairness)
LIVENESS = ("INV-COORD-UNMAP-AFTER-DEATH", "[] (g_died -> <> (all: !mapped[{q}]))")

#: the per-connection FIFO channels: Promela channels in the concrete model ...
CHANNELS = """\
chan cmd[TP] = [CMD_CAPACITY] of { byte };   /* coordinator -> worker r */
chan rep[TP] = [REP_CAPACITY] of { byte };   /* worker r -> coordinator */"""
#: ... and, in the symmetric model, each queue packed into one number (3 bits a message,
#: oldest lowest; messages are never 0) with its length, so that whole rank slots can be
#: compared and swapped; the same FIFO (see :mod:`kvstate.derive.promela_coord`)
QUEUES = """\
int cmdq[TP];                  /* coordinator -> worker r, packed */
byte cmdn[TP];
int repq[TP];                  /* worker r -> coordinator, packed */
byte repn[TP];"""

#: every global of the model; each array of TP entries is one rank's slot ({channels}: one
#: of the two above)
GLOBALS = """\
byte coord;                    /* coordinator machine */
byte rank[TP];                 /* rank machine of each worker's share */
{channels}
/* processes and what the kernel keeps for them */
bit c_alive = 1;
bit w_alive[TP];
bit e_alive[TP];
bit mapped[TP];                /* worker r maps its part */
byte leases[TP];               /* leases the group holds on rank r's bank */
bit pins[TP];                  /* a load of worker r is in flight */
byte deaths;
/* the coordinator's bookkeeping */
bit v_ok[TP];
bit i_ok[TP];
bit q_ok[TP];
bit gone[TP];
bit dead[TP];
byte n_imported;
/* what each worker noticed */
bit c_noticed[TP];
bit e_noticed[TP];
bit repeated[TP];
/* the world's choices */
bit bad_group;
bit incompatible;
/* ghosts for the properties */
bit g_checked;
bit g_ready;
bit g_died;
bit g_drain_asked;
bit g_validated[TP];
bit g_imported[TP];
/* rank q holds its lease, or no longer needs one: its share ended or a process died */
#define LEASE_OR_GONE(q) (leases[q] > 0 || RANK_ENDED(q) || !w_alive[q] || !e_alive[q])"""
