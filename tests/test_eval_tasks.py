"""Downstream tasks in the training loop (issue 37): the shipped tasks in lm-evaluation-harness's
format scored on the live model on 2 CPU ranks, the same at every layout and with both engines;
a broken task exits 2 before any rank starts; rows and metrics unit by unit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launcher.evals.harness import metric_table, rolling
from launcher.evals.rows import (Packing, computed_tokens, packing_for, replica_batches,
                                 row_arrays, row_length, scored_rows,
                                 score_plan)
from launcher.core.eval_tasks import SHIPPED, data_files, task_problems
from tests.helpers.data_prep import train_hf_tokenizer
from tests.helpers.layout_runs import LAYOUT_GROUP
from tests.helpers.training import REPO, TINY, train

TASKS = ["eval.tasks=[tw_facts,tw_paragraphs]", "eval.limit=8"]
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_hf_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=500)


@pytest.mark.slow
@LAYOUT_GROUP  # the runs of tests/helpers/layout_runs.py, trained once for this and seeded_init
def test_the_same_checkpoint_scores_the_same_at_every_layout_and_engine(layout_runs):
    """DP2, TP2, PP2, PP2 x VPP2 and engine=deepspeed score the same initial weights the same;
    so do a 4-expert mixture at EP2 (each rank 2 of the experts, tokens sent to their expert's
    rank) and at EP1 (every rank all 4)."""
    base = layout_runs["pp1"]["scores"]
    assert base["eval/tw_facts/examples"] == 8 and base["eval/tw_paragraphs/examples"] == 8
    assert 0 < base["eval/tw_paragraphs/bits_per_byte"] < 20
    assert "tw_facts acc" in layout_runs["pp1"]["console"]  # the console line shows them
    for name, reference in {"tp2": "pp1", "pp2": "pp1", "pp2_vpp2": "pp1", "deepspeed": "pp1",
                            "moe_ep2": "moe_ep1"}.items():
        got, want = layout_runs[name]["scores"], layout_runs[reference]["scores"]
        assert set(got) == set(want), name
        for key in ("eval/tw_facts/acc", "eval/tw_facts/acc_norm"):
            assert got[key] == want[key], (name, key, got[key], want[key])  # exactly
        for key in ("eval/tw_paragraphs/bits_per_byte", "eval/tw_paragraphs/word_perplexity"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (name, key)


@pytest.mark.slow
def test_tasks_scored_every_interval_and_at_the_end_with_tokens(tmp_path, tokenizer):
    train(tmp_path, "every", *TASKS, "eval.interval=2", "trainer.train_steps=3",
          f"eval.tokenizer={tokenizer}", "engine=megatron")
    rows = [json.loads(line) for line in (tmp_path / "every" / "metrics.jsonl").read_text()
            .splitlines()]
    scored = [r for r in rows if "eval/tw_facts/acc" in r]
    assert [r["step"] for r in scored] == [2, 3]
    tokens = 2 * 2 * 64  # a step: micro-batch 2 x 2 replicas x sequence 64
    assert [r["eval/tokens"] for r in scored] == [2 * tokens, 3 * tokens]
    plan = json.loads((tmp_path / "every" / "plan.json").read_text())["downstream"]
    assert plan["evaluations"] == 2 and plan["seconds"] > 0
    assert plan["rows"] == scored[0]["eval/rows"] > 8 * 4  # the launcher counted what ran


@pytest.mark.slow
def test_a_generation_task_in_the_loop_on_both_engines(tmp_path, tokenizer):
    """tw_answers (generate_until, greedy) after the last step on the live model: engine=megatron
    at DP2 and at PP2, engine=deepspeed at DP2; the same weights (2 steps from the same seed)
    give the same exact_match on all three, and the plan priced the generation's tokens."""
    got = {}
    for name, layout in (("megatron", ["engine=megatron"]),
                         ("pp2", ["engine=megatron", "parallelism.pipeline_parallel_size=2"]),
                         ("deepspeed", ["engine=deepspeed"])):
        train(tmp_path, name, "eval.tasks=[tw_answers]", "eval.limit=6", "trainer.train_steps=2",
              "trainer.global_batch_size=4", f"eval.tokenizer={tokenizer}", *layout)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text()
                .splitlines()]
        [scored] = [r for r in rows if "eval/tw_answers/exact_match" in r]
        got[name] = scored["eval/tw_answers/exact_match"]
        plan = json.loads((tmp_path / name / "plan.json").read_text())["downstream"]
        assert plan["rows"] == 6 and plan["tokens"] > 6 * 10  # a pass per new token
    assert 0.0 <= got["megatron"] <= 1.0 and len(set(got.values())) == 1, got


def launch(tmp_path, *overrides) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.train", *TINY,
                           f"run.output_root={tmp_path}", "run.name=bad", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"})


def test_a_broken_task_exits_2_before_any_rank_starts(tmp_path, tokenizer):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "bad.yaml").write_text("task: bad\ndataset_path: json\n  oops: [\n")
    (tasks / "rows.jsonl").write_text('{"text": "fine"}\n{"text": broken}\n')
    (tasks / "rows.yaml").write_text(
        "task: rows\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: rows.jsonl\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\n")
    proc = launch(tmp_path, f"eval.include_path=[{tasks}]", "eval.tasks=[bad,rows]",
                  f"eval.tokenizer={tokenizer}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{tasks / 'bad.yaml'}: line 3" in proc.stderr  # the YAML error, with its line
    assert f"{tasks / 'rows.jsonl'}:2: not JSON" in proc.stderr  # the data file's line
    assert not (tmp_path / "bad").exists()  # no run directory: no rank started
    proc = launch(tmp_path, "eval.tasks=[tw_facts]", "eval.tokenizer=/nowhere/tok.json")
    assert proc.returncode == 2 and "/nowhere/tok.json does not exist" in proc.stderr


def test_task_problems_name_the_fix(tmp_path):
    remote = tmp_path / "remote.yaml"
    remote.write_text("task: remote\ndataset_path: EleutherAI/lambada_openai\n"
                      "output_type: loglikelihood\n")
    gen = tmp_path / "gen.yaml"
    gen.write_text("task: gen\ndataset_path: json\noutput_type: generate_until\n"
                   "generation_kwargs:\n  do_sample: true\n")
    problems = task_problems(["remote", "gen", "nope"], [str(tmp_path)])
    assert any("would be downloaded" in p and "dataset_path: json" in p for p in problems)
    assert any("do_sample=True: generation tasks are scored greedily" in p for p in problems)
    assert any("no task named 'nope'" in p and "tw_facts" in p for p in problems)
    assert task_problems(["tw_facts"], [str(tmp_path / "missing")]) == [
        f"eval.include_path: {tmp_path / 'missing'} is not a directory; give folders of task "
        "YAML files"]
    assert data_files({"dataset_kwargs": {"data_files": {"test": ["a.jsonl", "/b.jsonl"]}}},
                      SHIPPED) == [SHIPPED / "a.jsonl", Path("/b.jsonl")]


def test_a_row_is_the_tail_of_context_and_continuation_with_the_continuation_masked():
    tokens, labels, mask = row_arrays([1, 2, 3], [4, 5], seq=8)
    assert tokens.tolist() == [1, 2, 3, 4, 0, 0, 0, 0]
    assert labels.tolist() == [2, 3, 4, 5, 0, 0, 0, 0]
    assert mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]  # the labels 4 and 5
    tokens, labels, mask = row_arrays(list(range(10, 20)), [7, 8], seq=4)  # context cut left
    assert tokens.tolist() == [17, 18, 19, 7] and labels.tolist() == [18, 19, 7, 8]
    assert mask.tolist() == [0, 0, 1, 1]


def test_micro_batches_are_sized_to_the_rows_and_every_replica_gets_the_same_shapes():
    """Rows of 3-40 tokens at seq 64, micro-batch 2 (128 tokens a micro-batch): longest first,
    each step padded to its longest row rounded up to 8, as many rows as fit 128 tokens; every
    replica the same shapes; every row scored once. Before, each row was a whole seq-long
    sequence: here 20 x 64 = 1,280 tokens; now 592 for the rows' 415."""
    rng = np.random.default_rng(1)
    rows = [(list(rng.integers(1, 99, int(n) - 2)), [5, 6]) for n in rng.integers(4, 42, 20)]
    lengths = [row_length(c, x, 64) for c, x in rows]
    plan = score_plan(lengths, dp=2, seq=64, micro_batch=2)
    assert [s.length for s in plan] == sorted((s.length for s in plan), reverse=True)
    for step in plan:
        assert step.length % 8 == 0 and step.rows * step.length <= 128
        assert all(len(sequence) == 1 for r in step.replicas for sequence in r)  # not packed
        mine = [i for r in step.replicas for sequence in r for i in sequence]
        assert max(lengths[i] for i in mine) <= step.length < max(lengths[i] for i in mine) + 8
    assert sorted(i for s in plan for r in range(2) for i in scored_rows(s, r)) == list(range(20))
    assert computed_tokens(plan, 2) <= 1.5 * sum(lengths) and computed_tokens(plan, 2) < 640
    for replica in (0, 1):
        batches = replica_batches(rows, plan, replica)
        assert [b["tokens"].shape for b in batches] == [(s.rows, s.length) for s in plan]
        for step, batch in zip(plan, batches):  # each row as row_arrays makes it, then fillers
            assert "segment_ids" not in batch  # nothing to cut: causal attention as it is
            assert (batch["row_ids"][:, 0] == np.arange(step.rows) * (np.arange(step.rows) < len(
                step.replicas[replica]))).all()
            for j, i in enumerate(scored_rows(step, replica)):
                tokens, labels, mask = row_arrays(*rows[i], step.length)
                assert (batch["tokens"][j] == tokens).all() and (batch["loss_mask"][j] == mask).all()
            assert batch["loss_mask"][len(step.replicas[replica]):].sum() == 0
    empty = score_plan([], dp=4, seq=64, micro_batch=2)  # every rank still takes part
    assert len(empty) == 1 and replica_batches([], empty, 3)[0]["loss_mask"].sum() == 0
    assert score_plan([64], dp=1, seq=64, micro_batch=1)[0].length == 64


def test_rows_are_packed_best_fit_each_in_its_own_segment_with_positions_from_zero():
    """Packed (eval.pack_length 64): the same rows, several to a sequence, best-fit decreasing;
    each row's tokens, labels and mask as row_arrays makes it, at an offset, its positions
    restarting at 0, its own segment and row id; fewer tokens computed than one row a
    sequence (592 above)."""
    from launcher.evals.rows import packed_sequences

    assert packed_sequences([7, 5, 4, 3, 1], 8) == [(0, 4), (1, 3), (2,)]  # the best fit
    assert packed_sequences([12, 3], 8) == [(0,), (1,)]  # longer than a pack: its own
    rng = np.random.default_rng(1)
    rows = [(list(rng.integers(1, 99, int(n) - 2)), [5, 6]) for n in rng.integers(4, 42, 20)]
    lengths = [row_length(c, x, 64) for c, x in rows]
    plan = score_plan(lengths, dp=2, seq=64, micro_batch=2, packing=Packing(64))
    assert sorted(i for s in plan for r in range(2) for i in scored_rows(s, r)) == list(range(20))
    assert max(len(q) for s in plan for r in s.replicas for q in r) >= 3
    assert computed_tokens(plan, 2) < 592 and computed_tokens(plan, 2) <= 1.25 * sum(lengths)
    for replica in (0, 1):
        for step, batch in zip(plan, replica_batches(rows, plan, replica)):
            assert batch["tokens"].shape == (step.rows, step.length) and "segment_ids" in batch
            ids = scored_rows(step, replica)
            for j, sequence in enumerate(step.replicas[replica]):
                at = 0
                assert sum(lengths[i] for i in sequence) <= step.length
                for k, i in enumerate(sequence):
                    n = lengths[i]
                    tokens, labels, mask = row_arrays(*rows[i], n)
                    part = slice(at, at + n)
                    assert (batch["tokens"][j, part] == tokens).all()
                    assert (batch["labels"][j, part] == labels).all()
                    assert (batch["loss_mask"][j, part] == mask).all()
                    assert (batch["position_ids"][j, part] == np.arange(n)).all()
                    assert (batch["segment_ids"][j, part] == k).all()
                    assert (batch["row_ids"][j, part] == ids.index(i)).all()
                    at += n
                assert batch["loss_mask"][j, at:].sum() == 0  # the padding counts nothing
            assert batch["loss_mask"][len(step.replicas[replica]):].sum() == 0  # fillers


def test_the_pack_length_follows_the_attention():
    """THD sequences (Transformer Engine): the whole sequence; an explicit mask: 0.3 x hidden,
    a multiple of 8; nothing packed where it is unchecked (a window under THD) or impossible
    (context parallelism without THD); under CP each row's room a multiple of 2 x CP."""
    assert packing_for(0, seq=2048, hidden=256, thd=True) == Packing(2048)
    assert packing_for(0, seq=2048, hidden=256, thd=False) == Packing(72)
    assert packing_for(0, seq=64, hidden=4096, thd=False) == Packing(64)
    assert packing_for(96, seq=2048, hidden=256, thd=False) == Packing(96)
    assert packing_for(4096, seq=2048, hidden=256, thd=True) == Packing(2048)
    assert packing_for(0, seq=2048, hidden=256, thd=True, window=128) == Packing()
    assert packing_for(0, seq=2048, hidden=256, thd=False, cp=2) == Packing()
    assert packing_for(0, seq=2048, hidden=256, thd=True, cp=2) == Packing(2048, 4)
    plan = score_plan([5, 5, 5], dp=1, seq=16, micro_batch=1, packing=Packing(16, 4))
    assert [q for s in plan for q in s.replicas[0]] == [(0, 1), (2,)]  # rooms of 8, not 5


def test_rolling_windows_cover_every_token_once():
    class Req:
        def __init__(self, text):
            self.args = (text,)

    seen = []

    def score(rows):
        seen.extend(rows)
        return [(-float(len(cont)), True) for _, cont in rows]

    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    totals = rolling([Req("abcdefghij"), Req("xyz")], encode, eot=0, max_length=4, score=score)
    assert totals == [-10.0, -3.0]  # every token scored once, each text on its own
    assert all(len(ctx) + len(cont) <= 5 for ctx, cont in seen)


def test_evaluations_and_their_price():
    from launcher.plan.resilience import evaluations, planned_tasks_s

    assert evaluations(200, 50, True) == 4 and evaluations(210, 50, True) == 5
    assert evaluations(210, 50, False) == 4 and evaluations(30, 0, True) == 1
    assert evaluations(30, 0, False) == 0
    # 3,000 tokens of rows on 2 replicas of micro-batches of 4 x 64 tokens: 6 forward passes
    # (3,000 / 512, rounded up), each a third of 1/4 step
    assert planned_tasks_s(1.2, 3000, 2 * 4 * 64, 4) == pytest.approx(6 * 1.2 / 4 / 3)
    assert planned_tasks_s(1.2, 0, 512, 4) == 0


def test_metric_table_keeps_finite_metrics_without_filter_or_stderr():
    table = metric_table({"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A",
                                "acc_norm,none": 0.25, "sample_len": 8, "x,none": math.nan}})
    assert table == {"t": {"acc": 0.5, "acc_norm": 0.25, "examples": 8.0}}


@pytest.mark.slow
def test_evaluate_refuses_what_it_cannot_score_before_any_rank(tmp_path):
    def evaluate(*args):
        return subprocess.run([sys.executable, "-m", "launcher.evaluate", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})

    proc = evaluate("eval.tasks=[tw_facts]")
    assert proc.returncode == 2 and "missing checkpoint=" in proc.stderr
    proc = evaluate(f"checkpoint={tmp_path}", "eval.tasks=[tw_facts]")
    assert proc.returncode == 2 and "no complete trainwright checkpoint" in proc.stderr
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    proc = evaluate(f"checkpoint={tmp_path / 'hf'}", "eval.tasks=[nope]",
                    "eval.tokenizer=/nowhere.json")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no task named 'nope'" in proc.stderr and "/nowhere.json does not exist" in proc.stderr
    proc = evaluate(f"checkpoint={tmp_path / 'hf'}", "eval.tasks=[tw_facts]")
    assert proc.returncode == 2 and "eval.tasks needs a tokenizer" in proc.stderr
