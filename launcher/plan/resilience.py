"""Resilience settings checked against the planned step, save, eval and restart times.

Refused (exit 2, with the fix): a collective timeout shorter than the hang timeout (the
collective would fail first, with no stacks and no rank named); a fixed hang timeout shorter
than a planned step, save or evaluation (every one would be taken for a hang); in-job restarts
that cannot fit in the Slurm time limit with the planned restart time. Warned: a save
interval longer than the expected time between interruptions.
"""

from __future__ import annotations

from launcher.config import ResilienceConfig, TrainwrightConfig
from launcher.core.durations import slurm_time_limit_s
from launcher.core.problems import Problem
from launcher.plan.goodput import GoodputPlan

MIN_COLLECTIVE_TIMEOUT_S = 1800.0
"""The automatic collective timeout is never below torch's own default (30 minutes)."""
FIRST_PHASE_FLOOR_S = 300.0
"""The derived start-up / first-phase timeout is never below this: a loaded machine (two CPU
ranks beside other jobs) starts a tiny model in a minute."""
UNPLANNED_FIRST_PHASE_S = 1800.0
"""first_phase_timeout_s=0 in a config that skipped the plan (a test building a heartbeat by
hand): torch's collective timeout."""


def first_phase_s(r: ResilienceConfig) -> float:
    """The start-up / first-phase timeout in force: the configured (or planned) one, else
    :data:`UNPLANNED_FIRST_PHASE_S`."""
    return r.first_phase_timeout_s if r.first_phase_timeout_s > 0 else UNPLANNED_FIRST_PHASE_S


def planned_first_phase_s(r: ResilienceConfig, *, startup_s: float, load_s: float,
                          step_s: float, save_s: float, eval_s: float) -> float:
    """resilience.first_phase_timeout_s, or (0) the longest of :data:`FIRST_PHASE_FLOOR_S`, 10 x
    the planned start-up and load, 20 x the planned step (a first step warms up), 3 x the
    planned save and 3 x a validation pass."""
    if r.first_phase_timeout_s > 0:
        return r.first_phase_timeout_s
    return max(FIRST_PHASE_FLOOR_S, 10.0 * (startup_s + load_s), 20.0 * step_s, 3.0 * save_s,
               3.0 * eval_s)


def collective_timeout_s(r: ResilienceConfig) -> float:
    """Seconds every collective may take: resilience.collective_timeout_s, or (0) the longer
    of 30 minutes and twice the longest hang timeout, so hang detection always fires first."""
    if r.collective_timeout_s > 0:
        return r.collective_timeout_s
    longest_hang = max(r.hang_timeout_s, first_phase_s(r))
    return max(MIN_COLLECTIVE_TIMEOUT_S, 2.0 * longest_hang)


def planned_eval_s(step_time_s: float, eval_iters: int, grad_accum_steps: int) -> float:
    """One validation pass: eval_iters forward passes of a micro-batch, a forward being about
    a third of a micro-batch's share of the step."""
    return step_time_s * eval_iters / max(1, grad_accum_steps) / 3.0


def planned_tasks_s(step_time_s: float, tokens: int, step_micro_batch_tokens: int,
                    grad_accum_steps: int) -> float:
    """One evaluation of the downstream tasks: forward passes of the ``tokens`` its rows
    compute (launcher/evals/rows.py: micro-batches sized to the rows, every replica at once),
    each micro-batch's worth (``step_micro_batch_tokens``: a micro-batch's tokens on every
    replica) about a third of a micro-batch's share of the step (forward only)."""
    import math

    passes = math.ceil(tokens / max(1, step_micro_batch_tokens)) if tokens else 0
    return step_time_s * passes / max(1, grad_accum_steps) / 3.0


def evaluations(train_steps: int, interval: int, at_end: bool) -> int:
    """How many times a run of ``train_steps`` evaluates every ``interval`` steps (0: never on
    the way), and once more after the last step with ``at_end`` when that is not one of them."""
    count = train_steps // interval if interval else 0
    return count + (1 if at_end and (not interval or train_steps % interval) else 0)


def resilience_problems(cfg: TrainwrightConfig, *, step_time_s: float, eval_s: float,
                        goodput: GoodputPlan) -> list[Problem]:
    """Settings that cannot work together (module docstring)."""
    r, problems = cfg.resilience, []
    hang = r.hang_timeout_s
    if r.collective_timeout_s > 0 and hang > 0 and r.collective_timeout_s < 2 * hang:
        problems.append(Problem(("resilience.collective_timeout_s", "resilience.hang_timeout_s"), (
            f"resilience.collective_timeout_s={r.collective_timeout_s:g} is shorter than twice "
            f"resilience.hang_timeout_s={hang:g}: a stuck collective would fail before the hang "
            "is detected (no stacks, no rank named); set collective_timeout_s >= "
            f"{2 * hang:g} or 0 (automatic)")))
    if hang > 0:
        longest = max((step_time_s, "a step"), (goodput.stall_s, "a checkpoint save"),
                      (eval_s if cfg.trainer.eval_interval else 0.0, "a validation pass"))
        if hang < longest[0]:
            problems.append(Problem(("resilience.hang_timeout_s",), (
                f"resilience.hang_timeout_s={hang:g} is shorter than {longest[1]} "
                f"({longest[0]:.0f} s planned): every one would be taken for a hang; set "
                f"hang_timeout_s >= {3 * longest[0]:.0f} or 0 (automatic, from the run)")))
    problems += _restarts_fit(cfg, goodput)
    return problems


def _restarts_fit(cfg: TrainwrightConfig, goodput: GoodputPlan) -> list[Problem]:
    c, restarts = cfg.cluster, cfg.resilience.restarts_in_job
    if c.launcher != "slurm" or restarts <= 0:
        return []
    limit = slurm_time_limit_s(c.time_limit)
    needed = restarts * goodput.restart_s
    if needed < limit:
        return []
    fits = int(limit // goodput.restart_s)
    return [Problem(("resilience.restarts_in_job", "cluster.time_limit"), (
        f"resilience.restarts_in_job={restarts} restarts of {goodput.restart_s:.0f} s each "
        f"(start-up and loading {goodput.checkpoint_bytes / 1e9:,.0f} GB at "
        f"{c.checkpoint_gbps_per_node:g} GB/s per node) need {needed:.0f} s, more than "
        f"cluster.time_limit={c.time_limit} ({limit} s); set restarts_in_job <= "
        f"{max(0, fits - 1)} or a longer time limit"))]


def resilience_warnings(cfg: TrainwrightConfig, *, step_time_s: float,
                        goodput: GoodputPlan) -> list[str]:
    """Worth a word: a save interval longer than the expected time between interruptions; a
    Slurm job started with one task per GPU, which has no launcher to watch its ranks."""
    warnings = _srun_warning(cfg)
    interval_s = (cfg.trainer.save_interval or 0) * step_time_s
    mtbf_s = goodput.mtbf_hours * 3600
    if not cfg.trainer.save_interval or interval_s <= mtbf_s:
        return warnings
    return warnings + [f"trainer.save_interval={cfg.trainer.save_interval} steps ({interval_s / 3600:.1f} h) "
            f"is longer than the job's expected time between interruptions "
            f"({goodput.mtbf_hours:.1f} h): most interruptions will lose work; "
            f"save_interval={goodput.best_save_interval} maximises the expected goodput "
            f"({goodput.expected_at_best:.1%} against {goodput.expected:.1%})"]


def _srun_warning(cfg: TrainwrightConfig) -> list[str]:
    r = cfg.resilience
    if cfg.cluster.launcher != "slurm" or cfg.launch.mode.value != "srun" or \
            (r.restarts_in_job <= 0 and r.hang_timeout_s < 0):
        return []
    return ["launch.mode=srun starts one Slurm task per GPU with no launcher to watch them: no "
            "hang detection and no in-job restart (resilience.*) for this job; "
            "launch.mode=torchrun (one agent per node) has both"]
