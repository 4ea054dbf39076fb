"""``python -m launcher.convert <to_hf|from_hf|reshard|preset> key=value ...``

    to_hf   checkpoint=<run, checkpoints or step dir> out=<new dir> [dtype=auto|bf16|fp16|fp32]
            [max_shard_gb=5]
    from_hf hf=<HF dir> out=<new run dir> [parallelism.* engine=... cluster.* overrides]
    reshard checkpoint=<run, checkpoints or step dir> out=<new dir> [cluster.* overrides]
            (a dp_reshardable engine=megatron checkpoint -> one that resumes at any layout)
    preset  hf=<HF dir>      (prints the model YAML for conf/model/)

Exit codes: 0 done, 2 bad arguments, unsupported model or config error.
"""

from __future__ import annotations

if __name__ == "__main__":  # the ranks' fork server starts before this command's imports
    import sys as _sys

    from launcher.convert import RANK_MODULES_BY_COMMAND as _RANKS

    if _sys.argv[1:2] and _sys.argv[1] in _RANKS and not {"-h", "--help"} & set(_sys.argv):
        from launcher.launch.rank_preload import preload_rank_imports as _preload

        _preload(_RANKS[_sys.argv[1]])

import os
import sys
from pathlib import Path
from typing import Sequence

from launcher.core.errors import CheckpointError
from launcher.core.exits import CONFIG_ERROR_EXIT

EXIT_USAGE = CONFIG_ERROR_EXIT
OWN_KEYS = {"to_hf": ("checkpoint", "out", "dtype", "max_shard_gb"),
            "from_hf": ("hf", "out"), "reshard": ("checkpoint", "out"), "preset": ("hf",)}
REQUIRED = {"to_hf": ("checkpoint", "out"), "from_hf": ("hf", "out"),
            "reshard": ("checkpoint", "out"), "preset": ("hf",)}
OVERRIDES = {"from_hf": "config overrides", "reshard": "cluster.* overrides"}
"""Commands that take Hydra overrides besides their own keys, and which."""


def _fail(message: str) -> int:
    print(f"convert: {message}", file=sys.stderr)
    return EXIT_USAGE


def _cluster_override(key: str) -> bool:
    """``cluster=...`` or ``cluster.<field>``: what a conversion may set (the rest is the
    checkpoint's)."""
    return key.lstrip("+~") == "cluster" or key.lstrip("+~").startswith("cluster.") \
        or key == "run.verbose"


def parse(argv: Sequence[str]) -> tuple[str, dict, list]:
    """(command, its own key=value settings, the remaining Hydra overrides); ValueError."""
    if not argv or argv[0] not in OWN_KEYS:
        raise ValueError(f"first argument must be one of {', '.join(OWN_KEYS)}\n{__doc__}")
    command, own, rest = argv[0], {}, []
    for arg in argv[1:]:
        key, sep, value = arg.partition("=")
        if sep and key in OWN_KEYS[command]:
            own[key] = value
        elif sep and (command == "from_hf" or command == "reshard" and _cluster_override(key)):
            rest.append(arg)
        else:
            raise ValueError(f"{command}: unknown argument {arg!r}; it takes "
                             + ", ".join(f"{k}=" for k in OWN_KEYS[command])
                             + (f" and {OVERRIDES[command]}" if command in OVERRIDES else ""))
    missing = [k for k in REQUIRED[command] if not own.get(k)]
    if missing:
        raise ValueError(f"{command}: missing {', '.join(f'{k}=<...>' for k in missing)}")
    return command, own, rest


def to_hf(own: dict) -> int:
    from launcher.convert.hf_writer import DTYPES
    from launcher.convert.to_hf import export
    from launcher.engines.weights.sources import SourceError, open_source, step_dir_of

    dtype = own.get("dtype", "auto")
    if dtype != "auto" and dtype not in DTYPES:
        return _fail(f"dtype={dtype}: use auto, {', '.join(DTYPES)}")
    try:
        step_dir = step_dir_of(Path(own["checkpoint"]))
        source = open_source(step_dir)
        summary = export(source, step_dir, Path(own["out"]), dtype_name=dtype,
                         max_shard_gb=float(own.get("max_shard_gb", 5)),
                         log=lambda line: print(line, file=sys.stderr))
    except (SourceError, FileExistsError, ValueError) as exc:
        return _fail(str(exc))
    except CheckpointError as exc:  # e.g. a file that would run code when loaded
        print(f"convert: {exc}", file=sys.stderr)
        return exc.exit_code
    gb = summary["bytes"] / 1e9
    print(f"to_hf: step {summary['step']} -> {summary['out']}: {gb:.3f} GB in "
          f"{summary['shards']} shard(s), {summary['seconds']:.1f} s "
          f"({gb / max(summary['seconds'], 1e-9):.2f} GB/s); tokenizer: "
          f"{summary['tokenizer'] or 'none (not a Hugging Face tokenizer.json)'}")
    return 0


def preset(own: dict) -> int:
    import json

    import yaml

    from launcher.engines.weights.hf_config import UnsupportedModel, model_fields

    path = Path(own["hf"]) / "config.json"
    try:
        fields = model_fields(json.loads(path.read_text()), str(path))
    except (OSError, UnsupportedModel) as exc:
        return _fail(str(exc))
    print(f"# from {path}; save as conf/model/{fields['name']}.yaml")
    print(yaml.safe_dump(fields, sort_keys=False), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        command, own, rest = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        return _fail(str(exc))
    if "checkpoint" in own:  # s3://: the committed step's local copy (exit 2 if there is none)
        from launcher.launch.remote_inputs import local_checkpoint

        own["checkpoint"] = local_checkpoint(own["checkpoint"], "checkpoint")
    if command == "to_hf":
        return to_hf(own)
    if command == "preset":
        return preset(own)
    if command == "reshard":
        from launcher.convert.reshard import run_reshard

        return run_reshard(own["checkpoint"], own["out"], rest)
    from launcher.convert.from_hf import run_import

    return run_import(own["hf"], own["out"], rest)


if __name__ == "__main__":
    from launcher.launch.agent import scheduler_exit

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(scheduler_exit(main))
