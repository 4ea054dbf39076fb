"""Contamination against the run's own shards (issue 37): a task example copied into the training
corpus is flagged, one that is not is not; the shards' own tokenizer, any worker count, bad
arguments exit 2 naming the fix; the hashing unit by unit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_prep.contamination import window_hashes
from launcher.core.eval_tasks import SHIPPED
from tests.helpers.data_prep import run_module, stdlib_documents, write_jsonl

pytestmark = pytest.mark.slow


def lines(name: str) -> list:
    return [json.loads(line) for line in (SHIPPED / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Shards of standard-library code with paragraph 3 and fact question 5 pasted into two of
    its documents (inside other text, as a web page would quote them)."""
    root = tmp_path_factory.mktemp("contam")
    docs = stdlib_documents(30, offset=50, max_chars=20_000)
    docs[4] = docs[4][:3000] + "\n# " + lines("tw_paragraphs")[3]["text"] + "\n" + docs[4][3000:]
    docs[9] = docs[9][:500] + "\n" + lines("tw_facts")[5]["question"] + " four\n" + docs[9][500:]
    write_jsonl(root / "corpus.jsonl", docs)
    run_module("data_prep", f"input={root / 'corpus.jsonl'}", f"output={root / 'out'}",
               "progress=false", "shard_tokens=100000", check=True)
    return root / "out"


def contamination(*args: str):
    return run_module("data_prep.contamination", *args)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_copied_example_is_flagged_and_the_others_are_not(shards, workers):
    proc = contamination(f"shards={shards}", "eval.tasks=[tw_paragraphs,tw_facts]",
                         "format=json", f"workers={workers}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ngram"] == 8 and report["tokens_scanned"] > 200_000
    paragraphs, facts = report["tasks"]["tw_paragraphs"], report["tasks"]["tw_facts"]
    assert paragraphs == {"examples": 8, "contaminated": 1, "share": 1 / 8, "ids": [3],
                          "short": 0}
    assert facts["ids"] == [5] and facts["examples"] == 32 and facts["share"] == 1 / 32


def test_the_text_report_names_counts_and_throughput(shards):
    proc = contamination(f"shards={shards}", "eval.tasks=[tw_paragraphs]", "ngram=13")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "13-grams" in proc.stdout and "tokens/s" in proc.stdout
    assert "tw_paragraphs: 1 of 8 examples (12.5%): 3" in proc.stdout


def test_bad_arguments_exit_2_with_the_fix(tmp_path):
    proc = contamination(f"shards={tmp_path}", "eval.tasks=[nope]", "ngram=0", "colour=red")
    assert proc.returncode == 2 and "unknown key colour" in proc.stderr
    proc = contamination(f"shards={tmp_path}", "eval.tasks=[nope]", "ngram=0")
    assert proc.returncode == 2
    for text in ("not a data_prep output directory", "no task named 'nope'", "ngram=0"):
        assert text in proc.stderr, text


def test_window_hashes_match_equal_windows_only():
    tokens = np.array([5, 6, 7, 8, 5, 6, 7, 9], dtype=np.uint16)
    hashes = window_hashes(tokens, 3)
    assert len(hashes) == 6 and hashes[0] == hashes[4]  # 5 6 7 twice
    assert len(set(hashes.tolist())) == 5
    assert len(window_hashes(tokens[:2], 3)) == 0
    wide = window_hashes(np.array([70000, 1, 2], dtype=np.uint32), 2)
    assert wide[0] != window_hashes(np.array([70000 - 65536, 1], dtype=np.uint32), 2)[0]


@pytest.fixture(scope="module")
def hf_shards(tmp_path_factory):
    """Shards of standard-library code, a byte-level BPE of the tiny model's size, and fact
    question 5 pasted into one document."""
    from tests.helpers.data_prep import train_hf_tokenizer

    root = tmp_path_factory.mktemp("run_contam")
    tokenizer = train_hf_tokenizer(root, vocab_size=500)
    docs = stdlib_documents(20, offset=80, max_chars=20_000)
    docs[3] = docs[3][:800] + "\n" + lines("tw_facts")[5]["question"] + "\n" + docs[3][800:]
    write_jsonl(root / "corpus.jsonl", docs)
    run_module("data_prep", f"input={root / 'corpus.jsonl'}", f"output={root / 'shards'}",
               "progress=false", "tokenizer.kind=hf", f"tokenizer.path={tokenizer}", check=True)
    return root / "shards"


def test_a_run_scores_each_task_beside_its_clean_subset(hf_shards, tmp_path):
    from tests.helpers.training import train

    data = [f"hydra.searchpath=[file://{hf_shards / 'conf'}]", "data=shards",
            'data.split="80,10,10"']
    proc = train(tmp_path, "run", *data, "eval.tasks=[tw_facts]", "eval.contamination=true",
                 "trainer.train_steps=1", "engine=megatron")
    assert "eval.contamination: examples found in the shards (8-grams, 50%): tw_facts 1" \
        in proc.stderr
    [cached] = (hf_shards / "contamination").glob("*.json")
    assert json.loads(cached.read_text())["tasks"]["tw_facts"]["ids"] == [5]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    [scored] = [r for r in rows if "eval/tw_facts/acc" in r]
    assert scored["eval/tw_facts/examples"] == 32 and scored["eval/tw_facts/examples_clean"] == 31
    assert {"eval/tw_facts/acc_clean", "eval/tw_facts/acc_norm_clean"} <= set(scored)
    recorded = (tmp_path / "run" / "config.yaml").read_text()
    assert "contaminated:\n    tw_facts:\n    - 5" in recorded
    again = train(tmp_path, "again", *data, "eval.tasks=[tw_facts]", "eval.contamination=true",
                  "trainer.train_steps=1", "engine=megatron")
    assert "tw_facts 1" in again.stderr and len(list((hf_shards / "contamination").glob("*"))) == 1


def test_contamination_without_shards_exits_2(tmp_path):
    from tests.helpers.data_prep import train_hf_tokenizer
    from tests.helpers.training import train

    tokenizer = train_hf_tokenizer(tmp_path, vocab_size=500)
    proc = train(tmp_path, "mock", "eval.tasks=[tw_facts]", "eval.contamination=true",
                 f"eval.tokenizer={tokenizer}", expect=2)
    assert "eval.contamination needs the run's shards" in proc.stderr
    assert not (tmp_path / "mock").exists()
