"""``python -m launcher.sweep_summary <sweep dir> [--json]``: one row per sweep point.

Every run directory under the sweep directory (a folder holding ``metrics.jsonl``) is a point,
named by its folder (the swept overrides). Columns: last step, final training loss, final and best
validation loss (``eval/loss`` lines of metrics.jsonl) and the step of the best; rows sorted by
best validation loss (points without validation last). Exit 1 when no point is found.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence


def summarize_run(run_dir: Path) -> dict:
    """The summary row of one run directory."""
    row = {"point": run_dir.name, "steps": 0, "train_loss": None, "final_val_loss": None,
           "best_val_loss": None, "best_val_step": None}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if "loss" in rec:
            row["steps"], row["train_loss"] = rec["step"], rec["loss"]
        if "eval/loss" in rec:
            row["final_val_loss"] = rec["eval/loss"]
            if row["best_val_loss"] is None or rec["eval/loss"] < row["best_val_loss"]:
                row["best_val_loss"], row["best_val_step"] = rec["eval/loss"], rec["step"]
    return row


def summarize(sweep_dir: Path) -> list[dict]:
    """Rows of every point under ``sweep_dir``, best validation loss first."""
    runs = sorted(p.parent for p in Path(sweep_dir).glob("*/metrics.jsonl"))
    rows = [summarize_run(r) for r in runs]
    return sorted(rows, key=lambda r: (r["best_val_loss"] is None,
                                       r["best_val_loss"] if r["best_val_loss"] is not None
                                       else math.inf, r["point"]))


def format_table(rows: list[dict]) -> str:
    """A plain-text table of the rows."""
    cols = ["point", "steps", "train_loss", "final_val_loss", "best_val_loss", "best_val_step"]
    cell = lambda v: "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))  # noqa
    table = [cols] + [[cell(r[c]) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                               for i, (v, w) in enumerate(zip(line, widths)))
                     for line in table)


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
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
