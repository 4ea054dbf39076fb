"""Render the sbatch script of a training run from the ``cluster`` and ``launch`` groups and a plan.

The script is a header of ``#SBATCH`` directives, one ``srun`` line that starts the training with
the caller's overrides (each one ``shlex.quote``-d, so no character of a value is ever interpreted
by the shell), and the requeue logic: when the training exits with
:data:`launcher.core.stop.REQUEUE_EXIT` (it saved after the early-warning signal), or was ended
by a stop signal before its handler existed (:func:`requeue_codes`), and the job has restarted
fewer than ``cluster.max_restarts`` times, the job requeues itself with ``scontrol requeue``;
every other exit status is the job's own.

Node and process counts come from the :class:`launcher.plan.Plan`, so the job and the parallel
layout cannot disagree. A ``#SBATCH`` value holding a newline is rejected (:class:`SbatchError`).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Sequence

from launcher.core.exits import REQUEUE_EXIT
from launcher.core.stop import resolve_signal, stop_signals

_PLAIN_VALUE = re.compile(r"[^\s\"'\\]*")

TASK_EXIT_GRACE_S = 120
"""``srun --wait``: seconds the other tasks get to finish after the first one exits (any code)
before srun kills them. Ranks that stop for requeue exit a moment apart (rank 0 closes the
metrics), which ``--kill-on-bad-exit`` would turn into a kill; a crashed rank still ends the
step within this grace instead of leaving the others blocked in a collective."""


class SbatchError(ValueError):
    """A value that cannot be written into an ``#SBATCH`` directive."""


def directive(option: str, value=None) -> str:
    """``#SBATCH --option[=value]``; values with spaces are double-quoted, newlines rejected."""
    if value is None:
        return f"#SBATCH --{option}"
    text = str(value)
    if "\n" in text or "\r" in text:
        raise SbatchError(f"#SBATCH --{option}: value {text!r} holds a newline, which would end "
                          f"the directive; remove it")
    if not _PLAIN_VALUE.fullmatch(text):
        if '"' in text or "\\" in text:
            raise SbatchError(f"#SBATCH --{option}: value {text!r} mixes spaces or quotes with a "
                              f"double quote or backslash; sbatch cannot parse it")
        text = f'"{text}"'
    return f"#SBATCH --{option}={text}"


def slurm_signal(stop_signal: str, lead_s: int) -> str:
    """``SIGUSR1``, 120 -> ``USR1@120`` (sent to every job step, not the batch shell)."""
    return f"{resolve_signal(stop_signal).name[3:]}@{lead_s}"


def header(cfg, plan, run_dir: Path, job_name: str) -> list[str]:
    """The ``#SBATCH`` lines; counts from the plan, the rest from ``cfg.cluster``."""
    c, torchrun = cfg.cluster, cfg.launch.mode.value == "torchrun"
    tasks = 1 if torchrun else plan.machines.gpus_per_node
    cpus = c.cpus_per_task * (plan.machines.gpus_per_node if torchrun else 1)
    logs = str(Path(run_dir) / "logs").replace("%", "%%")
    lines = [directive("job-name", job_name), directive("nodes", plan.machines.nodes),
             directive("ntasks-per-node", tasks)]
    if plan.machines.gpu.lower() != "cpu":
        lines.append(directive("gpus-per-node", plan.machines.gpus_per_node))
    optional = [("cpus-per-task", cpus or None), ("mem", c.mem or None),
                ("partition", c.partition or None), ("account", c.account or None),
                ("qos", c.qos or None), ("constraint", c.constraint or None)]
    lines += [directive(k, v) for k, v in optional if v is not None]
    lines.append(directive("time", c.time_limit))
    if c.exclusive:
        lines.append(directive("exclusive"))
    if c.signal_lead_s > 0:
        lines.append(directive("signal", slurm_signal(cfg.trainer.stop_signal, c.signal_lead_s)))
    lines += [directive("requeue"), directive("open-mode", "append"),
              directive("output", f"{logs}/slurm-%j.out"),
              directive("error", f"{logs}/slurm-%j.err")]
    return lines


def srun_line(cfg, plan, overrides: Sequence[str]) -> str:
    """The ``srun`` command that starts the training (quoted for bash)."""
    c = cfg.cluster
    srun = ["srun", "--kill-on-bad-exit=0", f"--wait={TASK_EXIT_GRACE_S}",
            f"--nodes={plan.machines.nodes}"]
    if c.container_image:
        srun.append(f"--container-image={c.container_image}")
        if c.container_mounts:
            srun.append(f"--container-mounts={c.container_mounts}")
    quoted = " ".join(shlex.quote(o) for o in overrides)
    if cfg.launch.mode.value == "torchrun":
        cpus = c.cpus_per_task * plan.machines.gpus_per_node
        srun += ["--ntasks-per-node=1"] + ([f"--cpus-per-task={cpus}"] if cpus else [])
        agent = (f'"$PYTHON" -m launcher.launch.agent --nnodes={plan.machines.nodes} '
                 f'--nproc-per-node={plan.machines.gpus_per_node} --rdzv-endpoint="$HEAD:'
                 f'{cfg.launch.rdzv_port}" --rdzv-id="$SLURM_JOB_ID" --')
        return " ".join(shlex.quote(a) for a in srun) + f" {agent} {quoted}".rstrip()
    srun += [f"--ntasks-per-node={plan.machines.gpus_per_node}"]
    srun += [f"--cpus-per-task={c.cpus_per_task}"] if c.cpus_per_task else []
    return " ".join(shlex.quote(a) for a in srun) + \
        f' "$PYTHON" -m launcher.train {quoted}'.rstrip()


def body(cfg, plan, overrides: Sequence[str], workdir: Path, python: str) -> list[str]:
    """Everything after the header: environment, srun, requeue on exit 75."""
    lines = ["set -uo pipefail", f"cd {shlex.quote(str(workdir))}",
             f"PYTHON={shlex.quote(python)}",
             'PYTHON="${TRAINWRIGHT_PYTHON:-$PYTHON}"',
             'echo "trainwright: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on '
             '${SLURM_JOB_NODELIST}"']
    if cfg.launch.mode.value == "torchrun":
        lines.append('HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)')
    lines += [srun_line(cfg, plan, overrides), "rc=$?",
              f'if {requeue_test(cfg.trainer.stop_signal)}; then',
              f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {cfg.cluster.max_restarts} ]; then',
              '    echo "trainwright: stopped for requeue; requeueing job ${SLURM_JOB_ID}"',
              '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
              "  fi",
              f'  echo "trainwright: cluster.max_restarts={cfg.cluster.max_restarts} reached"',
              "fi",
              'exit "$rc"']
    return lines


def requeue_codes(stop_signal: str) -> list[int]:
    """The training's exit codes that mean "stopped, requeue me": 75, and 128 + N for each stop
    signal N, which srun reports when a stop signal ended a task in its interpreter's first
    instants, before its handler (docs/launching.md: nothing had started, so nothing is lost)."""
    return [REQUEUE_EXIT] + sorted(128 + int(s) for s in stop_signals(stop_signal))


def requeue_test(stop_signal: str) -> str:
    """``[ "$rc" -eq 75 ] || ...``: the shell test for :func:`requeue_codes`."""
    return " || ".join(f'[ "$rc" -eq {code} ]' for code in requeue_codes(stop_signal))


def render(cfg, plan, overrides: Sequence[str], run_dir: Path, workdir: Path,
           python: str) -> str:
    """The whole sbatch script (raises SbatchError for an unwritable ``#SBATCH`` value)."""
    job_name = f"tw_{Path(run_dir).name}"
    lines = ["#!/bin/bash",
             "# Generated by `python -m launcher.submit`; resubmit with `sbatch <this file>`.",
             *header(cfg, plan, run_dir, job_name), "", *body(cfg, plan, overrides, workdir,
                                                              python)]
    return "\n".join(lines) + "\n"
