"""Ranks forked from a fork server that imported their libraries while the launcher went on
(:mod:`launcher.launch.rank_preload`): they get the launcher's environment of the launch, not the
server's, and the server never outlives its launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher.launch.rank_preload import has_nvidia_device

pytestmark = pytest.mark.skipif(has_nvidia_device(), reason="ranks are spawned on a GPU machine")

REPO = Path(__file__).resolve().parents[1]

LAUNCH = textwrap.dedent("""
    import os, sys, time
    from launcher.launch.rank_preload import preload_rank_imports
    os.environ["TW_BEFORE"] = "before"
    os.environ["TW_REMOVED_AFTER"] = "still here"
    preload_rank_imports(["tests.helpers.preloaded"])
    os.environ["TW_SET_AFTER"] = "after"
    del os.environ["TW_REMOVED_AFTER"]
    if sys.argv[2] == "wait":
        print("started", flush=True)  # the server still imports (TW_SLOW_IMPORT)
        time.sleep(60)
    from launcher.launch.local import Rendezvous, launch_world
    from tests.helpers.preloaded import report
    launch_world(report, (sys.argv[1],), 2, Rendezvous.local())
    assert "tests.helpers.preloaded" in sys.modules
""")


def _run(tmp_path: Path, mode: str, **extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    return subprocess.Popen([sys.executable, "-c", LAUNCH, str(tmp_path), mode], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_ranks_are_forks_of_the_server_with_the_environment_of_the_launch(tmp_path):
    proc = _run(tmp_path, "launch")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, seen in enumerate(ranks):
        assert seen["imported_by"] != seen["pid"], "the rank imported the module itself"
        assert seen["imported_by"] == seen["ppid"], "the rank is not a fork of the server"
        assert seen["env"] == {"RANK": str(rank), "WORLD_SIZE": "2", "TW_SET_AFTER": "after",
                               "TW_REMOVED_AFTER": None, "TW_BEFORE": "before"}


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie its parent has not reaped yet is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_server_dies_with_its_launcher_even_while_importing_and_ignores_stops(tmp_path):
    proc = _run(tmp_path, "wait", TW_SLOW_IMPORT="60")
    assert proc.stdout.readline().strip() == "started"
    server = _fork_server(proc.pid)
    os.kill(server, signal.SIGUSR1)  # held there: a stop sent to the group never ends it
    os.kill(server, signal.SIGTERM)
    time.sleep(0.5)
    assert _alive(server), "a stop signal ended the fork server"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(server):
        assert time.monotonic() < deadline, "the fork server outlived its launcher"
        time.sleep(0.05)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _fork_servers(pid: int) -> list[int]:
    """The fork-server children of ``pid`` (dead ones not yet reaped included)."""
    return [c for c in _children(pid)
            if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _fork_server(pid: int, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        servers = _fork_servers(pid)
        if servers:
            [server] = servers  # one fork server per launcher
            return server
        assert time.monotonic() < deadline, "no fork server started"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_launcher_waiting_for_its_ranks_imports_still_stops_at_once(tmp_path):
    """The launcher has composed and planned; its fork server still imports (held here with
    SIGSTOP). A stop to the launcher ends the job with 75 at once: before the launcher waited
    for the server itself, it sat in its request for a rank, deaf until the imports were done."""
    from tests.helpers.signals import launch

    log = tmp_path / "run.log"
    proc = launch(tmp_path, "held", log)
    try:
        server = _fork_server(proc.pid)
        os.kill(server, signal.SIGSTOP)
        deadline = time.monotonic() + 90
        while True:  # until the launcher is idle for a second: done planning, waiting
            ticks = _cpu_ticks(proc.pid)
            time.sleep(1.0)
            assert proc.poll() is None, log.read_text()[-3000:]
            if _cpu_ticks(proc.pid) - ticks <= 10:  # under 10% of a core
                break
            assert time.monotonic() < deadline, "the launcher never went idle"
        os.kill(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        code = proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert code == 75 and took < 5, (code, took, output[-3000:])
    assert output.count("stopped by SIGTERM during start-up") == 1, output[-3000:]
    # Stopped before its first lines (a loaded host), it did not yet die with its launcher:
    # continued, it ends when it finds its launcher gone, once its imports are done.
    os.kill(server, signal.SIGCONT)
    deadline = time.monotonic() + 120
    while _alive(server):
        assert time.monotonic() < deadline, "the fork server outlived its launcher"
        time.sleep(0.05)


@pytest.mark.slow
def test_training_ranks_are_forked_import_nothing_and_print_no_warning_of_it(tmp_path):
    """launcher.train's ranks come from the fork server: the `imports` part of the run's
    start-up is the moment from fork to entry (a spawned rank's was 3-4 s on 2 cores), and the
    rank's re-run of the command's module as __mp_main__ leaves no runpy warning on the console
    (it did while the server kept launcher.train imported)."""
    from tests.helpers.training import train

    proc = train(tmp_path, "forked", "cluster.gpus_per_node=2", "trainer.train_steps=1",
                 "trainer.save_interval=0", "trainer.eval_interval=0")
    assert "found in sys.modules" not in proc.stderr, proc.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "forked" / "events.jsonl").open()]
    [startup] = [e for e in events if e["kind"] == "startup"]
    assert startup["imports_s"] < 0.5, startup


@pytest.mark.slow
def test_a_one_rank_job_ends_its_fork_server_before_it_trains(tmp_path):
    """One rank runs in the launcher's own process; the fork server's imports (about 5 s of
    CPU) would only take a core from it. The server is gone before the first step, and the run
    still trains and exits cleanly."""
    from tests.helpers.signals import STEPS, launch, logged_steps, wait_for

    log = tmp_path / "run.log"
    proc = launch(tmp_path, "one", log, "cluster.gpus_per_node=1")
    try:
        server = _fork_server(proc.pid)
        wait_for(proc, log, lambda: logged_steps(tmp_path / "one") >= 1)
        assert not _alive(server), "the fork server of a one-rank job was still running"
        assert not [c for c in _fork_servers(proc.pid) if _alive(c)]
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, log.read_text()[-3000:]
    assert logged_steps(tmp_path / "one") >= STEPS


OPTIMIZER_IMPORTS = textwrap.dedent("""
    import importlib, json, sys
    from launcher.engines.compat import shape_imports
    shape_imports()  # as the fork server does first
    for name in importlib.import_module(sys.argv[1]).RANK_MODULES:
        __import__(name)
    import torch
    before = set(sys.modules)
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([weight], lr=0.1, foreach=True)
    weight.sum().backward()
    optimizer.step()
    print(json.dumps(sorted(set(sys.modules) - before)))
""")


@pytest.mark.parametrize("command", ["launcher.train", *[
    pytest.param(name, marks=pytest.mark.slow)
    for name in ("launcher.convert.from_hf", "launcher.convert.reshard")]])
def test_a_rank_building_an_optimizer_finds_dynamo_imported_by_the_server(command):
    """torch.optim imports TorchDynamo at the first optimizer a process builds (about 2.5 s of
    CPU here, in every rank at once); the ranks that build one have it in their preload."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", OPTIMIZER_IMPORTS, command], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not [m for m in imported if m.startswith("torch._dynamo")], imported


TASK_DATA_IMPORTS = textwrap.dedent("""
    import importlib, json, sys
    from launcher.engines.compat import shape_imports
    shape_imports()  # as the fork server does first
    for name in importlib.import_module("launcher.evaluate").RANK_MODULES:
        __import__(name)
    import datasets
    before = set(sys.modules)
    rows = datasets.load_dataset("json", data_files={"test": sys.argv[1]}, split="test")
    assert len(rows) == 2, len(rows)
    print(json.dumps(sorted(set(sys.modules) - before)))
""")


def test_an_evaluating_rank_loads_task_data_with_nothing_left_to_import(tmp_path):
    """Every ``datasets.load_dataset`` of a rank's tasks imports scipy.io (about 0.4 s of each
    rank's start): the evaluating ranks have it in their preload."""
    data = tmp_path / "task.jsonl"
    data.write_text('{"text": "a"}\n{"text": "b"}\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", TASK_DATA_IMPORTS, str(data)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not [m for m in imported if m.startswith("scipy")], imported
