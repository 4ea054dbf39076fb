"""lm-evaluation-harness's own task names (issue 47): arc_easy runs offline from the local
datasets cache (a copy laid out as ``load_dataset`` leaves it, tests/helpers/hf_cache.py) and
scores like the HF backend; a task whose data are not cached (hellaswag) exits 2 before any rank
starts, naming the dataset and how to bring it, with nothing downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.data_prep import train_hf_tokenizer
from tests.helpers.hf_cache import cache_dataset
from tests.helpers.training import REPO

pytestmark = pytest.mark.slow


def arc_rows(n: int, seed: int) -> list:
    import random

    rng = random.Random(seed)
    words = "cold warm river stone seven cloud apple night green water".split()
    return [{"id": f"q{i}", "question": f"Which word goes with {rng.choice(words)}?",
             "choices": {"text": rng.sample(words, 4), "label": ["A", "B", "C", "D"]},
             "answerKey": rng.choice("ABCD")} for i in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(a tiny random Llama with its tokenizer, the environment of a machine whose datasets
    cache holds ARC-Easy and nothing else)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("harness_tasks")
    tokenizer = train_hf_tokenizer(root, vocab_size=500)
    hf = root / "hf"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer))
    tok.eos_token = tok.convert_ids_to_tokens(0)
    tok.save_pretrained(hf)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=128,
                                 bos_token_id=0, eos_token_id=0)).save_pretrained(hf)
    cache = root / "hf_home" / "datasets"
    cache_dataset(cache, "allenai/ai2_arc", "ARC-Easy",
                  {split: arc_rows(10, seed) for seed, split in
                   enumerate(("train", "validation", "test"))})
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled",
           "HF_HOME": str(root / "hf_home"), "HF_DATASETS_CACHE": str(cache),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return hf, env


def evaluate(hf, env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.evaluate", f"checkpoint={hf}",
                           "trainer.precision=fp32", "eval.format=json", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_an_lm_eval_task_name_runs_offline_from_the_datasets_cache(setup):
    """Scored by launcher.evaluate (2 ranks) and by the HF backend in a process of the same
    environment: the same acc and acc_norm."""
    hf, env = setup
    proc = evaluate(hf, env, "eval.tasks=[arc_easy]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads(proc.stdout.strip().splitlines()[-1])["tasks"]["arc_easy"]
    assert ours["examples"] == 10
    code = ("import json, sys; from launcher.evals.harness import run_tasks; "
            "from launcher.core.eval_tasks import load_tasks; "
            "from lm_eval.models.huggingface import HFLM; "
            "from transformers import PreTrainedTokenizerFast; "
            f"tok = PreTrainedTokenizerFast.from_pretrained({str(hf)!r}); "
            f"lm = HFLM(pretrained={str(hf)!r}, tokenizer=tok, device='cpu', dtype='float32', "
            "batch_size=4, max_length=128); "
            "print(json.dumps(run_tasks(load_tasks(['arc_easy'], []), lm)['arc_easy']))")
    theirs = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    want = json.loads(theirs.stdout.strip().splitlines()[-1])
    assert ours["acc"] == want["acc"] and ours["acc_norm"] == want["acc_norm"]


def test_an_lm_eval_task_whose_data_are_not_cached_exits_2_naming_it(setup):
    hf, env = setup
    proc = evaluate(hf, env, "eval.tasks=[hellaswag]")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "task hellaswag" in proc.stderr and "Rowan/hellaswag" in proc.stderr
    assert "not in this machine's datasets cache" in proc.stderr
    assert "datasets.load_dataset('Rowan/hellaswag')" in proc.stderr
    assert "rank" not in proc.stdout.lower()  # refused before any rank started
