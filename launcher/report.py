"""``python -m launcher.report DIR [--format text|json|html] [--output FILE]``: a run or a sweep.

DIR is a run directory (``outputs/<run name>``: metrics.jsonl or events.jsonl) or a sweep
directory (``launcher.train -m``: run directories inside it).

Run, text (default): the goodput, each cause of lost time and each attempt (launch, in-job
restarts, requeues) with how it ended. json: one object with ``wall_s``, ``productive_s``,
``goodput`` (productive / wall), ``lost_s`` (cause -> seconds) and ``attempts``
(:mod:`launcher.runtime.goodput` says how each is measured). html: the run's report, one
self-contained page with charts (:mod:`launcher.reports.run`), written to ``--output``
(default ``DIR/report.html``) and its path printed.

Sweep, text: one row per point (steps, losses, tokens/s, peak memory, goodput, outcome), best
first; json: the rows; html: the sweep's report (:mod:`launcher.reports.sweep`).

Exit 2 when DIR is neither.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.runtime.goodput import account, summary_line


def render_text(acc: dict) -> str:
    rows = [summary_line(acc), f"  productive        {acc['productive_s']:>10,.1f} s"]
    rows += [f"  {cause.replace('_', ' '):<17} {seconds:>10,.1f} s"
             for cause, seconds in acc["lost_s"].items() if abs(seconds) >= 0.05]
    rows.append("attempts:")
    rows += [f"  {a['attempt']}: {a['seconds']:,.1f} s, "
             + (f"from step {a['resumed_at']}, " if a["resumed_at"] else "")
             + (f"to step {a['last_step']}, " if a["last_step"] is not None else "no step, ")
             + a["cause"] for a in acc["attempts"]]
    return "\n".join(rows)


def is_run_dir(path: Path) -> bool:
    return (path / "events.jsonl").is_file() or (path / "metrics.jsonl").is_file()


def run_report(run_dir: Path, fmt: str, output: Path | None) -> int:
    if fmt == "html":
        from launcher.reports.run import write_run_report

        print(write_run_report(run_dir, output))
        return 0
    acc = account(run_dir)
    print(json.dumps(acc) if fmt == "json" else render_text(acc))
    return 0


def sweep_report(sweep_dir: Path, fmt: str, output: Path | None) -> int:
    from launcher.reports.sweep import format_table, summarize, write_sweep_report

    if fmt == "html":
        print(write_sweep_report(sweep_dir, output))
        return 0
    rows = summarize(sweep_dir)
    print(json.dumps(rows, indent=1) if fmt == "json" else format_table(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, metavar="DIR",
                        help="a run directory (outputs/<run name>) or a sweep directory")
    parser.add_argument("--format", choices=("text", "json", "html"), default="text")
    parser.add_argument("--output", type=Path, default=None,
                        help="html: the file to write (default DIR/report.html)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from launcher.reports.sweep import points

    if is_run_dir(args.run_dir):
        return run_report(args.run_dir, args.format, args.output)
    if args.run_dir.is_dir() and points(args.run_dir):
        return sweep_report(args.run_dir, args.format, args.output)
    print(f"report: {args.run_dir} has neither events.jsonl nor metrics.jsonl: not a run "
          "directory (give outputs/<run name>); and no run directory inside it: not a sweep "
          "directory either", file=sys.stderr)
    return CONFIG_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
