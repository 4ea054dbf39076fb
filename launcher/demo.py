"""`make demo`: the embedded default, end to end as far as the project goes today.

Prints the plan of the default config (the tiny model on this machine's CPU) and of the flagship
16,384-GPU Llama 3 70B experiment. The training runtime extends this to prepare a corpus, train,
save and resume.
"""

from __future__ import annotations

import sys

from rich.console import Console

from launcher.compose import compose_or_exit, to_object
from launcher.plan import PlanError, compute_plan
from launcher.plan_report import render_plan


def show(title: str, overrides: list[str], console: Console) -> int:
    console.rule(f"[bold]{title}[/]  python -m launcher.plan {' '.join(overrides)}")
    try:
        render_plan(compute_plan(to_object(compose_or_exit(overrides))), console)
    except PlanError as exc:
        console.print(f"[red]plan problems:[/]\n{exc}")
        return 2
    return 0


def main() -> int:
    console = Console()
    extra = sys.argv[1:]
    status = show("default config (tiny model, 2 CPU processes)", extra, console)
    status |= show("Llama 3 70B on 16,384 H100", ["experiment=llama3_70b_16k_h100", *extra],
                   console)
    return status


if __name__ == "__main__":
    sys.exit(main())
