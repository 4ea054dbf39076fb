"""1 vs N workers, Slurm-array split plus merge, and the generated data config."""

from __future__ import annotations

import numpy as np
import pytest
from tests.helpers.data_prep import load, prepare, read_documents, run_module, shard_bytes, stdlib_documents, write_jsonl

from launcher.compose import compose_config

pytestmark = pytest.mark.xdist_group("data_prep_parallel")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = stdlib_documents(90, offset=300, max_chars=20_000)
    for i in range(3):
        write_jsonl(root / f"part{i}.jsonl", docs[i * 30:(i + 1) * 30])
    write_jsonl(root / "part3.jsonl.gz", docs[:10])
    specs = f"input=[{root}/part*.jsonl,{root}/part3.jsonl.gz]"
    return specs, docs + docs[:10]


COMMON = ["tokenizer.kind=tiktoken", "tokenizer.path=cl100k_base", "block_bytes=65536", "shard_tokens=60000",
          "name=corpus"]


@pytest.mark.slow
def test_one_and_two_workers_write_identical_bytes(corpus, tmp_path):
    specs, docs = corpus
    prepare(specs, f"output={tmp_path / 'w1'}", "workers=1", *COMMON)
    prepare(specs, f"output={tmp_path / 'w2'}", "workers=2", *COMMON)
    one, two = shard_bytes(tmp_path / "w1"), shard_bytes(tmp_path / "w2")
    assert len(one) >= 6 and one == two
    m1, m2 = load(tmp_path / "w1" / "manifest.json"), load(tmp_path / "w2" / "manifest.json")
    assert m1["shards"] == m2["shards"] and m1["totals"] == m2["totals"]
    assert m1["totals"]["documents"] == len(docs)


@pytest.mark.slow
def test_array_split_and_merge_equal_a_single_run(corpus, tmp_path):
    specs, docs = corpus
    single, split = tmp_path / "single", tmp_path / "split"
    prepare(specs, f"output={single}", "workers=1", *COMMON)
    for task in range(2):
        prepare(specs, f"output={split}", "workers=1", "num_tasks=2", f"task_index={task}", *COMMON)
    assert not (split / "manifest.json").exists()
    merged = run_module("data_prep.merge", str(split), check=True)
    assert "corpus" in merged.stdout
    one, two = load(single / "manifest.json"), load(split / "manifest.json")
    assert two["merged_tasks"] == 2 and two["complete"]
    for key in ("documents", "tokens", "skipped", "records"):
        assert one["totals"][key] == two["totals"][key]
    assert [f["path"] for f in one["inputs"]] == [f["path"] for f in two["inputs"]]
    a, b = read_documents(single), read_documents(split)
    assert len(a) == len(b) == len(docs) and all(np.array_equal(x, y) for x, y in zip(a, b))
    data = compose_config([f"hydra.searchpath=[file://{split}/conf]", "data=corpus"]).data
    assert list(data.prefixes) == [str(split / s["prefix"]) for s in two["shards"]]
    assert {p.split("/")[-1].rsplit("_", 1)[0] for p in data.prefixes} == {"corpus_task00000", "corpus_task00001"}


def test_merge_refuses_missing_tasks(corpus, tmp_path):
    specs, _ = corpus
    prepare(specs, f"output={tmp_path}", "workers=1", "num_tasks=3", "task_index=1", *COMMON)
    proc = run_module("data_prep.merge", str(tmp_path))
    assert proc.returncode == 2 and "missing [0, 2]" in proc.stderr


def test_slurm_variables_pick_the_task(corpus, tmp_path, monkeypatch):
    from data_prep.plan import task_layout

    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "5")
    assert task_layout(0, -1) == (4, 2)
    assert task_layout(2, 1) == (2, 1)


def test_data_yaml_composes_into_the_training_config(corpus, tmp_path):
    specs, _ = corpus
    out = tmp_path / "out"
    prepare(specs, f"output={out}", "workers=1", *COMMON)
    manifest = load(out / "manifest.json")
    cfg = compose_config([f"hydra.searchpath=[file://{out}/conf]", "data=corpus"])
    assert cfg.data.name == "corpus" and cfg.data.eod_token_id == 100257
    assert list(cfg.data.prefixes) == [str(out / s["prefix"]) for s in manifest["shards"]]
    assert list(cfg.data.weights) == [float(s["tokens"]) for s in manifest["shards"]]
    assert cfg.data.tokenizer_path == manifest["tokenizer"]["path"]
    assert (out / "data.yaml").read_text() == (out / "conf" / "data" / "corpus.yaml").read_text()


@pytest.mark.slow
def test_sbatch_recipe_runs_a_task_and_queues_the_merge(corpus, tmp_path):
    """The recipe with Slurm's array variables and a stand-in sbatch that records the merge job."""
    import os
    import subprocess

    from tests.helpers.data_prep import PYTHON, REPO

    specs, _ = corpus
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'sbatch_args'}\n")
    (bindir / "sbatch").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", PYTHON=PYTHON, PYTHONPATH=str(REPO),
               SLURM_ARRAY_JOB_ID="42", SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_TASK_MIN="0",
               SLURM_ARRAY_TASK_COUNT="2", SLURM_CPUS_PER_TASK="1",
               DATA_PREP_ARGS="tokenizer.kind=byte name=corpus")
    glob_spec = specs[len("input=["):-1].split(",")[0]
    proc = subprocess.run(["bash", str(REPO / "recipes" / "data_prep_array.sbatch"), glob_spec, str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    task = load(tmp_path / "out" / "manifest.task-00000-of-00002.json")
    assert task["complete"] and task["task"] == {"index": 0, "count": 2}
    recorded = (tmp_path / "sbatch_args").read_text()
    assert "--dependency=afterok:42" in recorded and "data_prep.merge" in recorded
    assert "data_prep: tokenizing" in proc.stderr  # the task's log gets progress lines


TRAINING_READER = """
import sys, numpy as np, torch.distributed as dist
from launcher.compose import compose_config
from launcher.runtime.data import SplitSizes, build_datasets
out, cache = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{cache}/pg", rank=0, world_size=1)
import faulthandler; faulthandler.dump_traceback_later(150, exit=True)
cfg = compose_config([f"hydra.searchpath=[file://{out}/conf]", "data=corpus"])
train, valid, test = build_datasets(cfg.data, seq_length=32, vocab_size=100352, seed=1,
                                    sizes=SplitSizes(40, 4, 4), cache_dir=cache)
tokens = np.concatenate([train[i]["tokens"].numpy() for i in range(len(train))])
print(len(train), int(tokens.max()), int((tokens == cfg.data.eod_token_id).sum()))
"""


@pytest.mark.slow
def test_training_data_pipeline_reads_the_output(corpus, tmp_path):
    """launcher.runtime.data builds Megatron GPTDatasets straight from the generated data config."""
    import subprocess

    from tests.helpers.data_prep import PYTHON, REPO

    specs, _ = corpus
    out = tmp_path / "out"
    # Megatron splits every prefix on its own: each shard needs enough documents for every split.
    prepare(specs, f"output={out}", "workers=1", "split='90,5,5'", *COMMON[:3], "name=corpus")
    (tmp_path / "cache").mkdir()
    proc = subprocess.run([PYTHON, "-c", TRAINING_READER, str(out), str(tmp_path / "cache")], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples, max_id, eods = map(int, proc.stdout.split()[-3:])
    assert samples >= 40 and 0 < max_id <= 100257 and eods >= 0
