"""``kvstate bench``: every suite side by side in one run (the suites are in benchmarks/).

Prints ratios and absolute figures, and writes ``bench.md`` (a Markdown table),
``bench.json`` (every row: suite, name, median, p10, p90, ratio; and the comparisons) and
``bench.png`` (a plot; skipped with a message when matplotlib is absent) to ``--out``, and
``summary.png``: kvstate's ratios against its peers with the goals drawn, from ``bench.json``
and the vLLM suite's ``bench-vllm.json`` in the same folder (``benchmarks/summary.py``).
``--json`` prints the JSON document on stdout instead of the table (messages go to stderr).
The suites live in the source checkout's ``benchmarks/`` (and the vLLM suite's engines in
``tests/support/engines``), not in the installed package: ``kvstate bench`` is a command of
a checkout (``make bench``); from an installed wheel it says so and exits 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

help = "run the benchmarks against peers, side by side"

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of seconds")
    parser.add_argument("--suite", action="append", choices=["B1", "B2", "B3", "B4", "vllm"],
                        help="run only this suite (repeatable); default: all but vllm (real vLLM engines, "
                             "run it with the vLLM venv's interpreter)")
    parser.add_argument("--repeats", type=int, help="timed repeats per row (default 7, quick 2)")
    parser.add_argument("--lengths", type=int, nargs="+",
                        help="vllm suite: the prompt lengths measured (default 512 1024 2048 4096; quick 512 1024)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="where bench.md and bench.png go")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG plots (bench.png, summary.png)")
    parser.add_argument("--json", action="store_true",
                        help="print every row (suite, name, median, p10, p90, ratio) as JSON on stdout")


def checkout() -> Path | None:
    """The source checkout this kvstate was imported from, or None for an installed wheel.

    Its ``benchmarks/`` and ``tests/`` (the engines kit) go first on ``sys.path``, so the
    suites and the processes they spawn (spawn copies ``sys.path``) import them whatever
    the current folder is."""
    import kvstate

    root = Path(kvstate.__file__).resolve().parents[1]
    if not (root / "benchmarks" / "suites.py").is_file() or not (root / "tests" / "support").is_dir():
        return None
    for path in (str(root / "tests"), str(root)):
        if path not in sys.path:
            sys.path.insert(0, path)
    return root


def _benchmarks() -> tuple[Any, Any, Any]:
    # Imported here, not at the top: the suites pull in numpy and the peers' libraries.
    from benchmarks import framework, report, suites
    return framework, suites, report


def run(args: argparse.Namespace) -> int:
    if args.repeats is not None and args.repeats < 1:
        print("kvstate bench: --repeats must be at least 1", file=sys.stderr)
        return 2
    if checkout() is None:
        print("kvstate bench: the benchmarks are not installed with kvstate; they run from a source checkout "
              "of kvstate (its benchmarks/ folder): run `make bench` there", file=sys.stderr)
        return 2
    vllm_status = 0
    if args.suite and "vllm" in args.suite:
        vllm_status = _vllm(args)
        args.suite = [s for s in args.suite if s != "vllm"]
        if not args.suite:
            return vllm_status
    framework, suites, report = _benchmarks()
    chosen = [s for s in suites.suites(quick=args.quick, repeats=args.repeats)
              if not args.suite or s.key in args.suite]
    results = framework.run_suites(chosen, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    say = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    say(report.terminal(results))
    args.out.mkdir(parents=True, exist_ok=True)
    command = "kvstate bench" + (" --quick" if args.quick else "") + "".join(f" --suite {s}" for s in args.suite or [])
    when = dt.datetime.now(dt.timezone.utc)
    md = args.out / "bench.md"
    md.write_text(report.markdown(results, when=when, command=command), encoding="utf-8")
    doc = json.dumps(report.rows_json(results, when=when, command=command), indent=2)
    (args.out / "bench.json").write_text(doc + "\n", encoding="utf-8")
    if args.json:
        print(doc)
    say(f"\nwrote {md} and {args.out / 'bench.json'}")
    if args.no_plot:
        say("plot skipped: --no-plot")
    else:
        png = args.out / "bench.png"
        why = report.plot(results, png)
        say(f"wrote {png}" if why is None else f"plot skipped: {why}")
        say(_summary(args.out))
    failed = [r.name for res in results for r in res.rows if r.failed]
    if failed:
        print(f"kvstate bench: {len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
        return max(1, vllm_status)
    return vllm_status  # the vLLM suite's failure is not lost behind the others'


def _vllm(args: argparse.Namespace) -> int:
    """The vLLM suite: engines in their own processes, its own table (bench-vllm.md)."""
    from benchmarks import b5_vllm

    why = b5_vllm.problem()
    if why is not None:
        print(f"kvstate bench --suite vllm: {why}", file=sys.stderr)
        return 1
    if args.lengths is not None and not all(0 < n <= 8000 for n in args.lengths):
        print("kvstate bench --lengths: prompt lengths must be in 1..8000 (the engines' max_model_len is 8192)",
              file=sys.stderr)
        return 2
    print(b5_vllm.run(args.out, repeats=args.repeats or 3, quick=args.quick, lengths=args.lengths))
    print(f"\nwrote {args.out / 'bench-vllm.md'} and {args.out / 'bench-vllm.json'}")
    if not args.no_plot:
        print(_summary(args.out))
    return 0


def _summary(out: Path) -> str:
    """Draw ``out/summary.png`` from the result files in ``out``; say what happened."""
    from benchmarks import summary

    png = out / "summary.png"
    why = summary.write(summary.load(out / "bench.json"), summary.load(out / "bench-vllm.json"), png)
    return f"wrote {png}" if why is None else f"summary skipped: {why}"
