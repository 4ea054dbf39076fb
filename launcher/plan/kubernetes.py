"""Checks of a ``cluster.launcher=kubernetes`` config before anything is rendered: the image,
the names Kubernetes will check, the volumes, where the run directory lands inside the pod, and
no secret as a plain value. Each problem names its keys and the fix (the plan exits 2)."""

from __future__ import annotations

import posixpath
import re

from launcher.config import ClusterConfig, LoggerConfig, RunConfig
from launcher.core.objectstore import is_remote
from launcher.core.problems import Problem
from launcher.core.secrets import is_secret_env_name

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
"""RFC 1123 label: volume names, namespaces, claim and Secret names (at most 63 characters)."""
QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)([KMGTPE]i|[kMGTPE]|m|e\d+)?")
"""A Kubernetes resource quantity (256Gi, 1600Gi, 512M, 8)."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
SHM_VOLUME = "dshm"
"""The in-memory /dev/shm volume every pod gets (launcher.launch.kubernetes.pod); no
cluster.volumes entry may take its name."""


def pod_run_root(cluster: ClusterConfig, run: RunConfig) -> str | None:
    """Where ``run.output_root`` is inside the pod (None: relative to an unknown directory)."""
    if posixpath.isabs(run.output_root):
        return posixpath.normpath(run.output_root)
    if not cluster.working_dir:
        return None
    return posixpath.normpath(posixpath.join(cluster.working_dir, run.output_root))


def run_volume(cluster: ClusterConfig, root: str):
    """The writable volume holding ``root`` (the innermost mount), or None."""
    holding = [v for v in cluster.volumes if not v.read_only and
               (root == v.mount_path.rstrip("/") or root.startswith(v.mount_path.rstrip("/") + "/"))]
    return max(holding, key=lambda v: len(v.mount_path), default=None)


def kubernetes_problems(cluster: ClusterConfig, run: RunConfig,
                        checkpoint_uri: str = "") -> list[Problem]:
    """Every problem of a Kubernetes cluster config (none for other launchers);
    ``checkpoint_uri``: trainer.checkpoint_uri (on an object store the checkpoints outlive the
    pod, so the run directory may be on the container's disk)."""
    if cluster.launcher != "kubernetes":
        return []
    run_dir = [] if is_remote(checkpoint_uri) and pod_run_root(cluster, run) is not None \
        else _run_dir_problems(cluster, run)
    return (_image_and_names(cluster) + _volume_problems(cluster) + run_dir
            + _env_problems(cluster) + _scheduling_problems(cluster))


def kubernetes_warnings(cluster: ClusterConfig, logger: LoggerConfig) -> list[str]:
    """Worth a word: logger=wandb in pods that get no WANDB_API_KEY from a Secret (it may come
    from the image or an envFrom Secret, so this is not a refusal)."""
    if cluster.launcher != "kubernetes" or logger.name != "wandb" or cluster.env_from_secrets \
            or any(s.name == "WANDB_API_KEY" for s in cluster.secret_env):
        return []
    return ["logger=wandb, but no Secret gives the pods WANDB_API_KEY: add cluster.secret_env="
            "[{name: WANDB_API_KEY, secret: <Secret name>, key: <key>}] (or "
            "cluster.env_from_secrets), or set logger.mode=offline: wandb cannot log in "
            "from the pods without it"]


def _image_and_names(c: ClusterConfig) -> list[Problem]:
    problems = []
    if not c.container_image.strip() or any(ch.isspace() for ch in c.container_image):
        problems.append(Problem(("cluster.container_image",), (
            f"cluster.container_image={c.container_image!r}: a Kubernetes pod needs an image "
            "with this project installed; set cluster.container_image=<registry>/<image>:<tag>")))
    names = [("cluster.service_account", c.service_account),
             ("cluster.priority_class", c.priority_class)]
    names += [("cluster.image_pull_secrets", s) for s in c.image_pull_secrets]
    names += [("cluster.env_from_secrets", s) for s in c.env_from_secrets]
    for key, value in names:
        if value and not _dns_name(value):
            problems.append(Problem((key,), (
                f"{key}={value!r} is not a Kubernetes name (lower case letters, digits, '-' and "
                "'.', starting and ending with a letter or digit, at most 253 characters)")))
    if not _dns_label(c.namespace):
        problems.append(Problem(("cluster.namespace",), (
            f"cluster.namespace={c.namespace!r} is not a namespace name (a DNS label: lower case "
            "letters, digits and '-', at most 63 characters); e.g. cluster.namespace=default")))
    for key, value in (("cluster.shm_size", c.shm_size), ("cluster.pod_memory", c.pod_memory)):
        if value and not QUANTITY.fullmatch(str(value)):
            problems.append(Problem((key,), (
                f"{key}={value!r} is not a Kubernetes quantity; write e.g. 64Gi or 512G")))
    if not str(c.shm_size):
        problems.append(Problem(("cluster.shm_size",), (
            "cluster.shm_size is empty: without an in-memory /dev/shm the pod gets Kubernetes' "
            "64 MB, too little for NCCL and DataLoader workers; set e.g. cluster.shm_size=64Gi")))
    return problems


def _volume_problems(c: ClusterConfig) -> list[Problem]:
    problems, seen_names, seen_paths = [], set(), set()
    for i, v in enumerate(c.volumes):
        key = f"cluster.volumes[{i}]"
        if not _dns_label(v.name) or v.name == SHM_VOLUME:
            problems.append(Problem((f"{key}.name",), (
                f"{key}.name={v.name!r} must be a DNS label (lower case letters, digits, '-') "
                f"other than {SHM_VOLUME!r} (the renderer's /dev/shm volume)")))
        if not _dns_name(v.claim):
            problems.append(Problem((f"{key}.claim",), (
                f"{key}.claim={v.claim!r} is not a PersistentVolumeClaim name")))
        if not posixpath.isabs(v.mount_path) or v.mount_path.rstrip("/") in ("", "/dev/shm"):
            problems.append(Problem((f"{key}.mount_path",), (
                f"{key}.mount_path={v.mount_path!r} must be an absolute path other than / and "
                "/dev/shm")))
        for seen, value, what in ((seen_names, v.name, "name"),
                                  (seen_paths, v.mount_path.rstrip("/"), "mount_path")):
            if value in seen:
                problems.append(Problem((f"{key}.{what}",), (
                    f"{key}.{what}={value!r} is used by another volume; each must be unique")))
            seen.add(value)
    if c.working_dir and not posixpath.isabs(c.working_dir):
        problems.append(Problem(("cluster.working_dir",), (
            f"cluster.working_dir={c.working_dir!r} must be an absolute path in the container "
            "(or empty for the image's own)")))
    return problems


def _run_dir_problems(c: ClusterConfig, run: RunConfig) -> list[Problem]:
    root = pod_run_root(c, run)
    writable = [v for v in c.volumes if not v.read_only]
    fix = (f"set run.output_root={writable[0].mount_path.rstrip('/')}/outputs (volume "
           f"{writable[0].name!r}, claim {writable[0].claim!r})" if writable else
           "add a writable volume to cluster.volumes (a PersistentVolumeClaim) and set "
           "run.output_root under its mount_path")
    if root is None:
        return [Problem(("run.output_root", "cluster.working_dir"), (
            f"run.output_root={run.output_root!r} is relative and cluster.working_dir is empty, "
            f"so the run directory's place in the pod is unknown; {fix}"))]
    if run_volume(c, root) is None:
        return [Problem(("run.output_root", "cluster.volumes"), (
            f"run.output_root={run.output_root!r} is {root} in the pod, on the container's own "
            "disk, which is lost with the pod (a restarted pod could not resume and the "
            f"checkpoints would be gone); {fix}"))]
    return []


def _env_problems(c: ClusterConfig) -> list[Problem]:
    problems = []
    for name in c.env:
        if not ENV_NAME.fullmatch(name):
            problems.append(Problem((f"cluster.env.{name}",), (
                f"cluster.env: {name!r} is not an environment variable name")))
        elif is_secret_env_name(name):
            problems.append(Problem((f"cluster.env.{name}",), (
                f"cluster.env.{name} looks like a secret and would be written into the manifest "
                f"as plain text; remove it and add cluster.secret_env=[{{name: {name}, secret: "
                "<Secret name>, key: <key in it>}] (only the reference is written)")))
    for i, s in enumerate(c.secret_env):
        if not ENV_NAME.fullmatch(s.name) or not _dns_name(s.secret) or not s.key:
            problems.append(Problem((f"cluster.secret_env[{i}]",), (
                f"cluster.secret_env[{i}]={{name: {s.name!r}, secret: {s.secret!r}, key: "
                f"{s.key!r}}}: name must be a variable name, secret a Secret's name and key "
                "non-empty")))
    return problems


def _scheduling_problems(c: ClusterConfig) -> list[Problem]:
    problems = []
    for i, t in enumerate(c.tolerations):
        if t.operator not in TOLERATION_OPERATORS or t.effect not in TOLERATION_EFFECTS \
                or (t.operator == "Exists" and t.value) or (t.operator == "Equal" and not t.key):
            problems.append(Problem((f"cluster.tolerations[{i}]",), (
                f"cluster.tolerations[{i}]: operator={t.operator!r} effect={t.effect!r} "
                f"key={t.key!r} value={t.value!r}; operator is one of "
                f"{', '.join(TOLERATION_OPERATORS)} (Exists takes no value, Equal needs a key), "
                f"effect one of {', '.join(e or '(empty)' for e in TOLERATION_EFFECTS)}")))
    if c.termination_grace_s < 0:
        problems.append(Problem(("cluster.termination_grace_s",), (
            f"cluster.termination_grace_s={c.termination_grace_s} must be >= 0 (0 = from the "
            "plan's step and save times)")))
    return problems


def _dns_label(value: str) -> bool:
    return len(value) <= 63 and bool(DNS_LABEL.fullmatch(value))


def _dns_name(value: str) -> bool:
    return len(value) <= 253 and all(_dns_label(part) for part in value.split("."))
