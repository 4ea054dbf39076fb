"""The files trainwright writes into a checkpoint load without running code (weights-only)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from launcher.runtime.checkpoint import _rng_state, _set_rng_state, load_rng_file


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
    with pytest.raises(Exception, match="Weights only load failed"):
        load_rng_file(tmp_path / "evil.pt")
    assert not (tmp_path / "PWNED").exists()
    older = {"python": random.getstate(), "numpy": np.random.get_state()}  # before tensors only
    torch.save(older, tmp_path / "older.pt")
    loaded = load_rng_file(tmp_path / "older.pt")
    assert np.array_equal(loaded["numpy"][1], older["numpy"][1])
