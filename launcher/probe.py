"""``python -m launcher.probe [overrides]``: measure this machine for the composed job.

parse and plan once (the job ``launcher.train`` would run with the same overrides) -> start its
ranks (:func:`launcher.launch.bootstrap.run_ranks`) -> every rank measures at once
(:mod:`launcher.runtime.probe`: passes at every tensor-parallel size the node allows,
AdamW, the collectives at the job's sizes, the engine at the job's layout) -> rank 0 merges the
figures into this machine's profile (:mod:`launcher.plan.profile`), where the plan and the
search find them again, and prints where -> then a two-step launch of the same job in a scratch
directory measures start-up and exit (:func:`short_launch`; one node). Takes well under a
minute on 2 CPU ranks.

``python -m launcher.probe --from-run RUN_DIR`` refines the stored profile from a finished
run's own measurements instead (its median step time becomes the engine figure of its layout).
Exit codes: 0 written, 2 config error.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.launch.bootstrap import Rank, run_ranks
from launcher.launch.job import prepare


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if argv and argv[0] == "--from-run":
        return from_run(Path(argv[1]) if len(argv) > 1 else None, argv[2:])
    job = prepare(argv)
    others = other_engine_configs(argv, job.cfg)
    code = run_ranks(job, functools.partial(probe_rank, others=others), command="probe")
    if code == 0 and job.cfg.cluster.nodes == 1:
        short_launch(argv, job)
    return code


SHORT_LAUNCH = ("trainer.train_steps=2", "trainer.save_interval=0", "trainer.eval_interval=0",
                "eval.tasks=[]", "logger=none", "run.report=false", "trainer.load=",
                "trainer.checkpoint_uri=", "plan.calibrate=false")
"""The job as a two-step run (one save at the end, no evaluation, no logger): what a launch
costs before its first step and after its last, whatever the job's own settings."""


def short_launch(argv: Sequence[str], job) -> None:
    """Start-up and exit of this job measured by a short real launch (:data:`SHORT_LAUNCH`) in
    a scratch run directory, stored as the profile's ``launch`` figures (as ``--from-run``
    stores a finished run's): the plan's goodput then prices them measured, not assumed. A
    launch that fails costs a line, never the probe."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="trainwright-probe-launch-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "launcher.train", *argv, *SHORT_LAUNCH,
                               f"run.output_root={tmp}", "run.name=launch"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        figures = launch_figures(Path(tmp) / "launch") if proc.returncode == 0 else {}
        if not figures:
            print(f"probe: the short launch that measures start-up and exit failed (exit "
                  f"{proc.returncode}); start-up and exit stay assumed:\n"
                  f"{proc.stderr[-1500:]}", file=sys.stderr)
            return
        figures["launch"]["run"] = "a two-step launch of launcher.probe"
        path = store(job, figures, "probe")
        launch = figures["launch"]
        print(f"probe: {path} (start-up {launch['startup_s']:.1f} s, exit "
              f"{launch['exit_s']:.1f} s: a two-step launch of this job)", file=sys.stderr)


def other_engine_configs(argv: Sequence[str], cfg) -> list:
    """The job (``cfg``, resolved) with each other registered engine's group (composed from
    ``argv`` with ``engine=<name>``), at the job's ZeRO stage or else at 1, the first that
    engine's plan accepts (Megatron-Core has no ZeRO-2/3); an engine whose rules refuse the
    job's layout at both (DeepSpeed with pipeline, context or expert parallelism) is left out.
    The probe times their framework too, so that one probe plans every engine."""
    from launcher.compose import compose_config, to_object
    from launcher.engines import REGISTRY
    from launcher.plan import PlanError, compute_plan

    out = []
    for name in (n for n in REGISTRY if n != cfg.engine.name):
        engine = to_object(compose_config([*argv, f"engine={name}"])).engine
        for stage in dict.fromkeys((cfg.parallelism.zero_stage, 1)):
            other = dataclasses.replace(cfg, engine=engine, parallelism=dataclasses.replace(
                cfg.parallelism, zero_stage=stage))
            try:
                compute_plan(other)
            except PlanError:
                continue
            out.append(other)
            break
    return out


def probe_rank(rank: Rank, others: Sequence = ()) -> int:
    """Every rank measures (launcher.runtime.probe); rank 0 stores the profile. ``others``: the
    job's config with each other engine (:func:`other_engine_configs`), also timed."""
    from launcher.engines import engine_inputs, spec
    from launcher.engines.model import reset_parallel_state
    from launcher.config import ParallelismConfig
    from launcher.runtime import probe

    job, started = rank.job, time.perf_counter()
    cfg, plan = job.cfg, job.plan
    b = plan.batch.micro_batch_size
    reset_parallel_state(ParallelismConfig(zero_stage=0), seed=cfg.trainer.seed)  # TP = 1
    figures = {"passes": probe.pass_records(cfg, local_ranks=job.local_ranks,
                                            micro_batches=probe.pass_micro_batches(b))}
    figures["optimizer"] = probe.optimizer_records(*optimizer_size(plan))
    figures["collectives"] = probe.collective_records(
        collective_sizes(plan), 2 if cfg.trainer.precision in ("bf16", "fp16") else 4,
        rank.world)
    reset_parallel_state(cfg.parallelism, seed=cfg.trainer.seed)  # the job's layout again
    engine_spec, subs = spec(cfg.engine.name), engine_inputs(cfg)
    figures["engine"] = probe.engine_records(
        cfg, plan, job.config,
        lambda model, batch: engine_spec.build(batch=batch, model=model, **subs))
    for other in others:
        reset_parallel_state(other.parallelism, seed=cfg.trainer.seed)
        other_spec, other_subs = spec(other.engine.name), engine_inputs(other)
        figures["engine"] += probe.other_engine_records(
            cfg, plan, job.config,
            lambda model, batch: other_spec.build(batch=batch, model=model, **other_subs),
            other.engine.name.value, other.parallelism.zero_stage)
    if rank.rank == 0:
        path = store(job, figures, "probe")
        rank.console.error(f"probe: {path} ({time.perf_counter() - started:.1f} s of "
                           f"measurements on {rank.world} rank(s))")
    return 0


def optimizer_size(plan) -> tuple[int, int]:
    """(parameters, tensors) of the most loaded rank's optimizer shard."""
    sharded = plan.zero_stage >= 1
    shards = plan.dims.dense_shards if sharded else 1
    layers = max(plan.stage_layers) if plan.stage_layers else plan.model.layers
    return max(1, plan.params.per_gpu // shards), 9 * layers + 4


def collective_sizes(plan) -> dict:
    """Elements a layout sends: a micro-batch's activations, the most loaded rank's
    gradients."""
    b = plan.batch
    return {"activations": b.micro_batch_tokens * plan.model.hidden,
            "gradients": plan.params.per_gpu}


def machine_identity(job, device_model: str = ""):
    """The profile identity of this node for ``job``."""
    from launcher.plan.machine import cpu_info, library_versions
    from launcher.plan.profile import MachineProfile

    device = job.plan.machines.gpu
    if not device_model:
        device_model = cpu_info().model if device == "cpu" else _gpu_name()
    return MachineProfile(device=device, model=device_model, ranks=job.local_ranks,
                          threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", "1") or 1),
                          versions=library_versions())


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


def store(job, figures: dict, source: str) -> Path:
    """Merge ``figures`` into this machine's profile; its path."""
    from launcher.plan.profile import profile_dir, save_figures

    return save_figures(profile_dir(job.cfg.plan.profile_dir), machine_identity(job), figures,
                        source)


def from_run(run_dir: Path | None, overrides: Sequence[str]) -> int:
    """``--from-run RUN_DIR``: the run's median step time (warm-up, saves and evaluations left
    out) as the engine figure of its model and layout, on this machine's profile."""
    import json

    import yaml

    from launcher.core.jsonl import read_jsonl
    from launcher.reports.plan_check import measured_step_s
    from launcher.plan.calibrated import engine_key

    files = [run_dir / name for name in ("config.yaml", "plan.json")] if run_dir else []
    if not files or not all(f.is_file() for f in files):
        print(f"probe: --from-run needs a run directory with config.yaml and plan.json "
              f"(got {run_dir})", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    step = measured_step_s(read_jsonl(run_dir / "metrics.jsonl"))
    if step is None:
        print(f"probe: {run_dir} has fewer than two steps to measure", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    config, plan = yaml.safe_load(files[0].read_text()), json.loads(files[1].read_text())
    record = {"key": engine_key(plan, config), "layers": config["model"]["num_layers"],
              "seconds": step, "run": str(run_dir)}
    figures = {"engine": [record], **launch_figures(run_dir)}
    from launcher.plan.profile import profile_dir, save_figures

    path = save_figures(profile_dir((config.get("plan") or {}).get("profile_dir", "")),
                        run_identity(plan, config), figures, f"run {run_dir}")
    launch = figures.get("launch", {})
    print(f"probe: {path} (step {step:.3f} s" + (
        f", start-up {launch['startup_s']:.1f} s, exit {launch['exit_s']:.1f} s"
        if launch else "") + f" from {run_dir})")
    return 0


def launch_figures(run_dir: Path) -> dict:
    """{"launch": {startup_s, exit_s}} of a finished run's first launch, as its goodput account
    (:func:`launcher.runtime.goodput.account`) counts them, so that the plan's goodput and the
    measured one share one definition: the attempt's start to its first step, and the last
    step to exit less the final save; {} when the run did not end normally."""
    from launcher.core.jsonl import read_jsonl
    from launcher.runtime.goodput import account

    events = read_jsonl(run_dir / "events.jsonl")
    saves = [e for e in events if e.get("kind") == "checkpoint" and "seconds" in e
             and " saved" in e.get("message", "")]
    lost = account(run_dir)["lost_s"]
    if lost["startup"] <= 0 or not saves or lost["shutdown"] <= 0:
        return {}
    return {"launch": {"startup_s": lost["startup"],
                       "exit_s": max(0.0, lost["shutdown"] - saves[-1]["seconds"]),
                       "run": str(run_dir)}}


def run_identity(plan: dict, config: dict):
    """The profile identity of the machine a finished run ran on (this one)."""
    from launcher.plan.machine import cpu_info, library_versions
    from launcher.plan.profile import MachineProfile

    device = plan["gpu"]
    return MachineProfile(device=device, model=cpu_info().model if device == "cpu"
                          else _gpu_name(), ranks=plan["gpus_per_node"] * plan["ranks_per_gpu"],
                          threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", "1") or 1),
                          versions=library_versions())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
