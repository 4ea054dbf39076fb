"""Check the rendered manifests, keep them in the run directory and create them with kubectl."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from launcher.core.atomic import atomic_write_text
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.launch.kubernetes import to_yaml
from launcher.launch.kubernetes.checks import manifest_problems

MANIFEST_NAME = "kubernetes.yaml"
"""File name of the rendered manifests inside the run directory."""
KUBECTL_ENV = "TRAINWRIGHT_KUBECTL"
"""The kubectl to run (default: ``kubectl`` on PATH)."""


def checked_yaml_or_exit(documents: Sequence[dict]) -> str:
    """The documents as YAML, or exit 2 listing what an API server would refuse."""
    problems = manifest_problems(documents)
    if problems:
        print(f"submit: {len(problems)} problem(s) in the rendered manifests (nothing was "
              "written or sent):", file=sys.stderr)
        for problem in problems:
            print(f"- {problem}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
    return to_yaml(documents)


def create(text: str, run_dir: Path, namespace: str) -> Path:
    """Write ``<run_dir>/kubernetes.yaml`` and ``kubectl create`` it (SystemExit(1) with
    kubectl's message when it fails)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MANIFEST_NAME
    atomic_write_text(path, text)
    command = [os.environ.get(KUBECTL_ENV, "kubectl"), "create", "-n", namespace, "-f", str(path)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"submit: {shlex.join(command)} failed: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if proc.returncode != 0:
        print(f"submit: kubectl exited {proc.returncode}: {proc.stderr.strip()}\n"
              f"submit: the manifests are in {path}; if the job exists already, "
              f"`kubectl delete -f {path}` first", file=sys.stderr)
        raise SystemExit(1)
    sys.stderr.write(proc.stdout)
    return path


def follow_hint(kind: str, name: str, namespace: str, nodes: int) -> str:
    """How to watch the job and read its pods' logs."""
    return (f"watch: kubectl -n {namespace} get {kind.lower()} {name} -w\n"
            f"logs:  kubectl -n {namespace} logs -f -l trainwright/run={name} --prefix "
            f"--max-log-requests={max(nodes, 5)}")
