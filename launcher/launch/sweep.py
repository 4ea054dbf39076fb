"""``python -m launcher.train -m key=a,b ...``: a Hydra multirun, one training run per point.

The sweep directory is ``<run.output_root>/<run.name or sweep_<time>>``; every point trains in
its own run directory inside it, named after the swept overrides (Hydra's
``hydra.job.override_dirname`` restricted to the swept keys, ``/`` replaced by ``_``), e.g.
``outputs/lr_sweep/optimizer.lr=0.0001``. All points share the wandb group named after the sweep
(unless ``logger.group`` is set). Each point is a ``python -m launcher.train`` process, so a point
behaves exactly like a single run (exit codes, local process launch, resume).

``hydra/launcher=slurm`` (conf/hydra/launcher/slurm.yaml, hydra-submitit-launcher) submits one
Slurm job per point; its resources come from the ``cluster`` group (one task per node that starts
``cluster.gpus_per_node`` processes, ``cpus_per_task x gpus_per_node`` CPUs, the time limit,
partition, account, qos and constraint). A summary of a finished sweep:
``python -m launcher.report <sweep dir> [--format text|json|html]``; the sweep writes the HTML
one into the sweep directory when it ends.

Each point returns its objective (``sweep.objective``: the final validation loss, else the
final training loss) to Hydra's sweeper, so optimising sweepers work:
``hydra/sweeper=optuna 'optimizer.lr=interval(1e-4,3e-3)' hydra.sweeper.n_trials=20`` (Hydra's
Optuna sweeper plugin), as do Nevergrad and Ax, locally and through submitit on Slurm.

Stops follow the contract of single runs (:mod:`launcher.core.stop`). On Slurm, submitit
sends its warning ``cluster.signal_lead_s`` seconds before the time limit, as
``trainer.stop_signal`` (``SUBMITIT_PREEMPT_SIGNAL``); a point's process forwards every stop
signal to its ``launcher.train`` child instead of letting submitit requeue at once, waits for it
to save, and when it exits 75 requeues its own job (up to ``cluster.max_restarts`` times); the
requeued job runs the same point again, which resumes from its run directory. Outside Slurm a
stopped point ends the sweep with exit 75; the same command resumes every point.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from launcher.compose import CONF_DIR, compose_or_exit, to_object, with_aliases
from launcher.core.durations import slurm_time_limit_s
from launcher.core.exits import BAD_DATA_EXIT, REQUEUE_EXIT
from launcher.core.stop import forward_stop_signals, resolve_signal, restore_handlers

SWEEP_FLAGS = ("-m", "--multirun")
"""Command-line flags that make launcher.train run a sweep."""
POINT_KEYS = ("run.name", "run.output_root", "logger.group")
"""Overrides set per point by the sweep (the user's values name the sweep instead)."""


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(keys of sweep overrides, the plain overrides), by Hydra's own override parser."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    swept = [o.key_or_group for o in parsed if o.is_sweep_override()]
    plain = [text for o, text in zip(parsed, overrides) if not o.is_sweep_override()]
    return swept, plain


def time_limit_minutes(limit: str) -> int:
    """Slurm ``D-HH:MM:SS`` / ``HH:MM:SS`` / ``MM`` -> minutes (rounded up)."""
    return -(-slurm_time_limit_s(limit) // 60)


def _quote(value: str) -> str:
    return "'" + str(value).replace("'", "\\'") + "'"


def slurm_launcher_overrides(cluster) -> list[str]:
    """hydra.launcher settings (submitit) from the ``cluster`` group."""
    out = [f"hydra.launcher.timeout_min={time_limit_minutes(cluster.time_limit)}",
           "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=1",
           f"hydra.launcher.cpus_per_task={max(1, cluster.cpus_per_task) * cluster.gpus_per_node}",
           f"hydra.launcher.signal_delay_s={max(0, cluster.signal_lead_s)}",
           "+hydra.launcher.additional_parameters.requeue=true"]
    if cluster.gpu.lower() != "cpu":
        out.append(f"hydra.launcher.gpus_per_node={cluster.gpus_per_node}")
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(cluster, key):
            out.append(f"hydra.launcher.{key}={_quote(getattr(cluster, key))}")
    if cluster.mem:
        out.append(f"+hydra.launcher.additional_parameters.mem={_quote(cluster.mem)}")
    return out


def use_stop_signal_for_submitit(stop_signal: str) -> None:
    """Make submitit's warning signal (``--signal=<sig>@lead`` and its handler in the job) the
    configured ``trainer.stop_signal``; submitit reads the variable when it is imported."""
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = resolve_signal(stop_signal).name[3:]


def requeue_slurm_job(max_restarts: int) -> bool:
    """In a submitit Slurm job: requeue it (``scontrol requeue``) unless it has restarted
    ``max_restarts`` times already; False when it may not requeue."""
    job = os.environ.get("SLURM_JOB_ID")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if not job:
        return False
    if restarts >= max_restarts:
        print(f"sweep: cluster.max_restarts={max_restarts} reached; not requeueing job {job}",
              flush=True)
        return False
    print(f"sweep: stopped for requeue; requeueing job {job} (restart {restarts + 1})", flush=True)
    return subprocess.call(["scontrol", "requeue", job]) == 0


def train_point(argv: list[str], stop_signal: str) -> int:
    """Run ``python -m launcher.train argv``, forwarding every stop signal this process gets
    (submitit's warning, scancel, Ctrl-C) to it; its exit code once it has finished."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    child = subprocess.Popen([sys.executable, "-m", "launcher.train", *argv], env=env)
    previous = forward_stop_signals(stop_signal, lambda: [child.pid])
    try:
        return child.wait()
    finally:
        restore_handlers(previous)


def objective_of(run_dir: Path, objective: str = "auto") -> float:
    """What a finished point returns to the sweeper (``sweep.objective``): its final
    validation loss (``val_loss``), final training loss (``train_loss``) or the first of the
    two it has (``auto``); ValueError when it has none."""
    from launcher.core.jsonl import read_jsonl

    last: dict = {}
    path = Path(run_dir) / "metrics.jsonl"
    for row in read_jsonl(path):
        for key in ("eval/loss", "loss"):
            if row.get(key) is not None:
                last[key] = float(row[key])
    wanted = {"val_loss": ("eval/loss",), "train_loss": ("loss",),
              "auto": ("eval/loss", "loss")}[str(objective)]
    for key in wanted:
        if key in last:
            return last[key]
    raise ValueError(f"{path} holds no {' or '.join(wanted)} for sweep.objective={objective}"
                     + ("; set trainer.eval_interval so that points evaluate"
                        if "eval/loss" in wanted else ""))


def run_point(sweep_dir: str, group: str, stop_signal: str = "SIGUSR1",
              max_restarts: int = 0, objective: str = "auto") -> float:
    """Body of one sweep point (in this process or a Slurm job): train; return the point's
    objective (:func:`objective_of`; NaN when it diverged, exit 3, which Optuna records as a
    failed trial); raise on another failure, exit 75 after a stop (the Slurm job requeues
    itself first)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    name = hydra_cfg.job.override_dirname.replace("/", "_") or f"point_{hydra_cfg.job.num}"
    mine = [o for o in hydra_cfg.overrides.task if o.split("=", 1)[0].lstrip("+~") not in
            POINT_KEYS]
    argv = [*mine, f"run.output_root={sweep_dir}", f"run.name={_quote(name)}",
            f"logger.group={_quote(group)}"]
    print(f"sweep: point {hydra_cfg.job.num}: {name}", flush=True)
    code = train_point(argv, stop_signal)
    if code == REQUEUE_EXIT and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        if requeue_slurm_job(max_restarts):
            raise SystemExit(REQUEUE_EXIT)  # the job runs this point again and resumes
        raise RuntimeError(f"sweep point {name!r} saved and stopped, and was not requeued")
    if code == REQUEUE_EXIT:
        print(f"sweep: point {name!r} saved and stopped; run the same sweep again to resume it",
              flush=True)
        raise SystemExit(REQUEUE_EXIT)
    if code == BAD_DATA_EXIT:
        print(f"sweep: point {name!r} diverged or met bad data (exit {code}); its objective "
              "is NaN (a failed trial)", flush=True)
        return float("nan")
    if code != 0:
        raise RuntimeError(f"sweep point {name!r} exited with {code}")
    return objective_of(Path(sweep_dir) / name, objective)


def main(argv: Sequence[str], on_end: Optional[Callable[[Path], None]] = None) -> int:
    """Run the multirun given launcher.train's command line (with -m/--multirun);
    ``on_end(sweep_dir)`` runs however it ends (the command writes the sweep report)."""
    import hydra

    overrides = with_aliases([a for a in argv if a not in SWEEP_FLAGS])  # eval.async, ...
    swept, plain = split_overrides(overrides)
    cfg = to_object(compose_or_exit(plain))
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    sweep_name = cfg.run.name or f"sweep_{stamp}"
    sweep_dir = Path(cfg.run.output_root).resolve() / sweep_name
    group = cfg.logger.group or sweep_name
    exclude = sorted(({o.split("=", 1)[0].lstrip("+~") for o in plain} - set(swept))
                     | set(POINT_KEYS))
    hydra_args = [*overrides, f"hydra.sweep.dir={_quote(sweep_dir)}",
                  "hydra.sweep.subdir=.hydra/${hydra.job.num}",
                  f"hydra.job.config.override_dirname.exclude_keys=[{','.join(exclude)}]"]
    if any(o.replace(" ", "") == "hydra/launcher=slurm" for o in overrides):
        hydra_args += slurm_launcher_overrides(cfg.cluster)
        use_stop_signal_for_submitit(cfg.trainer.stop_signal)
    print(f"sweep: {sweep_name} over {', '.join(swept) or 'no swept keys'} in {sweep_dir}",
          flush=True)

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _task(_cfg) -> float:
        return run_point(str(sweep_dir), group, cfg.trainer.stop_signal,
                         cfg.cluster.max_restarts, str(cfg.sweep.objective))

    sys.argv = [sys.argv[0], "--multirun", *hydra_args]
    try:
        _task()
    finally:
        if on_end is not None and sweep_dir.is_dir():
            on_end(sweep_dir)
    return 0
