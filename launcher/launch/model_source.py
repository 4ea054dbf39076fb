"""A checkpoint carries its architecture: the ``model`` group of a run that starts from weights.

``trainer.init_from``, ``launcher.generate checkpoint=`` and ``launcher.convert from_hf`` read the
model from the weights they load (an HF ``config.json`` or a trainwright checkpoint's
``trainwright.json``). Without an explicit ``model=<preset>`` those fields are added as
``model.<field>=<value>`` overrides ahead of the user's own, so the composed, saved and planned
config is that model; an explicit preset or a ``model.*`` override that changes the
architecture exits 2 naming every field, both values and the override that fixes it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from launcher.compose import compose_or_exit, to_object
from launcher.config import ModelConfig
from launcher.core.exits import CONFIG_ERROR_EXIT

MODEL_FIELDS = {f.name for f in fields(ModelConfig)}


class ModelMismatch(ValueError):
    """The composed model is not the architecture of the weights; the message has the fix."""


def source_model(path: str) -> dict:
    """ModelConfig fields of the weights at ``path`` (HF directory or trainwright run / step
    directory); ValueError naming the path when there are none."""
    p = Path(path)
    if (p / "config.json").is_file():
        from launcher.engines.weights.hf_config import check_weights, model_fields

        config = json.loads((p / "config.json").read_text())
        fields = model_fields(config, str(p / "config.json"))
        check_weights(config, p, int(fields["num_layers"]))
        return fields
    from launcher.engines.weights.sources import _model_of, step_dir_of

    return {k: v for k, v in _model_of(step_dir_of(p)).items() if k in MODEL_FIELDS}


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def picks_model(argv: Sequence[str]) -> bool:
    """Whether the command line selects a model preset (``model=...``)."""
    return any(a.lstrip("+~").split("=", 1)[0] == "model" for a in argv)


def with_model(argv: Sequence[str], model: dict) -> list[str]:
    """``argv`` with ``model`` (the weights' fields) as overrides in front (unless a preset is
    picked)."""
    if picks_model(argv):
        return list(argv)
    return [f"model.{k}={_hydra_value(v)}" for k, v in model.items()] + list(argv)


def differences(weights: dict, composed: Any) -> list[str]:
    """``model.<field>: weights <a>, config <b> (set model.<field>=<a>)`` per differing field."""
    from launcher.engines.weights.hf_config import architecture_differences
    from launcher.runtime.rundir import to_plain

    now = to_plain(composed) if not isinstance(composed, dict) else composed
    out = []
    for key, theirs, ours in architecture_differences(weights, now):
        fix = f"model.{key}={theirs}" if key in MODEL_FIELDS and theirs is not None \
            else f"model.arch={weights.get('arch')}"
        out.append(f"model.{key}: weights {theirs}, config {ours} (set {fix})")
    return out


def adopt_model(argv: Sequence[str], path_key: str, path: str) -> list[str]:
    """The command line to compose for a run whose weights come from ``path`` (given as
    ``path_key``, e.g. ``trainer.init_from``): the weights' model added, then checked; exit 2 on a
    mismatch or unreadable weights. ``argv`` itself when ``path`` is empty."""
    if not path:
        return list(argv)
    try:
        weights = source_model(path)
        adopted = with_model(argv, weights)
    except (OSError, ValueError) as exc:
        print(f"config error: {path_key}={path}: {exc}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    problems = differences(weights, to_object(compose_or_exit(adopted)).model)
    if problems:
        print(f"config error: the model does not match the weights at {path_key}={path}:\n  "
              + "\n  ".join(problems) + "\nDrop model=/model.* to take the weights' model, or "
              "set the values above.", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
    return adopted

