"""Which environment variables hold secrets: their values never reach logs, run directories,
scripts or manifests (launcher.runtime.rundir redacts them; the Kubernetes renderer refuses them
as plain values and takes them only as Secret references)."""

from __future__ import annotations

import re

SECRET_ENV_NAME_RE = re.compile(
    r"api_?key|token|secret|password|passwd|credential|(?:key|pass)$", re.IGNORECASE)
"""An environment variable whose value is a secret wherever it appears: a name containing
``api_key``, ``token``, ``secret``, ``password``, ``credential`` or ending in ``KEY`` or ``PASS``
(WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, OPENAI_KEY, DB_PASS, ...)."""

ALWAYS_SECRET_ENV = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
"""Secret whatever the pattern says."""


def is_secret_env_name(name: str) -> bool:
    """True for WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, DB_PASS, ..."""
    return name in ALWAYS_SECRET_ENV or bool(SECRET_ENV_NAME_RE.search(name))
