"""Hydra's command-line flags on launcher.train, launcher.plan, launcher.submit and launcher.search
(launcher.cli).

Every flag is exercised in-process through the entry points' ``main(argv)``; one subprocess checks
``python -m launcher.train --help`` end to end.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.core.global_hydra import GlobalHydra

from launcher.cli import handle_flags
from launcher.compose import CONF_DIR
from launcher.plan.__main__ import main as plan_main
from launcher.search.__main__ import main as search_main
from launcher.submit import main as submit_main
from launcher.train import main as train_main

ROOT = Path(__file__).resolve().parent.parent
MAINS = {"launcher.train": train_main, "launcher.plan": plan_main, "launcher.submit": submit_main,
         "launcher.search": search_main}
ENTRIES = list(MAINS)
GROUPS = ("model", "parallelism", "data", "optimizer", "trainer", "cluster", "engine", "logger",
          "experiment")
DESCRIPTION = {"launcher.train": "train the configured model",
               "launcher.plan": "print the pre-flight plan",
               "launcher.submit": "submit a training run to a Slurm or Kubernetes cluster",
               "launcher.search": "the fastest layouts for the composed model"}


def run(capsys, entry: str, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m <entry> argv`` run in this process."""
    with pytest.raises(SystemExit) as stop:
        MAINS[entry](list(argv))
    out, err = capsys.readouterr()
    return stop.value.code, out, err


@pytest.mark.parametrize("entry", ENTRIES)
def test_help_lists_groups_options_description_and_config(capsys, entry):
    code, out, _ = run(capsys, entry, "--help", "model=gpt2_124m")
    assert code == 0
    assert DESCRIPTION[entry] in out and "Exit codes" in out
    assert f"Usage: python -m {entry} [flags] [overrides]" in out
    groups = out.split("== Configuration groups ==")[1].split("== Config ==")[0]
    for group in GROUPS:
        assert f"\n{group}: " in groups
    models = groups.split("\nmodel: ")[1].split("\n")[0].split(", ")
    assert models == sorted(models) and {"gpt2_124m", "llama3_1b", "llama3_1_8b"} <= set(models)
    assert "tiny_1x2_cpu" in groups
    assert "data_prep" not in groups and "hydra/" not in groups  # not composed by config.yaml
    assert "--cfg,-c : Show config" in out and "--info,-i" in out
    assert ("--multirun,-m" in out) == (entry == "launcher.train")
    assert "  name: gpt2_124m" in out.split("== Config ==")[1]  # the override is composed


@pytest.mark.parametrize("entry", ENTRIES)
def test_cfg_job_prints_composed_config_with_overrides(capsys, entry):
    code, out, _ = run(capsys, entry, "optimizer.lr=0.000123", "--cfg", "job", "model=gpt2_124m")
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["optimizer"]["lr"] == 0.000123 and cfg["model"]["name"] == "gpt2_124m"
    assert "hydra" not in cfg and set(GROUPS) - {"experiment"} <= set(cfg)
    assert not GlobalHydra.instance().is_initialized()  # the normal compose path can run next


def test_cfg_hydra_all_and_package(capsys):
    code, out, _ = run(capsys, "launcher.train", "--cfg", "hydra")
    assert code == 0 and list(yaml.safe_load(out)) == ["hydra"]
    assert yaml.safe_load(out)["hydra"]["job"]["name"] == "train"
    code, out, _ = run(capsys, "launcher.plan", "-c", "all", "trainer.seed=7")
    assert code == 0 and {"hydra", "model", "trainer"} <= set(yaml.safe_load(out))
    code, out, _ = run(capsys, "launcher.submit", "--cfg", "job", "-p", "optimizer")
    assert code == 0 and out.startswith("# @package optimizer\n")
    assert yaml.safe_load(out)["lr"] == 0.0003
    code, out, _ = run(capsys, "launcher.plan", "--cfg", "job", "--package", "trainer.seed",
                       "trainer.seed=99")
    assert (code, out) == (0, "99\n")


def test_resolve_resolves_interpolations(capsys):
    _, raw, _ = run(capsys, "launcher.plan", "--cfg", "hydra", "-p", "hydra.run")
    code, resolved, _ = run(capsys, "launcher.plan", "--cfg", "hydra", "-p", "hydra.run",
                            "--resolve")
    assert code == 0 and "${now:" in raw and "${" not in resolved
    assert resolved.splitlines()[-1].startswith("dir: outputs/")


@pytest.mark.parametrize("entry", ENTRIES)
def test_config_errors_exit_2_with_the_usual_message(capsys, entry):
    code, out, err = run(capsys, entry, "--cfg", "job", "optimizer.lrr=1")
    assert (code, out) == (2, "")
    assert err.startswith("config error: ") and "did you mean optimizer.lr?" in err
    assert "Traceback" not in err
    code, _, plain_err = run(capsys, entry, "optimizer.lrr=1")  # the same message as without flags
    assert code == 2 and plain_err == err


def test_unknown_package_exits_2_with_a_hint(capsys):
    code, out, err = run(capsys, "launcher.train", "--cfg", "job", "-p", "optimzer")
    assert (code, out) == (2, "")
    assert "package 'optimzer' not found" in err and "did you mean optimizer?" in err


@pytest.mark.parametrize("info, expected", [
    ("all", ["Hydra 1.3", "Installed Hydra Plugins", "Defaults List", "Config"]),
    ("config", ["Config search path", "Defaults Tree", "Defaults List", "lr: 0.0003"]),
    ("defaults", ["Defaults List", "model/tiny", "optimizer/adamw_cosine"]),
    ("defaults-tree", ["Defaults Tree", "model: tiny", "experiment: null"]),
    ("plugins", ["Installed Hydra Plugins", "BasicSweeper"]),
    ("searchpath", ["Config search path", f"file://{CONF_DIR}"]),
])
def test_info_modes(capsys, info, expected):
    handlers = logging.getLogger().handlers[:]
    code, out, _ = run(capsys, "launcher.plan", "--info", info)
    assert code == 0 and all(text in out for text in expected), out
    assert logging.getLogger().handlers == handlers  # Hydra's stdout handler is gone again


@pytest.mark.parametrize("entry", ENTRIES)
def test_info_follows_overrides_on_every_entry_point(capsys, entry):
    code, out, _ = run(capsys, entry, "-i", "defaults-tree", "model=llama3_8b")
    assert code == 0 and "model: llama3_8b" in out


@pytest.mark.parametrize("entry", ENTRIES)
def test_hydra_help(capsys, entry):
    code, out, _ = run(capsys, entry, "--hydra-help")
    assert code == 0 and out.startswith("Hydra (1.3")
    assert "hydra/launcher: basic, slurm" in out and "--shell-completion,-sc" in out


@pytest.mark.parametrize("entry", ENTRIES)
def test_version(capsys, entry):
    code, out, _ = run(capsys, entry, "--version")
    assert code == 0 and out.startswith(f"{entry} (trainwright ") and "\nHydra 1.3." in out


@pytest.mark.parametrize("entry", ENTRIES)
def test_shell_completion_install_bash_calls_the_module(capsys, entry):
    code, out, _ = run(capsys, entry, "-sc", "install=bash")
    assert code == 0
    assert "launcher.train|launcher.plan|launcher.submit|launcher.search" in out
    assert "${words[0]} -m ${words[2]}" in out and "-sc query=bash" in out
    assert "complete -o nospace -o default -F trainwright_bash_completion" in out


def test_shell_completion_other_shells_and_uninstall(capsys):
    _, zsh, _ = run(capsys, "launcher.train", "--shell-completion", "install=zsh")
    assert zsh.startswith("autoload -Uz bashcompinit && bashcompinit\n")
    _, fish, _ = run(capsys, "launcher.plan", "-sc", "install=fish")
    assert ("__fish_seen_subcommand_from launcher.train launcher.plan launcher.submit "
            "launcher.search") in fish
    _, gone, _ = run(capsys, "launcher.submit", "-sc", "uninstall=bash")
    assert "unset -f trainwright_bash_completion" in gone


def test_shell_completion_query_completes_groups_and_keys(capsys, monkeypatch):
    monkeypatch.setenv("COMP_LINE", "python -m launcher.plan model=gp")
    code, out, _ = run(capsys, "launcher.plan", "-sc", "query=bash")
    assert (code, out) == (0, "model=gpt2_124m\n")
    monkeypatch.setenv("COMP_LINE", "/venv/bin/python -m launcher.train optimizer.l")
    code, out, _ = run(capsys, "launcher.train", "-sc", "query=fish")
    assert (code, out) == (0, "optimizer.lr=\n")


@pytest.mark.parametrize("argv, message", [
    (["-sc"], "--shell-completion takes one of install=SHELL"),
    (["-sc", "install=tcsh"], "(SHELL: bash, zsh, fish)"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--cfg", "jobs"], "invalid choice: 'jobs'"),
    (["--resolve"], "--resolve can only be used in conjunction with --cfg or --help"),
    (["-p", "model"], "--package/-p selects what --cfg shows"),
    (["--config-name", "other"], "--config-name is a Hydra flag launcher.train does not take"),
    (["-m", "a=1,2", "--info"], "only one of --run, --multirun, --cfg, --info"),
    (["--info", "model=tiny"], "put --info last"),
])
def test_bad_flags_exit_2_and_list_the_supported_ones(capsys, argv, message):
    code, out, err = run(capsys, "launcher.train", *argv)
    assert (code, out) == (2, "")
    assert message in err and "supported flags: --help/-h, --hydra-help, --version" in err
    assert "--multirun/-m" in err and "Traceback" not in err


@pytest.mark.parametrize("entry", ["launcher.plan", "launcher.submit"])
def test_multirun_is_refused_where_there_is_no_sweep(capsys, entry):
    code, _, err = run(capsys, entry, "-m", "optimizer.lr=1e-4,3e-4")
    assert code == 2 and f"{entry} runs no sweeps" in err and "--multirun/-m" not in err


def test_multirun_cfg_prints_every_point_without_running(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "launcher.train", "-m", "optimizer.lr=1e-4,3e-4",
                       "model=tiny,gpt2_124m", "--cfg", "job")
    assert code == 0 and list(tmp_path.iterdir()) == []
    docs = list(yaml.safe_load_all(out))
    assert [(d["optimizer"]["lr"], d["model"]["name"]) for d in docs] == [
        (1e-4, "tiny"), (1e-4, "gpt2_124m"), (3e-4, "tiny"), (3e-4, "gpt2_124m")]
    assert out.startswith("# sweep point 0 of 4: optimizer.lr=0.0001 model=tiny\n")
    code, out, _ = run(capsys, "launcher.train", "--multirun", "optimizer.lr=1e-4,3e-4",
                       "--cfg", "hydra", "-p", "hydra.job")
    jobs = list(yaml.safe_load_all(out))
    assert code == 0 and [j["num"] for j in jobs] == [0, 1]
    assert jobs[1]["override_dirname"] == "optimizer.lr=0.0003"
    code, _, err = run(capsys, "launcher.train", "-m", "optimizer.lr=abc,1", "--cfg", "job")
    assert code == 2 and "optimizer.lr=abc" in err


def test_help_takes_sweep_overrides(capsys):
    code, out, _ = run(capsys, "launcher.train", "-m", "optimizer.lr=1e-4,3e-4", "--help")
    assert code == 0 and "== Configuration groups ==" in out


def test_without_flags_the_command_line_goes_through_untouched():
    for argv in ([], ["model=tiny", "optimizer.lr=1e-4"], ["~logger", "+x=1"]):
        assert handle_flags(argv, "launcher.plan", None) == argv
    sweep = ["-m", "optimizer.lr=1e-4,3e-4", "--multirun"]
    assert handle_flags(sweep, "launcher.train", None, multirun=True) == sweep
    assert handle_flags(["--run", "a=1", "-r", "b=2"], "launcher.plan", None) == ["a=1", "b=2"]


def test_run_flag_runs_as_without_it(capsys):
    assert plan_main(["plan.format=json"]) == 0
    plain = capsys.readouterr().out
    assert plan_main(["--run", "plan.format=json"]) == 0
    assert capsys.readouterr().out == plain and plain.startswith("{")


def test_train_help_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "launcher.train", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "train the configured model" in proc.stdout
    groups = dict(line.split(": ", 1) for line in proc.stdout.splitlines()
                  if line.startswith(("model: ", "cluster: ")))
    assert "gpt2_124m" in groups["model"].split(", ")
    assert {"local_cpu", "slurm_h100", "k8s_h100"} <= set(groups["cluster"].split(", "))
