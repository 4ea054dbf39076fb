"""Checkpoints on object storage, against a real S3 server (SeaweedFS, started by this module):
each engine saves at DP2 to ``s3://``, a run with an empty run directory resumes from the store
bit for bit, keep-k deletes on the store, and only committed steps are ever resumed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.s3 import SECRET_KEY, SeaweedS3
from tests.helpers.training import steps_of, train

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("s3_store")]

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    server.bucket(BUCKET)
    yield server
    server.stop()


def _rows(run_dir: Path) -> list:
    steps = steps_of(run_dir)
    return [(s, steps[s]["loss"], steps[s]["grad_norm"]) for s in sorted(steps)]


def _events(run_dir: Path, kind: str = "checkpoint") -> list:
    rows = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == kind]


ENGINES = {"megatron": ["engine=megatron", "parallelism.zero_stage=1"],
           "deepspeed": ["engine=deepspeed", "parallelism.zero_stage=1"]}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_saves_to_the_store_and_resumes_bitwise_from_an_empty_run_directory(s3, tmp_path,
                                                                            engine):
    """4 steps at DP2 saving every 2 to s3://: the store holds both steps, each with its commit
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
    bucket = "nosuchbucket" if case == "bucket" else BUCKET
    proc = train(tmp_path, case, "trainer.train_steps=2",
                 f"trainer.checkpoint_uri=s3://{bucket}/x", env=env, expect=2)
    err = proc.stderr
    assert "trainer.checkpoint_uri" in err and f"bucket {bucket!r}" in err, err[-2000:]
    assert {"bucket": "does not exist", "credentials": "access denied",
            "endpoint": "does not answer"}[case] in err, err[-2000:]
    assert "wrong-secret-xyz" not in err and SECRET_KEY not in err
    assert not (tmp_path / case / "checkpoints").exists()
