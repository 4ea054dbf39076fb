"""recipes/data_prep_array.sbatch on the real one-node Slurm of this machine (.ci/slurm_up.sh): a
task warned of its time limit (SIGUSR1 to the batch shell, as ``--signal=B:USR1@300`` sends it)
stops with its committed shards, requeues itself, resumes after them, and the merge job (queued
once) combines both tasks into the documents of a run that was never stopped."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from tests.helpers.data_prep import load, prepare, read_documents, stdlib_documents, write_jsonl

from tests.helpers.slurm import REPO, job_env, job_info, sbatch, start_requeued_job_now, wait_job

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]
SETTINGS = ("data_prep=cl100k tokenizer.backend=native name=c block_bytes=1048576 "
            "shard_bytes=4000000")
"""tiktoken's own library (about 11 MB/s on one core here), so that a task runs for seconds."""


def _corpus(root):
    """Two files of about 40 MB each (about 4 s of tokenizing each)."""
    docs = stdlib_documents(200, offset=500, max_chars=12_000)
    for name in ("a", "b"):
        write_jsonl(root / f"{name}.jsonl", docs * 40)
    return root / "*.jsonl"


def _logs(tmp_path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted(tmp_path.glob("*.out")))


def _signal_when_a_shard_is_committed(manifest, task: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if load(manifest)["shards"]:
                break
        except (OSError, ValueError):
            pass
        assert job_info(task).get("JobState") in ("PENDING", "RUNNING"), job_info(task)
        time.sleep(0.05)
    subprocess.run(["scancel", "--batch", "--signal=USR1", task], check=True, timeout=30)


def test_a_task_warned_of_its_time_limit_requeues_and_resumes(slurm, tmp_path):
    inputs, out = _corpus(tmp_path), tmp_path / "out"
    job = sbatch("--array=0-1", "--cpus-per-task=1", f"--output={tmp_path}/task-%A_%a.out",
                 str(REPO / "recipes" / "data_prep_array.sbatch"), str(inputs), str(out),
                 env=job_env(DATA_PREP_ARGS=SETTINGS), cwd=tmp_path)
    first, second = f"{job}_0", f"{job}_1"
    _signal_when_a_shard_is_committed(out / "manifest.task-00000-of-00002.json", first)
    deadline = time.monotonic() + 120
    while job_info(first).get("Restarts", "0") == "0" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_info(first)["Restarts"] == "1", _logs(tmp_path)
    start_requeued_job_now(first)
    for task in (first, second):
        info = wait_job(task, timeout=300, logs=tmp_path)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _logs(tmp_path)
    log = (tmp_path / f"task-{job}_0.out").read_text()
    assert "stopped for requeue (SIGUSR1)" in log and "requeueing job" in log
    assert "restart 1" in log and log.count("Submitted batch job") == 1  # one merge job
    merge = log.split("Submitted batch job")[1].split()[0]
    assert wait_job(merge, timeout=300, logs=tmp_path)["JobState"] == "COMPLETED", _logs(tmp_path)
    assert (tmp_path / f"data_prep_merge_{merge}.out").is_file()  # beside the tasks' logs
    assert load(out / "manifest.json")["complete"]
    prepare(f"input={inputs}", f"output={tmp_path / 'reference'}", "workers=1",
            *SETTINGS.split())
    got, want = read_documents(out), read_documents(tmp_path / "reference")
    assert len(got) == len(want) and all(np.array_equal(x, y) for x, y in zip(got, want))


def test_a_stop_inside_a_commit_leaves_no_file_of_the_shard(tmp_path, monkeypatch):
    """A stop signal between commit()'s two renames: abandoning the shard must not fail on the
    .bin.tmp already renamed (a FileNotFoundError hid the stop, so the task was not requeued),
    and no file of the shard the manifest never listed may stay under a final name."""
    import os

    from data_prep.errors import StopForRequeue
    from data_prep.shards import ShardWriter

    writer = ShardWriter(str(tmp_path), "c_00000", np.uint16)
    writer.add(np.arange(10, dtype=np.uint16), np.array([4, 6], dtype=np.int32))
    real_replace, renames = os.replace, []

    def stopped_after_the_first(src, dst):
        if renames:
            raise StopForRequeue("signal 10")
        renames.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", stopped_after_the_first)
    with pytest.raises(StopForRequeue):
        writer.commit()
    assert renames == [str(tmp_path / "c_00000.bin")]
    writer.abandon()
    assert list(tmp_path.iterdir()) == []


def test_sigusr1_to_the_whole_group_twice_stops_for_requeue_once(tmp_path):
    """The early warning as a scheduler may deliver it: to every process of the run, and again.
    Workers ignore it, the main process stops once (exit 75, shards kept, lock released), and the
    re-run writes the bytes of a run that was never stopped."""
    import os
    import signal

    from tests.helpers.data_prep import PYTHON, shard_bytes

    from launcher.core.exits import REQUEUE_EXIT

    path = write_jsonl(tmp_path / "a.jsonl", stdlib_documents(200, offset=500, max_chars=12_000) * 4)
    args = [f"input={path}", "workers=2", "progress=false", "tokenizer.kind=byte", "name=c",
            "block_bytes=16384", "shard_tokens=40000"]
    out = tmp_path / "out"
    proc = subprocess.Popen([PYTHON, "-m", "data_prep", f"output={out}", *args], cwd=REPO,
                            start_new_session=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if load(out / "manifest.json")["shards"]:
                break
        except (OSError, ValueError):
            time.sleep(0.005)
    for _ in range(2):
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(0.02)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == REQUEUE_EXIT, stderr
    assert stderr.count("stopped for requeue (SIGUSR1)") == 1
    assert not load(out / "manifest.json")["complete"]
    assert not list(out.glob("*.tmp")) and not list(out.glob(".data_prep*.lock"))
    prepare(f"output={out}", *args)
    prepare(f"output={tmp_path / 'reference'}", *args)
    assert shard_bytes(out) == shard_bytes(tmp_path / "reference")


def test_chat_array_tasks_and_their_merge_under_slurm(slurm, tmp_path):
    """format=chat through the same recipe: two array tasks render, mask and pack a share of the
    conversations each, and the merge job (queued by task 0) writes one chat manifest and data
    config over both."""
    import json

    from tests.helpers.chat import chatml_tokenizer

    tok = chatml_tokenizer(tmp_path / "tok", 600)
    (tmp_path / "in").mkdir()
    for name, first in (("a", 0), ("b", 50)):
        (tmp_path / "in" / f"{name}.jsonl").write_text("".join(json.dumps(
            {"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i} " * (1 + i % 7)}]}) + "\n"
            for i in range(first, first + 50)))
    out = tmp_path / "out"
    args = (f"format=chat tokenizer.kind=hf tokenizer.path={tok} chat.template=chatml "
            "seq_length=127 progress=false")
    job = sbatch("--array=0-1", "--cpus-per-task=1", f"--output={tmp_path}/task-%A_%a.out",
                 str(REPO / "recipes" / "data_prep_array.sbatch"), str(tmp_path / "in"),
                 str(out), env=job_env(DATA_PREP_ARGS=args, PYTHON=sys.executable),
                 cwd=tmp_path)
    for task in (f"{job}_0", f"{job}_1"):
        info = wait_job(task, timeout=300, logs=tmp_path)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _logs(tmp_path)
    merge = (tmp_path / f"task-{job}_0.out").read_text().split("Submitted batch job")[1].split()[0]
    assert wait_job(merge, timeout=300, logs=tmp_path)["JobState"] == "COMPLETED", _logs(tmp_path)
    manifest = load(out / "manifest.json")
    assert manifest["format"] == "chat" and manifest["merged_tasks"] == 2
    assert manifest["totals"]["conversations"] == 100
    assert sorted({s["task"] for s in manifest["shards"]}) == [0, 1]
    assert "format: chat" in (out / "data.yaml").read_text()
    assert "conversations in" in (tmp_path / f"data_prep_merge_{merge}.out").read_text()
