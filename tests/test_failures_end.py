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


FULL_DISK_RUN = ["trainer.train_steps=20", "trainer.save_interval=2", "trainer.keep_last=0",
                 "trainer.precision=fp32", "data.num_workers=1", "run.report=false"]
"""The tiny model of conf/model/tiny.yaml (a checkpoint of about 70 MB), saved every 2 steps;
fp32 so that a CPU without fast bf16 runs it at full speed."""


def _lines_after(out: str, marker: str) -> list[str]:
    """The console lines after the last line holding ``marker``."""
    lines = out.splitlines()
    last = max(i for i, line in enumerate(lines) if marker in line)
    return [line for line in lines[last + 1:] if line.strip()]


@pytest.mark.parametrize("engine", ["deepspeed", "megatron"])
def test_a_full_disk_with_the_logs_on_it_ends_the_run_once_with_exit_2(tmp_path, mount_tmpfs,
                                                                       engine):
    """The run directory (checkpoints, rank logs, events) on a 100 MiB disk: the save of step 4
    fills it. Both ranks end with exit 2 (a full disk is final), nothing restarts, the console
    holds at most one line per rank plus the launcher's verdict and summary, no traceback; once
    space is freed the run resumes from the last complete checkpoint."""
    disk = mount_tmpfs("100m")
    name = f"full-{engine}-{os.getpid()}"
    # where a rank's output goes once its log cannot be written (/dev/shm unless TMPDIR is set:
    # a long TMPDIR would break multiprocessing's sockets, so the test keeps the default)
    fallback = Path("/dev/shm")
    for old in fallback.glob(f"trainwright-{name}-*"):
        old.unlink()
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    args = [sys.executable, "-m", "launcher.train", f"engine={engine}", f"run.name={name}",
            f"run.output_root={disk}", *FULL_DISK_RUN]
    log = tmp_path / "full.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    saving = "checkpoint step 4: saving to"
    try:
        wait_for(proc, log, lambda: saving in log.read_text() or proc.poll() is not None,
                 timeout=300)
    except BaseException:
        ranks = sorted((disk / name / "logs").glob("rank_*.log"))
        pytest.fail("\n".join(f"{r}:\n{r.read_text()[-3000:]}" for r in ranks) or "no rank log")
    failing_save = time.monotonic()
    code = _finish(proc, log, within=60)
    out = log.read_text()
    assert code == 2, out[-4000:]
    assert time.monotonic() - failing_save < 30, out[-4000:]
    assert "Traceback" not in out and "restarting every rank" not in out, out[-4000:]
    after = _lines_after(out, saving)
    for rank in (0, 1):
        mine = [line for line in after if line.startswith(f"train: rank {rank}")]
        assert len(mine) <= 1, after
    assert [line for line in after if line.startswith("train: rank")], after
    assert sum("no space left on" in line and "is intact" in line for line in after) >= 1
    for line in after:  # a rank whose log filled up says where its output went instead
        if "cannot be written (No space left on device); its output goes to" in line:
            kept = Path(line.rsplit("its output goes to ", 1)[1].rstrip("]"))
            assert kept.parent == fallback and "no space left on" in kept.read_text()
            kept.unlink()
    launcher = [line for line in after if line.startswith("launcher:")]
    assert len(launcher) == 1 and "not restarting: exit 2" in launcher[0], after
    assert launcher[0].endswith("exiting with 2"), after
    summary = [line for line in after if line.startswith(("[goodput]", "[report]"))]
    assert len(after) == len(launcher) + len(summary) + len(
        [line for line in after if line.startswith("train: rank")]), "\n".join(after)
    run_dir = disk / name
    assert _ranks_gone(run_dir)
    ckpts = run_dir / "checkpoints"
    assert not list(ckpts.glob("*.tmp")) and (ckpts / "step_000002" / "complete").is_file()
    # space freed where the run is: it resumes from the last complete checkpoint and finishes
    subprocess.run(["mount", "-o", "remount,size=400m", str(disk)], check=True)
    resume_log = tmp_path / "resume.log"
    with open(resume_log, "w") as out:
        proc = subprocess.Popen([*args, "trainer.save_interval=10"], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    assert _finish(proc, resume_log, within=300) == 0, resume_log.read_text()[-4000:]
    assert f"resumed from {ckpts / 'step_000002'}" in resume_log.read_text()
    assert max(steps_of(run_dir)) == 20


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
