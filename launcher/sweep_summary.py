"""``python -m launcher.sweep_summary <sweep dir> [--json]``: one row per sweep point.

Kept for scripts written against it; ``python -m launcher.report <sweep dir> [--format
text|json|html]`` is the one command for runs and sweeps and shows more columns (tokens/s, peak
memory, goodput, outcome) and the HTML report. The rows are :func:`launcher.reports.sweep
.summarize`'s: last step, final training loss, final and best validation loss and the step of
the best, best validation loss first (points without validation after). Exit 1 when no point
is found.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from launcher.reports.sweep import COLUMNS, format_table, summarize

LEGACY_COLUMNS = COLUMNS[:6]
"""point, steps, train_loss, final_val_loss, best_val_loss, best_val_step."""

__all__ = ["main", "summarize"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.sweep_summary", description=__doc__)
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--json", action="store_true", help="one JSON list on stdout")
    args = parser.parse_args(argv)
    rows = summarize(args.sweep_dir)
    if not rows:
        print(f"sweep_summary: no run directory with metrics.jsonl under {args.sweep_dir}",
              file=sys.stderr)
        return 1
    rows = [{c: r[c] for c in LEGACY_COLUMNS} for r in rows]
    print(json.dumps(rows, indent=1) if args.json else format_table(rows, LEGACY_COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
