"""Everything a run needs decided up front, from the composed config: files, tokenizer, names."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, List

from data_prep.assemble import token_dtype
from data_prep.errors import ConfigError
from data_prep.inputs import InputFile, expand_inputs, split_for_task
from data_prep.manifest import manifest_name, shard_stem
from data_prep.tokenizer_choice import resolve_tokenizer
from data_prep.tokenizer_spec import TokenizerInfo


BLOCK_SCHEME = 2
"""How inputs are cut into blocks and parts (data_prep.blocks, data_prep.parts); part of the
fingerprint, so a re-run never resumes shards cut another way. 2: compressed inputs by frame or
by file, streamed in parts."""


@dataclass
class RunPlan:
    out_dir: str
    name: str
    stem: str
    files: List[InputFile]
    """This task's input files, in output order."""
    info: TokenizerInfo
    dtype: type
    workers: int
    num_tasks: int
    task_index: int
    manifest_path: str
    settings: dict
    """Worker settings: text_key, append_eod, prepend_bos, examples_per_reason, strict, part_bytes."""


def task_layout(num_tasks: int, task_index: int) -> tuple:
    """(num_tasks, task_index) from the config, else from Slurm array variables, else (1, 0)."""
    env = os.environ
    if num_tasks <= 0:
        num_tasks = int(env.get("SLURM_ARRAY_TASK_COUNT", "1") or 1)
    if task_index < 0:
        task_id = env.get("SLURM_ARRAY_TASK_ID")
        task_index = int(task_id) - int(env.get("SLURM_ARRAY_TASK_MIN", "0") or 0) if task_id else 0
    if not 0 <= task_index < num_tasks:
        raise ConfigError(f"task_index={task_index} is outside 0..{num_tasks - 1} (num_tasks={num_tasks})")
    return num_tasks, task_index


def default_name(out_dir: str, name: str) -> str:
    name = name or os.path.basename(os.path.normpath(out_dir)) or "shard"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"name={name!r}: use letters, digits, '_', '-' and '.' (it names files "
                          "and the data config); set name=<stem>")
    return name


def auto_workers(files: List[InputFile], block_bytes: int) -> int:
    """workers=0: all cores, but no more processes than the input has blocks (small inputs are
    done faster in one process than it takes to start a pool)."""
    total = sum(f.size * (4 if f.compression else 1) for f in files)
    return max(1, min(len(os.sched_getaffinity(0)), -(-total // block_bytes)))


def _check_numbers(cfg) -> None:
    if cfg.block_bytes < 1024:
        raise ConfigError(f"block_bytes={cfg.block_bytes} is too small; use at least 1024")
    if cfg.shard_tokens < 0 or cfg.shard_bytes < 0:
        raise ConfigError("shard_tokens and shard_bytes must be >= 0 (0 = no limit)")
    if not 0.0 <= cfg.max_bad_fraction <= 1.0:
        raise ConfigError(f"max_bad_fraction={cfg.max_bad_fraction} must be between 0 and 1")
    if cfg.workers < 0:
        raise ConfigError(f"workers={cfg.workers} must be >= 0 (0 = all cores)")
    if cfg.progress_every_s < 0:
        raise ConfigError(f"progress_every_s={cfg.progress_every_s} must be >= 0 (seconds between "
                          "progress lines in a log; 0 = none)")


def make_plan(cfg, on_inputs: Callable[[List[InputFile], int], None] = lambda files, workers: None) -> RunPlan:
    """Validate and resolve ``cfg``: inputs, output names, worker count and tokenizer;
    ``on_inputs(files, workers)`` runs once the inputs and the worker count are known, before
    the (slower) tokenizer load."""
    _check_numbers(cfg)
    num_tasks, task_index = task_layout(cfg.num_tasks, cfg.task_index)
    out_dir = os.path.abspath(cfg.output)
    name = default_name(out_dir, cfg.name)
    files = split_for_task(expand_inputs(list(cfg.input), str(cfg.format), out_dir), num_tasks, task_index)
    workers = cfg.workers or auto_workers(files, cfg.block_bytes)
    on_inputs(files, workers)
    info = resolve_tokenizer(cfg.tokenizer)
    settings = {"text_key": cfg.text_key, "append_eod": bool(cfg.tokenizer.append_eod),
                "prepend_bos": bool(cfg.tokenizer.prepend_bos),
                "examples_per_reason": int(cfg.examples_per_reason), "strict": bool(cfg.strict),
                "part_bytes": int(cfg.block_bytes)}
    return RunPlan(out_dir, name, shard_stem(name, num_tasks, task_index), files, info,
                   token_dtype(info.vocab_size), workers, num_tasks, task_index,
                   os.path.join(out_dir, manifest_name(num_tasks, task_index)), settings)


def fingerprint(plan: RunPlan, cfg) -> dict:
    """What must be unchanged for a re-run to keep shards already written. The block scheme
    changed only how compressed inputs are cut, so it is recorded only when there is one (runs
    over plain files written before it keep their shards)."""
    compressed = any(getattr(f, "compression", "") for f in plan.files)
    return {"inputs": [[f.path, f.size, f.mtime_ns] for f in plan.files],
            **({"block_scheme": BLOCK_SCHEME} if compressed else {}),
            "format": str(cfg.format), "text_key": cfg.text_key, "text_unit": str(cfg.text_unit),
            "block_bytes": cfg.block_bytes, "shard_tokens": cfg.shard_tokens,
            "shard_bytes": cfg.shard_bytes, "stem": plan.stem,
            "tokenizer": {"kind": plan.info.kind, "sha256": plan.info.sha256,
                          "vocab_size": plan.info.vocab_size},
            "eod_id": plan.info.eod_id if plan.settings["append_eod"] else -1,
            "bos_id": plan.info.bos_id if plan.settings["prepend_bos"] else -1}
