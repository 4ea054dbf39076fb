"""Check rendered manifests as an API server would on create, with no API server.

- Built-in kinds (each Job a JobSet will create, each pod template) against Kubernetes' own
  OpenAPI schemas, strictly (unknown fields are errors): ``kubernetes-validate``.
- TrainJob, TrainingRuntime and JobSet against the Kubeflow Trainer's API models
  (``kubeflow-trainer-api``): a round trip through the models must give the document back;
  the models drop unknown fields silently, so a difference names the field they dropped.
- The same kinds against the CRDs of a pinned Trainer release (``crds/``): the structural
  schema (types, required fields, enums, bounds, unknown fields) and every CEL rule
  (``x-kubernetes-validations``) that applies on create, evaluated with ``cel-python``.
  A JobSet is checked against the TrainingRuntime CRD's ``spec.template.spec``, the JobSet
  spec that release embeds.

:func:`manifest_problems` returns one line per problem, each naming the document, the field
path and the rule; an empty list means every check passed.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Sequence

import yaml

from launcher.launch.kubernetes.crd import schema_problems

TRAINER_RELEASE = "v2.3.0"
CRD_DIR = Path(__file__).resolve().parent / "crds" / f"kubeflow-trainer-{TRAINER_RELEASE}"
KUBERNETES_VERSION = "1.33.0"
"""The Kubernetes release whose schemas the built-in kinds are checked against (Job success
and pod failure policies are GA there; JobSet needs 1.27 or later)."""


def manifest_problems(documents: Sequence[dict]) -> list[str]:
    """Every problem of the rendered documents (empty: all checks passed)."""
    problems = []
    for doc in documents:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        problems += [f"{where}: {p}" for p in document_problems(doc)]
    return problems


def document_problems(doc: dict) -> list[str]:
    kind = doc.get("kind")
    problems = [f"built-in {p}" for p in builtin_problems(doc)]
    if kind in ("TrainJob", "TrainingRuntime", "JobSet"):
        problems += model_round_trip_problems(doc)
        problems += schema_problems(doc, crd_schema(kind))
    return problems


def embedded_builtins(doc: dict) -> list[dict]:
    """The built-in objects a document stands for: Jobs of a JobSet (or of a runtime's JobSet
    template), pod templates of a PyTorchJob; a built-in kind is itself."""
    kind, name = doc.get("kind"), doc.get("metadata", {}).get("name", "x")
    spec = doc.get("spec", {})
    if kind == "TrainingRuntime":
        spec = spec.get("template", {}).get("spec", {})
    if kind in ("TrainingRuntime", "JobSet"):
        return [{"apiVersion": "batch/v1", "kind": "Job",
                 "metadata": {"name": f"{name}-{rj.get('name')}-0"}, "spec": rj["template"]["spec"]}
                for rj in spec.get("replicatedJobs", [])]
    if kind == "PyTorchJob":
        return [{"apiVersion": "v1", "kind": "PodTemplate",
                 "metadata": {"name": f"{name}-{role.lower()}"}, "template": r["template"]}
                for role, r in spec.get("pytorchReplicaSpecs", {}).items()]
    if kind == "TrainJob":
        return []
    return [doc]


def builtin_problems(doc: dict) -> list[str]:
    import kubernetes_validate

    problems = []
    for obj in embedded_builtins(doc):
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}"
                           for p in exc.absolute_path)
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {path or '.'}: "
                            f"{exc.message} (Kubernetes {KUBERNETES_VERSION} schema)")
    return problems


MODELS = {"TrainJob": "TrainerV1alpha1TrainJob", "TrainingRuntime": "TrainerV1alpha1TrainingRuntime",
          "JobSet": "JobsetV1alpha2JobSet"}


def model_round_trip_problems(doc: dict) -> list[str]:
    """The fields the Trainer's API models lose (unknown to them) or reject."""
    import kubeflow_trainer_api.models as models
    from pydantic import ValidationError

    model = getattr(models, MODELS[doc["kind"]])
    try:
        back = model.from_dict(doc).to_dict()
    except ValidationError as exc:
        return [f"{MODELS[doc['kind']]}: {e['loc']}: {e['msg']}" for e in exc.errors()]
    return [f"{MODELS[doc['kind']]} has no field {path} (it would be dropped)"
            for path in lost_fields(doc, back, "")]


def lost_fields(sent: Any, back: Any, path: str) -> list[str]:
    """Paths present in ``sent`` and missing from ``back``."""
    if isinstance(sent, dict):
        back = back if isinstance(back, dict) else {}
        return [p for k, v in sent.items()
                for p in ([f"{path}.{k}"] if k not in back else lost_fields(v, back[k],
                                                                            f"{path}.{k}"))]
    if isinstance(sent, list) and isinstance(back, list):
        return [p for i, (a, b) in enumerate(zip(sent, back))
                for p in lost_fields(a, b, f"{path}[{i}]")]
    return []


@functools.lru_cache(maxsize=None)
def _crd(kind: str) -> dict:
    file = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
            "TrainingRuntime": "trainer.kubeflow.org_trainingruntimes.yaml",
            "JobSet": "trainer.kubeflow.org_trainingruntimes.yaml"}[kind]
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load((CRD_DIR / file).read_text(), Loader=loader)


def crd_schema(kind: str) -> dict:
    """The openAPIV3Schema of ``kind`` (for JobSet: the runtime's JobSet template spec)."""
    crd = _crd(kind)
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    schema = version["schema"]["openAPIV3Schema"]
    if kind == "JobSet":
        schema = _jobset_schema(schema)
    return schema


def _jobset_schema(runtime_schema: dict) -> dict:
    """A JobSet's schema: apiVersion, kind, metadata and the runtime's template spec."""
    template = runtime_schema["properties"]["spec"]["properties"]["template"]
    top = runtime_schema["properties"]
    return {"type": "object", "required": ["spec"],
            "properties": {"apiVersion": top["apiVersion"], "kind": top["kind"],
                           "metadata": {"type": "object"},
                           "spec": template["properties"]["spec"]}}
