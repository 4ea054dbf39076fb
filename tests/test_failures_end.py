"""Failures never hang: real 2-rank runs whose disk fills up or whose data shard goes bad
under them end within seconds, with one line naming the cause, and nothing left running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from data_prep.cli import compose
from data_prep.run import execute
from tests.helpers.data_prep import stdlib_documents, write_jsonl
from tests.helpers.signals import wait_for
from tests.helpers.training import REPO, TINY, steps_of

pytestmark = pytest.mark.slow


def _start(tmp: Path, name: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    log = tmp / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "launcher.train", *TINY, f"run.name={name}", *overrides]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log


def _ranks_gone(run_dir: Path) -> bool:
    pids = [int(p.read_text()) for p in (run_dir / "logs").glob("rank_*.pid")]
    return pids and not any(Path(f"/proc/{pid}").exists() and
                            "Z" != Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][1]
                            for pid in pids)


def _finish(proc: subprocess.Popen, log: Path, within: float) -> int:
    try:
        return proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running after {within} s:\n{log.read_text()[-4000:]}")


def test_disk_full_during_a_save_ends_the_job_and_keeps_the_last_checkpoint(tmp_path,
                                                                            mount_tmpfs):
    disk = mount_tmpfs("8m")
    run = ["trainer.train_steps=40", "trainer.save_interval=2", "trainer.keep_last=0",
           "trainer.eval_interval=0", f"data.cache_dir={tmp_path / 'cache'}"]
    proc, log = _start(tmp_path, "full", f"run.output_root={disk}", *run)
    # timed from the first step line (start-up on a loaded 2-core machine varies by a minute):
    # the save that fills the disk comes a few steps later
    wait_for(proc, log, lambda: "step 1 |" in log.read_text() or proc.poll() is not None)
    training = time.monotonic()
    code = _finish(proc, log, within=120)
    out = log.read_text()
    assert code == 2, out[-4000:]
    assert time.monotonic() - training < 60, out[-4000:]
    assert "no space left on" in out and "is intact" in out and "Traceback" not in out
    assert "not restarting: exit 2" in out
    run_dir = disk / "full"
    assert _ranks_gone(run_dir)
    ckpts = run_dir / "checkpoints"
    latest = (ckpts / "latest").read_text().strip() if (ckpts / "latest").is_file() \
        else os.readlink(ckpts / "latest")
    assert not list(ckpts.glob("*.tmp"))
    # the last complete checkpoint loads: resume a copy of the run on a roomy disk
    roomy = tmp_path / "roomy"
    shutil.copytree(run_dir, roomy / "full", symlinks=True)
    proc, log = _start(tmp_path, "full", f"run.output_root={roomy}", *run)
    assert _finish(proc, log, within=240) == 0, log.read_text()[-4000:]
    assert f"resumed from {roomy / 'full' / 'checkpoints' / latest}" in log.read_text()
    assert max(steps_of(roomy / "full")) == 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    src = write_jsonl(root / "docs.jsonl", stdlib_documents(300, max_chars=600))
    out = root / "out"
    execute(compose([f"input=[{src}]", f"output={out}", "tokenizer.kind=byte", "workers=1",
                     "progress=false", "name=bytes"]))
    return out


def test_shard_truncated_mid_run_ends_the_job_naming_it(tmp_path, corpus):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    conf = data / "conf"
    for yml in conf.rglob("*.yaml"):
        yml.write_text(yml.read_text().replace(str(corpus), str(data)))
    prefix = yaml.safe_load((data / "data.yaml").read_text())["prefixes"][0].replace(
        str(corpus), str(data))
    proc, log = _start(tmp_path, "shard", f"hydra.searchpath=[file://{conf}]", "data=bytes",
                       f"run.output_root={tmp_path}", "trainer.train_steps=400",
                       "trainer.eval_interval=0", "trainer.save_interval=0")
    run_dir = tmp_path / "shard"
    wait_for(proc, log, lambda: (run_dir / "metrics.jsonl").exists() and
             len(steps_of(run_dir)) >= 5)
    os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") // 4)
    truncated = time.monotonic()
    code = _finish(proc, log, within=90)
    out = log.read_text()
    assert code == 3, out[-4000:]
    assert time.monotonic() - truncated < 30
    assert f"a data shard went bad during the run: {prefix}.bin is" in out
    assert "not restarting: exit 3" in out and "Traceback" not in out
    assert _ranks_gone(run_dir)
