"""Kubernetes manifests of a training run (``cluster.launcher=kubernetes``).

:func:`render` turns the config, its plan and the submitted overrides into the documents of
``cluster.kubernetes_api`` (:mod:`.apis`), around one pod template (:mod:`.pod`) and the stop
contract's failure policies (:mod:`.contract`); :mod:`.checks` validates them before anything
reaches a cluster.
"""

from __future__ import annotations

from typing import Sequence

import yaml

from launcher.launch.kubernetes.apis import RENDERERS
from launcher.launch.kubernetes.pod import job_name


def render(cfg, plan, overrides: Sequence[str], run_name: str) -> list[dict]:
    """The manifests, in the order to apply them. The pods get the overrides as given, less
    the ``submit.*`` ones (they are this command's)."""
    training = [o for o in overrides if not o.lstrip("+~").startswith("submit.")]
    return RENDERERS[cfg.cluster.kubernetes_api](cfg, plan, training, job_name(run_name))


def to_yaml(documents: Sequence[dict]) -> str:
    """YAML documents separated by ``---``, keys in the order rendered."""
    return "---\n".join(yaml.safe_dump(d, sort_keys=False, width=100) for d in documents)
