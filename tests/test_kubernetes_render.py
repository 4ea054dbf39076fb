"""``launcher.submit`` for Kubernetes without a cluster: what each API renders, that every document
passes the checks an API server would make (and that the checks catch what a server refuses),
the stop contract as the Job and JobSet controllers would apply it, config errors with exit 2,
secrets only as references, overrides passed through the kubelet's expansion unchanged.
The rendered pods really running are tests/test_kubernetes_pods.py."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.compose import compose_config, to_object
from launcher.core.exits import PERMANENT_EXITS, REQUEUE_EXIT
from launcher.launch.kubernetes import render as render_documents
from launcher.launch.kubernetes.checks import manifest_problems
from launcher.launch.kubernetes.contract import PYTORCHJOB_REQUEUE_EXIT
from launcher.launch.kubernetes.pod import job_name
from launcher.plan import plan_or_exit
from tests.helpers.pods import expand
from tests.helpers.submit import HOSTILE, hydra_quote

REPO = Path(__file__).resolve().parent.parent
APIS = ("trainjob", "jobset", "pytorchjob")
EIGHT_B = ("experiment=llama3_8b_1x8_h100", "cluster=k8s_h100")


def submit(tmp: Path, *overrides: str, env: dict | None = None, dry_run: bool = True):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "launcher.submit", *overrides,
                           *(["submit.dry_run=true"] if dry_run else [])], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=120)


def rendered(*overrides: str) -> list[dict]:
    """The documents of a config, in this process."""
    cfg = to_object(compose_config(list(overrides)))
    return render_documents(cfg, plan_or_exit(cfg), list(overrides), "run")


def pod_templates(doc: dict) -> list[dict]:
    spec = doc["spec"]
    if doc["kind"] == "TrainingRuntime":
        spec = spec["template"]["spec"]
    if doc["kind"] in ("TrainingRuntime", "JobSet"):
        return [rj["template"]["spec"]["template"] for rj in spec["replicatedJobs"]]
    if doc["kind"] == "PyTorchJob":
        return [r["template"] for r in spec["pytorchReplicaSpecs"].values()]
    return []


def jobs(docs: list[dict]) -> list[dict]:
    return [rj["template"]["spec"] for d in docs if d["kind"] in ("TrainingRuntime", "JobSet")
            for rj in (d["spec"]["template"]["spec"] if d["kind"] == "TrainingRuntime"
                       else d["spec"])["replicatedJobs"]]


@pytest.mark.parametrize("api", APIS)
def test_8b_experiment_renders_valid_documents_for_each_api(tmp_path, api):
    proc = submit(tmp_path, *EIGHT_B, f"cluster.kubernetes_api={api}")
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))  # stdout is YAML documents and nothing else
    assert [d["kind"] for d in docs] == {"trainjob": ["TrainingRuntime", "TrainJob"],
                                         "jobset": ["JobSet"], "pytorchjob": ["PyTorchJob"]}[api]
    assert manifest_problems(docs) == []
    template = pod_templates(docs[0])[0]
    main = template["spec"]["containers"][0]
    assert main["command"] == ["python", "-u", "-m", "launcher.launch.agent"]
    assert main["args"][-3:] == ["experiment=llama3_8b_1x8_h100", "cluster=k8s_h100",
                                 f"cluster.kubernetes_api={api}"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "256Gi"}} in \
        template["spec"]["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    assert main["workingDir"] == "/runs" and \
        {"name": "runs", "mountPath": "/runs"} in main["volumeMounts"]
    # the run directory's lock knows a restarted JobSet's pods from a second launch
    fields = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
              for e in main["env"]}
    if api != "pytorchjob":
        assert fields["TRAINWRIGHT_JOB_ID"] == "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"
        assert fields["TRAINWRIGHT_JOB_ATTEMPT"] == \
            "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"
    assert not (tmp_path / "outputs").exists()  # a dry run writes nothing


def test_70b_experiment_renders_2048_pods_of_8_gpus():
    for api in APIS:
        docs = rendered("experiment=llama3_70b_16k_h100", "cluster=k8s_h100",
                        f"cluster.kubernetes_api={api}")
        assert manifest_problems(docs) == []
        if api == "pytorchjob":
            replicas = docs[0]["spec"]["pytorchReplicaSpecs"]
            assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 2048
            assert docs[0]["spec"]["nprocPerNode"] == "8"
        else:
            job = jobs(docs)[0]
            assert job["parallelism"] == job["completions"] == 2048
        if api == "trainjob":
            assert docs[1]["spec"]["trainer"] == {"numNodes": 2048, "numProcPerNode": 8}
        if api == "jobset":
            env = {e["name"]: e.get("value") for e in
                   pod_templates(docs[0])[0]["spec"]["containers"][0]["env"]}
            name = docs[0]["metadata"]["name"]
            assert env["PET_NNODES"] == "2048" and env["PET_NPROC_PER_NODE"] == "8"
            assert env["PET_MASTER_ADDR"] == f"{name}-node-0-0.{name}"


# --- the stop contract, as the Job controller and the JobSet controller apply it ---------------

def job_failure(job: dict, *, exit_code: int | None = None, condition: str | None = None):
    """(reason, message) of the Job's failure when a pod fails so (the Job controller's rules:
    podFailurePolicy in order, FailJob messages in its format; else backoffLimit)."""
    for index, rule in enumerate(job["podFailurePolicy"]["rules"]):
        codes = rule.get("onExitCodes")
        if codes and exit_code is not None and (exit_code in codes["values"]) == \
                (codes["operator"] == "In"):
            assert rule["action"] == "FailJob"
            return "PodFailurePolicy", (f"Container {codes['containerName']} for pod ns/p-0 failed "
                                        f"with exit code {exit_code} matching FailJob rule at "
                                        f"index {index}")
        conditions = [c["type"] for c in rule.get("onPodConditions", [])]
        if condition in conditions:
            return "PodFailurePolicy", (f"Pod ns/p-0 has condition {condition} matching FailJob "
                                        f"rule at index {index}")
    assert job["backoffLimit"] == 0  # the first failed pod fails the Job
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def jobset_action(policy: dict, reason: str, message: str) -> tuple[str, bool]:
    """(action, counted against maxRestarts) of the JobSet's failurePolicy for a Job failure."""
    for rule in policy["rules"]:
        if reason in rule.get("onJobFailureReasons", [reason]) and any(
                re.search(p, message) for p in rule.get("onJobFailureMessagePatterns", [".*"])):
            return rule["action"], rule["action"] == "RestartJobSet"
    return "RestartJobSet", True


@pytest.mark.parametrize("api", ("trainjob", "jobset"))
def test_stop_contract_on_jobset_restarts_75_uncounted_fails_2_and_3_counts_the_rest(api):
    docs = rendered(*EIGHT_B, f"cluster.kubernetes_api={api}", "resilience.restarts_in_job=5")
    spec = docs[0]["spec"]["template"]["spec"] if api == "trainjob" else docs[0]["spec"]
    policy, job = spec["failurePolicy"], jobs(docs)[0]
    assert policy["maxRestarts"] == 5
    outcomes = {code: jobset_action(policy, *job_failure(job, exit_code=code))
                for code in (REQUEUE_EXIT, *PERMANENT_EXITS, 1, 137, 143)}
    assert outcomes[REQUEUE_EXIT] == ("RestartJobSetAndIgnoreMaxRestarts", False)
    for code in PERMANENT_EXITS:
        assert outcomes[code] == ("FailJobSet", False)
    for code in (1, 137, 143):
        assert outcomes[code] == ("RestartJobSet", True)
    assert jobset_action(policy, *job_failure(job, exit_code=137, condition="DisruptionTarget"))\
        == ("RestartJobSetAndIgnoreMaxRestarts", False)
    pod = pod_templates(docs[0])[0]["spec"]
    assert pod["restartPolicy"] == "Never"


def test_pytorchjob_passes_75_as_a_retryable_code_and_keeps_2_and_3_permanent():
    doc = rendered(*EIGHT_B, "cluster.kubernetes_api=pytorchjob", "cluster.nodes=4")[0]
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    assert {r: s["replicas"] for r, s in replicas.items()} == {"Master": 1, "Worker": 3}
    assert {s["restartPolicy"] for s in replicas.values()} == {"ExitCode"}
    main = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert main["name"] == "pytorch"
    assert f"--requeue-exit={PYTORCHJOB_REQUEUE_EXIT}" in main["args"][:main["args"].index("--")]
    # the training-operator's ExitCode policy: 1-127 permanent, 128-255 retryable
    assert PYTORCHJOB_REQUEUE_EXIT >= 128 and all(code < 128 for code in PERMANENT_EXITS)


def test_agent_exits_with_the_requeue_code_it_was_given(monkeypatch):
    from launcher.launch.agent import REQUEUE_EXIT_ENV, scheduler_exit

    def stopped():
        raise SystemExit(REQUEUE_EXIT)
    assert scheduler_exit(stopped) == REQUEUE_EXIT
    monkeypatch.setenv(REQUEUE_EXIT_ENV, str(PYTORCHJOB_REQUEUE_EXIT))
    assert scheduler_exit(stopped) == PYTORCHJOB_REQUEUE_EXIT
    assert scheduler_exit(lambda: 2) == 2 and scheduler_exit(lambda: 0) == 0


def test_grace_period_comes_from_the_plan_unless_set():
    cfg = to_object(compose_config(list(EIGHT_B)))
    plan = plan_or_exit(cfg)
    pod = pod_templates(render_documents(cfg, plan, [], "run")[0])[0]["spec"]
    expected = int(-(-2 * (plan.compute.step_time_s + plan.goodput.save_s) // 1)) + 60
    assert pod["terminationGracePeriodSeconds"] == expected > 60
    pod = pod_templates(rendered(*EIGHT_B, "cluster.termination_grace_s=900")[0])[0]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 900


# --- config errors, secrets, quoting, Kueue -----------------------------------------------------

CONFIG_ERRORS = {
    "layout does not fit the node": (
        ("experiment=llama3_70b_16k_h100", "cluster=k8s_h100", "cluster.gpus_per_node=3"),
        "tensor_parallel_size=8 and cluster.gpus_per_node=3 do not divide one another"),
    "no image": ((*EIGHT_B, "cluster.container_image="), "cluster.container_image"),
    "run dir on the container's disk": (
        (*EIGHT_B, "run.output_root=/workspace/outputs"),
        "on the container's own disk, which is lost with the pod"),
    "relative run dir, no working dir": (
        (*EIGHT_B, "cluster.working_dir="), "cluster.working_dir is empty"),
    "run dir on a read-only volume": ((*EIGHT_B, "run.output_root=/data/out"),
                                      "set run.output_root=/runs/outputs"),
    "secret as a plain variable": ((*EIGHT_B, "+cluster.env.WANDB_API_KEY=abc"),
                                   "cluster.secret_env"),
    "bad namespace": ((*EIGHT_B, "cluster.namespace=Team_A"), "cluster.namespace='Team_A'"),
    "bad shm size": ((*EIGHT_B, "cluster.shm_size=lots"), "cluster.shm_size='lots'"),
    "ranks per gpu": ((*EIGHT_B, "cluster.ranks_per_gpu=2"), "cluster.ranks_per_gpu=2"),
    "unknown api": ((*EIGHT_B, "cluster.kubernetes_api=mpijob"), "kubernetes_api"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_config_errors_exit_2_naming_the_key_and_write_nothing(tmp_path, case):
    overrides, message = CONFIG_ERRORS[case]
    proc = submit(tmp_path, *overrides)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "outputs").exists()


def test_secrets_are_references_and_their_values_never_appear(tmp_path):
    value = "wandb-secret-value-1234567890"
    proc = submit(tmp_path, *EIGHT_B, "logger=wandb",
                  "+cluster.secret_env=[{name: WANDB_API_KEY, secret: wandb, key: api-key}]",
                  "+cluster.env_from_secrets=[hf-token]", env={"WANDB_API_KEY": value})
    assert proc.returncode == 0, proc.stderr
    assert value not in proc.stdout + proc.stderr
    main = pod_templates(next(yaml.safe_load_all(proc.stdout)))[0]["spec"]["containers"][0]
    assert {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "wandb", "key": "api-key"}}} in main["env"]
    assert main["envFrom"] == [{"secretRef": {"name": "hf-token"}}]


def test_s3_checkpoints_free_the_run_dir_from_a_volume_and_take_keys_as_references(tmp_path):
    """With trainer.checkpoint_uri=s3://..., a run directory on the container's disk is allowed
    (the checkpoints outlive the pod; the same override without it is refused); the store's
    secret key is a Secret reference, its value in no manifest, the endpoint a plain variable."""
    value = "aws-secret-value-0987654321"
    common = (*EIGHT_B, "run.output_root=/workspace/outputs",
              "+cluster.secret_env=[{name: AWS_SECRET_ACCESS_KEY, secret: s3, key: secret}]",
              "+cluster.env.AWS_ENDPOINT_URL_S3=http://store.internal:8333")
    proc = submit(tmp_path, *common, "trainer.checkpoint_uri=s3://ckpts/llama-8b",
                  env={"AWS_SECRET_ACCESS_KEY": value})
    assert proc.returncode == 0, proc.stderr
    assert value not in proc.stdout + proc.stderr
    main = pod_templates(next(yaml.safe_load_all(proc.stdout)))[0]["spec"]["containers"][0]
    assert {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {
        "name": "s3", "key": "secret"}}} in main["env"]
    assert {"name": "AWS_ENDPOINT_URL_S3", "value": "http://store.internal:8333"} in main["env"]
    refused = submit(tmp_path, *common)
    assert refused.returncode == 2 and "lost with the pod" in refused.stderr


def test_hostile_override_reaches_the_pod_unchanged_through_the_kubelet(tmp_path):
    override = f"logger.project={hydra_quote(HOSTILE)}"
    docs = rendered(*EIGHT_B, override)
    args = pod_templates(docs[0])[0]["spec"]["containers"][0]["args"]
    env = {"POD_IP": "10.0.0.7", "HOME": "/root", "PATH": "/bin"}
    assert [expand(a, env) for a in args[args.index("--") + 1:]] == [*EIGHT_B, override]
    assert expand(args[1], env) == "--local-addr=10.0.0.7"


@pytest.mark.parametrize("api", APIS)
def test_kueue_queue_labels_the_job_and_creates_it_suspended(api):
    docs = rendered(*EIGHT_B, f"cluster.kubernetes_api={api}", "cluster.queue=team-a")
    job = docs[-1]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    suspended = job["spec"]["runPolicy"]["suspend"] if api == "pytorchjob" \
        else job["spec"]["suspend"]
    assert suspended is True and manifest_problems(docs) == []


def test_job_names_are_dns_labels_that_fit_every_derived_name():
    assert job_name("llama3_8b_1x8_h100") == "tw-llama3-8b-1x8-h100"
    long_a, long_b = "x" * 80 + "_a", "x" * 80 + "_b"
    assert len(job_name(long_a)) <= 40 and job_name(long_a) != job_name(long_b)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job_name("__Weird.Name__"))


# --- the checks fail where an API server would refuse --------------------------------------------

def _mutations(docs):
    runtime, trainjob = docs
    pod = pod_templates(runtime)[0]["spec"]
    yield "unknown pod field", lambda: pod["containers"][0].__setitem__("gpus", 8), "gpus"
    yield "unknown TrainJob field", lambda: trainjob["spec"]["trainer"].__setitem__(
        "numGPUs", 8), "numGPUs"
    yield "TrainJob name", lambda: trainjob["metadata"].__setitem__("name", "Bad_Name"), \
        "RFC 1035"
    yield "numProcPerNode 0", lambda: trainjob["spec"]["trainer"].__setitem__(
        "numProcPerNode", 0), "greater than or equal to 1"
    yield "JobSet action", lambda: runtime["spec"]["template"]["spec"]["failurePolicy"][
        "rules"][0].__setitem__("action", "Explode"), "Explode"
    yield "two ML policies", lambda: runtime["spec"]["mlPolicy"].__setitem__("mpi", {}), \
        "Only one of the policy"
    yield "env without a name", lambda: pod["containers"][0]["env"].append({"value": "x"}), \
        "'name' is a required property"


def test_checks_refuse_what_an_api_server_would():
    names = [name for name, _, _ in _mutations(rendered(*EIGHT_B))]
    for name in names:
        docs = copy.deepcopy(rendered(*EIGHT_B))
        mutate, expected = next((m, e) for n, m, e in _mutations(docs) if n == name)
        mutate()
        problems = manifest_problems(docs)
        assert any(expected in p for p in problems), (name, problems)


def test_readme_shows_the_8b_trainjob_as_rendered_today(tmp_path):
    readme = (REPO / "README.md").read_text()
    proc = submit(tmp_path, *EIGHT_B)
    assert proc.returncode == 0, proc.stderr
    runtime, trainjob = proc.stdout.split("---\n")
    for marker, text in (("k8s-trainjob", trainjob), ("k8s-runtime", runtime)):
        block = readme.split(f"<!-- {marker}:begin -->\n```yaml\n")[1].split("```")[0]
        assert block == text, f"README's {marker} block is stale: re-render it"


def test_wandb_without_a_key_secret_is_a_plan_warning():
    cfg = to_object(compose_config([*EIGHT_B, "logger=wandb"]))
    assert any("WANDB_API_KEY" in w for w in plan_or_exit(cfg).warnings)
    cfg = to_object(compose_config([*EIGHT_B, "logger=wandb", "+cluster.secret_env=[{name: "
                                    "WANDB_API_KEY, secret: wandb, key: api-key}]"]))
    assert not any("WANDB_API_KEY" in w for w in plan_or_exit(cfg).warnings)


KUBECTL = """#!/bin/sh
# kubectl's stand-in (no API server here): records its arguments and the file it was given
echo "$@" > "$KUBECTL_LOG"
[ -n "$KUBECTL_FAIL" ] && { echo 'Error from server (AlreadyExists): trainjobs "x" already exists' >&2; exit 1; }
echo "trainingruntime.trainer.kubeflow.org/tw-k created"
echo "trainjob.trainer.kubeflow.org/tw-k created"
"""


def test_submit_writes_the_manifests_then_creates_them_with_kubectl(tmp_path):
    kubectl, log = tmp_path / "kubectl", tmp_path / "kubectl.args"
    kubectl.write_text(KUBECTL)
    kubectl.chmod(0o755)
    env = {"TRAINWRIGHT_KUBECTL": str(kubectl), "KUBECTL_LOG": str(log)}
    proc = submit(tmp_path, *EIGHT_B, "run.name=k", "cluster.namespace=team-a", env=env,
                  dry_run=False)
    assert proc.returncode == 0, proc.stderr
    manifest = tmp_path / "outputs" / "k" / "kubernetes.yaml"
    assert proc.stdout == "tw-k\n"
    assert log.read_text().split() == ["create", "-n", "team-a", "-f", str(manifest)]
    docs = list(yaml.safe_load_all(manifest.read_text()))
    assert [d["kind"] for d in docs] == ["TrainingRuntime", "TrainJob"]
    assert "kubectl -n team-a get trainjob tw-k -w" in proc.stderr
    assert "logs -f -l trainwright/run=tw-k" in proc.stderr
    proc = submit(tmp_path, *EIGHT_B, "run.name=k", env={**env, "KUBECTL_FAIL": "1"},
                  dry_run=False)
    assert proc.returncode == 1 and "AlreadyExists" in proc.stderr
    assert f"kubectl delete -f {manifest}" in proc.stderr
