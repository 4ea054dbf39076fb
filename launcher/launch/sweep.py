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
``python -m launcher.sweep_summary <sweep dir>``.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from launcher.compose import CONF_DIR, compose_or_exit, to_object

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
    days, _, clock = limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    h, m, s = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


def _quote(value: str) -> str:
    return "'" + str(value).replace("'", "\\'") + "'"


def slurm_launcher_overrides(cluster) -> list[str]:
    """hydra.launcher settings (submitit) from the ``cluster`` group."""
    out = [f"hydra.launcher.timeout_min={time_limit_minutes(cluster.time_limit)}",
           "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=1",
           f"hydra.launcher.cpus_per_task={max(1, cluster.cpus_per_task) * cluster.gpus_per_node}"]
    if cluster.gpu.lower() != "cpu":
        out.append(f"hydra.launcher.gpus_per_node={cluster.gpus_per_node}")
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(cluster, key):
            out.append(f"hydra.launcher.{key}={_quote(getattr(cluster, key))}")
    if cluster.mem:
        out.append(f"+hydra.launcher.additional_parameters.mem={_quote(cluster.mem)}")
    return out


def run_point(sweep_dir: str, group: str) -> None:
    """Body of one sweep point (in this process or a Slurm job): train; raise on failure."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    name = hydra_cfg.job.override_dirname.replace("/", "_") or f"point_{hydra_cfg.job.num}"
    mine = [o for o in hydra_cfg.overrides.task if o.split("=", 1)[0].lstrip("+~") not in
            POINT_KEYS]
    argv = [*mine, f"run.output_root={sweep_dir}", f"run.name={_quote(name)}",
            f"logger.group={_quote(group)}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"sweep: point {hydra_cfg.job.num}: {name}", flush=True)
    code = subprocess.call([sys.executable, "-m", "launcher.train", *argv], env=env)
    if code != 0:
        raise RuntimeError(f"sweep point {name!r} exited with {code}")


def main(argv: Sequence[str]) -> int:
    """Run the multirun given launcher.train's command line (with -m/--multirun)."""
    import hydra

    overrides = [a for a in argv if a not in SWEEP_FLAGS]
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
    print(f"sweep: {sweep_name} over {', '.join(swept) or 'no swept keys'} in {sweep_dir}",
          flush=True)

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _task(_cfg) -> None:
        run_point(str(sweep_dir), group)

    sys.argv = [sys.argv[0], "--multirun", *hydra_args]
    _task()
    return 0
