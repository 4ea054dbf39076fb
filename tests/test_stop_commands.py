"""A stop signal to the process group of ``launcher.convert from_hf`` and ``launcher.generate``
(two ranks each, started through the same bootstrap as ``launcher.train``): the ranks stop at
their next safe point, the command exits 128 + N, and nothing is half-written: no ``<out>`` for
the import (its ranks wrote into ``<out>.partial``), no output for the generation.

The signal is sent once both ranks catch SIGTERM (their stop request is installed: the kernel's
caught-signal mask of each rank says so), so it always takes the stop path under test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.training import REPO, train

pytestmark = pytest.mark.slow


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt of /proc/<pid>/status)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:"))
               .split()[1], 16)
    return bool(mask >> (sig - 1) & 1)


def _stop_when_ranks_catch(proc: subprocess.Popen, ranks: int, timeout: float = 240) -> None:
    """SIGTERM to the whole process group once ``ranks`` child processes catch SIGTERM."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        children = psutil.Process(proc.pid).children(recursive=True)
        if sum(_catches(c.pid, signal.SIGTERM) for c in children) >= ranks:
            os.killpg(proc.pid, signal.SIGTERM)
            return
        time.sleep(0.05)
    raise AssertionError(f"the ranks never caught SIGTERM (exit {proc.poll()})")


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_generate_stops_between_tokens_and_prints_nothing(tmp_path):
    train(tmp_path, "run", "trainer.train_steps=1")
    proc = _start("launcher.generate", f"checkpoint={tmp_path / 'run'}",
                  "generate.prompt_ids=[1,2,3]", "generate.max_new_tokens=100000",
                  "generate.format=json")
    _stop_when_ranks_catch(proc, ranks=2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert out == "" and "generate: stopped by signal 15 after" in err


def test_from_hf_stops_before_its_save_and_leaves_no_output(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    out = tmp_path / "ck"
    proc = _start("launcher.convert", "from_hf", f"hf={tmp_path / 'hf'}", f"out={out}",
                  "trainer.precision=fp32", "model.seq_length=64")
    _stop_when_ranks_catch(proc, ranks=2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "from_hf: stopped by signal 15 before the save" in err
    assert not out.exists()
    assert not list((tmp_path / "ck.partial" / "checkpoints").glob("step_*[0-9]"))
