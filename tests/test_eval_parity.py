"""Held against a peer (issue 37): a trainwright checkpoint scored by ``launcher.evaluate`` at
TP=2 equals lm-evaluation-harness's own Hugging Face backend on the checkpoint's ``to_hf``
export, for the same task files: accuracy exactly, the log-likelihood metrics to float
tolerance; and every request's log-likelihood and greedy flag, example by example, at TP=2 and
at PP=2 (``eval.samples``), to 1e-5."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.data_prep import train_hf_tokenizer
from tests.helpers.training import REPO, train

pytestmark = pytest.mark.slow
TASKS = ["tw_facts", "tw_paragraphs"]
LIMIT = 12


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"})


def harness_scores(hf_dir, tokenizer, samples: list | None = None) -> dict:
    """lm-evaluation-harness's HFLM on the export (its own batching, padding and truncation);
    ``samples`` gets its per-example records."""
    import transformers
    from lm_eval.models.huggingface import HFLM

    from launcher.evals.harness import run_tasks
    from launcher.core.eval_tasks import load_tasks

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer))
    lm = HFLM(pretrained=str(hf_dir), tokenizer=tok, device="cpu", dtype="float32",
              batch_size=8, max_length=64, prefix_token_id=0)  # prefix: data.eod_token_id
    return run_tasks(load_tasks(TASKS, []), lm, LIMIT, samples=samples)


def test_our_scores_equal_lm_evaluation_harness_on_the_export(tmp_path):
    tokenizer = train_hf_tokenizer(tmp_path, vocab_size=500)
    train(tmp_path, "run", "engine=megatron", "trainer.train_steps=3")
    exported = cli("launcher.convert", "to_hf", f"checkpoint={tmp_path / 'run'}",
                   f"out={tmp_path / 'hf'}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    ours = cli("launcher.evaluate", f"checkpoint={tmp_path / 'run'}", f"eval.tasks=[{','.join(TASKS)}]",
               f"eval.limit={LIMIT}", f"eval.tokenizer={tokenizer}", "eval.format=json",
               "parallelism.tensor_parallel_size=2", "trainer.precision=fp32",
               f"eval.samples={tmp_path / 'tp2.jsonl'}", "eval.pack_length=64")
    assert ours.returncode == 0, ours.stderr[-3000:]
    result = json.loads(ours.stdout.strip().splitlines()[-1])
    assert result["step"] == 3 and set(result["tasks"]) == set(TASKS)
    their_samples: list = []
    theirs = harness_scores(tmp_path / "hf", tokenizer, their_samples)
    pp2 = cli("launcher.evaluate", f"checkpoint={tmp_path / 'run'}", f"eval.tasks=[{','.join(TASKS)}]",
              f"eval.limit={LIMIT}", f"eval.tokenizer={tokenizer}", "trainer.precision=fp32",
              "parallelism.pipeline_parallel_size=2", f"eval.samples={tmp_path / 'pp2.jsonl'}",
              "eval.pack_length=64")
    assert pp2.returncode == 0, pp2.stderr[-3000:]
    for layout in ("tp2", "pp2"):  # every request's log-likelihood, not only the aggregates
        assert_same_samples(read_samples(tmp_path / f"{layout}.jsonl"),
                            index_samples(their_samples), layout)
    for task in TASKS:
        assert set(result["tasks"][task]) == set(theirs[task]), task
    assert result["tasks"]["tw_facts"]["examples"] == LIMIT  # of 32
    assert result["tasks"]["tw_paragraphs"]["examples"] == 8  # all there are
    assert result["tasks"]["tw_facts"]["acc"] == theirs["tw_facts"]["acc"]
    assert result["tasks"]["tw_facts"]["acc_norm"] == theirs["tw_facts"]["acc_norm"]
    for metric in ("bits_per_byte", "byte_perplexity", "word_perplexity"):
        assert result["tasks"]["tw_paragraphs"][metric] == \
            pytest.approx(theirs["tw_paragraphs"][metric], rel=1e-5), metric


def index_samples(records: list) -> dict:
    return {(r["task"], r["doc_id"]): r for r in records}


def read_samples(path) -> dict:
    return index_samples([json.loads(line) for line in path.read_text().splitlines()])


def assert_same_samples(ours: dict, theirs: dict, layout: str) -> None:
    """Each example's requests: log-likelihoods to 1e-5 (relative), greedy flags equal."""
    assert set(ours) == set(theirs) and len(ours) == 2 * LIMIT - (LIMIT - 8), layout
    for key, mine in ours.items():
        requests, other = mine["resps"], theirs[key]["resps"]
        assert len(requests) == len(other), (layout, key)
        for got, want in zip(requests, other):
            got, want = got[0], want[0]  # one response per request
            got, want = (got, want) if isinstance(got, list) else ([got], [want])
            assert got[0] == pytest.approx(want[0], rel=1e-5, abs=1e-5), (layout, key, got, want)
            assert got[1:] == [bool(x) for x in want[1:]], (layout, key)


def test_greedy_generations_equal_the_hf_backends_at_dp2_tp2_and_pp2(tmp_path):
    """generate_until (greedy, the task's stop strings and max_gen_toks) in launcher.evaluate:
    every example's generated text equals lm-evaluation-harness's HF backend's on the
    export, with the rows split over two replicas (DP2) and at TP2 and PP2."""
    from launcher.core.eval_tasks import load_tasks

    tokenizer = train_hf_tokenizer(tmp_path, vocab_size=500)
    train(tmp_path, "run", "engine=megatron", "trainer.train_steps=3")
    assert cli("launcher.convert", "to_hf", f"checkpoint={tmp_path / 'run'}",
               f"out={tmp_path / 'hf'}").returncode == 0
    theirs: list = []
    import transformers
    from lm_eval.models.huggingface import HFLM

    from launcher.evals.harness import run_tasks

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer))
    tok.eos_token = tok.convert_ids_to_tokens(0)  # the run's data.eod_token_id
    lm = HFLM(pretrained=str(tmp_path / "hf"), tokenizer=tok, device="cpu", dtype="float32",
              batch_size=1, max_length=64, prefix_token_id=0)
    run_tasks(load_tasks(["tw_answers"], []), lm, LIMIT, samples=theirs)  # shipped
    want = {r["doc_id"]: r["resps"][0][0] for r in theirs}
    assert len(want) == LIMIT and any(want.values())  # something generated
    for name, layout in (("dp2", []), ("tp2", ["parallelism.tensor_parallel_size=2"]),
                         ("pp2", ["parallelism.pipeline_parallel_size=2"])):
        proc = cli("launcher.evaluate", f"checkpoint={tmp_path / 'run'}", "eval.tasks=[tw_answers]",
                   f"eval.limit={LIMIT}",
                   f"eval.tokenizer={tokenizer}", "trainer.precision=fp32", *layout,
                   f"eval.samples={tmp_path / name}.jsonl")
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = {r["doc_id"]: r["resps"][0][0] for r in map(
            json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())}
        assert got == want, name

