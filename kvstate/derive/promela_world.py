"""What the tables do not say, for the Promela models of :mod:`kvstate.derive.promela`:
what each guard and effect means (the registry), who fires each event and when the world
lets it happen (actors and world rules), and the properties (monitors and invariants).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs


PER_RANK = "per_rank"
COUNTING = "counting"
KINDS = (PER_RANK, COUNTING)

PER_RANK_TPS = (2, 3, 4)
COUNTING_TPS = (8, 16, 32, 64)
#: live leases per bank in the per-rank model: the group's importer and one other
MAX_LEASES = 2
#: op slots (prefix loads in flight at once)
OP_SLOTS = 1
#: The per-rank model gives every rank its own bank (exporter side, leases, pins), as a
#: decode engine has: tp banks. (Before, rank 0's bank stood for all of them.) A per-model
#: value: the banks of a per-rank model are its ranks, see :func:`banks`.
def banks(tp: int) -> int:
    return tp

#: machines each model contains, in declaration order
MACHINES = {PER_RANK: ("bank", "group", "part", "op"), COUNTING: ("group", "part", "op")}

LIVENESS_CLAIM = "drain_quiesces"

MARK = "@@"  # prefix of every event line a trail replay prints


@attrs.frozen
class Cascade:
    """An effect that fires ``event`` of machine ``machine`` through that machine's table:
    on every instance (``target="all"``) or on one free instance (``target="free"``)."""

    machine: str
    event: str
    target: str = "all"


Text = str | Cascade


@attrs.frozen
class Code:
    """Promela for one entry, per model kind. ``None``: the entry does not exist there.

    Placeholders: ``{i}`` is the machine instance's index. A text starting ``all:``,
    ``any:`` or ``each:`` is expanded over the ranks ``{r}`` (per-rank model) with
    ``&&``, ``||`` or ``;`` respectively. Op indices expand the same way with ``ops:``.
    """

    per_rank: Text | None
    counting: Text | None = None

    def get(self, kind: str) -> Text | None:
        return self.per_rank if kind == PER_RANK else self.counting


def same(text: Text) -> Code:
    return Code(text, text)


# -- the registry: what each table guard and effect means in Promela ------------------

REGISTRY: Mapping[tuple[str, str, str], Code] = {
    # bank (per-rank model only)
    ("bank", "guard", "accepting_leases"): Code("leases[{i}] < MAX_LEASES"),
    ("bank", "guard", "last_lease"): Code("leases[{i}] == 1"),
    ("bank", "guard", "native_quiescent"): Code("(leases[{i}] == 0 && pins[{i}] == 0)"),
    # expired leases are counted apart (xl) only to bound expiry: each lease expires once
    ("bank", "guard", "lease_live"): Code("leases[{i}] > xl[{i}]"),
    ("bank", "effect", "native_register"): Code("g_registered[{i}] = 1"),
    ("bank", "effect", "publish_descriptor"): Code("skip"),
    ("bank", "effect", "grant_lease"): Code("leases[{i}]++"),
    # the lease that ends may be an expired one: keep xl <= leases
    ("bank", "effect", "end_lease"): Code("leases[{i}]--; if :: xl[{i}] > leases[{i}] -> xl[{i}] = leases[{i}] "
                                          ":: else -> skip fi"),
    ("bank", "effect", "expire_lease"): Code("xl[{i}]++"),
    ("bank", "effect", "renew_lease"): Code("skip"),
    ("bank", "effect", "withdraw_descriptor"): Code("skip"),
    ("bank", "effect", "stop_new_leases"): Code("skip"),
    ("bank", "effect", "native_release"): Code("skip"),
    # stores copy engine pages into the bank; the models leave the exporter's own ops out
    ("bank", "effect", "submit_store"): Code("skip"),
    ("bank", "effect", "collect_store"): Code("skip"),
    # group
    ("group", "guard", "group_validated"): Code("all: part[{r}] == PART_validated",
                                                "part_n[PART_validated] == TP"),
    ("group", "guard", "all_parts_imported"): Code("all: part[{r}] == PART_imported",
                                                   "part_n[PART_imported] == TP"),
    ("group", "guard", "parts_compatible"): same("!incompatible"),
    ("group", "guard", "native_quiescent"): Code("all: pins[{r}] == 0", "pins == 0"),
    ("group", "effect", "rollback_parts"): same(Cascade("part", "close")),
    ("group", "effect", "submit_load"): same(Cascade("op", "submit", target="free")),
    ("group", "effect", "stop_loads"): same("skip"),
    ("group", "effect", "collect_load"): same("skip"),
    ("group", "effect", "unmap_parts"): same(Cascade("part", "close")),
    # part
    ("part", "guard", "group_importing"): same("group == GROUP_importing"),
    ("part", "guard", "group_admitted"): Code(
        "group == GROUP_importing && (all: part[{r}] == PART_leased || part[{r}] == PART_imported)",
        "group == GROUP_importing && part_n[PART_leased] + part_n[PART_imported] == TP"),
    ("part", "guard", "group_releasing"): same("group != GROUP_ready && group != GROUP_draining"),
    ("part", "guard", "part_unpinned"): Code("pins[{i}] == 0", "pins == 0"),
    # the importer's own lease on its rank's bank (ilease) and its mapping of it (mapped),
    # kept apart from the bank's lease count and from op pins: returning the lease only
    # lets the lessee's release_lease happen; the bank sees it when that event fires
    ("part", "effect", "native_lease"): Code("ilease[{i}] = 1", "skip"),
    ("part", "effect", "native_import"): Code("mapped[{i}] = 1", "skip"),
    ("part", "effect", "return_lease"): Code("ilease[{i}] = 0", "skip"),
    ("part", "effect", "unmap_close"): Code("mapped[{i}] = 0; ilease[{i}] = 0", "skip"),
    # op: one gather op pins the region of every rank
    ("op", "guard", "regions_mapped"): Code("all: part[{r}] == PART_imported",
                                            "part_n[PART_imported] == TP"),
    ("op", "effect", "pin_regions"): Code("each: pins[{r}]++", "pins++"),
    ("op", "effect", "unpin_regions"): Code("each: pins[{r}]--", "pins--"),
}

# -- the environment: who fires each event, and when the world can produce it ---------

EXPORTER, LESSEE, IMPORTER, OPERATOR, ENGINE = "exporter", "lessee", "importer", "operator", "engine"

#: machine -> event -> actor process (None: fired only by a Cascade)
ACTORS: Mapping[str, Mapping[str, str | None]] = {
    "bank": {"register": EXPORTER, "register_failed": EXPORTER, "advertise": EXPORTER,
             "quiesce": EXPORTER, "release": EXPORTER, "drain": OPERATOR,
             "grant_lease": LESSEE, "lease_mapped": LESSEE, "release_lease": LESSEE,
             "peer_died": LESSEE, "lease_expired": LESSEE, "renew_lease": LESSEE,
             "descriptor_expired": EXPORTER, "store": EXPORTER, "stored": EXPORTER},
    "group": {"begin_import": IMPORTER, "reject": IMPORTER, "complete": IMPORTER, "load": IMPORTER, "loaded": IMPORTER,
              "drain": OPERATOR, "quiesce": IMPORTER, "close": IMPORTER, "part_failed": IMPORTER,
              "peer_died": IMPORTER, "incarnation_changed": IMPORTER, "expired": IMPORTER},
    "part": {"validate": IMPORTER, "reject": IMPORTER, "lease": IMPORTER, "open": IMPORTER, "close": IMPORTER,
             "import_failed": IMPORTER},
    "op": {"submit": None, "start": ENGINE, "finish": ENGINE, "fail": ENGINE, "cancel": ENGINE,
           "reap": ENGINE},
}

#: (machine, event) -> when the world can produce the event at all
WORLD_RULES: Mapping[tuple[str, str], Code] = {
    # Stores and the collection of a finished load change no state and happen once per
    # transfer in the implementation; the models leave them out (a self-loop the world
    # could fire forever would hide a drain that never quiesces).
    ("bank", "store"): same("false"),
    ("bank", "stored"): same("false"),
    ("group", "loaded"): same("false"),
    # an ending lease names a live lease; the group's importer returns its own (ilease)
    # only after unmapping (its part's close), and its process does not die here (that
    # would take the mapping with it). Any lease, the importer's included, may run out
    # unrenewed at any time: expiry is nondeterministic.
    ("bank", "release_lease"): Code("leases[{i}] > ilease[{i}]"),
    ("bank", "peer_died"): Code("leases[{i}] > ilease[{i}]"),
    ("bank", "lease_expired"): Code("leases[{i}] > 0"),
    ("bank", "renew_lease"): Code("leases[{i}] > 0"),
    # the group's importer reports a mapping once its part is imported
    ("bank", "grant_lease"): Code("true"),  # the group's importer, or another lessee, at any time
    ("bank", "lease_mapped"): Code("part[{i}] == PART_imported"),
    # a descriptor arrives only once its bank was advertised
    ("part", "validate"): Code("g_advertised[{i}]", "true"),
    ("part", "reject"): Code("g_advertised[{i}]", "true"),
    # opening a handle fails only while the group imports (an open was attempted)
    ("part", "import_failed"): same("group == GROUP_importing"),
    # a part is leased and imported under a live lease on its own rank's bank (the
    # lease it claims is one the importer has not claimed already)
    ("part", "lease"): Code("leases[{i}] > ilease[{i}]", "true"),
    ("part", "open"): Code("leases[{i}] > 0", "true"),
    # the importer closes a part directly to discard the parts of a finished group, and
    # (an attack, or a bug) tries to close a part of a ready or draining group: the table
    # must refuse that one (INV-GROUP-COMPLETE). Before that, the group's own effects
    # close its parts.
    ("part", "close"): same("GROUP_FINISHED || group == GROUP_ready || group == GROUP_draining"),
    # the group hears of a failed part only once one failed
    ("group", "part_failed"): Code("any: part[{r}] == PART_failed", "part_n[PART_failed] > 0"),
    # a load runs under live leases on every rank, in a free op slot
    ("group", "load"): Code("(banks: leases[{b}] > 0) && (ops: op[{k}] == OP_created)",
                            "(ops: op[{k}] == OP_created)"),
}

#: transition monitors: (machine, event) -> assertion before the effects
PRE_MONITORS: Mapping[tuple[str, str], tuple[tuple[str, Code], ...]] = {
    ("bank", "grant_lease"): (("INV-DRAIN-NO-NEW", Code("!g_drained[{i}]")),),
    ("group", "load"): (("INV-DRAIN-NO-NEW", same("!g_group_drained")),),
    ("part", "lease"): (("INV-GROUP-ATOMIC", same("g_admitted")),),
    ("part", "open"): (("INV-GROUP-ATOMIC", same("g_admitted")),
                       ("INV-LEASE-BEFORE-OPEN", Code("all: part[{r}] == PART_leased || part[{r}] == PART_imported",
                                                      "part_n[PART_leased] + part_n[PART_imported] == TP"))),
}

#: ghost updates after the commit: (machine, "event"|"enter", name) -> statement
POST_MONITORS: Mapping[tuple[str, str, str], Code] = {
    ("bank", "event", "advertise"): Code("g_advertised[{i}] = 1"),
    ("bank", "enter", "draining"): Code("g_drained[{i}] = 1"),
    ("bank", "enter", "quiescent"): Code("g_quiesced[{i}] = 1"),
    ("group", "enter", "draining"): same("g_group_drained = 1"),
    ("group", "event", "begin_import"): same("g_admitted = 1"),
    ("part", "event", "reject"): Code("g_rejected[{i}] = 1", "g_rejections++"),
}

#: state invariants, asserted after every transition
STATE_INVARIANTS: tuple[tuple[str, Code], ...] = (
    ("INV-GROUP-COMPLETE", Code("group != GROUP_ready || ((all: part[{r}] == PART_imported) && !incompatible)",
                                "group != GROUP_ready || (part_n[PART_imported] == TP && !incompatible)")),
    ("INV-GROUP-ATOMIC", Code("g_admitted || (all: part[{r}] != PART_imported)",
                              "g_admitted || part_n[PART_imported] == 0")),
    ("INV-ROLLBACK-COMPLETE", Code("group != GROUP_failed || (all: part[{r}] != PART_imported)",
                                   "group != GROUP_failed || part_n[PART_imported] == 0")),
    ("INV-QUIESCE-AFTER-DRAIN", same("group != GROUP_quiescent || g_group_drained")),
    ("INV-REJECT-BEFORE-OPEN", Code("all: !g_rejected[{r}] || part[{r}] != PART_imported",
                                    "part_n[PART_rejected] == g_rejections")),
    ("INV-NO-UNMAP-PINNED", Code("(all: pins[{r}] == 0 || part[{r}] == PART_imported) "
                                 "&& (banks: pins[{b}] == 0 || bank[{b}] != BANK_released)",
                                 "pins == 0 || part_n[PART_imported] == TP")),
    ("INV-NO-RELEASE-MAPPED", Code("banks: bank[{b}] != BANK_released || !mapped[{b}]")),
    ("INV-RELEASE-QUIESCENT", Code("banks: bank[{b}] != BANK_released || (leases[{b}] == 0 && pins[{b}] == 0 "
                                   "&& (!g_registered[{b}] || g_quiesced[{b}]))")),
    ("INV-OP-PINS", Code("all: pins[{r}] == OPS_PINNING", "pins == OPS_PINNING")),
)

GLOBALS = {
    PER_RANK: """\
byte bank[BANKS];              /* bank machine of each rank (exporter side) */
byte leases[BANKS];            /* leases on each bank (expired ones included) */
byte xl[BANKS];                /* of which expired (bounds expiry: each lease expires once) */
bit ilease[TP];                /* the group's importer holds a lease on its rank's bank */
bit mapped[TP];                /* the group's importer maps its rank's bank (importer pin) */
byte pins[TP];                 /* native pins on each rank's region */
byte group;                    /* group machine (importer side) */
byte part[TP];                 /* part machine of each rank */
byte op[OP_SLOTS];             /* op machine of each op slot */
bool incompatible;             /* the world: the parts disagree (geometry, tp, generation) */
/* ghosts for the properties */
bit g_admitted;                /* begin_import happened */
bit g_group_drained;
bit g_rejected[TP];
bit g_advertised[BANKS];
bit g_drained[BANKS];
bit g_registered[BANKS];
bit g_quiesced[BANKS];""",
    COUNTING: """\
byte group;                    /* group machine (importer side) */
byte part_n[PART_STATES];      /* how many parts are in each state (symmetry reduction) */
byte op[OP_SLOTS];             /* op machine of each op slot */
byte pins;                     /* pins on every rank's region (each op pins all of them) */
bool incompatible;             /* the world: the parts disagree (geometry, tp, generation) */
/* ghosts for the properties */
bit g_admitted;
bit g_group_drained;
byte g_rejections;""",
}


