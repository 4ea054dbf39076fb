"""The pre-flight plan: pure, torch-free checks and derived numbers of a composed config.

``python -m launcher.plan [overrides]`` prints it (:mod:`launcher.plan.__main__`)."""

from launcher.plan.plan import Plan, PlanError, compute_plan, plan_or_exit, print_problems

__all__ = ["Plan", "PlanError", "compute_plan", "plan_or_exit", "print_problems"]
