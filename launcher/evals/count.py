"""How much one evaluation of the tasks scores (:func:`count_rows`): what the plan prices."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from launcher.config import EvalConfig
from launcher.evals.rows import Packing, computed_tokens, score_plan


def count_rows(ev: EvalConfig, tokenizer: str, seq: int, *, micro_batch: int,
               packing: Packing) -> tuple[int, int]:
    """(rows, tokens) of one evaluation of ``ev.tasks`` (``ev.limit`` examples each): the rows
    of :func:`row_lengths` (encoded with ``tokenizer``) and the tokens the forward passes
    compute for them, packed and padded as their micro-batches take them on one replica
    (:mod:`launcher.evals.rows`)."""
    from launcher.evals.tokenizer import TextTokenizer

    lengths = row_lengths(ev, TextTokenizer(Path(tokenizer)).encode, seq)
    plan = score_plan(lengths, dp=1, seq=seq, micro_batch=micro_batch, packing=packing)
    return len(lengths), computed_tokens(plan, 1)


def row_lengths(ev: EvalConfig, encode: Callable[[str], list[int]], seq: int) -> list[int]:
    """Input tokens of each row one evaluation of ``ev.tasks`` scores: a row per loglikelihood
    request (a multiple-choice example makes one per choice), one per window of ``seq`` tokens
    of a rolling text; a generation request counts the tokens of its forward passes."""
    from launcher.core.eval_tasks import load_tasks

    lengths: list[int] = []
    for task in load_tasks(ev.tasks, ev.include_path).values():
        task.build_all_requests(limit=ev.limit or None, rank=0, world_size=1)
        for instance in task.instances:
            if instance.request_type == "loglikelihood_rolling":
                lengths += _windows(len(encode(instance.args[0])), seq)
            elif instance.request_type == "generate_until":
                lengths.append(_generation_tokens(len(encode(instance.args[0])),
                                                  instance.args[1] or {}, seq))
            else:
                context, continuation = instance.args[:2]
                lengths.append(min(seq, max(1, len(encode(context + continuation)))))
    return lengths


def _windows(tokens: int, seq: int) -> list[int]:
    """Input lengths of a rolling text's windows of at most ``seq`` tokens (at least one)."""
    full, rest = divmod(max(1, tokens), seq)
    return [seq] * full + ([rest] if rest else [])


def _generation_tokens(prompt: int, gen_kwargs: dict, seq: int) -> int:
    """Tokens the forward passes of one greedy generation compute: a pass over the whole
    sequence per new token (no KV cache), at most the task's max_gen_toks of them."""
    from launcher.evals.harness import DEFAULT_MAX_GEN_TOKS

    budget = min(int(gen_kwargs.get("max_gen_toks") or DEFAULT_MAX_GEN_TOKS), seq - 1)
    start = min(prompt, seq - budget)
    return sum(start + k for k in range(1, budget + 1))
