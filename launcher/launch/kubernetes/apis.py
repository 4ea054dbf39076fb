"""The manifests of each Kubernetes API (``cluster.kubernetes_api``) around the same pod.

- ``trainjob``: a TrainingRuntime named after the job (a JobSet template that carries the stop
  contract: a TrainJob has no failure policy of its own) and the TrainJob that runs on it; the
  Trainer injects PET_* into the ``node`` container.
- ``jobset``: the same JobSet spec as a JobSet, with the PET_* variables set in the pod.
- ``pytorchjob``: a training-operator v1 PyTorchJob (Master + Workers, restartPolicy ExitCode).
"""

from __future__ import annotations

from typing import Sequence

from launcher.launch.kubernetes import contract
from launcher.launch.kubernetes.pod import NODE_CONTAINER, container, pet_env, pod_spec

TRAINER_API = "trainer.kubeflow.org/v1alpha1"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PYTORCHJOB_API = "kubeflow.org/v1"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
REPLICATED_JOB = "node"


def metadata(cfg, name: str, kind_labels: dict | None = None, queued: bool = True) -> dict:
    """Name, namespace and labels (the run's, and Kueue's queue when cluster.queue is set and
    the document is the one Kueue admits)."""
    labels = {"app.kubernetes.io/name": "trainwright", "trainwright/run": name,
              **(kind_labels or {})}
    if cfg.cluster.queue and queued:
        labels[KUEUE_QUEUE_LABEL] = cfg.cluster.queue
    return {"name": name, "namespace": cfg.cluster.namespace, "labels": labels}


def pod_template(cfg, plan, overrides: Sequence[str], name: str, *, container_name: str,
                 extra_env: Sequence[dict] = (), extra_args: Sequence[str] = ()) -> dict:
    """A PodTemplateSpec with the agent container."""
    main = container(cfg, plan, overrides, container_name, rdzv_id=name, extra_env=extra_env,
                     jobset=container_name == NODE_CONTAINER)
    if extra_args:
        split = main["args"].index("--")
        main["args"][split:split] = list(extra_args)
    return {"metadata": {"labels": {"trainwright/run": name}},
            "spec": pod_spec(cfg, plan, main)}


def jobset_spec(cfg, plan, template: dict) -> dict:
    """One replicated Job of ``nodes`` indexed pods, with the contract's failure policies."""
    job = contract.job_spec(template, plan.machines.nodes, NODE_CONTAINER)
    return {"failurePolicy": contract.jobset_failure_policy(cfg.resilience.restarts_in_job),
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {
                "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}}, "spec": job}}]}


def trainjob(cfg, plan, overrides: Sequence[str], name: str) -> list[dict]:
    """The TrainingRuntime and the TrainJob."""
    template = pod_template(cfg, plan, overrides, name, container_name=NODE_CONTAINER)
    runtime = {"apiVersion": TRAINER_API, "kind": "TrainingRuntime",
               "metadata": metadata(cfg, name, {"trainer.kubeflow.org/framework": "torch"},
                                    queued=False),  # Kueue admits the TrainJob
               "spec": {"mlPolicy": {"numNodes": plan.machines.nodes, "torch": {}},
                        "template": {"spec": jobset_spec(cfg, plan, template)}}}
    spec = {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                           "name": name},
            "trainer": {"numNodes": plan.machines.nodes,
                        "numProcPerNode": plan.machines.gpus_per_node}}
    if cfg.cluster.queue:
        spec["suspend"] = True
    job = {"apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": metadata(cfg, name),
           "spec": spec}
    return [runtime, job]


def jobset(cfg, plan, overrides: Sequence[str], name: str) -> list[dict]:
    """A JobSet whose pods find the first one through JobSet's headless Service."""
    master = f"{name}-{REPLICATED_JOB}-0-0.{name}"
    env = pet_env(plan.machines.nodes, plan.machines.gpus_per_node, master, cfg.launch.rdzv_port)
    template = pod_template(cfg, plan, overrides, name, container_name=NODE_CONTAINER,
                            extra_env=env)
    spec = jobset_spec(cfg, plan, template)
    if cfg.cluster.queue:
        spec["suspend"] = True
    return [{"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": metadata(cfg, name),
             "spec": spec}]


def pytorchjob(cfg, plan, overrides: Sequence[str], name: str) -> list[dict]:
    """A PyTorchJob: the operator injects PET_*; 75 leaves the pod as 138 (retryable)."""
    template = pod_template(cfg, plan, overrides, name, container_name="pytorch",
                            extra_args=[f"--requeue-exit={contract.PYTORCHJOB_REQUEUE_EXIT}"])
    replicas = {"Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": template}}
    if plan.machines.nodes > 1:
        replicas["Worker"] = {"replicas": plan.machines.nodes - 1, "restartPolicy": "ExitCode",
                              "template": template}
    run_policy = {"backoffLimit": cfg.resilience.restarts_in_job, "cleanPodPolicy": "All"}
    if cfg.cluster.queue:
        run_policy["suspend"] = True
    return [{"apiVersion": PYTORCHJOB_API, "kind": "PyTorchJob", "metadata": metadata(cfg, name),
             "spec": {"nprocPerNode": str(plan.machines.gpus_per_node), "runPolicy": run_policy,
                      "pytorchReplicaSpecs": replicas}}]


RENDERERS = {"trainjob": trainjob, "jobset": jobset, "pytorchjob": pytorchjob}
"""cluster.kubernetes_api -> the function returning its manifests."""
