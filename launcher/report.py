"""``python -m launcher.report RUN_DIR [--format text|json]``: where a run's wall time went.

text (default): the goodput, each cause of lost time and each attempt (launch, in-job
restarts, requeues) with how it ended. json: one object with ``wall_s``, ``productive_s``,
``goodput`` (productive / wall), ``lost_s`` (cause -> seconds) and ``attempts``
(:mod:`launcher.runtime.goodput` says how each is measured). Exit 2 when RUN_DIR is not a run
directory.
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a run directory (outputs/<run name>)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not (args.run_dir / "events.jsonl").is_file() and \
            not (args.run_dir / "metrics.jsonl").is_file():
        print(f"report: {args.run_dir} has neither events.jsonl nor metrics.jsonl: not a run "
              "directory (give outputs/<run name>)", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    acc = account(args.run_dir)
    print(json.dumps(acc) if args.format == "json" else render_text(acc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
