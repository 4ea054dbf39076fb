"""The pod template every Kubernetes API gets: one pod per node, running one elastic agent
(``python -m launcher.launch.agent``, torchrun's counterpart with the stop contract) that
starts ``cluster.gpus_per_node`` training processes with the submitted overrides.

The agent reads the node count, processes per node and rendezvous endpoint from the PET_*
variables (set by the Trainer, the training-operator, or :func:`pet_env` for a bare JobSet);
its own address comes from the downward API (POD_IP). Volumes are the cluster's
PersistentVolumeClaims plus an in-memory /dev/shm; secrets appear only as references.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Sequence

from launcher.core.locks import JOB_ATTEMPT_ENV, JOB_ID_ENV
from launcher.plan.kubernetes import SHM_VOLUME

NODE_CONTAINER = "node"
"""The container's name: the Trainer injects PET_* only into the container named ``node``."""
RDZV_PORT_NAME = "c10d"
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"
JOBSET_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
"""Labels JobSet puts on every pod: the JobSet's uid, and how many times it was restarted."""
MAX_JOB_NAME = 40
"""Job names are kept short enough for every derived name (JobSet's
``<name>-node-0-0`` pods, the TrainJob's 63-character limit, the headless Service)."""


def job_name(run_name: str) -> str:
    """A DNS-1035 label for the run (``llama3_8b_1x8_h100`` -> ``tw-llama3-8b-1x8-h100``);
    names cut to length keep a hash of the whole."""
    base = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-") or "run"
    name = f"tw-{base}"
    if len(name) > MAX_JOB_NAME:
        digest = hashlib.sha256(run_name.encode()).hexdigest()[:6]
        name = f"{name[:MAX_JOB_NAME - 7].rstrip('-')}-{digest}"
    return name


def kubelet_escape(arg: str) -> str:
    """``$`` -> ``$$``: the kubelet expands ``$(VAR)`` in command and args and turns ``$$`` into
    ``$``, so an override is passed through exactly as given."""
    return arg.replace("$", "$$")


def grace_seconds(cluster, step_time_s: float, save_s: float) -> int:
    """terminationGracePeriodSeconds: cluster.termination_grace_s, else enough for the stop to
    finish its step and save twice over, plus a minute for the processes to exit."""
    if cluster.termination_grace_s > 0:
        return int(cluster.termination_grace_s)
    return int(math.ceil(2 * (step_time_s + save_s))) + 60


def container(cfg, plan, overrides: Sequence[str], name: str, rdzv_id: str,
              extra_env: Sequence[dict] = (), jobset: bool = True) -> dict:
    """The training container: the agent, its environment, resources and mounts."""
    c = cfg.cluster
    spec = {"name": name, "image": c.container_image, "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-u", "-m", "launcher.launch.agent"],
            "args": [f"--rdzv-id={rdzv_id}", "--local-addr=$(POD_IP)", "--",
                     *(kubelet_escape(o) for o in overrides)],
            "env": [*extra_env, *environment(c, jobset)],
            "ports": [{"name": RDZV_PORT_NAME, "containerPort": cfg.launch.rdzv_port}],
            "resources": resources(c, plan),
            "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}] + [
                {"name": v.name, "mountPath": v.mount_path, **({"readOnly": True}
                                                              if v.read_only else {})}
                for v in c.volumes]}
    if c.env_from_secrets:
        spec["envFrom"] = [{"secretRef": {"name": s}} for s in c.env_from_secrets]
    if c.working_dir:
        spec["workingDir"] = c.working_dir
    return spec


def environment(c, jobset: bool) -> list[dict]:
    """POD_IP (downward API), unbuffered Python, the job's identity (JobSet's uid and restart
    attempt, for the run directory's lock: launcher.core.locks), cluster.env, then the Secret
    references."""
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if jobset:
        env += [{"name": JOB_ID_ENV, "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.labels['{JOBSET_UID_LABEL}']"}}},
                {"name": JOB_ATTEMPT_ENV, "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.labels['{JOBSET_ATTEMPT_LABEL}']"}}}]
    env += [{"name": k, "value": str(v)} for k, v in c.env.items()]
    env += [{"name": s.name, "valueFrom": {"secretKeyRef": {"name": s.secret, "key": s.key}}}
            for s in c.secret_env]
    return env


def pet_env(nnodes: int, nproc_per_node: int, master_addr: str, port: int) -> list[dict]:
    """The variables Kubeflow's Trainer injects for torchrun, for a JobSet without it (the
    node rank is the Job's completion index)."""
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    return [{"name": "PET_NNODES", "value": str(nnodes)},
            {"name": "PET_NPROC_PER_NODE", "value": str(nproc_per_node)},
            {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": index}}},
            {"name": "PET_MASTER_ADDR", "value": master_addr},
            {"name": "PET_MASTER_PORT", "value": str(port)}]


def resources(c, plan) -> dict:
    """CPU request (cpus_per_task per process), memory request = limit, the GPUs as limits."""
    requests, limits = {}, {}
    if c.cpus_per_task:
        requests["cpu"] = str(c.cpus_per_task * plan.machines.gpus_per_node)
    if c.pod_memory:
        requests["memory"] = limits["memory"] = c.pod_memory
    if plan.machines.gpu.lower() != "cpu":
        requests[c.gpu_resource] = limits[c.gpu_resource] = str(plan.machines.gpus_per_node)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def pod_spec(cfg, plan, main: dict, restart_policy: str = "Never") -> dict:
    """The pod spec around ``main``: volumes, grace period, scheduling, identity."""
    c = cfg.cluster
    grace = grace_seconds(c, plan.compute.step_time_s,
                          plan.goodput.save_s if plan.goodput else 0.0)
    spec = {"restartPolicy": restart_policy, "terminationGracePeriodSeconds": grace,
            "containers": [main],
            "volumes": [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                          "sizeLimit": c.shm_size}}] + [
                {"name": v.name, "persistentVolumeClaim": {
                    "claimName": v.claim, **({"readOnly": True} if v.read_only else {})}}
                for v in c.volumes]}
    optional = {"nodeSelector": dict(c.node_selector) or None,
                "tolerations": [toleration(t) for t in c.tolerations] or None,
                "priorityClassName": c.priority_class or None,
                "serviceAccountName": c.service_account or None,
                "imagePullSecrets": [{"name": s} for s in c.image_pull_secrets] or None}
    spec.update({k: v for k, v in optional.items() if v is not None})
    return spec


def toleration(t) -> dict:
    out = {"operator": t.operator}
    out.update({k: v for k, v in (("key", t.key), ("value", t.value), ("effect", t.effect)) if v})
    return out
