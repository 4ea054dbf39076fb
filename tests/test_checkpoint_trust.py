"""The files trainwright writes into a checkpoint load without running code (weights-only)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from launcher.engines.unpickle import UnsafeCheckpointFile
from launcher.runtime.checkpoint import _rng_state, _set_rng_state, load_rng_file

# the module's trained runs are made once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("checkpoint_trust")


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_rng_state_is_plain_tensors_and_restores_every_generator(tmp_path):
    torch.save(_rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    state = torch.load(tmp_path / "rng.pt", weights_only=True)  # no allow-list needed
    _set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_rng_file_with_code_is_refused_and_numpy_era_files_still_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"python": random.getstate(), "x": RunsCode()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointFile, match=f"refused to load checkpoint file {tmp_path}"):
        load_rng_file(tmp_path / "evil.pt")
    assert not (tmp_path / "PWNED").exists()
    older = {"python": random.getstate(), "numpy": np.random.get_state()}  # before tensors only
    torch.save(older, tmp_path / "older.pt")
    loaded = load_rng_file(tmp_path / "older.pt")
    assert np.array_equal(loaded["numpy"][1], older["numpy"][1])


LOAD_IN_A_FRESH_PROCESS = """
import sys
from launcher.engines import unpickle
loaded = unpickle.load(sys.argv[1])
print(type(loaded.get("scaler")).__name__, "deepspeed" in sys.modules)
"""


def test_deepspeed_is_imported_only_for_an_archive_that_names_its_classes(tmp_path):
    import subprocess
    import sys

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    torch.save({"w": torch.ones(2), "scaler": DynamicLossScaler(
        init_scale=8.0, scale_window=10, min_scale=1.0, delayed_shift=1,
        consecutive_hysteresis=False)},
               tmp_path / "zero.pt")

    def fresh(name: str) -> str:
        return subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS,
                               str(tmp_path / name)], capture_output=True, text=True,
                              check=True).stdout.splitlines()[-1].split()

    assert fresh("plain.pt") == ["NoneType", "False"]  # a Megatron-Core read imports none
    assert fresh("zero.pt") == ["DynamicLossScaler", "True"]


def _plant(path, marker):
    """Replace ``path`` by a pickle whose loading runs ``touch <marker>``."""
    import pickle

    class Touch:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path.write_bytes(pickle.dumps(Touch(), protocol=2))


COMMON = ("trainer.precision=bf16", "trainer.save_interval=2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """engine -> a 2-step run of that engine with its step-2 checkpoint, trained once for the
    module; each test plants its file in a copy (``_copy_of``)."""
    from tests.helpers.training import train

    root = tmp_path_factory.mktemp("trained")
    for engine in ("deepspeed", "megatron"):
        train(root / engine, "run", f"engine={engine}", *COMMON, "trainer.train_steps=2")
    return root


def _copy_of(trained, engine: str, tmp_path):
    """A copy of ``engine``'s trained run as ``<tmp_path>/run``; its step-2 checkpoint."""
    import shutil

    shutil.copytree(trained / engine / "run", tmp_path / "run", symlinks=True)
    return tmp_path / "run" / "checkpoints" / "step_000002"


@pytest.mark.parametrize("engine,victim", [
    ("deepspeed", "mp_rank_00_model_states.pt"),
    ("deepspeed", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("megatron", "megatron/.metadata"),
    ("megatron", "megatron/common.pt"),
    ("megatron", "rng/rank_1.pt"),
])
def test_a_planted_checkpoint_file_is_refused_before_it_runs(tmp_path, trained, engine, victim):
    """A checkpoint file replaced by a pickle that runs a shell command: the resume exits 2
    naming the file, and the command never runs (on either engine, any of its file kinds)."""
    from tests.helpers.training import train

    marker = tmp_path / "PWNED"
    step = _copy_of(trained, engine, tmp_path)
    _plant(step / victim, marker)
    proc = train(tmp_path, "run", f"engine={engine}", *COMMON, "trainer.train_steps=4", expect=2)
    assert not marker.exists(), "the planted pickle ran"
    assert f"refused to load checkpoint file {step / victim}" in proc.stdout + proc.stderr


@pytest.mark.parametrize("engine,victim", [("deepspeed", "mp_rank_00_model_states.pt"),
                                           ("megatron", "megatron/.metadata")])
def test_export_and_generate_refuse_a_planted_checkpoint(tmp_path, trained, engine, victim):
    """The readers of generate and export are the same: exit 2 naming the file, nothing run."""
    import subprocess
    import sys

    from tests.helpers.training import REPO

    marker = tmp_path / "PWNED"
    step = _copy_of(trained, engine, tmp_path)
    _plant(step / victim, marker)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    commands = [["-m", "launcher.convert", "to_hf", f"checkpoint={tmp_path / 'run'}",
                 f"out={tmp_path / 'hf'}"],
                ["-m", "launcher.generate", f"checkpoint={tmp_path / 'run'}",
                 "generate.prompt_ids=[1,2,3]", "generate.max_new_tokens=2"]]
    for args in commands:
        proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2, (args, proc.stderr[-3000:])
        assert f"refused to load checkpoint file {step / victim}" in proc.stderr
        assert not marker.exists() and not (tmp_path / "hf").exists()
