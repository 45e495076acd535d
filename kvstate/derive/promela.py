"""Promela models generated from the transition tables, for the Spin model checker.

Theory of operation
-------------------

Every row of a table becomes one guarded command of Promela, executed atomically::

    :: atomic { <source state> && <world rule> && <guards> && !<unless> && <earlier rows refused>
                -> <pre-monitors>; <effects>; <state = dest>; <post-monitors>;
                   printf("@@ machine index event source dest"); check_invariants() }

so an execution of the model is a sequence of table events, and a Spin trail replays as
exactly that sequence (the ``@@`` lines, read by :mod:`kvstate.harness.modelcheck`). Rows with the
same trigger and source are tried in table order, as :meth:`kvstate.core.machine.Lifecycle.fire`
does: a later row also requires every earlier row's guards to refuse.

What a guard or effect *means* is not in the tables, so it lives here, in ONE registry
(:data:`REGISTRY`): ``(machine, "guard"|"effect", name)`` -> Promela text for the
per-rank model and for the counting model. A table naming a guard or effect the registry
does not know is a :class:`ConfigInvalid` (MODEL) naming the file and the
entry, never a silently unconstrained model. An effect that drives another machine (a
group rolling back its parts, a load submitting an op) is a :class:`Cascade`: it fires
the child's event through the child's own table, so the child's guards still apply.

Around the tables sits the *environment*, which is nondeterministic: rank parts arrive,
are validated or rejected and are imported in any order; imports fail; peers die;
exporters restart (incarnation change); leases and descriptors expire; a drain comes at
any point; native ops start, finish, fail or are cancelled at any time. Each event is
fired by one *actor* process (:data:`ACTORS`), which matters for liveness: Spin's weak
fairness is per process, so the lease holder of each bank and the op engine are separate
processes that cannot be starved by unrelated activity. A few *world rules*
(:data:`WORLD_RULES`) say when the world can produce an event at all, for example a lease
can end only if one is live. They restrict the environment, never the tables.

Properties carry the invariant ids of ``spec/invariants.toml``: state invariants are
asserted after every transition (so in every reachable state), transition monitors assert
at the event, and the liveness property INV-DRAIN-QUIESCES is an LTL formula checked with
``pan -a -f``. Every actor loop ends only when its machines are terminal, so Spin's
invalid-end-state check finds every deadlock.

Two models:

* **per-rank** (``models/per_rank_tp{2,3,4}.pml``): every rank has its own part (importer
  side), pinned region and bank (exporter side, leases, pins), whose lease holder is the
  group's importer; every fault. The ranks
  are unrolled into one command per (row, rank), so tp is fixed per file: a ``#define TP``
  form would need a loop inside the atomic step to pick a rank, which either breaks the
  atomicity of a table event or adds interleaving states that stand for nothing.
* **counting** (``models/counting.pml``, parametrised by ``-DTP=n``): parts are
  interchangeable, so the model keeps only how many parts are in each state (symmetry
  reduction). Its commands do not depend on tp, so one file serves tp 8..64. It covers
  the group, its parts and native ops, where tp matters; banks have no guard across ranks,
  so the bank properties are checked in the per-rank model.

A native op is one gather of a prefix load and pins every region it touches, i.e. the
region of every rank (``pin_regions``). The per-rank model counts pins per rank region,
shared by the importer's mapping and the exporter's bank (one physical region).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from kvstate.core.errors import ConfigInvalid
from kvstate.core.spec import MachineSpec, Spec, TransitionSpec
from kvstate.derive.promela_world import (
    ENGINE,
    EXPORTER,
    IMPORTER,
    LESSEE,
    OPERATOR,
    ACTORS,
    banks,
    COUNTING,
    COUNTING_TPS,
    Cascade,
    GLOBALS,
    KINDS,
    LIVENESS_CLAIM,
    MACHINES,
    MARK,
    MAX_LEASES,
    OP_SLOTS,
    PER_RANK,
    PER_RANK_TPS,
    POST_MONITORS,
    PRE_MONITORS,
    REGISTRY,
    STATE_INVARIANTS,
    Text,
    WORLD_RULES,
    same,
)

__all__ = ["COUNTING", "COUNTING_TPS", "KINDS", "LIVENESS_CLAIM", "MARK", "PER_RANK", "PER_RANK_TPS",
           "MODELS", "generate", "used_invariants"]


# -- generation -----------------------------------------------------------------------


def _const(machine: str, state: str) -> str:
    return f"{machine.upper()}_{state}"


def _states(m: MachineSpec) -> list[str]:
    """State numbering: the initial state is 0, so zeroed arrays start there."""
    return [m.initial, *(s for s in m.state_names if s != m.initial)]


@attrs.frozen
class _Ctx:
    spec: Spec
    kind: str
    tp: int | None  # per-rank: ranks to unroll; counting: None (TP is a macro)

    def expand(self, text: str, i: str) -> str:
        """Fill placeholders; expand ``all:``/``any:``/``each:``/``ops:`` over ranks or op slots."""
        out = text
        for prefix, joiner, over in (("all:", " && ", "r"), ("any:", " || ", "r"),
                                     ("each:", "; ", "r"), ("ops:", " || ", "k"), ("banks:", " && ", "b")):
            while prefix in out:
                start = out.index(prefix)
                # a group is either parenthesised "(all: ...)" or runs to the end
                end = out.find(")", start) if start > 0 and out[start - 1] == "(" else len(out)
                body = out[start + len(prefix):end].strip()
                count = {"r": self.tp or 0, "k": OP_SLOTS, "b": banks(self.tp or 0)}[over]
                parts = [body.replace("{" + over + "}", str(n)) for n in range(count)]
                if over == "r" and self.tp is None:
                    raise AssertionError(f"rank expansion in the counting model: {text!r}")
                joined = joiner.join(f"({p})" if joiner != "; " else p for p in parts)
                out = out[:start] + joined + out[end:]
        return out.replace("{i}", i)


def _lookup(ctx: _Ctx, m: MachineSpec, kind: str, name: str) -> Text:
    code = REGISTRY.get((m.name, kind, name))
    text = code.get(ctx.kind) if code is not None else None
    if text is None:
        section = "guards" if kind == "guard" else "effects"
        model = "per-rank" if ctx.kind == PER_RANK else "counting"
        raise ConfigInvalid.model(
            m.source, f"{section}.{name}",
            f"the Promela generator has no {model} meaning for {kind} {name!r}; "
            f"add it to kvstate.derive.promela.REGISTRY")
    return text


def _guard_expr(ctx: _Ctx, m: MachineSpec, row: TransitionSpec, i: str) -> str:
    terms = []
    for g in row.guards:
        terms.append(f"({ctx.expand(_text(_lookup(ctx, m, 'guard', g)), i)})")
    for g in row.unless:
        terms.append(f"!({ctx.expand(_text(_lookup(ctx, m, 'guard', g)), i)})")
    return " && ".join(terms) if terms else "true"


def _text(value: Text) -> str:
    if isinstance(value, Cascade):
        raise AssertionError("a cascade is an effect, not a guard")
    return value


def _enabled(ctx: _Ctx, m: MachineSpec, row: TransitionSpec, i: str) -> str:
    """The row's own guards and the refusal of every earlier row of the same trigger and source."""
    own = _guard_expr(ctx, m, row, i)
    rows = m.rows(row.trigger, row.source)
    refusals = [f"!({_guard_expr(ctx, m, r, i)})" for r in rows[:rows.index(row)]]
    # a refusal that the row's own guards already imply is left out, for readability
    refusals = [r for r in refusals if r.removeprefix("!(").removesuffix(")") not in
                [f"({ctx.expand(_text(_lookup(ctx, m, 'guard', g)), i)})" for g in row.unless]]
    return " && ".join([own, *refusals]) if refusals else own


def _instances(ctx: _Ctx, machine: str) -> list[str]:
    if machine == "group":
        return ["0"]
    if machine == "op":
        return [str(k) for k in range(OP_SLOTS)]
    if machine == "bank":
        assert ctx.tp is not None
        return [str(b) for b in range(banks(ctx.tp))]
    if ctx.kind == COUNTING and machine == "part":
        return ["*"]
    assert ctx.tp is not None
    return [str(r) for r in range(ctx.tp)]


def _counted(ctx: _Ctx, machine: str) -> bool:
    return ctx.kind == COUNTING and machine == "part"


def _var(machine: str, i: str) -> str:
    return "group" if machine == "group" else f"{machine}[{i}]"


def _in_state(ctx: _Ctx, machine: str, i: str, state: str) -> str:
    if _counted(ctx, machine):
        return f"part_n[{_const(machine, state)}] > 0"
    return f"{_var(machine, i)} == {_const(machine, state)}"


def _printf(machine: str, i: str, row: TransitionSpec, nested: bool, count: str | None = None) -> str:
    mark = MARK + (">" if nested else "")
    index = "%d" if i == "i" else i
    args = ", i" if i == "i" else ""
    suffix = ""
    if count is not None:
        suffix, args = " x%d", f"{args}, {count}"
    return f'printf("{mark} {machine} {index} {row.trigger} {row.source} {row.dest}{suffix}\\n"{args})'


def _effects(ctx: _Ctx, m: MachineSpec, row: TransitionSpec, i: str, depth: int) -> list[str]:
    out = []
    for name in row.effects:
        text = _lookup(ctx, m, "effect", name)
        if isinstance(text, Cascade):
            out.append(_cascade(ctx, text, depth + 1))
        else:
            out.append(ctx.expand(text, i))
    return [s for s in out if s != "skip"]


def _monitors_pre(ctx: _Ctx, m: MachineSpec, row: TransitionSpec, i: str) -> list[str]:
    out = []
    for inv, code in PRE_MONITORS.get((m.name, row.trigger), ()):
        text = code.get(ctx.kind)
        if text is not None:
            out.append(_assert(inv, ctx.expand(_text(text), i)))
    return out


def _monitors_post(ctx: _Ctx, m: MachineSpec, row: TransitionSpec, i: str) -> list[str]:
    out = []
    keys = [(m.name, "event", row.trigger)]
    if row.source != row.dest:
        keys.append((m.name, "enter", row.dest))
    for key in keys:
        code = POST_MONITORS.get(key)
        text = code.get(ctx.kind) if code is not None else None
        if text is not None:
            out.append(ctx.expand(_text(text), i))
    return out


def _assert(inv: str, cond: str) -> str:
    return (f'if :: !({cond}) -> printf("{MARK} violated {inv}\\n"); assert(false) '
            f":: else -> skip fi")


def _commit(ctx: _Ctx, machine: str, i: str, row: TransitionSpec) -> list[str]:
    if row.source == row.dest:
        return []
    if _counted(ctx, machine):
        return [f"part_n[{_const(machine, row.source)}]--", f"part_n[{_const(machine, row.dest)}]++"]
    return [f"{_var(machine, i)} = {_const(machine, row.dest)}"]


def _cascade(ctx: _Ctx, c: Cascade, depth: int) -> str:
    """Fire ``c.event`` of ``c.machine`` on its instances, through its table rows."""
    child = _machine(ctx, c.machine)
    rows = [t for t in child.transitions if t.trigger == c.event]
    blocks = []
    if _counted(ctx, c.machine):
        # symmetric: every part in a source state moves at once
        for row in rows:
            cond = _enabled(ctx, child, row, "*")
            moved = [f"g_moved = part_n[{_const(c.machine, row.source)}]",
                     *_effects(ctx, child, row, "*", depth),
                     *([f"part_n[{_const(c.machine, row.dest)}] = part_n[{_const(c.machine, row.dest)}] + g_moved",
                        f"part_n[{_const(c.machine, row.source)}] = 0"] if row.source != row.dest else []),
                     _printf(c.machine, "*", row, True, "g_moved")]
            blocks.append(f"if :: part_n[{_const(c.machine, row.source)}] > 0 && ({cond}) -> "
                          + "; ".join(moved) + " :: else -> skip fi")
        return ";\n\t\t".join(blocks)
    options = []
    for i in _instances(ctx, c.machine):
        arms = []
        for row in rows:
            cond = f"({_in_state(ctx, c.machine, i, row.source)}) && ({_enabled(ctx, child, row, i)})"
            body = [*_monitors_pre(ctx, child, row, i), *_effects(ctx, child, row, i, depth),
                    *_commit(ctx, c.machine, i, row), *_monitors_post(ctx, child, row, i),
                    _printf(c.machine, i, row, True)]
            arms.append(f":: {cond} -> " + "; ".join(body))
        if c.target == "all":
            blocks.append("if " + " ".join(arms) + " :: else -> skip fi")
        else:
            options.extend(arms)
    if c.target == "free":
        return "if " + " ".join(options) + " :: else -> skip fi"
    return ";\n\t\t".join(blocks)


def _machine(ctx: _Ctx, name: str) -> MachineSpec:
    if name not in MACHINES[ctx.kind]:
        raise AssertionError(f"machine {name!r} is not in the {ctx.kind} model")
    return ctx.spec.machines[name]


def _world(ctx: _Ctx, m: MachineSpec, event: str, i: str) -> str:
    code = WORLD_RULES.get((m.name, event))
    text = code.get(ctx.kind) if code is not None else None
    return "true" if text is None else ctx.expand(_text(text), i)


def _command(ctx: _Ctx, m: MachineSpec, row: TransitionSpec, i: str) -> str:
    cond = " && ".join(f"({c})" for c in (_in_state(ctx, m.name, i, row.source), _world(ctx, m, row.trigger, i),
                                           _enabled(ctx, m, row, i)) if c != "true")
    body = [*_monitors_pre(ctx, m, row, i), *_effects(ctx, m, row, i, 0), *_commit(ctx, m.name, i, row),
            *_monitors_post(ctx, m, row, i), _printf(m.name, i, row, False), "check_invariants()"]
    return f"\t:: atomic {{ {cond} ->\n\t\t" + ";\n\t\t".join(body) + " }"


def _actor_of(m: MachineSpec, event: str) -> str | None:
    actors = ACTORS.get(m.name, {})
    if event not in actors:
        raise ConfigInvalid.model(m.source, f"events.{event}",
                                  f"the Promela generator has no actor for event {event!r}; "
                                  f"add it to kvstate.derive.promela.ACTORS")
    return actors[event]


def _commands_for(ctx: _Ctx, actor: str, per_instance: str | None) -> list[str]:
    """Commands of ``actor``; ``per_instance`` is the proctype parameter for rank-bound actors."""
    out: list[str] = []
    for name in MACHINES[ctx.kind]:
        m = ctx.spec.machines[name]
        for row in m.transitions:
            if _actor_of(m, row.trigger) != actor:
                continue
            instances = [per_instance] if per_instance is not None else _instances(ctx, name)
            out.extend(_command(ctx, m, row, i) for i in instances)
    return out


def _terminal(ctx: _Ctx, machine: str, i: str) -> str:
    m = ctx.spec.machines[machine]
    states = sorted(m.terminal)
    if _counted(ctx, machine):
        return "(" + " + ".join(f"part_n[{_const(machine, s)}]" for s in states) + " == TP)"
    return "(" + " || ".join(f"{_var(machine, i)} == {_const(machine, s)}" for s in states) + ")"


def _all_terminal(ctx: _Ctx, machine: str) -> str:
    if _counted(ctx, machine):
        return _terminal(ctx, machine, "*")
    return " && ".join(_terminal(ctx, machine, i) for i in _instances(ctx, machine))


def _validate(ctx: _Ctx) -> None:
    """Every guard, effect and event of the model's tables has a meaning here: else say so."""
    for name in MACHINES[ctx.kind]:
        m = ctx.spec.machines[name]
        for ev in m.event_names:
            _actor_of(m, ev)
        for g in m.guards:
            _lookup(ctx, m, "guard", g)
        for e in m.effects:
            _lookup(ctx, m, "effect", e)


def _proctype(name: str, param: str | None, commands: list[str], done: str) -> str:
    head = f"proctype {name}({'byte ' + param if param else ''})"
    return (f"{head}\n{{\n\tdo\n" + "\n".join(commands)
            + f"\n\t:: {done} -> break\n\tod\n}}\n")


def generate(spec: Spec, kind: str, tp: int | None = None) -> str:
    """The Promela text of one model. ``tp`` is required for the per-rank model only."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(KINDS)}")
    if (kind == PER_RANK) != (tp is not None):
        raise ValueError("tp is given for the per-rank model only (the counting model takes -DTP=n)")
    ctx = _Ctx(spec, kind, tp)
    _validate(ctx)
    out = [_header(ctx), _globals(ctx), _invariants(ctx), _processes(ctx), _init(ctx)]
    if kind == PER_RANK:
        assert tp is not None
        draining, quiescent = _const("bank", "draining"), _const("bank", "quiescent")
        # Premise: the group's importer eventually lets go (its group finishes). A bank
        # whose lease ran out waits for that importer's unmap (INV-NO-RELEASE-MAPPED),
        # and an importer may keep loading for ever: what drains it in practice (the
        # bank refusing renewal, so its group expires) is outside these tables.
        each = " && ".join(f"((bank[{b}] == {draining}) -> <> (bank[{b}] == {quiescent}))" for b in range(banks(tp)))
        out.append(f"/* {_inv_title(spec, 'INV-DRAIN-QUIESCES')} (every rank's bank, once the importer lets go) */\n"
                   f"ltl {LIVENESS_CLAIM} {{ (<> GROUP_FINISHED) -> [] ({each}) }}\n")
    return "\n".join(out)


def _inv_title(spec: Spec, inv: str) -> str:
    if inv not in spec.invariants:
        raise ConfigInvalid.model("spec/invariants.toml", inv, "the models check this invariant; declare it")
    return f"{inv}: {spec.invariants[inv].statement}"


def _header(ctx: _Ctx) -> str:
    # Name the tables as spec/ does, not by the path they were loaded from, so that the
    # text depends only on their content (a copy of spec/ generates the same models).
    tables = ", ".join(f"spec/{n}.toml" for n in MACHINES[ctx.kind])
    lines = [f"/* Generated by kvstate.derive.promela from {tables}. Do not edit:",
             "   regenerate with `kvstate generate`. */", ""]
    if ctx.kind == PER_RANK:
        lines.append(f"#define TP {ctx.tp}")
    else:
        lines += ["#ifndef TP", f"#define TP {COUNTING_TPS[0]}", "#endif"]
    lines += [f"#define OP_SLOTS {OP_SLOTS}"]
    if ctx.kind == PER_RANK:
        lines.append(f"#define MAX_LEASES {MAX_LEASES}")
        lines.append(f"#define BANKS {banks(ctx.tp or 0)}")
    for name in MACHINES[ctx.kind]:
        m = ctx.spec.machines[name]
        lines.append("")
        for n, s in enumerate(_states(m)):
            lines.append(f"#define {_const(name, s)} {n}")
        lines.append(f"#define {name.upper()}_STATES {len(m.states)}")
    group = ctx.spec.machines["group"]
    lines += ["", "#define GROUP_FINISHED (" + " || ".join(
        f"group == {_const('group', s)}" for s in sorted(group.terminal)) + ")"]
    pinning = [f"(op[{k}] == {_const('op', 'queued')} || op[{k}] == {_const('op', 'running')})"
               for k in range(OP_SLOTS)]
    lines.append("#define OPS_PINNING (" + " + ".join(pinning) + ")")
    return "\n".join(lines) + "\n"


def _globals(ctx: _Ctx) -> str:
    extra = "\nbyte g_moved;                  /* scratch, reset after use: parts moved by a cascade */" \
        if ctx.kind == COUNTING else ""
    return GLOBALS[ctx.kind] + extra + "\n"


def _invariants(ctx: _Ctx) -> str:
    checks = []
    for inv, code in STATE_INVARIANTS:
        text = code.get(ctx.kind)
        if text is not None:
            checks.append(f"\t/* {_inv_title(ctx.spec, inv)} */\n\t"
                          + _assert(inv, ctx.expand(_text(text), "0")))
    if ctx.kind == COUNTING:
        checks.append("\tg_moved = 0")
    return "inline check_invariants() {\n" + ";\n".join(checks) + "\n}\n"


def _processes(ctx: _Ctx) -> str:
    out = []
    if ctx.kind == PER_RANK:
        out.append(_proctype(EXPORTER, "i", _commands_for(ctx, EXPORTER, "i"),
                             f"bank[i] == {_const('bank', 'released')}"))
        out.append(_proctype(LESSEE, "i", _commands_for(ctx, LESSEE, "i"),
                             f"bank[i] == {_const('bank', 'released')}"))
    finished = "GROUP_FINISHED"
    out.append(_proctype(IMPORTER, None, _commands_for(ctx, IMPORTER, None),
                         f"{finished} && {_all_terminal(ctx, 'part')}"))
    banks_done = f" && {_all_terminal(ctx, 'bank')}" if ctx.kind == PER_RANK else ""
    out.append(_proctype(OPERATOR, None, _commands_for(ctx, OPERATOR, None), f"{finished}{banks_done}"))
    idle = " && ".join(f"(op[{k}] == {_const('op', 'created')} || op[{k}] == {_const('op', 'reaped')})"
                       for k in range(OP_SLOTS))
    out.append(_proctype(ENGINE, None, _commands_for(ctx, ENGINE, None), f"{finished} && {idle}"))
    return "\n".join(out)


def _init(ctx: _Ctx) -> str:
    runs = []
    if ctx.kind == COUNTING:
        runs.append(f"part_n[{_const('part', ctx.spec.machines['part'].initial)}] = TP")
    runs.append("if :: incompatible = false :: incompatible = true fi")
    runs.append(f'printf("{MARK} world incompatible %d\\n", incompatible)')
    if ctx.kind == PER_RANK:
        assert ctx.tp is not None
        runs += [f"run {EXPORTER}({b}); run {LESSEE}({b})" for b in range(banks(ctx.tp))]
    runs += [f"run {IMPORTER}()", f"run {OPERATOR}()", f"run {ENGINE}()"]
    return "init {\n\tatomic {\n\t\t" + ";\n\t\t".join(runs) + "\n\t}\n}\n"


# -- the committed files --------------------------------------------------------------

#: File name under ``models/`` -> (model kind, tp): every committed model.
MODELS: Mapping[str, tuple[str, int | None]] = {
    **{f"per_rank_tp{tp}.pml": (PER_RANK, tp) for tp in PER_RANK_TPS},
    "counting.pml": (COUNTING, None),
}


def used_invariants() -> Iterable[str]:
    """Invariant ids the models check."""
    ids = {inv for inv, _ in STATE_INVARIANTS}
    ids |= {inv for mons in PRE_MONITORS.values() for inv, _ in mons}
    ids.add("INV-DRAIN-QUIESCES")
    return sorted(ids)
