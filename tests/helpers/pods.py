"""Run a rendered pod template as a local "pod": its own process group, running exactly the
template's command and environment, as the kubelet would start it.

What the kubelet and the Trainer would do, done here: the Trainer's PET_* variables are added
(``pet``); ``valueFrom`` is resolved (POD_IP -> 127.0.0.1, the Job's completion index, the pod's
labels, Secret references from ``secrets``); ``$(VAR)`` in command and args expands against the container's
environment and ``$$`` becomes ``$``; every volume mount path is mapped to a local folder
(``volumes``: mount path -> folder), in the working directory and in every argument and value.
The image's ``python`` is this interpreter, with this checkout importable.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.training import REPO

VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
LABEL_FIELD = re.compile(r"metadata\.labels\['([^']+)'\]")


def expand(text: str, env: dict) -> str:
    """The kubelet's expansion: ``$(VAR)`` -> its value when defined, ``$$`` -> ``$``."""
    def one(match):
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return VAR_REF.sub(one, text)


def map_paths(text: str, volumes: dict) -> str:
    for mount, local in sorted(volumes.items(), key=lambda kv: -len(kv[0])):
        text = re.sub(rf"(?<![\w/]){re.escape(mount)}(?=/|$|\s|,)", str(local), text)
    return text


def container_env(container: dict, *, index: int, pet: dict, secrets: dict,
                  volumes: dict, labels: dict) -> dict:
    """The container's environment in the order Kubernetes builds it (envFrom, then env)."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(secrets[source["secretRef"]["name"]])
    for var in [*pet_list(pet), *container.get("env", [])]:
        if "value" in var:
            env[var["name"]] = map_paths(expand(var["value"], env), volumes)
            continue
        ref = var["valueFrom"]
        if "secretKeyRef" in ref:
            env[var["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        elif ref["fieldRef"]["fieldPath"] == "status.podIP":
            env[var["name"]] = "127.0.0.1"
        elif ref["fieldRef"]["fieldPath"] == INDEX_FIELD:
            env[var["name"]] = str(index)
        elif LABEL_FIELD.fullmatch(ref["fieldRef"]["fieldPath"]):  # a missing label reads ""
            env[var["name"]] = labels.get(LABEL_FIELD.fullmatch(
                ref["fieldRef"]["fieldPath"]).group(1), "")
        else:
            raise AssertionError(f"no emulation for {ref}")
    return env


def pet_list(pet: dict) -> list:
    return [{"name": k, "value": str(v)} for k, v in pet.items()]


def start_pod(template: dict, *, index: int, pet: dict, volumes: dict, secrets: dict,
              log: Path, labels: dict | None = None) -> subprocess.Popen:
    """Start pod ``index`` of ``template`` in its own process group; stdout+stderr to ``log``.
    ``labels``: the pod's labels beyond the template's (what JobSet adds: its uid, the restart
    attempt)."""
    spec = template["spec"]
    assert len(spec["containers"]) == 1 and not spec.get("initContainers")
    container = spec["containers"][0]
    labels = {**template.get("metadata", {}).get("labels", {}), **(labels or {})}
    env = container_env(container, index=index, pet=pet, secrets=secrets, volumes=volumes,
                        labels=labels)
    argv = [map_paths(expand(a, env), volumes) for a in container["command"] + container["args"]]
    assert argv[0] == "python", argv
    argv[0] = sys.executable
    workdir = Path(map_paths(container["workingDir"], volumes))
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    with open(log, "w") as out:
        return subprocess.Popen(argv, cwd=workdir, env={**base, **env}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
