"""``python -m launcher.submit [overrides]``: submit a training run to a Slurm or Kubernetes cluster.

Kubernetes (``cluster.launcher=kubernetes``): compose -> plan (exit 2) -> render the manifests of
``cluster.kubernetes_api`` (:mod:`launcher.launch.kubernetes`) -> check them as an API server
would (exit 2 with every problem) -> ``submit.dry_run=true`` prints them (YAML documents, nothing
else on stdout); otherwise they are written to ``<run dir>/kubernetes.yaml`` and created with
``kubectl create`` (``$TRAINWRIGHT_KUBECTL`` if set); the job name goes to stdout, how to follow it
to stderr. The data paths are the pods' and are checked by the pods, not here.

Slurm:

compose (exit 2) -> plan (exit 2) -> render the sbatch script (:mod:`launcher.launch.sbatch`; exit 2 for
a value that cannot go into ``#SBATCH``) -> write ``<run dir>/submit.sbatch`` -> ``sbatch`` ->
print the job id on stdout. ``submit.dry_run=true`` prints the script instead and writes nothing.
The job runs ``python -m launcher.train`` with exactly the overrides given here. The Python of the
job is this interpreter (``sys.executable``) unless ``TRAINWRIGHT_PYTHON`` is set in the job's
environment. Secrets (WANDB_API_KEY, ...) are never written; the job inherits the environment.
Exit codes: 0 submitted (or printed), 2 config error, plan problem or unusable cluster, 1 sbatch
failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from launcher.cli import handle_flags
from launcher.compose import compose_or_exit, to_object
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.launch import kubernetes
from launcher.launch.kubernetes.apply import checked_yaml_or_exit, create, follow_hint
from launcher.launch.sbatch import SbatchError, render
from launcher.plan import plan_or_exit
from launcher.plan.data_check import check_data_or_exit
from launcher.runtime.rundir import run_dir_path

SCRIPT_NAME = "submit.sbatch"
"""File name of the rendered script inside the run directory."""


def render_or_exit(cfg, plan, argv: Sequence[str], run_dir: Path) -> str:
    """The script for this config, or exit 2 with the reason."""
    if cfg.cluster.launcher != "slurm":
        print(f"submit: cluster={cfg.cluster.name} has launcher={cfg.cluster.launcher}; pick a "
              f"Slurm or Kubernetes cluster (cluster=slurm_h100, k8s_h100, ...) or run "
              f"launcher.train", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
    python = os.environ.get("TRAINWRIGHT_PYTHON") or sys.executable
    try:
        return render(cfg, plan, argv, run_dir=run_dir, workdir=Path.cwd(), python=python)
    except SbatchError as exc:
        print(f"submit: {exc}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT) from None


def sbatch(script: Path) -> str:
    """Submit ``script``; return the job id (SystemExit(1) with sbatch's message on failure)."""
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"submit: sbatch failed: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if proc.returncode != 0:
        print(f"submit: sbatch exited {proc.returncode}: {proc.stderr.strip()}", file=sys.stderr)
        raise SystemExit(1)
    return proc.stdout.strip().split(";")[0]


def submit_kubernetes(cfg, plan, argv: Sequence[str]) -> int:
    """Render, check, then print or create the Kubernetes manifests."""
    run_dir = run_dir_path(cfg.run, cfg.model.name, cfg.cluster.name)
    documents = kubernetes.render(cfg, plan, argv, run_name=run_dir.name)
    text = checked_yaml_or_exit(documents)
    if cfg.submit.dry_run:
        sys.stdout.write(text)
        return 0
    path = create(text, run_dir.resolve(), cfg.cluster.namespace)
    job = documents[-1]
    print(f"submit: {job['kind']} {job['metadata']['name']}: {path}\n"
          f"{follow_hint(job['kind'], job['metadata']['name'], cfg.cluster.namespace, plan.machines.nodes)}",
          file=sys.stderr)
    print(job["metadata"]["name"])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = handle_flags(sys.argv[1:] if argv is None else argv, "launcher.submit", __doc__)
    cfg = to_object(compose_or_exit(argv))
    plan = plan_or_exit(cfg)
    if cfg.cluster.launcher == "kubernetes":
        return submit_kubernetes(cfg, plan, argv)
    # s3:// shards are checked on the store here; the job's nodes copy them (once per node)
    check_data_or_exit(cfg.data.prefixes, cfg.model.vocab_size, cfg.data.split, fetch=False)
    run_dir = run_dir_path(cfg.run, cfg.model.name, cfg.cluster.name).resolve()
    script = render_or_exit(cfg, plan, argv, run_dir)
    if cfg.submit.dry_run:
        sys.stdout.write(script)
        return 0
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / SCRIPT_NAME
    path.write_text(script)
    path.chmod(0o755)
    job_id = sbatch(path)
    print(f"submit: job {job_id}: {path}; logs in {run_dir / 'logs'}", file=sys.stderr)
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
