"""``python -m launcher.plan [overrides]``: print the pre-flight plan of the composed config.

The plan (:mod:`launcher.plan.plan`): parallel layout, parameters, memory per GPU, FLOPs and time
estimates, as a table, with ``plan.format=json`` one JSON object, with ``plan.format=html`` a
page with charts (memory per stage against the GPU, the step-time model) written to
``plan.output`` (default plan.html) and its path printed. With ``plan.calibrate=true`` and no
stored profile that measured this model and layout here, ``launcher.probe`` measures this
machine first (launcher/cli/probe_first.py). Exit codes: 0 the plan fits,
2 config error or plan problem (each printed on stderr with a fix).
"""

from __future__ import annotations

import json
import sys

from launcher.cli import handle_flags
from launcher.cli.probe_first import needs_probe, probe_first
from launcher.compose import compose_or_exit, to_object
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.plan.plan import PlanError, compute_plan, print_problems, print_warnings
from launcher.plan.report import render_plan


def _planned(cfg) -> tuple:
    """(the plan or None, the PlanError or None)."""
    try:
        return compute_plan(cfg, measure_precision=True), None
    except PlanError as exc:
        return exc.plan, exc


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.plan [overrides]``: print the plan; exit 2 on any config problem."""
    argv = handle_flags(sys.argv[1:] if argv is None else argv, "launcher.plan", __doc__)
    cfg = to_object(compose_or_exit(argv))
    plan, error = _planned(cfg)
    if error is None and needs_probe(cfg.plan.calibrate, plan.sources["step time"]):
        probe_first(argv, cfg.run.name, "plan")  # then the plan finds the profile it stored
        plan, error = _planned(cfg)
    if cfg.plan.format.value == "json":
        if plan is not None:
            print(json.dumps(plan.to_dict()))
    elif cfg.plan.format.value == "html":
        if plan is not None:
            from launcher.plan.html_report import plan_page, write_plan_page

            print(write_plan_page(plan_page(plan, cfg), cfg.plan.output, "plan.html"))
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
