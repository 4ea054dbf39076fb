"""``python -m launcher.plan [overrides]``: print the plan; exit 2 on any config problem."""

from __future__ import annotations

import json
import sys

from launcher.compose import CONFIG_ERROR_EXIT, compose_or_exit, to_object
from launcher.plan.plan import PlanError, compute_plan, print_problems, print_warnings
from launcher.plan.report import render_plan


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.plan [overrides]``: print the plan; exit 2 on any config problem."""
    cfg = to_object(compose_or_exit(sys.argv[1:] if argv is None else argv))
    try:
        plan, error = compute_plan(cfg), None
    except PlanError as exc:
        plan, error = exc.plan, exc
    if cfg.plan.format.value == "json":
        if plan is not None:
            print(json.dumps(plan.to_dict()))
    elif plan is not None:
        render_plan(plan)
    if plan is not None:
        print_warnings(plan)
    if error is not None:
        print_problems(error)
        return CONFIG_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
