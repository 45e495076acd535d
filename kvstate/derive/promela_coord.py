"""The Promela model of the coordinator protocol, generated from ``spec/coordinator.toml``
and ``spec/rank.toml``.

Theory of operation
-------------------

The model has one process per real process role: the **coordinator** (the group machine of
the scheduler side), one **worker** per rank (its rank share), one **engine** per rank (the
loads a worker's model runner submits, and their completion), and the **reaper**, which
kills any of them, or an exporter, at any step (:data:`~kvstate.derive.coord_world.MAX_DEATHS`
per run). Coordinator and worker talk only through per-connection FIFO channels, as over
SOCK_SEQPACKET: ``cmd[r]`` carries commands, ``rep[r]`` carries reports.

Where the rows come from:

* a coordinator effect ``send_<c>`` sends command ``c`` to every live worker; each ``c`` is a
  rank event, and the worker's rows of that event become one *receive* command: take the
  message off ``cmd[r]``, then fire the first of those rows that its state and guards admit;
* a rank effect ``report`` sends ``part_<dest>``; each coordinator event ``part_<s>`` is a
  report, and its rows become one receive command per rank on ``rep[r]``;
* every other event is local: its rows become guarded commands of the process that fires
  it (worker, engine or coordinator), restricted by the world rules.

A received message that no row of the receiver's current state admits is a violation of
INV-EVENT-DECLARED (the runtime would raise TransitionError (ILLEGAL)), unless the receiver's
machine already ended: then it is dropped, as the runtime drops messages for finished
groups. A send is dropped when its receiver is dead or its machine ended (the runtime's
send would fail or be dropped on arrival); otherwise the model asserts the queue has room,
so the bounds can never silently break atomicity.

Properties (ids from spec/invariants.toml): state invariants after every step, transition
monitors at ``load`` and ``mapped``, INV-EVENT-DECLARED on every receipt, and the liveness
property INV-COORD-UNMAP-AFTER-DEATH as an LTL claim (``pan -a -f``). Every process loop
ends only when its work is over, so Spin's invalid-end-state check finds every deadlock.

A planted bug can replace the Promela meaning of a guard or effect (``registry=``), which is
how "the coordinator counts reports without checking that ranks are distinct" is written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from kvstate.core.errors import ConfigInvalid
from kvstate.core.spec import MachineSpec, Spec, TransitionSpec
from kvstate.derive import coord_symmetry as symmetry
from kvstate.derive import coord_world as world
from kvstate.derive.promela_world import MARK

_TAIL = re.compile(r";\s*check_invariants\(\)$")

COORD_MODEL = "coordinator"
#: committed model files: name -> (tp, symmetric)
MODELS: Mapping[str, tuple[int, bool]] = {
    **{f"coordinator_tp{tp}.pml": (tp, False) for tp in world.COORD_TPS},
    **{f"coordinator_sym_tp{tp}.pml": (tp, True) for tp in world.SYMMETRIC_TPS},
}
REPORT_PREFIX = "part_"
SEND_PREFIX = "send_"
#: rank events the engine fires (everything else local to a worker is the worker's)
ENGINE_EVENTS = ("load",)


def _const(machine: str, state: str) -> str:
    return f"{'COORD' if machine == 'coordinator' else machine.upper()}_{state}"


def _states(m: MachineSpec) -> list[str]:
    return [m.initial, *(s for s in m.state_names if s != m.initial)]


class _Gen:
    def __init__(self, spec: Spec, tp: int, registry: Mapping[tuple[str, str, str], str],
                 symmetric: bool = False, slices: Sequence[tuple[int, int]] | None = None) -> None:
        self.spec, self.tp, self.registry, self.symmetric = spec, tp, registry, symmetric
        # every step ends with the state invariants (the symmetric model: see _proctype)
        self.tail = "check_invariants()"
        self.done: list[str] = []  # each process's end condition (symmetric model: the watchdog's)
        #: heterogeneous TP: (worker process, exporter) of each part; None: part r is
        #: worker r's and imports exporter r's bank
        self.slices = None if slices is None else tuple((int(w), int(e)) for w, e in slices)
        self.coord = spec["coordinator"]
        self.rank = spec["rank"]
        self.commands = [e[len(SEND_PREFIX):] for e in self.coord.effects if e.startswith(SEND_PREFIX)]
        self.reports = [e for e in self.coord.event_names if e.startswith(REPORT_PREFIX)]
        self._check()

    # -- names and checks ---------------------------------------------------------------

    def _check(self) -> None:
        for c in self.commands:
            if c not in self.rank.event_names:
                raise ConfigInvalid.model(self.coord.source, f"effects.{SEND_PREFIX}{c}",
                                          f"command {c!r} is not an event of the rank table")
        for row in self.rank.transitions:
            if "report" in row.effects and f"{REPORT_PREFIX}{row.dest}" not in self.reports:
                raise ConfigInvalid.model(self.rank.source, f"transitions ({row.trigger} {row.source})",
                                          f"reports {REPORT_PREFIX}{row.dest}, which the coordinator "
                                          "table does not declare")
        for m in (self.coord, self.rank):
            for kind, names in (("guard", m.guards), ("effect", m.effects)):
                for name in names:
                    self._text(m, kind, name)
        for r in self.reports:
            if r not in world.NOTES:
                raise ConfigInvalid.model(self.coord.source, f"events.{r}", "the coordinator model has no "
                                          "bookkeeping for this report; add it to coord_world.NOTES")

    def _text(self, m: MachineSpec, kind: str, name: str) -> str:
        text = self.registry.get((m.name, kind, name))
        if text is None:
            section = "guards" if kind == "guard" else "effects"
            raise ConfigInvalid.model(m.source, f"{section}.{name}",
                                      f"the coordinator model has no meaning for {kind} {name!r}; "
                                      "add it to kvstate.derive.coord_world.REGISTRY")
        return text

    def expand(self, text: str, r: str, row: TransitionSpec | None = None) -> str:
        out = text
        for prefix, joiner in (("all:", " && "), ("any:", " || "), ("sum:", " + "), ("each:", "; ")):
            while prefix in out:
                start = out.index(prefix)
                end = out.find(")", start) if start > 0 and out[start - 1] == "(" else len(out)
                body = out[start + len(prefix):end].strip()
                parts = [body.replace("{q}", str(q)) for q in range(self.tp)]
                out = out[:start] + joiner.join(f"({p})" if joiner != "; " else p for p in parts) + out[end:]
        if row is not None:
            out = out.replace("{dest}", row.dest).replace("{trigger}", row.trigger)
        return out.replace("{r}", r)

    def _proctype(self, name: str, param: str, commands: list[str], done: str) -> str:
        """A process looping over its commands. In the symmetric model no process ever ends
        (a process at its end would tie its pc to the slot it served, and the sort moves
        slots): its loop is a valid end state, and the watchdog checks deadlocks instead,
        with the same condition (each process's ``done``)."""
        if not self.symmetric:
            return _proctype(name, param, commands, done)
        ranks = [str(q) for q in range(self.tp)] if param else [""]
        self.done += [done.replace(f"[{param}]", f"[{q}]").replace(f"({param})", f"({q})") if param else done
                      for q in ranks]
        # One atomic step per loop, its commands the options of one if, and one tail that
        # checks the invariants and sorts: the same steps as one atomic block per command,
        # with the tail compiled once per process instead of once per command.
        arms = []
        for cmd in commands:
            head, end = "\t:: atomic { ", " }"
            assert cmd.startswith(head) and cmd.endswith(end), cmd
            arms.append("\t:: " + _TAIL.sub("", cmd[len(head):-len(end)]))
        head = f"proctype {name}({'byte ' + param if param else ''})"
        return (f"{head}\n{{\nend:\n\tdo\n\t:: atomic {{\n\tif\n" + "\n".join(arms)
                + "\n\tfi;\n\tcheck_invariants(); forget(); canon() }\n\tod\n}\n")

    # -- channels: Promela channels, or packed queues in the symmetric model --------------

    def _poll(self, chan: str, q: str, msg: str) -> str:
        """Whether the oldest message of ``chan[q]`` is ``msg``."""
        if self.symmetric:
            return f"{chan}n[{q}] > 0 && ({chan}q[{q}] & 7) == {msg}"
        return f"{chan}[{q}]?[{msg}]"

    def _take(self, chan: str, q: str, msg: str) -> str:
        if self.symmetric:
            return f"{chan}q[{q}] = {chan}q[{q}] >> 3; {chan}n[{q}]--"
        return f"{chan}[{q}]?{msg}"

    def _send(self, chan: str, capacity: str) -> str:
        if self.symmetric:
            return (f"assert({chan}n[q] < {capacity}); {chan}q[q] = {chan}q[q] | (m << (3 * {chan}n[q])); "
                    f"{chan}n[q]++")
        return f"assert(nfull({chan}[q])); {chan}[q]!m"

    def _empty(self, chan: str, q: str) -> str:
        return f"{chan}n[{q}] == 0" if self.symmetric else f"empty({chan}[{q}])"

    # -- rows ---------------------------------------------------------------------------

    def _guards(self, m: MachineSpec, row: TransitionSpec, r: str) -> list[str]:
        terms = [f"({self.expand(self._text(m, 'guard', g), r)})" for g in row.guards]
        terms += [f"!({self.expand(self._text(m, 'guard', g), r)})" for g in row.unless]
        return terms

    def _enabled(self, m: MachineSpec, row: TransitionSpec, r: str) -> str:
        var = "coord" if m.name == "coordinator" else f"rank[{r}]"
        terms = [f"{var} == {_const(m.name, row.source)}", *self._guards(m, row, r)]
        rows = m.rows(row.trigger, row.source)
        for earlier in rows[:rows.index(row)]:
            refused = self._guards(m, earlier, r)
            terms.append("!(" + " && ".join(refused) + ")" if refused else "false")
        return " && ".join(terms)

    def _body(self, m: MachineSpec, row: TransitionSpec, r: str, index: str) -> list[str]:
        var = "coord" if m.name == "coordinator" else f"rank[{r}]"
        out = []
        pre = world.PRE.get((m.name, row.trigger))
        if pre is not None:
            out.append(_assert(pre[0], self.expand(pre[1], r)))
        out += [self.expand(self._text(m, "effect", e), r, row) for e in row.effects]
        if row.source != row.dest:
            out.append(f"{var} = {_const(m.name, row.dest)}")
        for key in ((m.name, "event", row.trigger), (m.name, "enter", row.dest)):
            post = world.POST.get(key)
            if post is not None and (key[1] == "event" or row.source != row.dest):
                out.append(self.expand(post, r))
        fmt, args = (f"{m.name} %d", f", {r}") if r == "r" else (f"{m.name} 0", "")
        rank_note = "" if m.name == "rank" or r in ("", "r") else f" r{r}"
        out.append(f'printf("{MARK} {fmt} {row.trigger} {row.source} {row.dest}{rank_note}\\n"{args})')
        return [s for s in out if s != "skip"]

    def _local(self, m: MachineSpec, row: TransitionSpec, r: str) -> str:
        rule = world.WORLD_RULES.get((m.name, row.trigger))
        cond = " && ".join([*(["c_alive"] if m.name == "coordinator" else [f"w_alive[{r}]"]),
                            *([f"({self.expand(rule, r)})"] if rule else []), self._enabled(m, row, r)])
        body = self._body(m, row, r, r)
        return f"\t:: atomic {{ {cond} ->\n\t\t" + ";\n\t\t".join([*body, self.tail]) + " }"

    def _receive(self, m: MachineSpec, event: str, r: str, chan: str, msg: str, alive: str) -> str:
        """Take ``msg`` off ``chan[r]`` and fire the first admitted row of ``event``."""
        arms = []
        for row in (t for t in m.transitions if t.trigger == event):
            arms.append(f":: {self._enabled(m, row, r)} ->\n\t\t\t" + ";\n\t\t\t".join(self._body(m, row, r, r)))
        ended = "COORD_ENDED" if m.name == "coordinator" else f"RANK_ENDED({r})"
        who = f"{m.name} {'0' if m.name == 'coordinator' else '%d'}"
        arms.append(f":: {ended} -> skip")
        arms.append(f':: else -> printf("{MARK} violated INV-EVENT-DECLARED: {who} got {event}\\n"'
                    f'{", " + r if m.name == "rank" else ""}); assert(false)')
        return (f"\t:: atomic {{ {alive} && {self._poll(chan, r, msg)} -> {self._take(chan, r, msg)};\n\t\tif\n\t\t"
                + "\n\t\t".join(arms) + f"\n\t\tfi;\n\t\t{self.tail} }}")

    def _rank_bound(self, event: str, rows: list[TransitionSpec]) -> bool:
        """Whether a coordinator event concerns one rank (its texts name ``{r}``): then it is
        unrolled into one command per rank."""
        texts = [world.WORLD_RULES.get(("coordinator", event)) or ""]
        texts += [self._text(self.coord, "guard", g) for row in rows for g in (*row.guards, *row.unless)]
        texts += [self._text(self.coord, "effect", e) for row in rows for e in row.effects]
        return any("{r}" in t for t in texts)

    # -- sections -----------------------------------------------------------------------

    def header(self) -> str:
        lines = ["/* Generated by kvstate.derive.promela_coord from spec/coordinator.toml, spec/rank.toml.",
                 "   Do not edit: regenerate with `kvstate generate`. */", "",
                 f"#define TP {self.tp}", f"#define MAX_DEATHS {world.MAX_DEATHS}",
                 f"#define CMD_CAPACITY {world.CMD_CAPACITY}", f"#define REP_CAPACITY {world.REP_CAPACITY}"]
        for m in (self.coord, self.rank):
            lines.append("")
            lines += [f"#define {_const(m.name, s)} {n}" for n, s in enumerate(_states(m))]
        lines.append("")
        lines += [f"#define CMD_{c} {n + 1}" for n, c in enumerate(self.commands)]
        lines += [f"#define REP_{r[len(REPORT_PREFIX):]} {n + 1}" for n, r in enumerate(self.reports)]
        lines.append("")
        lines.append("#define COORD_ENDED (" + " || ".join(f"coord == {_const('coordinator', s)}"
                                                          for s in sorted(self.coord.terminal)) + ")")
        lines.append("#define RANK_ENDED(q) (" + " || ".join(f"rank[q] == {_const('rank', s)}"
                                                            for s in sorted(self.rank.terminal)) + ")")
        lines.append("#define LEASES_HELD (" + " + ".join(f"leases[{q}]" for q in range(self.tp)) + ")")
        return "\n".join(lines) + "\n"

    def inlines(self) -> str:
        notes = "\n".join(f"inline note_{r}(r) {{ {world.NOTES[r]} }}" for r in self.reports)
        return f"""\
/* A command to a dead worker, or to a share that ended, is lost or dropped on arrival. */
inline command(q, m) {{
\tif
\t:: w_alive[q] && !RANK_ENDED(q) -> {self._send("cmd", "CMD_CAPACITY")}
\t:: else -> skip
\tfi
}}
/* A report to a dead coordinator, or about a group that ended, is lost or dropped. */
inline report(q, m) {{
\tif
\t:: c_alive && !COORD_ENDED -> {self._send("rep", "REP_CAPACITY")}
\t:: else -> skip
\tfi
}}
/* The worker returns its lease (a dead exporter's leases are gone already) and unmaps. */
inline unmap(q) {{
\tmapped[q] = 0;
\tleases[q] = 0
}}
{notes}
"""

    def forget(self) -> str:
        """``forget()``: reset what nothing reads any more (:data:`coord_world.FORGET`)."""
        readers = [cond for _, cond in world.STATE] + [cond for _, cond in world.PRE.values()]
        readers += [world.LIVENESS[1], *(t for (m, _, _), t in self.registry.items() if m == "rank"),
                    *(t for (m, _), t in world.WORLD_RULES.items() if m == "rank")]
        steps = []
        for when, what in world.FORGET:
            for name in re.findall(r"(\w+)\[", what) + re.findall(r"(\w+) = ", what):
                if any(re.search(rf"\b{name}\b", text) for text in readers):
                    raise ConfigInvalid.model("kvstate/derive/coord_world.py", "FORGET",
                                              f"{name} is forgotten but a property or a rank text reads it")
            for q in [str(q) for q in range(self.tp)] if "{r}" in when else [""]:
                steps.append(f"\tif :: {self.expand(when, q)} -> {self.expand(what, q)} :: else -> skip fi")
        return "inline forget() {\n\td_step {\n" + ";\n".join(steps) + "\n\t}\n}\n"

    def invariants(self) -> str:
        checks = [f"\t/* {self._inv(inv)} */\n\t" + _assert(inv, self.expand(cond, "0"))
                  for inv, cond in world.STATE]
        return "inline check_invariants() {\n" + ";\n".join(checks) + "\n}\n"

    def _inv(self, inv: str) -> str:
        if inv not in self.spec.invariants:
            raise ConfigInvalid.model("spec/invariants.toml", inv, "the coordinator model checks this invariant; "
                                      "declare it")
        return f"{inv}: {self.spec.invariants[inv].statement}"

    def coordinator(self) -> str:
        cmds = []
        for event in self.coord.event_names:
            if event in self.reports:
                msg = f"REP_{event[len(REPORT_PREFIX):]}"
                cmds += [self._receive(self.coord, event, str(q), "rep", msg, f"c_alive && !dead[{q}]")
                         for q in range(self.tp)]
                continue
            rows = [t for t in self.coord.transitions if t.trigger == event]
            ranks = [str(q) for q in range(self.tp)] if self._rank_bound(event, rows) else [""]
            cmds += [self._local(self.coord, row, q) for q in ranks for row in rows]
        return self._proctype("coordinator", "", cmds, "!c_alive || COORD_ENDED")

    def worker(self) -> str:
        cmds = []
        for event in self.rank.event_names:
            if event in ENGINE_EVENTS:
                continue
            if event in self.commands:
                cmds.append(self._receive(self.rank, event, "r", "cmd", f"CMD_{event}",
                                          "w_alive[r] && !c_noticed[r]"))
                continue
            cmds += [self._local(self.rank, row, "r") for row in self.rank.transitions if row.trigger == event]
        repeat = (f"\t:: atomic {{ w_alive[r] && rank[r] == {_const('rank', 'imported')} && !repeated[r] && "
                  f"coord == {_const('coordinator', 'importing')} ->\n"
                  f"\t\trepeated[r] = 1; report(r, REP_imported);\n"
                  f'\t\tprintf("{MARK} channel %d repeat part_imported part_imported\\n", r) }}')
        done = ("!w_alive[r] || RANK_ENDED(r) || (rank[r] == RANK_idle && (!c_alive || COORD_ENDED) && "
                f"{self._empty('cmd', 'r')})")
        return self._proctype("worker", "r", [*cmds, repeat], done)

    def engine(self) -> str:
        cmds = [self._local(self.rank, row, "r") for row in self.rank.transitions if row.trigger in ENGINE_EVENTS]
        cmds.append(f"\t:: atomic {{ w_alive[r] && pins[r] -> pins[r] = 0; "
                    f"printf(\"{MARK} engine %d finish pinned unpinned\\n\", r) }}")
        done = ("!w_alive[r] || (pins[r] == 0 && (RANK_ENDED(r) || (rank[r] == RANK_idle && "
                f"(!c_alive || COORD_ENDED) && {self._empty('cmd', 'r')})))")
        return self._proctype("engine", "r", cmds, done)

    def reaper(self) -> str:
        kill = ["\t:: atomic { deaths < MAX_DEATHS && c_alive -> c_alive = 0; deaths++; g_died = 1;\n"
                f'\t\tprintf("{MARK} process coordinator died alive dead\\n"); {self.tail} }}']
        if self.symmetric:
            # The symmetric model's sort moves ranks between slots, so any slot may die.
            workers = {f"worker{q}": [q] for q in range(self.tp)}
            exporters = {f"exporter{q}": [q] for q in range(self.tp)}
        elif self.slices is None:
            # The ranks are symmetric (no row, guard or world rule singles one out), so killing
            # the last rank's worker or exporter stands for killing any rank's.
            workers = {f"worker{self.tp - 1}": [self.tp - 1]}
            exporters = {f"exporter{self.tp - 1}": [self.tp - 1]}
        else:
            # Heterogeneous TP: a process's death ends every part it holds (one prefill
            # worker with several slices; one exporter whose bank several slices lease).
            workers = {f"worker{w}": [q for q, (pw, _) in enumerate(self.slices) if pw == w]
                       for w in sorted({w for w, _ in self.slices})}
            exporters = {f"exporter{e}": [q for q, (_, pe) in enumerate(self.slices) if pe == e]
                         for e in sorted({e for _, e in self.slices})}
        for name, parts in workers.items():
            ends = " ".join(f"w_alive[{q}] = 0; mapped[{q}] = 0; pins[{q}] = 0; leases[{q}] = 0;" for q in parts)
            alive = " || ".join(f"w_alive[{q}]" for q in parts)
            kill.append(f"\t:: atomic {{ deaths < MAX_DEATHS && ({alive}) -> deaths++; g_died = 1;\n\t\t{ends}\n"
                        f'\t\tprintf("{MARK} process {name} died alive dead\\n"); {self.tail} }}')
        for name, parts in exporters.items():
            ends = " ".join(f"e_alive[{q}] = 0; leases[{q}] = 0;" for q in parts)
            alive = " || ".join(f"e_alive[{q}]" for q in parts)
            kill.append(f"\t:: atomic {{ deaths < MAX_DEATHS && ({alive}) -> deaths++; g_died = 1; {ends}\n"
                        f'\t\tprintf("{MARK} process {name} died alive dead\\n"); {self.tail} }}')
        over = " && ".join(["(!c_alive || COORD_ENDED)", *(f"(!w_alive[{q}] || RANK_ENDED({q}) || "
                                                          f"rank[{q}] == RANK_idle)" for q in range(self.tp))])
        return self._proctype("reaper", "", kill, f"deaths == MAX_DEATHS || ({over})")

    def init(self) -> str:
        runs = [*(f"w_alive[{q}] = 1; e_alive[{q}] = 1" for q in range(self.tp)),
                "if :: bad_group = false :: bad_group = true fi",
                "if :: incompatible = false :: incompatible = true fi",
                f'printf("{MARK} world bad_group %d\\n", bad_group)',
                f'printf("{MARK} world incompatible %d\\n", incompatible)',
                "run coordinator()", *(f"run worker({q}); run engine({q})" for q in range(self.tp)), "run reaper()"]
        if self.symmetric:
            runs.append("run watchdog()")
        return "init {\n\tatomic {\n\t\t" + ";\n\t\t".join(runs) + "\n\t}\n}\n"

    def liveness(self) -> str:
        inv, formula = world.LIVENESS
        return f"/* {self._inv(inv)} */\nltl {world.LIVENESS_CLAIM} {{ {self.expand(formula, '0')} }}\n"


def _assert(inv: str, cond: str) -> str:
    return (f'if :: !({cond}) -> printf("{MARK} violated {inv}\\n"); assert(false) '
            f":: else -> skip fi")


def _proctype(name: str, param: str, commands: list[str], done: str) -> str:
    head = f"proctype {name}({'byte ' + param if param else ''})"
    return f"{head}\n{{\n\tdo\n" + "\n".join(commands) + f"\n\t:: {done} -> break\n\tod\n}}\n"


def generate(spec: Spec, tp: int, registry: Mapping[tuple[str, str, str], str] | None = None,
             *, symmetric: bool = False, slices: Sequence[tuple[int, int]] | None = None) -> str:
    """The Promela text of the coordinator protocol for ``tp`` parts: one per rank, or with
    ``slices`` (heterogeneous TP, :func:`kvstate.core.heads.split`) the (worker process,
    exporter) of each part, so that a death ends every part of that process. ``symmetric``:
    the reduced model, whose rank slots are kept sorted (see
    :mod:`kvstate.derive.coord_symmetry`); slices single ranks out, so not with them."""
    if not 1 <= tp <= 8:
        raise ValueError(f"the coordinator model unrolls ranks: tp must be 1..8, not {tp}")
    if slices is not None and len(slices) != tp:
        raise ValueError(f"{len(slices)} slices for a model of {tp} parts")
    if slices is not None and symmetric:
        raise ValueError("heterogeneous-TP slices are not interchangeable: no symmetric model of them")
    g = _Gen(spec, tp, world.REGISTRY if registry is None else registry, symmetric, slices)
    channels = world.QUEUES if symmetric else world.CHANNELS
    parts = [g.header(), world.GLOBALS.replace("{channels}", channels) + "\n"]
    if symmetric:
        parts.append(symmetry.canon(world.GLOBALS.replace("{channels}", channels), tp))
        parts.append(g.forget())
    parts += [g.inlines(), g.invariants(), g.coordinator(), g.worker(), g.engine(), g.reaper()]
    if symmetric:
        parts.append(symmetry.watchdog(g.done))
    return "\n".join([*parts, g.init(), g.liveness()])


def used_invariants() -> list[str]:
    ids = {inv for inv, _ in world.STATE} | {inv for inv, _ in world.PRE.values()}
    return sorted(ids | {world.LIVENESS[0], "INV-EVENT-DECLARED"})
