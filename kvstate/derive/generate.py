"""One generator for every file derived from ``spec/``: ``kvstate generate [--check]``.

:data:`ARTIFACTS` lists each generated file with its producer: a function from the
:class:`Inputs` (the tables, and the code map that links rows to code) to the file's full
text. Adding an artifact is one line there. Output is deterministic and depends only on
the content of the tables and of the code, never on where they were read from, so a
committed copy is fresh exactly when it equals what its producer makes now.

:func:`write` writes every artifact (and removes leftovers in the directories the
generator owns). :func:`stale` writes nothing and names every file that differs, is
missing, or is a leftover; it is the one freshness check, used by the test suite and CI.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs

from kvstate.core.errors import ConfigInvalid, ArgumentInvalid
from kvstate.core.reasons import ArgumentReason
from kvstate.core.spec import MACHINE_NAMES, Spec, load_spec
from kvstate.core.rules import RuleSet, parse_rules
from kvstate.derive import codemap, docs, header, promela, promela_coord, rules_c, rules_py


@attrs.define
class Inputs:
    """What producers read: the tables and, scanned on first use, the code map."""

    root: Path
    spec: Spec
    _code: codemap.CodeMap | None = None
    _rules: RuleSet | None = None

    @property
    def rules_text(self) -> str:
        return (self.root / "spec" / "rules.toml").read_text(encoding="utf-8")

    @property
    def rules(self) -> RuleSet:
        """The descriptor rules, read from this root's spec/ (not the installed copy)."""
        if self._rules is None:
            self._rules = parse_rules(self.rules_text, "spec/rules.toml")
        return self._rules

    @property
    def code(self) -> codemap.CodeMap:
        if self._code is None:
            code = codemap.scan(self.root, self.spec)
            if code.problems:
                raise ConfigInvalid.binding("kvstate/", "fire sites", "the code map is ambiguous:\n  "
                                            + "\n  ".join(code.problems))
            self._code = code
        return self._code


Producer = Callable[[Inputs], str]


def _model(kind: str, tp: int | None, i: Inputs) -> str:
    return promela.generate(i.spec, kind, tp)


def _coord_model(tp: int, symmetric: bool, i: Inputs) -> str:
    return promela_coord.generate(i.spec, tp, symmetric=symmetric)


def _native_table(machine: str, i: Inputs) -> str:
    return header.machine_header(i.spec[machine])


def _page(machine: str, i: Inputs) -> str:
    return docs.machine_page(i.spec, machine, i.code)


#: (path under the source root, producer) of every generated file.
ARTIFACTS: tuple[tuple[str, Producer], ...] = (
    ("ffi/kvs_op_table.h", lambda i: header.op_header(i.spec["op"])),
    *((header.machine_header_path(m), partial(_native_table, m)) for m in header.NATIVE_MACHINES),
    *((f"models/{name}", partial(_model, kind, tp)) for name, (kind, tp) in promela.MODELS.items()),
    *((f"models/{name}", partial(_coord_model, tp, sym)) for name, (tp, sym) in promela_coord.MODELS.items()),
    (rules_c.PUBLIC_HEADER, lambda i: rules_c.public_header(i.rules)),
    (rules_c.CODES_HEADER, lambda i: rules_c.codes_header(i.rules)),
    (rules_c.RULES_HEADER, lambda i: rules_c.rules_header(i.rules)),
    (rules_c.PAGE, lambda i: rules_c.page(i.rules)),
    (rules_py.PATH, lambda i: rules_py.module(i.rules, i.rules_text)),
    ("docs/spec/index.md", lambda i: docs.index(i.spec)),
    *((f"docs/spec/{m}.md", partial(_page, m)) for m in MACHINE_NAMES),
)

#: Directories the generator owns: a file there matching the pattern that no producer
#: makes is a leftover (say, the page of a removed table).
OWNED = (("models", "*.pml"), ("docs/spec", "*.md"))


def source_root() -> Path:
    """The source tree this package runs from (a checkout or an editable install)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "spec").is_dir() or not (root / "ffi").is_dir():
        raise ArgumentInvalid.of("--root", ArgumentReason.RANGE,
                                 f"{root} is not a kvstate source tree (no spec/ and ffi/); pass --root")
    return root


def artifacts(root: Path, spec: Spec | None = None) -> dict[str, str]:
    """Path under ``root`` -> generated text, from ``spec`` (default: ``root/spec``)."""
    inputs = Inputs(root, spec if spec is not None else load_spec(root / "spec"))
    return {path: produce(inputs) for path, produce in ARTIFACTS}


def _leftovers(root: Path, made: dict[str, str]) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for d, pattern in OWNED for p in (root / d).glob(pattern)
                  if p.relative_to(root).as_posix() not in made)


def stale(root: Path, spec: Spec | None = None) -> list[tuple[str, str]]:
    """(path, why) of every stale file under ``root``; empty when all are fresh."""
    made = artifacts(root, spec)
    out = []
    for path, text in made.items():
        f = root / path
        if not f.is_file():
            out.append((path, "missing"))
        elif f.read_text(encoding="utf-8") != text:
            out.append((path, "differs from what spec/ and the code generate"))
    out += [(path, "generated by nothing any more") for path in _leftovers(root, made)]
    return out


def write(root: Path, spec: Spec | None = None) -> list[tuple[str, str]]:
    """Write every artifact that changed and remove leftovers; (path, what was done)."""
    made = artifacts(root, spec)
    done = []
    for path, text in made.items():
        f = root / path
        if f.is_file() and f.read_text(encoding="utf-8") == text:
            continue
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text, encoding="utf-8")
        done.append((path, "wrote"))
    for path in _leftovers(root, made):
        (root / path).unlink()
        done.append((path, "removed"))
    return done
