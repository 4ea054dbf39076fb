"""lm-evaluation-harness around a model that trainwright runs: :class:`ScoredLM` and
:func:`run_tasks`.

lm-evaluation-harness builds the requests (its templates, few-shot samples and limits), and
computes and aggregates the metrics; trainwright only scores token rows: ``score(rows)`` takes
``[(context ids, continuation ids), ...]`` and returns ``[(summed log-probability of the
continuation, whether every continuation token is the model's argmax), ...]``. Every rank of a
run calls :func:`run_tasks` with the same tasks, so every rank builds the same requests in the
same order; the scorer splits them over the ranks and gives every rank every result, and the
harness sees a world of one.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

Rows = Sequence[tuple[list[int], list[int]]]
Scorer = Callable[[Rows], list[tuple[float, bool]]]
Generator = Callable[[list, list, Callable[[int, list], bool]], list[list[int]]]
"""(prompts' ids, token budgets, done(row, new ids)) -> each row's generated ids
(:func:`launcher.runtime.eval_generation.generate_rows`)."""
DEFAULT_MAX_GEN_TOKS = 256
"""Tokens a generation task may generate when its ``generation_kwargs`` say nothing
(lm-evaluation-harness's Hugging Face backend's default)."""


def _template_lm():
    from lm_eval.api.model import TemplateLM

    return TemplateLM


class ScoredLM:
    """A ``TemplateLM`` (built on first use: lm_eval is imported only where tasks run) whose
    token rows go to ``score``; ``encode`` turns text into token ids."""

    def __new__(cls, encode: Callable[[str], list[int]], eot: int, max_length: int,
                score: Scorer, generate: Generator | None = None,
                decode: Callable[[list[int]], str] | None = None):
        base = _template_lm()

        class _LM(base):
            def __init__(self):
                super().__init__()

            @property
            def eot_token_id(self) -> int:
                return eot

            def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
                return encode(string)

            def loglikelihood(self, requests, disable_tqdm: bool = True):
                return super().loglikelihood(requests, disable_tqdm=True)

            def _loglikelihood_tokens(self, requests, **kwargs):
                return score([(list(ctx), list(cont)) for _, ctx, cont in requests])

            def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
                return rolling(requests, encode, eot, max_length, score)

            def generate_until(self, requests, disable_tqdm: bool = False):
                if generate is None or decode is None:
                    raise NotImplementedError("this scorer does not generate")
                return generate_texts(requests, encode, decode, eot, max_length, generate)

        return _LM()


def rolling(requests, encode, eot: int, max_length: int, score: Scorer) -> list[float]:
    """Log-likelihood of whole texts: disjoint windows of at most ``max_length`` tokens (each
    but the first conditioned on the text before it, up to ``max_length``), summed per text:
    lm-evaluation-harness's own windowing, our scoring."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    rows, owner = [], []
    for index, (text,) in enumerate(req.args for req in requests):
        windows = get_rolling_token_windows(token_list=encode(text), prefix_token=eot,
                                            max_seq_len=max_length, context_len=1)
        for window in map(make_disjoint_window, windows):
            rows.append((list(window[0]), list(window[1])))
            owner.append(index)
    totals = [0.0] * len(requests)
    for index, (logprob, _) in zip(owner, score(rows)):
        totals[index] += logprob
    return totals


def generate_texts(requests, encode, decode, eot: int, max_length: int,
                   generate: Generator) -> list[str]:
    """Greedy continuations of ``generate_until`` requests, as lm-evaluation-harness's Hugging
    Face backend makes them: its generation settings normalised by its own functions, the
    end-of-text added to the stop strings, the context cut from the left to leave room for
    ``max_gen_toks``, generation until a stop string appears (or the end-of-text token, or the
    budget), the text cut at the first stop string."""
    from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                      postprocess_generated_text)

    eos = decode([eot]) or None
    prompts, budgets, stops = [], [], []
    for request in requests:
        context, gen_kwargs = request.args
        kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), DEFAULT_MAX_GEN_TOKS)
        if kwargs.get("do_sample"):
            raise ValueError("generate_until: only greedy generation is scored (do_sample=false)")
        stops.append(handle_stop_sequences(kwargs.pop("until", None), eos=eos))
        budget = min(int(kwargs["max_gen_toks"]), max_length - 1)
        prompts.append(encode(context)[-(max_length - budget):])
        budgets.append(budget)

    def done(row: int, new: list) -> bool:
        return new[-1] == eot or any(stop and stop in decode(new) for stop in stops[row])

    outputs = generate(prompts, budgets, done)
    return [postprocess_generated_text(decode([t for t in ids if t != eot]), until, None)
            for ids, until in zip(outputs, stops)]


def run_tasks(tasks: dict, lm, limit: int = 0, contaminated: dict | None = None,
              samples: list | None = None) -> dict:
    """{task: {metric: value}} of ``tasks`` (lm-evaluation-harness Tasks) scored by ``lm``;
    ``limit`` examples per task (0: all). Standard errors are not computed (no bootstrap). With
    ``contaminated`` ({task: example indices}), each task also gets ``<metric>_clean`` and
    ``examples_clean``: its metrics over the examples not in that list. ``samples`` (a list)
    gets one record per example (:func:`sample_records`)."""
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")  # per-request progress bars on every rank
    from lm_eval.evaluator import evaluate

    from launcher.engines.compat import compiled_templates_kept

    compiled_templates_kept()

    out = evaluate(lm=lm, task_dict=tasks, limit=limit or None, bootstrap_iters=0,
                   log_samples=contaminated is not None or samples is not None,
                   verbosity="WARNING")
    if samples is not None:
        samples += sample_records(out["samples"])
    table = metric_table(out["results"])
    if contaminated is not None:
        for task, samples in out["samples"].items():
            table[task].update(clean_metrics(tasks[task], samples,
                                             set(contaminated.get(task, ()))))
    return table


def sample_records(by_task: dict) -> list:
    """One plain record per example of lm-evaluation-harness's logged samples: task, doc_id,
    target and resps (each request's scores: [log-likelihood, greedy] or [log-likelihood])."""
    def plain(value):
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if isinstance(value, (int, float, str, bool)) or value is None \
            else str(value)

    return [{"task": task, "doc_id": s["doc_id"], "target": plain(s.get("target")),
             "resps": plain(s["resps"])} for task, rows in by_task.items() for s in rows]


def clean_metrics(task, samples: list, excluded: set) -> dict:
    """The task's metrics over its samples whose example is not in ``excluded``, aggregated by
    the task's own functions (lm-evaluation-harness's: mean, weighted perplexity, ...)."""
    kept = [s for s in samples if s["doc_id"] not in excluded]
    out = {"examples_clean": float(len(kept))}
    for metric, aggregate in task.aggregation().items():
        values = [s[metric] for s in kept if metric in s]
        if values:
            value = float(aggregate(values))
            if math.isfinite(value):
                out[f"{metric}_clean"] = value
    return out


def metric_table(results: dict) -> dict:
    """lm-evaluation-harness's ``results`` ({task: {"acc,none": 0.5, "acc_stderr,none": ...,
    "alias": ...}}) as {task: {"acc": 0.5}}: finite numbers only, the filter suffix dropped."""
    table = {}
    for task, values in results.items():
        row = {}
        for key, value in values.items():
            metric, _, _ = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, (int, float)) \
                    or isinstance(value, bool) or metric == "alias":
                continue
            if math.isfinite(float(value)):
                row["examples" if metric == "sample_len" else metric] = float(value)
        table[task] = row
    return table
