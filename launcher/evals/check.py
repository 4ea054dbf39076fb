"""Everything about ``eval`` that can be checked before a rank starts: :func:`eval_problems`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from launcher.config import TrainwrightConfig
from launcher.core.eval_tasks import task_problems
from launcher.evals.tokenizer import TextTokenizer, eval_tokenizer_path


def eval_problems(cfg: TrainwrightConfig, tokenizer: Optional[str] = None) -> list[str]:
    """Every problem of ``cfg.eval`` (empty: none, or no tasks asked for), each with its fix;
    ``tokenizer``: the one the tasks will be encoded with (default: the run's,
    :func:`eval_tokenizer_path`)."""
    ev = cfg.eval
    problems = [f"eval.{key}={value} is negative; give 0 (off / all) or more"
                for key, value in (("interval", ev.interval), ("limit", ev.limit)) if value < 0]
    if not ev.tasks:
        return problems
    problems += task_problems(ev.tasks, ev.include_path)
    if not problems and cfg.parallelism.context_parallel_size > 1:
        problems += generation_problems(ev.tasks, ev.include_path,
                                        cfg.parallelism.context_parallel_size)
    return problems + tokenizer_problems(cfg, tokenizer or eval_tokenizer_path(ev, cfg.data))


def generation_problems(tasks, include, cp: int) -> list[str]:
    """Generation picks each row's next token at its end, which context parallelism splits
    over ranks: generate_until tasks are refused with CP > 1."""
    from launcher.core.eval_tasks import task_manager

    index = task_manager(include).task_index
    return [f"task {name}: generate_until is not run with parallelism.context_parallel_size="
            f"{cp}; score it with context_parallel_size=1 (python -m launcher.evaluate "
            "parallelism.context_parallel_size=1 on the checkpoint)"
            for name in tasks if (index[name].cfg or {}).get("output_type") == "generate_until"]


def tokenizer_problems(cfg: TrainwrightConfig, path: Optional[str]) -> list[str]:
    if path is None:
        return ["eval.tasks needs a tokenizer to encode the tasks' text and the run names none; "
                "set eval.tokenizer=<tokenizer.json> (or data.tokenizer_path)"]
    if not Path(path).is_file():
        return [f"eval.tokenizer: {path} does not exist; give a Hugging Face tokenizer.json"]
    try:
        size = TextTokenizer(Path(path)).vocab_size
    except Exception as exc:  # the tokenizers library's own errors
        return [f"eval.tokenizer: {path} is not a tokenizer.json the tokenizers library reads "
                f"({exc})"]
    if size > cfg.model.vocab_size:
        return [f"eval.tokenizer: {path} has {size} tokens, more than model.vocab_size="
                f"{cfg.model.vocab_size}; use the tokenizer the model was trained with"]
    return []


def check_eval_or_exit(cfg: TrainwrightConfig) -> None:
    """Print every problem of :func:`eval_problems` and exit 2 when there is any."""
    import sys

    from launcher.core.exits import CONFIG_ERROR_EXIT

    problems = eval_problems(cfg)
    if problems:
        print(f"eval: {len(problems)} problem(s):\n" + "\n".join(f"- {p}" for p in problems),
              file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
