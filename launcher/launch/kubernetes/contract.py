"""The stop contract (launcher.core.exits) as Kubernetes failure policies.

| the training process | Slurm (launcher.launch.sbatch) | Kubernetes (JobSet, TrainJob) |
|---|---|---|
| 75: saved after a stop signal | requeue, up to cluster.max_restarts | restart the whole job, not counted |
| 2 config error, 3 non-finite loss | fail | fail the job at once |
| evicted, preempted, node drained | requeue (75) | restart the whole job, not counted |
| anything else (after in-job restarts) | fail | restart the whole job, up to resilience.restarts_in_job |

On a JobSet (and the one a TrainJob's runtime creates) the Job's ``podFailurePolicy`` turns the
codes and the disruption into Job failures whose message names the rule, and the JobSet's
``failurePolicy`` picks the action from that message; the Job's ``backoffLimit`` is 0, so any
other failed pod fails the Job, which JobSet restarts and counts against ``maxRestarts``.

A PyTorchJob (restartPolicy ExitCode) can only say "1-127 permanent, 128-255 retryable", for
each pod alone: 75 is passed as 138 (retryable, and counted in ``backoffLimit`` like any retry),
2 and 3 stay permanent, and so does a crash with exit 1, which the contract would restart.
"""

from __future__ import annotations

from launcher.core.exits import PERMANENT_EXITS, REQUEUE_EXIT

PYTORCHJOB_REQUEUE_EXIT = 138
"""What the agent exits with instead of 75 under a PyTorchJob: in the training-operator's
ExitCode policy every code from 128 up is retryable (138 is the one its docs leave to users)."""

RULES = (
    # (name, podFailurePolicy rule, JobSet action)
    ("NeverRetry", {"onExitCodes": {"operator": "In", "values": list(PERMANENT_EXITS)}},
     "FailJobSet"),
    ("StoppedForRequeue", {"onExitCodes": {"operator": "In", "values": [REQUEUE_EXIT]}},
     "RestartJobSetAndIgnoreMaxRestarts"),
    ("Disrupted", {"onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
     "RestartJobSetAndIgnoreMaxRestarts"),
)
"""Each contract rule: a FailJob rule of the Job, and what the JobSet does when the Job fails
by it. The Job controller writes "... matching FailJob rule at index <i>" into the Job's
failure message, which is what the JobSet rule matches on."""


def pod_failure_policy(container: str) -> dict:
    """The Job's podFailurePolicy: every contract rule fails the Job, naming its index."""
    rules = []
    for _, rule, _ in RULES:
        rule = {k: (dict(v, containerName=container) if k == "onExitCodes" else v)
                for k, v in rule.items()}
        rules.append({"action": "FailJob", **rule})
    return {"rules": rules}


def jobset_failure_policy(max_restarts: int) -> dict:
    """The JobSet's failurePolicy: the contract's action for each rule's Job failure; any other
    Job failure (a pod that failed for another reason: backoffLimit 0) restarts the JobSet,
    counted against ``max_restarts``."""
    return {"maxRestarts": int(max_restarts),
            "rules": [{"name": name, "action": action,
                       "onJobFailureReasons": ["PodFailurePolicy"],
                       "onJobFailureMessagePatterns": [f"matching FailJob rule at index {i}"]}
                      for i, (name, _, action) in enumerate(RULES)]}


def job_spec(template: dict, nnodes: int, container: str) -> dict:
    """A Job of ``nnodes`` indexed pods that fails on its first failed pod (JobSet decides)."""
    return {"parallelism": nnodes, "completions": nnodes, "completionMode": "Indexed",
            "backoffLimit": 0, "podFailurePolicy": pod_failure_policy(container),
            "template": template}
