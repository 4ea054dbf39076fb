"""Reports a person can look at, opened in a real browser (headless Chromium, tests/helpers/
browser.py): a finished 2-rank run writes report.html when it ends and prints its path; the page
makes no request outside file:/data:, logs no console error, draws every chart, shows the run's
name and goodput, and the data behind its loss chart is metrics.jsonl's. A 50,000-step run's
charts keep a subset with the first, last, smallest and largest point and the spike. A failed
run, a run stopped for requeue and a run restarted inside the job render and say so. A sweep's
report marks its best point. ``launcher.report`` writes either, on request.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.browser import assert_self_contained, browser, open_report  # noqa: F401
from tests.helpers.signals import wait_for
from tests.helpers.training import REPO, TINY, train

# its module-scoped runs are made once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("reports")

RUN = ["run.report=true", "trainer.train_steps=12", "trainer.global_batch_size=8",
       "trainer.eval_interval=4", "trainer.save_interval=4"]
LONG = ["run.report=true", "trainer.train_steps=200", "trainer.global_batch_size=8",
        "trainer.eval_interval=0", "trainer.save_interval=5"]


def rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report_run")
    proc = train(tmp, "fin", *RUN)
    return tmp / "fin", proc.stderr


@pytest.mark.slow
def test_a_run_writes_its_report_when_it_ends_and_it_opens_offline(finished, browser):
    run_dir, stderr = finished
    assert f"[report] {run_dir / 'report.html'}" in stderr
    check = open_report(browser, run_dir / "report.html")
    assert_self_contained(check)
    assert check.declared_charts >= 8
    assert "trainwright run fin" in check.text and "finished: finished at step 12" in check.text
    account = json.loads(subprocess.run(
        [sys.executable, "-m", "launcher.report", str(run_dir), "--format", "json"], cwd=REPO,
        capture_output=True, text=True, check=True).stdout)
    assert f"goodput {account['goodput']:.1%}" in check.text


@pytest.mark.slow
def test_the_loss_chart_holds_metrics_jsonl_values(finished, browser):
    run_dir, _ = finished
    check = open_report(browser, run_dir / "report.html")
    traces = {t["name"]: t for t in check.data["chart1"]}
    lines = rows(run_dir / "metrics.jsonl")
    train_rows = [r for r in lines if "loss" in r]
    assert traces["train loss"]["x"] == [r["step"] for r in train_rows]
    assert traces["train loss"]["y"] == [r["loss"] for r in train_rows]
    evals = [r for r in lines if "eval/loss" in r]
    assert len(evals) == 3
    assert traces["validation loss"]["y"] == [r["eval/loss"] for r in evals]
    events = rows(run_dir / "events.jsonl")
    assert events[-1]["kind"] == "run_end" and events[-1]["outcome"] == "finished"


def synthetic_run(run_dir: Path, steps: int, spike_at: int) -> list:
    """A run directory of ``steps`` step lines (noisy falling loss, one spike), as a run
    writes them; returns the losses."""
    run_dir.mkdir(parents=True)
    rng, losses, t0 = random.Random(0), [], 1.7e9
    with (run_dir / "metrics.jsonl").open("w") as out:
        for step in range(1, steps + 1):
            loss = 8.0 / (1 + step / 2000) + rng.random() * 0.05 + (5.0 if step == spike_at else 0)
            losses.append(loss)
            out.write(json.dumps({"step": step, "time": t0 + step * 0.5, "loss": loss,
                                  "lr": 3e-4, "grad_norm": 1.0, "step_time": 0.5,
                                  "time/data": 0.01, "time/forward": 0.2,
                                  "time/backward": 0.25, "time/optimizer": 0.04}) + "\n")
    (run_dir / "plan.json").write_text(json.dumps({"train_steps": steps,
                                                   "global_batch_tokens": 4096}))
    return losses


@pytest.mark.slow
def test_a_long_run_keeps_every_extreme_in_a_light_page(tmp_path, browser):
    steps, spike = 50_000, 31_337
    losses = synthetic_run(tmp_path / "long", steps, spike)
    out = subprocess.run([sys.executable, "-m", "launcher.report", str(tmp_path / "long"),
                          "--format", "html"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    page = tmp_path / "long" / "report.html"
    assert out.stdout.strip() == str(page)
    assert page.stat().st_size < 10_000_000
    check = open_report(browser, page)
    assert_self_contained(check)
    loss = next(t for t in check.data["chart1"] if t["name"] == "train loss")
    assert len(loss["x"]) <= 4000
    kept = dict(zip(loss["x"], loss["y"]))
    assert all(losses[step - 1] == value for step, value in kept.items())  # a subset, exact
    low = min(range(steps), key=losses.__getitem__) + 1
    for step in (1, steps, spike, low):
        assert step in kept, step


def _launch(tmp: Path, name: str, *overrides: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO)}
    log = tmp / f"{name}.log"
    args = [sys.executable, "-m", "launcher.train", *TINY, f"run.output_root={tmp}",
            f"run.name={name}", *LONG, *overrides]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log, tmp / name


def _at_step(run_dir: Path, step: int):
    return lambda: (run_dir / "metrics.jsonl").exists() and \
        f'"step": {step},' in (run_dir / "metrics.jsonl").read_text()


def _rank_pid(run_dir: Path, rank: int) -> int:
    return int((run_dir / "logs" / f"rank_{rank}.pid").read_text())


@pytest.fixture(scope="module")
def ended(tmp_path_factory) -> dict:
    """Three real 2-rank runs, each ended another way: rank 1 killed with no restart left
    (failed), restarted once inside the job (finished), SIGTERM to the launcher (stopped)."""
    tmp, out = tmp_path_factory.mktemp("report_outcomes"), {}
    for name, extra, at, how in (
            ("failed", ["resilience.restarts_in_job=0"], 8, "kill_rank"),
            ("restarted", ["trainer.train_steps=14"], 8, "kill_rank"),
            ("stopped", [], 8, "term_launcher")):
        proc, log, run_dir = _launch(tmp, name, *extra)
        wait_for(proc, log, _at_step(run_dir, at))
        if how == "kill_rank":
            os.kill(_rank_pid(run_dir, 1), signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        out[name] = (proc.wait(timeout=240), run_dir, log.read_text())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name, code, shown", [
    ("failed", 137, "failed: failed with exit 137 after step"),
    ("restarted", 0, "finished: finished at step 14"),
    ("stopped", 75, "stopped: stopped for requeue at step")])
def test_each_way_a_run_ends_renders_and_says_so(ended, browser, name, code, shown):
    exit_code, run_dir, log = ended[name]
    assert exit_code == code, log[-3000:]
    assert f"[report] {run_dir / 'report.html'}" in log
    check = open_report(browser, run_dir / "report.html")
    assert_self_contained(check)
    assert shown in check.text, check.text[:600]
    if name == "failed":
        assert "rank 1 died (SIGKILL)" in check.text
    if name == "restarted":
        assert "2: 1 launch(es), 1 in-job restart(s)" in check.text
        timeline = check.data["chart7"]  # attempts on the timeline
        assert [t["name"] for t in timeline][0].startswith("rank 1 died")
        assert [t["y"] for t in timeline] == [["launch 1"], ["launch 1, restart 1"]]
        kinds = {t["name"] for t in check.data["chart8"]}
        assert {"restart", "attempt_end", "checkpoint"} <= kinds
        loss = {t["name"]: t for t in check.data["chart1"]}
        assert loss["train loss"]["x"] == list(range(1, 15))  # each step once, as kept
        redone = loss["thrown away by a restart"]["x"]  # steps after the step-5 checkpoint
        # the steps after the step-5 checkpoint, through the one the kill was sent at (8) or
        # the few a loaded machine logged before the other rank saw it die
        assert redone and redone == list(range(6, redone[-1] + 1)) and 8 <= redone[-1] < 14, \
            redone


def sweep_dir(root: Path) -> Path:
    """A finished three-point sweep over optimizer.lr, as launcher.train -m lays it out."""
    for lr, final in (("0.0001", 3.1), ("0.001", 2.4), ("0.01", 2.9)):
        run = root / f"optimizer.lr={lr}"
        run.mkdir(parents=True)
        lines = [{"step": s, "time": 1.7e9 + s, "loss": 4.0 - s / 10, "step_time": 1.0,
                  "tokens_per_s": 1000.0 + s, "memory_gb": 1.5} for s in range(1, 6)]
        lines += [{"step": 5, "time": 1.7e9 + 5, "eval/loss": final}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def test_a_sweep_report_marks_the_best_point_and_plots_against_the_swept_value(tmp_path,
                                                                               browser):
    sweep = sweep_dir(tmp_path / "lr_sweep")
    text = subprocess.run([sys.executable, "-m", "launcher.report", str(sweep)], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert text[0].split() == ["point", "steps", "train_loss", "final_val_loss",
                               "best_val_loss", "best_val_step", "tokens_per_s",
                               "peak_memory_gb", "goodput", "outcome"]
    assert text[1].split()[:5] == ["optimizer.lr=0.001", "5", "3.5000", "2.4000", "2.4000"]
    subprocess.run([sys.executable, "-m", "launcher.report", str(sweep), "--format", "html"],
                   cwd=REPO, check=True, capture_output=True)
    check = open_report(browser, sweep / "report.html")
    assert_self_contained(check)
    assert "best: optimizer.lr=0.001" in check.text
    curves = check.data["chart1"]
    assert {t["name"] for t in curves} >= {"optimizer.lr=0.0001", "optimizer.lr=0.001",
                                           "optimizer.lr=0.01"}
    against = {t["name"]: t for t in check.data["chart2"]}
    assert against["final validation loss"]["x"] == [0.0001, 0.001, 0.01]
    assert against["final validation loss"]["y"] == [3.1, 2.4, 2.9]
    assert against["best: optimizer.lr=0.001"]["x"] == [0.001]


def test_the_browser_check_fails_on_a_page_that_reaches_out(tmp_path, browser):
    """The helper itself: a page that asks the network for an image is caught."""
    from launcher.html.page import Page, write_page
    import plotly.graph_objects as go

    page = Page("reaches out")
    page.figure(go.Figure([go.Scatter(x=[1, 2], y=[3, 4])]))
    page.raw('<img src="http://127.0.0.1:9/pixel.png">')
    check = open_report(browser, write_page(page, tmp_path / "out.html"))
    with pytest.raises(AssertionError):
        assert_self_contained(check)
    assert "http://127.0.0.1:9/pixel.png" in check.requests


def test_report_refuses_a_directory_that_is_neither(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launcher.report", str(tmp_path), "--format",
                           "html"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "not a run directory" in proc.stderr
    assert "not a sweep directory either" in proc.stderr


def test_the_plan_page_stacks_each_stages_memory_against_the_gpu(tmp_path, browser):
    """plan.format=html for the 16,384-GPU experiment: the memory chart's bars are the plan's
    own numbers for the first, middle and last stage (the most loaded one is plan.json's)."""
    out = tmp_path / "plan.html"
    proc = subprocess.run([sys.executable, "-m", "launcher.plan", "experiment=llama3_70b_16k_h100",
                           "plan.format=html", f"plan.output={out}"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    plan = json.loads(subprocess.run(
        [sys.executable, "-m", "launcher.plan", "experiment=llama3_70b_16k_h100",
         "plan.format=json"], cwd=REPO, capture_output=True, text=True, check=True).stdout)
    check = open_report(browser, out)
    assert_self_contained(check)
    assert "trainwright plan: llama3_70b on 16,384 H100" in check.text
    bars = {t["name"]: t for t in check.data["chart1"]}
    assert set(bars) == {"weights", "grads", "optimizer", "activations"}
    assert bars["weights"]["x"] == ["first stage", "middle stage", "last stage"]
    stage = ["first", "middle", "last"].index(plan["memory_per_gpu"]["stage"])
    total = sum(bars[p]["y"][stage] for p in bars) * 2 ** 30
    assert total == pytest.approx(plan["memory_per_gpu"]["total"], rel=1e-9)
    parts = {t["name"]: t for t in check.data["chart2"]}
    assert sum(next(iter(parts.values()))["x"]) == pytest.approx(
        sum(v for v in plan["step_time_parts"].values() if v > 0))


def test_the_search_page_plots_every_candidate_and_greys_what_does_not_fit(tmp_path, browser):
    out = tmp_path / "search.html"
    proc = subprocess.run([sys.executable, "-m", "launcher.search", "experiment=llama3_8b_1x8_h100",
                           "search.format=html", f"plan.output={out}"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(subprocess.run(
        [sys.executable, "-m", "launcher.search", "experiment=llama3_8b_1x8_h100",
         "search.format=json"], cwd=REPO, capture_output=True, text=True, check=True).stdout)
    check = open_report(browser, out)
    assert_self_contained(check)
    traces = {t["name"].split(" (")[0]: t for t in check.data["chart1"]}
    fitting = sum(len(t["x"]) for name, t in traces.items()
                  if name not in ("excluded: memory", "best 10"))
    assert fitting == listed["valid"]
    grey = traces["excluded: memory"]
    assert grey["x"] and all(x < 0.1 for x in grey["x"])  # less headroom than search.headroom
    assert all("GiB per GPU, over the" in text for text in grey["hovertext"])
    assert f"{listed['searched']:,} layouts searched" in check.text


@pytest.mark.slow
def test_downstream_task_scores_are_drawn_against_tokens_once_per_step(tmp_path, browser):
    """Task lines of metrics.jsonl (a resumed run scored step 20 twice: the later counts)."""
    run_dir = tmp_path / "tasks"
    synthetic_run(run_dir, 40, spike_at=0)
    scores = [(10, 0.25, 5.1), (20, 0.30, 4.9), (20, 0.35, 4.8), (40, 0.5, 4.2)]
    with (run_dir / "metrics.jsonl").open("a") as out:
        for step, acc, bpb in scores:
            out.write(json.dumps({"step": step, "eval/tw_facts/acc": acc,
                                  "eval/tw_facts/examples": 32.0,
                                  "eval/tw_paragraphs/bits_per_byte": bpb,
                                  "eval/tokens": step * 4096}) + "\n")
    out = subprocess.run([sys.executable, "-m", "launcher.report", str(run_dir), "--format",
                          "html"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    check = open_report(browser, run_dir / "report.html")
    assert_self_contained(check)
    assert "Downstream tasks" in check.text
    by_name = {t["name"]: t for traces in check.data.values() for t in traces}
    assert by_name["acc"]["x"] == [10 * 4096, 20 * 4096, 40 * 4096]
    assert by_name["acc"]["y"] == [0.25, 0.35, 0.5]
    assert by_name["bits_per_byte"]["y"] == [5.1, 4.8, 4.2]
    assert "examples" not in by_name
