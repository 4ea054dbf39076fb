"""kill -9 at any moment leaves no partial file under a final name; a re-run finishes the job and
gives exactly the output of an uninterrupted run. A dead worker fails the run (non-zero exit)."""

from __future__ import annotations

import signal
import time

import pytest
from tests.helpers.data_prep import PYTHON, kill_group, load, prepare, shard_bytes, start_in_own_group, stdlib_documents, worker_processes, write_jsonl
from megatron.core.datasets.indexed_dataset import IndexedDataset

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("data_prep_resume")]

ARGS = ["tokenizer.kind=byte", "block_bytes=16384", "shard_tokens=40000", "name=c"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    docs = stdlib_documents(200, offset=500, max_chars=12_000)
    write_jsonl(root / "a.jsonl", docs[:120])
    write_jsonl(root / "b.jsonl.zst", docs[120:])
    reference = root / "reference"
    prepare(f"input=[{root / 'a.jsonl'},{root / 'b.jsonl.zst'}]", f"output={reference}", "workers=1", *ARGS)
    return root, reference


def _start(root, out, workers):
    cmd = [PYTHON, "-m", "data_prep", f"input=[{root / 'a.jsonl'},{root / 'b.jsonl.zst'}]",
           f"output={out}", f"workers={workers}", "progress=false", *ARGS]
    return start_in_own_group(cmd)


def _wait_for_shards(out, count, proc, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        manifest = out / "manifest.json"
        try:
            if manifest.exists() and len(load(manifest)["shards"]) >= count:
                return True
        except ValueError:
            pass
        time.sleep(0.005)
    return False


def _assert_no_partial_final_files(out):
    for path in out.glob("*.idx"):
        dataset = IndexedDataset(str(path.with_suffix("")), mmap=False)
        expected = int(dataset.sequence_lengths.sum()) * dataset.index.dtype_size
        assert path.with_suffix(".bin").stat().st_size == expected, path


@pytest.mark.parametrize("workers,kill_after", [(1, 3), (2, 6), (1, 0)])
def test_kill_9_then_rerun_equals_uninterrupted(corpus, tmp_path, workers, kill_after):
    root, reference = corpus
    out = tmp_path / "out"
    proc = _start(root, out, workers)
    if kill_after:
        assert _wait_for_shards(out, kill_after, proc), "run finished before it could be killed"
    else:
        time.sleep(0.3)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    if out.exists():
        _assert_no_partial_final_files(out)
        assert not load(out / "manifest.json")["complete"] if (out / "manifest.json").exists() else True
    rerun = prepare(f"input=[{root / 'a.jsonl'},{root / 'b.jsonl.zst'}]", f"output={out}",
                    f"workers={workers}", *ARGS)
    assert rerun.returncode == 0
    assert shard_bytes(out) == shard_bytes(reference)
    got, want = load(out / "manifest.json"), load(reference / "manifest.json")
    assert got["shards"] == want["shards"] and got["totals"] == want["totals"]
    assert not list(out.glob("*.tmp"))


def test_rerun_keeps_intact_shards_and_redoes_damaged_ones(corpus, tmp_path):
    root, reference = corpus
    out = tmp_path / "out"
    args = [f"input=[{root / 'a.jsonl'},{root / 'b.jsonl.zst'}]", f"output={out}", "workers=1", *ARGS]
    prepare(*args)
    shards = load(out / "manifest.json")["shards"]
    first_bin = out / f"{shards[0]['prefix']}.bin"
    damaged = out / f"{shards[3]['prefix']}.bin"
    before = first_bin.stat().st_mtime_ns
    damaged.write_bytes(damaged.read_bytes()[:-2])
    (out / "manifest.json").write_text((out / "manifest.json").read_text().replace('"complete": true', '"complete": false'))
    prepare(*args)
    assert first_bin.stat().st_mtime_ns == before, "intact shards are not rewritten"
    assert shard_bytes(out) == shard_bytes(reference)


def test_output_of_another_run_is_refused(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "out"
    prepare(f"input={root / 'a.jsonl'}", f"output={out}", "workers=1", *ARGS)
    other = prepare(f"input={root / 'b.jsonl.zst'}", f"output={out}", "workers=1", *ARGS, check=False)
    assert other.returncode == 2 and "overwrite=true" in other.stderr
    forced = prepare(f"input={root / 'b.jsonl.zst'}", f"output={out}", "workers=1", "overwrite=true", *ARGS)
    assert forced.returncode == 0


def test_a_dead_worker_fails_the_run(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "out"
    proc = _start(root, out, workers=2)
    deadline = time.time() + 30
    workers = []
    while time.time() < deadline and not workers and proc.poll() is None:
        workers = worker_processes(proc.pid)
        time.sleep(0.01)
    assert workers, "no worker process seen"
    workers[0].kill()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "worker process died" in stderr
    manifest = out / "manifest.json"
    assert not manifest.exists() or not load(manifest)["complete"]
    _assert_no_partial_final_files(out)


@pytest.mark.parametrize("workers", [1, 2])
def test_kill_9_before_the_first_commit_then_rerun(tmp_path, workers):
    """Killed while its first shard is still a .tmp: the run had already written its manifest
    (no shards yet, its fingerprint), so the re-run knows the leftovers as its own, removes them
    and finishes; without that manifest it refused the directory ('shard files but no
    manifest')."""
    path = write_jsonl(tmp_path / "big.jsonl", stdlib_documents(200, offset=500, max_chars=12_000) * 30)
    out = tmp_path / "out"
    cmd = [PYTHON, "-m", "data_prep", f"input={path}", f"output={out}", f"workers={workers}",
           "progress=false", "tokenizer.kind=byte", "block_bytes=65536", "name=c"]
    proc = start_in_own_group(cmd)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not list(out.glob("c_*.bin.tmp")):
        time.sleep(0.002)
    assert proc.poll() is None, "the run ended before its first shard file was seen"
    kill_group(proc)
    assert load(out / "manifest.json")["shards"] == []
    prepare(f"input={path}", f"output={out}", f"workers={workers}", "tokenizer.kind=byte",
            "block_bytes=65536", "name=c")
    prepare(f"input={path}", f"output={tmp_path / 'reference'}", "workers=1", "tokenizer.kind=byte",
            "block_bytes=65536", "name=c")
    assert shard_bytes(out) == shard_bytes(tmp_path / "reference")
