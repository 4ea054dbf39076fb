"""How many rows one evaluation of the tasks scores (:func:`count_rows`): what the plan prices."""

from __future__ import annotations

from pathlib import Path

from launcher.config import EvalConfig


def count_rows(ev: EvalConfig, tokenizer: str, seq: int) -> int:
    """Rows of one evaluation of ``ev.tasks`` (``ev.limit`` examples each): one per
    loglikelihood request (a multiple-choice example makes one per choice), and a rolling text
    as many as its windows of ``seq`` tokens (its length encoded with ``tokenizer``)."""
    import math

    from launcher.core.eval_tasks import load_tasks
    from launcher.evals.tokenizer import TextTokenizer

    encode = TextTokenizer(Path(tokenizer)).encode
    rows = 0
    for task in load_tasks(ev.tasks, ev.include_path).values():
        task.build_all_requests(limit=ev.limit or None, rank=0, world_size=1)
        for instance in task.instances:
            if instance.request_type == "loglikelihood_rolling":
                rows += max(1, math.ceil(len(encode(instance.args[0])) / seq))
            else:
                rows += 1
    return rows
