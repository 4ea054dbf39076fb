"""The run directory: where a run's config, plan, environment, metrics and checkpoints live.

``<run.output_root>/<run.name or <model>_<cluster>>`` is a pure function of the config, so a
requeued or restarted job finds its own directory (and its latest checkpoint and wandb run id)
again. Rank 0 calls :func:`prepare_run_dir` once per start:

    run_dir/
      config.yaml   resolved config, secrets redacted   } of the last start that got going
      plan.json     the pre-flight plan (Plan.to_dict()) } (a restart rewrites them only once
      data.json     the data the run reads              } its checkpoint loaded)
      configs/      every restart's config (launcher.runtime.confighistory)
      env.json      library versions, git SHA, hosts, rank variables, CUDA availability
      checkpoints/  written by the checkpoint module
      logs/         per-rank logs

Nothing is written un-redacted: :func:`redact` blanks values under secret-looking keys and every
occurrence of a secret environment variable's value inside any string.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path, PurePath
from typing import Any, Mapping

import yaml

from launcher.core.secrets import ALWAYS_SECRET_ENV, SECRET_ENV_NAME_RE
from launcher.config import RunConfig
from launcher.core.atomic import atomic_write_json, atomic_write_text
from launcher.plan.validate import names_a_run_dir
from launcher.runtime.confighistory import record_attempt

REDACTED = "<redacted>"
"""What a secret is replaced with."""

SECRET_KEY_RE = re.compile(
    r"(?:^|[_.\-])(?:api_?key|access_?key|private_?key|token|secret|password|passwd|"
    r"credentials?)(?:$|[_.\-])", re.IGNORECASE)
"""A config key whose (non-numeric) value is a secret: a word ``token``, ``api_key``, ``secret``,
``password``, ``passwd``, ``credential(s)`` (``hf_token``, ``wandb.api_key``, ``db-password``).
Keys such as ``train_tokens`` or ``tokenizer_path`` do not match, and numbers, booleans and null
under a matching key (``eod_token_id: 0``) are kept, since they cannot be credentials."""

TOKEN_FORMAT_RE = re.compile(
    r"\bhf_[A-Za-z0-9]{30,}|\bsk-[A-Za-z0-9_\-]{20,}|\bgh[pousr]_[A-Za-z0-9]{30,}"
    r"|\bxox[abprs]-[A-Za-z0-9\-]{10,}|\bAKIA[0-9A-Z]{16}\b|\bglpat-[A-Za-z0-9_\-]{20,}")
"""Values that look like known access tokens (Hugging Face, OpenAI, GitHub, Slack, AWS access
key ids, GitLab), redacted wherever they appear, whatever variable or key holds them."""

MIN_SECRET_LEN = 8
"""Shorter environment values (``1``, ``false``) are too common to be treated as secrets."""

RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID",
            "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NTASKS_PER_NODE",
            "SLURM_RESTART_COUNT", "CUDA_VISIBLE_DEVICES")


def run_dir_path(run: RunConfig, model_name: str, cluster_name: str) -> Path:
    """``<output_root>/<run.name or <model_name>_<cluster_name>>`` (the same on every restart)."""
    name = run.name or f"{model_name}_{cluster_name}"
    if not names_a_run_dir(name):
        raise ValueError(f"run.name={name!r} must be a relative name inside run.output_root "
                         f"(no leading '/', no '..', not '.')")
    return Path(run.output_root) / name


def secret_env_values(env: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret environment variables (≥ MIN_SECRET_LEN chars), longest first."""
    env = os.environ if env is None else env
    values = {value for name, value in env.items()
              if (name in ALWAYS_SECRET_ENV or SECRET_ENV_NAME_RE.search(name))
              and len(value) >= MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    """``text`` with every occurrence of a secret environment value, and every value that looks
    like a known token format, replaced by REDACTED."""
    for secret in secret_env_values() if secrets is None else secrets:
        text = text.replace(secret, REDACTED)
    return TOKEN_FORMAT_RE.sub(REDACTED, text)


def to_plain(obj: Any) -> Any:
    """Dataclasses, OmegaConf nodes, enums and paths turned into dicts, lists and scalars."""
    if "omegaconf" in sys.modules:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(obj):
            return to_plain(OmegaConf.to_container(obj, resolve=True, enum_to_str=True))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, PurePath):
        return str(obj)
    return obj


def redact(obj: Any, secrets: list[str] | None = None) -> Any:
    """A redacted deep copy of ``obj`` (dicts, lists, tuples, scalars; see module docstring).

    Values under secret-looking keys (SECRET_KEY_RE) become REDACTED, and so does every substring
    equal to a secret environment value (see :func:`secret_env_values`), in keys and values.
    """
    secrets = secret_env_values() if secrets is None else secrets
    if isinstance(obj, Mapping):
        return {_redact_key(k, secrets): _redact_item(k, v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, secrets) for v in obj)
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    if isinstance(obj, bytes):
        return redact_text(obj.decode("utf-8", "replace"), secrets).encode()
    return obj


def _redact_key(key: Any, secrets: list[str]) -> Any:
    return redact_text(key, secrets) if isinstance(key, str) else key


def _redact_item(key: Any, value: Any, secrets: list[str]) -> Any:
    """One mapping value: blanked under a secret key unless it is a number, bool or None."""
    numeric = value is None or isinstance(value, (bool, int, float))
    if isinstance(key, str) and SECRET_KEY_RE.search(key) and not numeric:
        return REDACTED
    return redact(value, secrets)


def redact_argv(argv: list[str]) -> list[str]:
    """Command-line words with the value of ``key=value`` overrides under secret keys blanked."""
    out = []
    for word in argv:
        key, sep, value = word.partition("=")
        numeric = value.replace(".", "", 1).lstrip("-").isdigit()
        secret = sep and SECRET_KEY_RE.search(key.lstrip("+~-")) and not numeric
        out.append(f"{key}={REDACTED}" if secret else word)
    return out


def _git_sha() -> str | None:
    """HEAD of the repository holding this package, with ``-dirty`` if it has local changes."""
    repo = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "") if sha else None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _hosts(env: Mapping[str, str]) -> list[str]:
    """This host, or every host of the Slurm allocation."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        from launcher.parallel.distributed import expand_hostlist

        try:
            return expand_hostlist(nodelist)
        except ValueError:
            return [nodelist]
    return [socket.gethostname()]


def collect_env(env: Mapping[str, str] | None = None) -> dict:
    """Versions, git SHA, hosts, rank variables and CUDA availability of this process."""
    env = os.environ if env is None else env
    import torch

    return {
        "python": sys.version.split()[0],
        "versions": {name: _version(dist) for name, dist in (
            ("torch", "torch"), ("megatron_core", "megatron-core"), ("deepspeed", "deepspeed"),
            ("hydra", "hydra-core"), ("omegaconf", "omegaconf"), ("wandb", "wandb"))},
        "git_sha": _git_sha(),
        "hostname": socket.gethostname(),
        "hosts": _hosts(env),
        "rank_env": {name: env[name] for name in RANK_ENV if name in env},
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": redact_argv(sys.argv),
    }


def prepare_run_dir(run_dir: Path, *, config: Any, plan: Any) -> None:
    """Create ``run_dir`` with checkpoints/ and logs/ and write env.json; on the first start also
    config.yaml, plan.json and data.json (:func:`write_run_files`). A restart (config.yaml
    exists) keeps those three, which describe the last start that got going, and records its
    config as the next ``configs/attempt_<n>_<time>.yaml`` instead; :func:`write_run_files`
    replaces them once the restart has loaded its checkpoint (launcher.runtime.confighistory).

    ``config`` is the resolved config (dict, DictConfig or dataclass) and ``plan`` the plan
    (dict or Plan). Every file is redacted and written atomically.
    """
    run_dir = Path(run_dir)
    for sub in ("checkpoints", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    secrets = secret_env_values()
    atomic_write_json(run_dir / "env.json", redact(collect_env(), secrets))
    if (run_dir / "config.yaml").is_file():
        record_attempt(run_dir, _config_yaml(config, secrets))
    else:
        write_run_files(run_dir, config=config, plan=plan)


def _config_yaml(config: Any, secrets: list[str]) -> str:
    return yaml.safe_dump(redact(to_plain(config), secrets), sort_keys=False)


def write_run_files(run_dir: Path, *, config: Any, plan: Any,
                    extra: Mapping[str, Any] | None = None) -> None:
    """What the run directory says about its run: config.yaml, plan.json, data.json (the data
    manifests the run reads) and ``extra`` (file name -> JSON-able, e.g. the engine's
    ds_config.json), redacted and written atomically."""
    run_dir = Path(run_dir)
    secrets = secret_env_values()
    plan_obj = plan.to_dict() if hasattr(plan, "to_dict") else plan
    atomic_write_text(run_dir / "config.yaml", _config_yaml(config, secrets))
    atomic_write_json(run_dir / "plan.json", redact(to_plain(plan_obj), secrets))
    data = to_plain(config).get("data") or {}
    atomic_write_json(run_dir / "data.json", redact(data_reference(data.get("prefixes") or []),
                                                     secrets))
    for name, content in (extra or {}).items():
        atomic_write_json(run_dir / name, redact(to_plain(content), secrets))


def data_reference(prefixes: list) -> dict:
    """Which data a run reads: each shard prefix, and each data_prep manifest beside the shards
    (path, sha256, totals, tokenizer identity), so a run directory names its exact corpus."""
    manifests = []
    for path in sorted({Path(p).parent / "manifest.json" for p in prefixes}):
        entry: dict = {"path": str(path), "exists": path.is_file()}
        if entry["exists"]:
            raw = path.read_bytes()
            entry["sha256"] = hashlib.sha256(raw).hexdigest()
            try:
                manifest = json.loads(raw)
                entry.update({k: manifest.get(k) for k in ("totals", "tokenizer", "dtype",
                                                           "eod_id", "version")})
            except ValueError:
                entry["error"] = "not valid JSON"
        manifests.append(entry)
    return {"prefixes": list(prefixes), "mock": not prefixes, "manifests": manifests}
