"""Checkpoints on object storage, against a real S3 server (SeaweedFS, started by this module):
each engine saves at DP2 to ``s3://``, a run with an empty run directory resumes from the store
bit for bit, keep-k deletes on the store, and only committed steps are ever resumed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.s3 import SECRET_KEY, serve
from tests.helpers.training import steps_of, train

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("s3_store")]

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    yield from serve(tmp_path_factory, BUCKET)


def _rows(run_dir: Path) -> list:
    steps = steps_of(run_dir)
    return [(s, steps[s]["loss"], steps[s]["grad_norm"]) for s in sorted(steps)]


def _events(run_dir: Path, kind: str = "checkpoint") -> list:
    rows = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == kind]


ENGINES = {"megatron": ["engine=megatron", "parallelism.zero_stage=1"],
           "megatron_tp2": ["engine=megatron", "parallelism=tp2"],
           "deepspeed": ["engine=deepspeed", "parallelism.zero_stage=1"],
           "deepspeed_tp2": ["engine=deepspeed", "parallelism=tp2"]}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_saves_to_the_store_and_resumes_bitwise_from_an_empty_run_directory(s3, tmp_path,
                                                                            engine):
    """4 steps at DP2 (and at TP2) saving every 2 to s3://: the store holds both steps, each with its commit
    record listing every object (sizes equal), and nothing of them stays on local disk but the
    newest, kept as a cache; a new run directory (another node) loading step 2 from the store
    repeats steps 3-4 bit for bit."""
    uri = f"s3://{BUCKET}/{engine}/straight"
    common = [*ENGINES[engine], "trainer.global_batch_size=8", "trainer.save_interval=2",
              "trainer.eval_interval=0", "trainer.train_steps=4"]
    train(tmp_path, "straight", *common, f"trainer.checkpoint_uri={uri}", env=s3.env())
    keys = s3.keys(BUCKET, f"{engine}/straight/")
    for step in ("step_000002", "step_000004"):
        record = json.loads(s3.client().get_object(
            Bucket=BUCKET, Key=f"{engine}/straight/{step}/complete")["Body"].read())
        stored = {k.split(f"{step}/", 1)[1]: v for k, v in keys.items() if f"/{step}/" in k}
        assert stored.pop("complete") > 0
        assert record["files"] == stored and record["bytes"] == sum(stored.values()) > 0
        assert any(name.startswith("rng/rank_1") for name in stored)
    local = sorted(p.name for p in (tmp_path / "straight" / "checkpoints").glob("step_*"))
    assert local == ["step_000004"], local
    saved = [e for e in _events(tmp_path / "straight") if " saved" in e["message"]]
    assert [e["uri"] for e in saved] == [f"{uri}/step_000002", f"{uri}/step_000004"]

    train(tmp_path, "resumed", *common, f"trainer.load={uri}/step_000002",
          f"trainer.checkpoint_uri=s3://{BUCKET}/{engine}/resumed", env=s3.env())
    assert _rows(tmp_path / "resumed") == _rows(tmp_path / "straight")[2:]
    loaded = _events(tmp_path / "resumed")[0]["message"]
    assert loaded.startswith("checkpoint step 2 loaded"), loaded


def test_a_requeue_with_an_empty_run_directory_resumes_from_the_newest_commit(s3, tmp_path):
    """keep_last=2 on the store: of steps 2, 4, 6, 8 only 6 and 8 remain, their objects too.
    The run directory deleted (a requeue onto another node), the same run asked for 10 steps
    finds step 8 on the store, downloads it and trains steps 9-10 exactly as a run resumed
    from a local copy of the same 8 steps."""
    uri = f"s3://{BUCKET}/requeue"
    common = ["trainer.global_batch_size=8", "trainer.save_interval=2",
              "trainer.eval_interval=0", "trainer.keep_last=2"]
    train(tmp_path, "local", *common, "trainer.train_steps=8")
    train(tmp_path, "local_more", *common, "trainer.train_steps=10",
          f"trainer.load={tmp_path / 'local' / 'checkpoints' / 'step_000008'}")
    train(tmp_path, "run", *common, "trainer.train_steps=8", f"trainer.checkpoint_uri={uri}",
          env=s3.env())
    folders = {k.split("/")[1] for k in s3.keys(BUCKET, "requeue/") if k.count("/") > 1}
    assert folders == {"step_000006", "step_000008"}, folders
    shutil.rmtree(tmp_path / "run")
    train(tmp_path, "run", *common, "trainer.train_steps=10", f"trainer.checkpoint_uri={uri}",
          env=s3.env())
    assert _rows(tmp_path / "run") == _rows(tmp_path / "local_more")
    assert [r[0] for r in _rows(tmp_path / "run")] == [9, 10]
    folders = {k.split("/")[1] for k in s3.keys(BUCKET, "requeue/") if k.count("/") > 1}
    assert folders == {"step_000008", "step_000010"}, folders
    # another model: refused from the step's metadata alone (its download still under way),
    # exit 2 naming the store's step, before the engine is built; nothing lands locally
    refused = train(tmp_path, "other", *common, "trainer.train_steps=12",
                    f"trainer.load={uri}", "model.num_layers=3", expect=2, env=s3.env())
    assert f"checkpoint {uri}/step_000010 does not match this run's model" in (
        refused.stdout + refused.stderr)
    assert not (tmp_path / "other" / "checkpoints" / "step_000010").exists()


def test_async_saves_upload_as_the_background_writer_closes_files_and_commit(s3, tmp_path):
    """trainer.async_save with a store: Megatron-Core's forked writer stages each step while
    training goes on, its files go up as they close, every step commits with all its files,
    and a run with an empty directory resumes from the newest."""
    uri = f"s3://{BUCKET}/async"
    common = ["engine=megatron", "trainer.global_batch_size=8", "trainer.save_interval=2",
              "trainer.eval_interval=0", "trainer.async_save=true", "trainer.keep_last=3"]
    train(tmp_path, "run", *common, "trainer.train_steps=6", f"trainer.checkpoint_uri={uri}",
          env=s3.env())
    keys = s3.keys(BUCKET, "async/")
    for step in ("step_000002", "step_000004", "step_000006"):
        record = json.loads(s3.client().get_object(
            Bucket=BUCKET, Key=f"async/{step}/complete")["Body"].read())
        assert {f"async/{step}/{name}": size for name, size in record["files"].items()}.items() \
            <= keys.items(), step  # every file the commit lists is there, at its size
    shutil.rmtree(tmp_path / "run")
    train(tmp_path, "run", *common, "trainer.train_steps=8", f"trainer.checkpoint_uri={uri}",
          env=s3.env())
    assert [r[0] for r in _rows(tmp_path / "run")] == [7, 8]


def test_the_secret_reaches_no_file_the_run_wrote(s3, tmp_path):
    train(tmp_path, "secret", "trainer.train_steps=2", "trainer.eval_interval=0",
          f"trainer.checkpoint_uri=s3://{BUCKET}/secret", env=s3.env())
    for path in (tmp_path / "secret").rglob("*"):
        if path.is_file():
            assert SECRET_KEY.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("case", ["bucket", "credentials", "endpoint"])
def test_an_unusable_store_exits_2_before_any_rank_starts(s3, tmp_path, case):
    env = {"bucket": s3.env(), "credentials": s3.env(AWS_SECRET_ACCESS_KEY="wrong-secret-xyz"),
           "endpoint": s3.env(AWS_ENDPOINT_URL_S3="http://127.0.0.1:9")}[case]
    import time

    bucket = "nosuchbucket" if case == "bucket" else BUCKET
    started = time.monotonic()
    proc = train(tmp_path, case, "trainer.train_steps=2",
                 f"trainer.checkpoint_uri=s3://{bucket}/x", env=env, expect=2)
    assert time.monotonic() - started < 40  # compose and plan, then a check of seconds
    err = proc.stderr
    assert "trainer.checkpoint_uri" in err and f"bucket {bucket!r}" in err, err[-2000:]
    assert {"bucket": "does not exist", "credentials": "access denied",
            "endpoint": "does not answer"}[case] in err, err[-2000:]
    assert "wrong-secret-xyz" not in err and SECRET_KEY not in err
    assert not (tmp_path / case / "checkpoints").exists()


HOLD_HOOK = '''
import json, os, time
from s3transfer.manager import TransferManager as _Manager

_holds = json.loads(os.environ.get("TW_TEST_HOLD", "[]"))
_upload = _Manager.upload

def upload(self, fileobj, bucket, key, *args, **kwargs):
    for needle, rank, marker, go in _holds:
        if needle in key and rank in ("any", os.environ.get("RANK")):
            if not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
            while not (go and os.path.exists(go)):  # no go: held until killed
                time.sleep(0.05)
    return _upload(self, fileobj, bucket, key, *args, **kwargs)

_Manager.upload = upload
'''
"""In the runs of these tests only (a sitecustomize on their PYTHONPATH): an upload whose key
holds ``needle``, on rank ``rank``, drops ``marker`` and waits until ``go`` exists (forever
when ``go`` is empty), so a kill lands inside an upload deterministically. Nothing else of
s3transfer or trainwright is replaced."""


def _start(tmp: Path, name: str, holds: list, *overrides: str, env: dict):
    """A run in the background with :data:`HOLD_HOOK`; (process, its log)."""
    import os
    import subprocess
    import sys

    from tests.helpers.training import REPO, TINY

    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOLD_HOOK)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                "PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "TW_TEST_HOLD": json.dumps(holds),
                **env}
    log = tmp / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "launcher.train", *TINY,
                             f"run.output_root={tmp}", f"run.name={name}", *overrides],
                            cwd=REPO, env=full_env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _wait_for(path_or_check, proc, log: Path, timeout_s: float = 240.0) -> None:
    import time

    check = path_or_check if callable(path_or_check) else path_or_check.exists
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None, log.read_text()[-5000:]
        assert time.monotonic() < deadline, log.read_text()[-5000:]
        time.sleep(0.05)


def _committed_steps(s3, prefix: str) -> list:
    keys = s3.keys(BUCKET, prefix + "/")
    return sorted(int(k.split("/step_")[1][:6]) for k in keys if k.endswith("/complete"))


def test_a_rank_killed_during_its_upload_never_commits_the_step(s3, tmp_path):
    """kill -9 of rank 1 while it uploads its share of step 4 (rank 0's share is on the store):
    step 4 is not committed, the run fails without a restart (restarts_in_job=0), and the same
    command resumes from step 2 and commits 4 and 6 with steps equal to an unbroken run."""
    import os
    import signal

    prefix = "rankkill"
    common = ["trainer.global_batch_size=8", "trainer.save_interval=2", "trainer.train_steps=6",
              "trainer.eval_interval=0", "trainer.keep_last=0", "resilience.restarts_in_job=0",
              f"trainer.checkpoint_uri=s3://{BUCKET}/{prefix}"]
    marker = tmp_path / "rank1_uploading"
    proc, log = _start(tmp_path, "run", [["step_000004/", "1", str(marker), ""]], *common,
                       env=s3.env())
    _wait_for(marker, proc, log)
    # Rank 1 is held before its first upload of step 4 (for good: no go file); rank 0 uploads its
    # share on its own, in its own time: the kill comes once that share is on the store.
    _wait_for(lambda: any("step_000004/" in k for k in s3.keys(BUCKET, prefix + "/")), proc, log)
    os.kill(int(marker.read_text()), signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    assert _committed_steps(s3, prefix) == [2]
    assert any("step_000004/" in k for k in s3.keys(BUCKET, prefix + "/"))  # a partial step
    train(tmp_path, "unbroken", *common[:-1])
    train(tmp_path, "run", *common, env=s3.env())
    assert _committed_steps(s3, prefix) == [2, 4, 6]
    resumed = steps_of(tmp_path / "run")
    assert [s for s in sorted(resumed) if s > 2] == [3, 4, 5, 6]
    assert _rows(tmp_path / "unbroken")[2:] == [r for r in _rows(tmp_path / "run") if r[0] > 2]


def _event_lines(run_dir: Path, needle: str) -> list:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if needle in line]


def _kill_the_server_mid_upload(s3, tmp_path: Path, prefix: str, holds: list, *overrides: str):
    """A run saving every 2 steps to ``prefix``; the server SIGKILLed while step 2 uploads
    (held there until then), then the upload let go; (process, log)."""
    marker, go = tmp_path / "uploading", tmp_path / "go"
    proc, log = _start(tmp_path, "run", [["step_000002/", "any", str(marker), str(go)], *holds],
                       "trainer.global_batch_size=8", "trainer.save_interval=2",
                       "trainer.eval_interval=0", f"trainer.checkpoint_uri=s3://{BUCKET}/{prefix}",
                       *overrides, env=s3.env())
    _wait_for(marker, proc, log)
    s3.kill()
    go.touch()
    return proc, log


def test_the_server_killed_during_a_save_costs_that_save_only(s3, tmp_path):
    """The S3 server SIGKILLed while step 2 uploads: one line names the step, the key and the
    error; nothing of step 2 is committed; training goes on; with the server back, steps 4 and
    6 commit and the run ends 0."""
    prefix, go4 = "serverkill", tmp_path / "go4"
    hold4 = ["step_000004/", "any", str(tmp_path / "uploading4"), str(go4)]
    try:
        # step 6 waits for step 4's upload, held until the server is back: on a loaded machine
        # a restart of the server took over the hang watchdog's 60 s
        proc, log = _kill_the_server_mid_upload(s3, tmp_path, prefix, [hold4],
                                                "trainer.train_steps=6",
                                                "trainer.checkpoint_retry_s=4",
                                                "resilience.hang_timeout_s=600")
        _wait_for(lambda: _event_lines(tmp_path / "run", "NOT saved"), proc, log)
    finally:
        s3.start()
        go4.touch()
    assert proc.wait(timeout=240) == 0, log.read_text()[-5000:]
    failed = _event_lines(tmp_path / "run", "NOT saved")
    assert len(failed) == 1 and failed[0]["step"] == 2, failed
    assert f"s3://{BUCKET}/{prefix}/step_000002/" in failed[0]["message"]
    assert "training continues" in failed[0]["message"]
    assert _committed_steps(s3, prefix) == [4, 6]
    assert log.read_text().count("NOT saved") == 1


def test_saves_failing_in_a_row_end_the_run_with_exit_4_and_no_restart(s3, tmp_path):
    """The server killed during the save of step 2 and left down: steps 2 and 4 fail
    (checkpoint_failures_allowed=2), the run exits 4 and the launcher does not restart it."""
    prefix = "downhill"
    try:
        proc, log = _kill_the_server_mid_upload(s3, tmp_path, prefix, [],
                                                "trainer.train_steps=8",
                                                "trainer.checkpoint_retry_s=2",
                                                "trainer.checkpoint_failures_allowed=2")
        assert proc.wait(timeout=240) == 4, log.read_text()[-5000:]
    finally:
        s3.start()
    assert [e["step"] for e in _event_lines(tmp_path / "run", "NOT saved")] == [2, 4]
    assert not _event_lines(tmp_path / "run", '"kind": "restart"')
    assert "checkpoint_failures_allowed=2" in log.read_text()
    assert _committed_steps(s3, prefix) == []


def _cli(*args: str, env: dict) -> "subprocess.CompletedProcess":
    import os
    import subprocess
    import sys

    from tests.helpers.training import REPO

    full = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
            "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=300)


def test_every_reader_takes_a_checkpoint_from_the_store(s3, tmp_path):
    """A run saved only to the store (the local copy deleted): ``launcher.convert to_hf``,
    ``launcher.evaluate`` and ``trainer.init_from`` given its s3:// URI give what they give on a
    local copy of the same step; a URI with nothing committed exits 2 naming it."""
    import safetensors.torch
    import torch

    from tests.helpers.data_prep import train_hf_tokenizer

    uri = f"s3://{BUCKET}/readers"
    train(tmp_path, "run", "engine=megatron", "trainer.train_steps=2", "trainer.eval_interval=0",
          f"trainer.checkpoint_uri={uri}", env=s3.env())
    local = tmp_path / "local_copy"
    shutil.move(tmp_path / "run" / "checkpoints", local)  # the reference; nothing left in run
    env = s3.env(TRAINWRIGHT_CACHE=str(tmp_path / "cache"))

    for source, out in ((uri, "hf_store"), (str(local / "step_000002"), "hf_local")):
        done = _cli("launcher.convert", "to_hf", f"checkpoint={source}",
                    f"out={tmp_path / out}", env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "[store] checkpoint=" in _cli("launcher.convert", "to_hf", f"checkpoint={uri}",
                                         f"out={tmp_path / 'again'}", env=env).stderr
    ours = safetensors.torch.load_file(next((tmp_path / "hf_store").glob("*.safetensors")))
    ref = safetensors.torch.load_file(next((tmp_path / "hf_local").glob("*.safetensors")))
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[k], ref[k]) for k in ref)

    (tmp_path / "tok").mkdir()
    tok = train_hf_tokenizer(tmp_path / "tok", vocab_size=500)
    scores = []
    for source in (f"{uri}/step_000002", str(local / "step_000002")):
        done = _cli("launcher.evaluate", f"checkpoint={source}", "eval.tasks=[tw_facts]",
                    "eval.limit=4", f"eval.tokenizer={tok}", "eval.format=json",
                    "cluster.gpus_per_node=1", env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        scores.append(json.loads(done.stdout.strip().splitlines()[-1])["tasks"])
    assert scores[0] == scores[1]

    for source, name in ((uri, "from_store"), (str(local / "step_000002"), "from_local")):
        train(tmp_path, name, "engine=megatron", "trainer.train_steps=1",
              "trainer.eval_interval=0", f"trainer.init_from={source}", env=env)
    assert _rows(tmp_path / "from_store") == _rows(tmp_path / "from_local")

    missing = _cli("launcher.convert", "to_hf", f"checkpoint=s3://{BUCKET}/nothing-here",
                   f"out={tmp_path / 'none'}", env=env)
    assert missing.returncode == 2
    assert f"checkpoint=s3://{BUCKET}/nothing-here" in missing.stderr
    assert "nothing is committed" in missing.stderr


def test_eval_jobs_score_the_store_checkpoints(s3, tmp_path):
    """eval.asynchronous with checkpoints on the store: each save asks for its s3:// step, the
    eval job downloads it and scores it as launcher.evaluate scores the same step."""
    import time

    from launcher.evals import ledger
    from tests.helpers.data_prep import train_hf_tokenizer

    (tmp_path / "tok").mkdir()
    tok = train_hf_tokenizer(tmp_path / "tok", vocab_size=500)
    uri = f"s3://{BUCKET}/evaljobs"
    env = s3.env(TRAINWRIGHT_CACHE=str(tmp_path / "cache"))
    train(tmp_path, "run", "engine=megatron", "eval.tasks=[tw_facts]", "eval.limit=4",
          "eval.async=true", "eval.job_overrides=['cluster.gpus_per_node=1']",
          f"eval.tokenizer={tok}", "trainer.save_interval=2", "trainer.train_steps=4",
          "trainer.keep_last=0", "trainer.eval_interval=0", f"trainer.checkpoint_uri={uri}",
          env=env)
    run_dir, deadline = tmp_path / "run", time.monotonic() + 300
    while not all(ledger.settled(run_dir, s) for s in (2, 4)):
        assert time.monotonic() < deadline, sorted(p.name for p in ledger.evals_dir(run_dir)
                                                   .iterdir())
        time.sleep(0.5)
    for step in (2, 4):
        request = ledger.result(run_dir, step)
        assert request is not None and request["checkpoint"] == f"{uri}/step_{step:06d}"
        done = _cli("launcher.evaluate", f"checkpoint={uri}/step_{step:06d}",
                    "eval.tasks=[tw_facts]", "eval.limit=4", f"eval.tokenizer={tok}",
                    "eval.format=json", "cluster.gpus_per_node=1", env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["tasks"] == request["tasks"]
