"""rundir.py: run directory naming, redaction of secrets, the three files of prepare_run_dir."""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.compose import compose_config, to_object
from launcher.config import RunConfig
from launcher.plan import compute_plan
from launcher.runtime.rundir import (REDACTED, prepare_run_dir, redact, redact_argv, run_dir_path,
                             secret_env_values, to_plain)


def test_run_dir_path():
    assert run_dir_path(RunConfig(), "tiny", "local_cpu") == Path("outputs/tiny_local_cpu")
    run = RunConfig(name="exp1", output_root="/scratch/runs")
    assert run_dir_path(run, "tiny", "local_cpu") == Path("/scratch/runs/exp1")
    assert run_dir_path(RunConfig(name="sweep/3"), "m", "c") == Path("outputs/sweep/3")
    for bad in ("/abs", "../up", "a/../../b"):
        with pytest.raises(ValueError, match="run.name"):
            run_dir_path(RunConfig(name=bad), "m", "c")


def test_redact_nested_keys():
    obj = {"logger": {"api_key": "abc", "project": "p", "Auth-Token": "t0k",
                      "nested": [{"password": "pw", "ok": 1}, ("x", {"client_secret": "s"})]},
           "data": {"tokenizer_path": "/tok.json", "eod_token_id": 0, "train_tokens": 10},
           "CREDENTIALS": {"user": "u"}, "hf_token": None}
    out = redact(obj, secrets=[])
    assert out["logger"]["api_key"] == REDACTED and out["logger"]["Auth-Token"] == REDACTED
    assert out["logger"]["project"] == "p"
    assert out["logger"]["nested"][0] == {"password": REDACTED, "ok": 1}
    assert out["logger"]["nested"][1] == ("x", {"client_secret": REDACTED})
    assert out["data"] == obj["data"]  # numbers and non-secret words untouched
    assert out["CREDENTIALS"] == REDACTED and out["hf_token"] is None
    assert obj["logger"]["api_key"] == "abc"  # a copy; the input is unchanged


def test_redact_secret_env_values_inside_strings(monkeypatch):
    key, tok = secrets.token_hex(16), secrets.token_hex(12)
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("MY_SERVICE_TOKEN", tok)
    monkeypatch.setenv("SHORT_SECRET", "abc")  # too short to be treated as a secret
    assert key in secret_env_values() and tok in secret_env_values()
    assert "abc" not in secret_env_values()
    out = redact({"url": f"https://u:{key}@host/x", "list": [f"--t={tok}", "abc"], key: 1})
    assert out == {"url": f"https://u:{REDACTED}@host/x", "list": [f"--t={REDACTED}", "abc"],
                   REDACTED: 1}


def test_redact_argv():
    argv = ["train", "logger.api_key=abc", "+x.hf_token=zz", "trainer.seed=1", "eod_token_id=3"]
    assert redact_argv(argv) == ["train", f"logger.api_key={REDACTED}",
                                 f"+x.hf_token={REDACTED}", "trainer.seed=1", "eod_token_id=3"]


def test_prepare_run_dir_writes_its_files(tmp_path, monkeypatch):
    key = secrets.token_hex(20)
    monkeypatch.setenv("WANDB_API_KEY", key)
    cfg = compose_config(["run.name=r1"])  # default config (tiny on local CPU)
    plan = compute_plan(to_object(cfg))
    config = {**to_plain(cfg), "extra": {"token": "s3cr3t-value", "note": f"key={key}"}}
    run_dir = tmp_path / "r1"
    prepare_run_dir(run_dir, config=config, plan=plan)
    assert sorted(p.name for p in run_dir.iterdir()) == \
        ["checkpoints", "config.yaml", "data.json", "env.json", "logs", "plan.json"]
    assert json.loads((run_dir / "data.json").read_text()) == {"prefixes": [], "mock": True,
                                                               "manifests": []}
    loaded = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert loaded["model"]["name"] == cfg.model.name
    assert loaded["extra"] == {"token": REDACTED, "note": f"key={REDACTED}"}
    assert json.loads((run_dir / "plan.json").read_text())["world_size"] == plan.dims.world
    env = json.loads((run_dir / "env.json").read_text())
    assert env["python"] == sys.version.split()[0]
    assert env["versions"]["torch"] and env["versions"]["megatron_core"] == "0.16.1"
    assert env["versions"]["deepspeed"] and env["versions"]["hydra"]
    assert env["cuda_available"] in (True, False) and env["hosts"]
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).parent).stdout.strip()
    assert env["git_sha"].startswith(sha)
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert key not in path.read_text() and "s3cr3t-value" not in path.read_text()
    prepare_run_dir(run_dir, config=config, plan=plan.to_dict())  # a restart rewrites in place
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]



def test_data_json_references_the_data_prep_manifest(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    manifest = {"totals": {"documents": 3, "tokens": 42}, "dtype": "uint16", "eod_id": 0,
                "tokenizer": {"kind": "byte", "vocab_size": 257}, "version": "x"}
    raw = json.dumps(manifest).encode()
    (shards / "manifest.json").write_bytes(raw)
    prefixes = [str(shards / "c_00000"), str(shards / "c_00001"), str(tmp_path / "other" / "d")]
    cfg = compose_config(["run.name=r2"])
    config = {**to_plain(cfg), "data": {**to_plain(cfg)["data"], "prefixes": prefixes}}
    prepare_run_dir(tmp_path / "r2", config=config, plan=compute_plan(to_object(cfg)))
    ref = json.loads((tmp_path / "r2" / "data.json").read_text())
    assert ref["prefixes"] == prefixes and ref["mock"] is False
    missing, found = ref["manifests"]  # one per shard directory, sorted by path
    assert found["path"] == str(shards / "manifest.json") and found["exists"]
    assert found["sha256"] == hashlib.sha256(raw).hexdigest()
    assert found["totals"] == {"documents": 3, "tokens": 42}
    assert found["tokenizer"]["vocab_size"] == 257
    assert missing == {"path": str(tmp_path / "other" / "manifest.json"), "exists": False}
