"""The data a run reads is checked against the model before launch: a data_prep corpus whose
tokenizer vocabulary exceeds model.vocab_size is refused by launcher.train and launcher.submit
(exit 2, naming the manifest and the fix) before any process, run directory or job exists."""

from __future__ import annotations

import json

import pytest
import yaml

from data_prep.cli import compose
from data_prep.run import execute
from tests.helpers.data_prep import run_module, stdlib_documents, write_jsonl
from launcher.plan.data_check import vocab_problems


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
