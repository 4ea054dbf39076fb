"""The data a run reads is checked against the model before launch: a data_prep corpus whose
tokenizer vocabulary exceeds model.vocab_size is refused by launcher.train and launcher.submit
(exit 2, naming the manifest and the fix) before any process, run directory or job exists."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from data_prep.cli import compose
from data_prep.run import execute
from tests.helpers.data_prep import run_module, stdlib_documents, write_jsonl
from launcher.plan.data_check import expected_bin_bytes, shard_problems, vocab_problems


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A real data_prep output (byte tokenizer) and the name of its generated data config."""
    root = tmp_path_factory.mktemp("corpus")
    src = write_jsonl(root / "docs.jsonl", stdlib_documents(6, max_chars=2000))
    out = root / "out"
    execute(compose([f"input=[{src}]", f"output={out}", "tokenizer.kind=byte", "workers=1",
                     "progress=false", "name=bytes"]))
    return out


def _vocab(out) -> int:
    return json.loads((out / "manifest.json").read_text())["tokenizer"]["vocab_size"]


def test_vocab_problems_name_manifest_and_fix(corpus):
    prefixes = yaml.safe_load((corpus / "data.yaml").read_text())["prefixes"]
    vocab = _vocab(corpus)
    assert vocab_problems(prefixes, vocab) == [] and vocab_problems(prefixes, vocab + 1) == []
    (problem,) = vocab_problems(prefixes, vocab - 1)
    assert f"model.vocab_size={vocab - 1}" in problem and f"vocab_size={vocab}" in problem
    assert str(corpus / "manifest.json") in problem and f"set model.vocab_size={vocab}" in problem
    assert vocab_problems([str(corpus / "elsewhere" / "x")], 8) == []  # no manifest: unchecked


@pytest.mark.parametrize("module", ["launcher.train", "launcher.submit"])
def test_too_small_model_vocab_exits_2_before_launch(corpus, module, tmp_path):
    vocab = _vocab(corpus)
    proc = run_module(module, f"hydra.searchpath=[file://{corpus / 'conf'}]", "data=bytes",
                      f"model.vocab_size={vocab - 16}", f"run.output_root={tmp_path}",
                      "submit.dry_run=true" if module == "launcher.submit" else "run.name=x")
    assert proc.returncode == 2, proc.stderr
    assert f"set model.vocab_size={vocab}" in proc.stderr
    assert not any(tmp_path.iterdir())  # no run directory, no script


def _shards(corpus) -> list[str]:
    return yaml.safe_load((corpus / "data.yaml").read_text())["prefixes"]


def test_expected_bin_size_agrees_with_megatron_core_reader(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in _shards(corpus):
        index = IndexedDataset(prefix).index
        itemsize = index.dtype_size
        described = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * itemsize
        assert expected_bin_bytes(prefix + ".idx") == described
        assert described == (corpus / (prefix + ".bin")).stat().st_size
    assert shard_problems(_shards(corpus)) == []


def _damaged_copy(corpus, tmp_path, how):
    """A copy of the corpus with its first shard's .bin (or .idx) damaged."""
    import shutil

    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    first = _shards(corpus)[0].replace(str(corpus), str(copy))
    how(first)
    return copy, first


@pytest.mark.parametrize("damage,expect", [
    ("truncate", "truncated"), ("grow", "longer"), ("bad_index", "bad header"),
    ("missing", "does not exist")])
def test_damaged_shards_are_named(corpus, tmp_path, damage, expect):
    def how(prefix):
        if damage == "truncate":
            os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") // 2)
        elif damage == "grow":
            with open(prefix + ".bin", "ab") as f:
                f.write(b"\0" * 8)
        elif damage == "bad_index":
            with open(prefix + ".idx", "r+b") as f:
                f.write(b"XXXX")
        else:
            os.remove(prefix + ".bin")

    copy, first = _damaged_copy(corpus, tmp_path, how)
    prefixes = [p.replace(str(corpus), str(copy)) for p in _shards(corpus)]
    (problem,) = shard_problems(prefixes)
    assert expect in problem and first in problem


def test_truncated_shard_exits_2_before_spawning(corpus, tmp_path):
    copy, first = _damaged_copy(
        corpus, tmp_path, lambda p: os.truncate(p + ".bin", os.path.getsize(p + ".bin") // 2))
    conf = copy / "conf"
    for yml in conf.rglob("*.yaml"):
        yml.write_text(yml.read_text().replace(str(corpus), str(copy)))
    out = tmp_path / "runs"
    proc = run_module("launcher.train", f"hydra.searchpath=[file://{conf}]", "data=bytes",
                      f"run.output_root={out}", "run.name=x")
    assert proc.returncode == 2, proc.stderr
    assert f"{first}.bin is " in proc.stderr and "truncated" in proc.stderr
    assert "python -m data_prep" in proc.stderr
    assert not out.exists()  # nothing started, no run directory


def test_a_split_left_without_documents_is_refused(corpus, tmp_path):
    """Megatron-Core splits each shard by documents; a split with none would make its dataset
    builder loop forever (found with a 16-document corpus and data.split=98,1,1)."""
    from launcher.plan.data_check import document_count, split_problems

    prefixes = _shards(corpus)
    docs = sum(document_count(p + ".idx") for p in prefixes)
    assert docs == 6  # the corpus fixture's documents
    (problem,) = split_problems(prefixes[:1], "98,1,1")
    assert "leaves the validation split no document of" in problem and prefixes[0] in problem
    # the fix it suggests composes as written (unquoted commas were a Hydra list: exit 2)
    suggested = problem.split("(e.g. '")[1].split("'")[0]
    from launcher.compose import compose_config

    assert compose_config([suggested]).data.split == "80,10,10"
    assert split_problems(prefixes, "34,33,33") == []
    assert split_problems(prefixes, "100,0,0") == []  # an unweighted split is not built
    proc = run_module("launcher.train", f"hydra.searchpath=[file://{corpus / 'conf'}]",
                      "data=bytes", f"run.output_root={tmp_path}", "run.name=x")
    assert proc.returncode == 2 and "data.split=98,1,1 leaves the validation split" in proc.stderr
    assert not (tmp_path / "x").exists()
