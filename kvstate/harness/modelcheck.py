"""Run Spin on the generated models and read the result back as table events.

:func:`check` writes a model into a scratch directory, runs ``spin -a``, compiles ``pan``
with bounded memory (``-DMEMLIM``), runs it, and parses what pan reports (result, states
stored, transitions, depth reached, memory, time). On a violation it replays the trail
with ``spin -t``; the model prints one ``@@`` line per table event (see
:mod:`kvstate.derive.promela`), so the counterexample comes back as a :class:`Trace` of
:class:`Event` (machine, index, event, source -> dest), which :func:`replay` can drive
against any objects with ``fire(event)`` and ``state``: the runtime machines, or test
harnesses bound to the same (possibly broken) tables.

A search that ran out of depth or memory is a failure, never a pass: nothing partial is
reported as verified.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from kvstate.derive import coord_world, promela_coord
from kvstate.derive import promela as models
from kvstate.core.errors import ArgumentInvalid, BackendUnavailable, NativeError
from kvstate.core.reasons import ArgumentReason, BackendReason, NativeReason
from kvstate.core.spec import Spec, load_spec

INSTALL_HINT = ("install Spin from Debian/Ubuntu packages: `sudo apt-get install -y spin` "
                "(a C compiler, gcc or cc, is needed too)")

MAX_DEPTH = 1_000_000
#: how a result of the coordinator model's symmetric form is named
COORD_SYMMETRIC = "coordinator_sym"
#: fairness slots: pan needs one per process (init, importer, operator, engine, exporter,
#: lessee; the coordinator model has a worker and an engine per rank besides)
_NFAIR = 4


@attrs.frozen
class Event:
    """One table event of a trail. ``index`` is ``"*"`` for a part of the counting model."""

    machine: str
    index: str
    event: str
    source: str
    dest: str
    nested: bool = False  # fired by an effect of the event before it (a cascade)
    count: int | None = None  # counting model cascades: how many parts moved
    rank: int | None = None  # coordinator model: the rank whose report or death this is

    @property
    def instance(self) -> str:
        return f"{self.machine}[{self.index}]"

    def __str__(self) -> str:
        lead = "    via effect: " if self.nested else ""
        many = f" (x{self.count})" if self.count is not None else ""
        about = f" (rank {self.rank})" if self.rank is not None else ""
        return f"{lead}{self.instance}: {self.event}{about}  {self.source} -> {self.dest}{many}"


@attrs.frozen
class Trace:
    events: tuple[Event, ...]
    world: Mapping[str, int]  # the environment's initial choices, e.g. incompatible
    violated: tuple[str, ...]  # invariant ids the model reported, in order
    cycle_start: int | None  # index into events where an acceptance cycle starts

    def render(self) -> str:
        lines = [f"world: {', '.join(f'{k}={v}' for k, v in self.world.items()) or '-'}"]
        for n, ev in enumerate(self.events):
            if n == self.cycle_start:
                lines.append("---- cycle starts (repeats forever) ----")
            lines.append(f"{n:3d}  {ev}")
        for inv in self.violated:
            lines.append(f"VIOLATED {inv}")
        return "\n".join(lines)


@attrs.frozen
class CheckResult:
    model: str  # "per_rank" or "counting"
    tp: int
    mode: str  # "safety" or "liveness"
    ok: bool
    problem: str | None  # pan's first error line, when not ok
    states_stored: int
    transitions: int
    depth: int
    memory_mb: float
    pan_seconds: float
    wall_seconds: float  # spin -a, compile and run
    trace: Trace | None
    output: str = attrs.field(repr=False)
    incomplete: bool = False  # pan stopped early without finding an error: nothing verified

    @property
    def verdict(self) -> str:
        return "OK" if self.ok else "INCOMPLETE" if self.incomplete else "VIOLATION"

    def report(self) -> str:
        head = (f"{self.model} tp={self.tp} {self.mode}: {self.verdict}"
                + (f" ({self.problem})" if self.problem else ""))
        lines = [head,
                 f"  states stored {self.states_stored}, transitions {self.transitions}, "
                 f"depth reached {self.depth}",
                 f"  memory {self.memory_mb:.1f} MB, pan time {self.pan_seconds:.2f} s, "
                 f"total {self.wall_seconds:.1f} s (spin -a, cc, pan)"]
        if self.incomplete:
            memory = self.problem is not None and ("MEMLIM" in self.problem or "memory" in self.problem)
            lines.append("  the search did not complete, so nothing is verified"
                         + ("; raise the memory bound (`kvstate check --memlim MB`)" if memory else ""))
        if self.trace is not None:
            lines.append("  counterexample (spin -t), as table events:")
            lines += ["    " + line for line in self.trace.render().splitlines()]
        return "\n".join(lines)


def tools() -> tuple[str, str]:
    """Paths of ``spin`` and a C compiler, or :class:`BackendUnavailable` (SPIN) saying how to install."""
    spin = shutil.which("spin")
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if spin is None or cc is None:
        missing = "spin" if spin is None else "a C compiler"
        raise BackendUnavailable(BackendReason.SPIN, f"{missing} not found on PATH; {INSTALL_HINT}")
    return spin, cc


def _run(cmd: Sequence[str], cwd: Path, timeout: float, what: str) -> str:
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise NativeError(NativeReason.MODEL_CHECK,
                          f"{what} did not finish within {timeout:.0f} s: {' '.join(cmd)}") from None
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and what != "pan":
        raise NativeError(NativeReason.MODEL_CHECK,
                          f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{out[-2000:]}")
    return out


def _number(pattern: str, text: str, cast: type = int) -> Any:
    found = re.search(pattern, text)
    if found is None:
        raise NativeError(NativeReason.MODEL_CHECK, f"cannot read {pattern!r} from pan's output:\n{text[-2000:]}")
    return cast(found.group(1))


_PROBLEMS = ("assertion violated", "acceptance cycle", "invalid end state", "max search depth too small",
             "out of memory", "reached -DMEMLIM bound", "non-progress cycle", "error:")
#: what pan prints whenever it stopped before exploring every state, whatever the cause
_INCOMPLETE = "Warning: Search not completed"


def _problem(out: str, errors: int) -> str | None:
    for line in out.splitlines():
        text = line.strip()
        if text.startswith("pan:") and any(p in text for p in _PROBLEMS) or text.startswith("error:"):
            if "elapsed time" not in text:
                return text
    if errors:
        return f"{errors} error(s)"
    # a stop pan has no error line for (or one worded anew) must not pass as a full search
    return "search not completed: pan stopped before exploring every state" if _INCOMPLETE in out else None


_EVENT = re.compile(r"@@(>?) (\w+) (\S+) (\w+) (\w+) (\w+)(?: x(\d+))?(?: r(\d+))?$")


def parse_trail(text: str) -> Trace:
    """Read the ``@@`` lines a ``spin -t`` replay of a generated model prints."""
    events: list[Event] = []
    world: dict[str, int] = {}
    violated: list[str] = []
    cycle: int | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if "START OF CYCLE" in line:
            cycle = len(events)
            continue
        if not line.startswith(models.MARK):
            continue
        if line.startswith(f"{models.MARK} violated "):
            violated.append(line.split()[2].rstrip(":"))
            continue
        if line.startswith(f"{models.MARK} world "):
            _, _, name, value = line.split()
            world[name] = int(value)
            continue
        found = _EVENT.match(line)
        if found is None:
            raise NativeError(NativeReason.MODEL_CHECK, f"unreadable event line in the trail: {line!r}")
        nested, machine, index, event, source, dest, count, rank = found.groups()
        events.append(Event(machine, index, event, source, dest, bool(nested),
                            int(count) if count is not None else None, int(rank) if rank is not None else None))
    return Trace(tuple(events), world, tuple(violated), cycle)


def check_text(text: str, *, model: str, tp: int, liveness: bool = False, memlim_mb: int = 2048,
               timeout_s: float = 600.0, keep: Path | None = None, claim: str = models.LIVENESS_CLAIM,
               nfair: int = _NFAIR) -> CheckResult:
    """Check one Promela model. ``tp`` is passed as ``-DTP`` for the counting model;
    ``claim`` names the LTL claim of a liveness run, ``nfair`` its fairness slots."""
    spin, cc = tools()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvstate-spin-") as scratch:
        work = keep if keep is not None else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        name = f"{model}_tp{tp}.pml"
        (work / name).write_text(text, encoding="utf-8")
        defines = [f"-DTP={tp}"] if model == models.COUNTING else []
        _run([spin, *defines, "-a", name], work, timeout_s, "spin -a")
        flags = [f"-DMEMLIM={memlim_mb}", "-O0", "-w"]  # -O0: compiling dominates at these sizes
        flags += [f"-DNFAIR={nfair}"] if liveness else ["-DSAFETY", "-DNOCLAIM"]
        _run([cc, *flags, "-o", "pan", "pan.c"], work, timeout_s, "cc pan.c")
        # liveness runs check only the claim (-A: assertions are the safety run's job)
        run = ["./pan", f"-m{MAX_DEPTH}"] + (["-a", "-f", "-A", "-N", claim] if liveness else [])
        out = _run(run, work, timeout_s, "pan")
        errors = _number(r"errors: (\d+)", out)
        problem = _problem(out, errors)
        trace = None
        if problem is not None and (work / f"{name}.trail").exists():
            trace = parse_trail(_run([spin, *defines, "-t", name], work, timeout_s, "spin -t"))
        return CheckResult(
            model=model, tp=tp, mode="liveness" if liveness else "safety", ok=problem is None,
            problem=problem,
            states_stored=_number(r"(\d+) states, stored", out),
            transitions=_number(r"(\d+) transitions \(=", out),
            depth=_number(r"depth reached (\d+)", out),
            memory_mb=_number(r"([\d.]+)\s+total actual memory usage", out, float),
            pan_seconds=_number(r"elapsed time ([\d.e+-]+) seconds", out, float),
            wall_seconds=time.monotonic() - started, trace=trace, output=out,
            incomplete=problem is not None and errors == 0)


def check(model: str, tp: int, *, liveness: bool = False, spec: Spec | None = None,
          spec_dir: Path | None = None, memlim_mb: int = 2048, timeout_s: float = 600.0,
          registry: Mapping[tuple[str, str, str], str] | None = None,
          symmetric: bool | None = None, slices: Sequence[tuple[int, int]] | None = None) -> CheckResult:
    """Generate a model from the tables (``spec_dir`` for a variant) and check it.

    ``registry`` replaces the coordinator model's meanings of guards and effects (planted
    bugs of an implementation that the tables cannot express). ``symmetric`` picks the
    coordinator model's symmetry-reduced form (:mod:`kvstate.derive.coord_symmetry`); by
    default, for tp above the concrete model's (:data:`coord_world.COORD_TPS`) and never
    with ``slices``: the model's parts as heterogeneous-TP slices (:func:`promela_coord.generate`)."""
    if spec is None:
        spec = load_spec(spec_dir)
    if model == promela_coord.COORD_MODEL:
        if symmetric is None:
            symmetric = slices is None and tp > max(coord_world.COORD_TPS)
        if symmetric and liveness:
            raise ArgumentInvalid.of("liveness", ArgumentReason.RANGE,
                                     f"the coordinator's liveness is checked at tp {max(coord_world.COORD_TPS)} "
                                     "only: the symmetric model (safety) moves ranks between processes, and "
                                     "weak fairness is per process")
        text = promela_coord.generate(spec, tp, registry, symmetric=symmetric, slices=slices)
        return check_text(text, model=COORD_SYMMETRIC if symmetric else model, tp=tp, liveness=liveness,
                          memlim_mb=memlim_mb, timeout_s=timeout_s, claim=coord_world.LIVENESS_CLAIM,
                          nfair=max(_NFAIR, 2 * tp + 3))
    if liveness and model != models.PER_RANK:
        raise ArgumentInvalid.of("liveness", ArgumentReason.RANGE,
                                 "the liveness property (INV-DRAIN-QUIESCES) is in the per-rank model")
    text = models.generate(spec, model, tp if model == models.PER_RANK else None)
    return check_text(text, model=model, tp=tp, liveness=liveness, memlim_mb=memlim_mb, timeout_s=timeout_s)


# -- replaying a counterexample against objects ---------------------------------------


class Firable(Protocol):
    """What :func:`replay` drives: a runtime machine, or anything shaped like one."""

    @property
    def state(self) -> str: ...

    def fire(self, event: str, **kwargs: Any) -> str: ...



def _pick(objects: Mapping[str, Firable], ev: Event, state: str) -> str:
    if ev.index != "*":
        if ev.instance not in objects:
            raise NativeError(NativeReason.MODEL_CHECK, f"no object for {ev.instance}; have {sorted(objects)}")
        return ev.instance
    for key in sorted(objects):
        if key.startswith(f"{ev.machine}[") and objects[key].state == state:
            return key
    raise NativeError(NativeReason.MODEL_CHECK, f"no {ev.machine} in state {state!r} for {ev}")


def replay(trace: Trace, objects: Mapping[str, Firable]) -> list[str]:
    """Fire the trail's top-level events, in order, on ``objects`` (keyed ``machine[index]``).

    Events fired by effects (``nested``) are not fired again: the objects' own effects do
    that, and the replay checks that they arrived where the model did. Returns one line per
    event applied. Exceptions of ``fire`` (a guard refusing, say) propagate: a real
    implementation that refuses the counterexample stops it there.
    """
    applied: list[str] = []
    for ev in trace.events:
        if ev.nested:
            moved = [k for k in objects if k.startswith(f"{ev.machine}[") and objects[k].state == ev.dest]
            wanted = ev.count if ev.count is not None else 1
            if ev.index != "*" and objects[_pick(objects, ev, ev.dest)].state != ev.dest \
                    or len(moved) < wanted:
                raise NativeError(NativeReason.MODEL_CHECK, f"effect did not move {ev.instance} to {ev.dest!r}")
            applied.append(str(ev))
            continue
        key = _pick(objects, ev, ev.source)
        if objects[key].state != ev.source:
            raise NativeError(NativeReason.MODEL_CHECK,
                              f"{key} is in {objects[key].state!r}, the trail expects {ev.source!r}")
        dest = objects[key].fire(ev.event)
        if dest != ev.dest:
            raise NativeError(NativeReason.MODEL_CHECK,
                              f"{key}: {ev.event} went to {dest!r}, the trail went to {ev.dest!r}")
        applied.append(f"{key}: {ev.event}  {ev.source} -> {dest}")
    return applied
