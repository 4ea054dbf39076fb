"""``launcher.convert reshard``: a checkpoint whose optimizer state loads only at its own layout
-> a copy that loads at any TP/PP/VPP/CP/EP/DP.

engine=megatron saves the distributed optimizer's state as ``dp_reshardable`` by default: each
rank writes its shard as it holds it, at disk speed, and a resume may change only DP. To resume
at another layout, convert the checkpoint once: the ranks of the checkpoint's own model-parallel
layout (TP x PP x CP, with the smallest data-parallel size whose plan fits, unless ``cluster.*``
says otherwise) build its model and optimizer from the config saved in the checkpoint, load it,
and write the same step as ``fully_reshardable`` into ``<out>/checkpoints/step_<N>``, with the
original metadata and every rank's RNG file. The new layout then resumes with
``trainer.load=<out>``.

The ranks write into ``<out>.partial``, renamed to ``<out>`` only once the step is complete; a
conversion that fails or is stopped leaves no ``<out>``.
"""

from __future__ import annotations

import functools
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from launcher.compose import to_object
from launcher.convert import RANK_MODULES_BY_COMMAND
from launcher.core.checkpoints import read_meta, resume_point
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.launch.bootstrap import Rank, run_ranks
from launcher.launch.job import Job, compose, planned_job, with_saved_training
from launcher.launch.rank_preload import preload_rank_imports
from launcher.parallel.distributed import in_distributed_launch, launch_rank
from launcher.plan import PlanError, compute_plan

TARGET_FORMAT = "fully_reshardable"
"""The optimizer format a conversion writes (Megatron-Core's model-space layout)."""

CONVERSION_CHANGES = {"engine": {"optimizer_checkpoint": TARGET_FORMAT},
                      "trainer": {"load": "", "init_from": "", "async_save": False}}
"""What a conversion changes in the checkpoint's training config."""


class NothingToConvert(Exception):
    """The checkpoint already loads at any layout; the message says why."""


RANK_MODULES = RANK_MODULES_BY_COMMAND["reshard"]
"""What a rank of this command imports, imported for it before it starts (see there)."""


def saved_optimizer_format(step_dir: Path) -> dict:
    """The content metadata of ``step_dir``'s Megatron-Core checkpoint; ValueError naming what
    makes it unconvertible, NothingToConvert when it needs no conversion."""
    from megatron.core import dist_checkpointing

    from launcher.engines import compat

    if not (step_dir / "megatron").is_dir():
        raise ValueError(f"{step_dir} is not an engine=megatron checkpoint (no megatron/); "
                         "DeepSpeed checkpoints cannot change TP/PP at resume, start a new run "
                         f"from its weights with trainer.init_from={step_dir}")
    with compat.checkpoint_loads_without_code():
        saved = dist_checkpointing.load_content_metadata(str(step_dir / "megatron")) or {}
    sharding = saved.get("distrib_optim_sharding_type")
    if sharding != "dp_reshardable":
        raise NothingToConvert(
            f"{step_dir} already loads at any layout (optimizer state: "
            f"{sharding or 'model space, plain optimizer'}); resume it with the new layout and "
            f"trainer.load={step_dir}")
    return saved


def _user_sets_world(argv: Sequence[str]) -> bool:
    return any(a.split("=", 1)[0] in ("cluster.nodes", "cluster.gpus_per_node",
                                      "cluster.ranks_per_gpu") for a in argv)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def conversion_job(step_dir: Path, saved: dict, argv: Sequence[str], run_dir: Path) -> Job:
    """The job that converts ``step_dir``: its saved training config at its saved model-parallel
    layout, on ``argv``'s cluster; without a world size there, the smallest data-parallel size
    (a divisor of the saved one) whose plan fits on one node. Exit 2 when none does."""
    config, layout = read_meta(step_dir).get("config") or {}, saved.get("layout", {})
    if not config:
        print(f"reshard: {step_dir / 'trainwright.json'} holds no config to rebuild the run "
              "from", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
    model_parallel = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    sizes = [None] if _user_sets_world(argv) or in_distributed_launch() \
        else _divisors(int(layout.get("dp", 1)))
    problems: Optional[PlanError] = None
    for dp in sizes:
        world = [] if dp is None else ["cluster.nodes=1",
                                       f"cluster.gpus_per_node={model_parallel * dp}"]
        overrides, raw = compose([*argv, *world, "logger=none"])
        raw = with_saved_training(raw, config, CONVERSION_CHANGES)
        try:
            if dp is not None:
                compute_plan(to_object(raw), model_parallel * dp)
        except PlanError as exc:
            problems = exc
            continue
        return planned_job(overrides, raw, run_dir=run_dir, check_data=False)
    print(f"reshard: no data-parallel size of the saved layout ({', '.join(map(str, sizes))}) "
          f"plans on one node of this cluster:\n{problems}\nSet cluster.nodes and "
          "cluster.gpus_per_node (a multiple of TP x PP x CP = "
          f"{model_parallel}) and launch it under srun or torchrun", file=sys.stderr)
    raise SystemExit(CONFIG_ERROR_EXIT)


def run_reshard(checkpoint: str, out: str, argv: Sequence[str]) -> int:
    """Convert the checkpoint at ``checkpoint`` (a run, checkpoints or step directory) into
    ``out`` (a new directory); the exit code."""
    from launcher.core.errors import CheckpointError
    from launcher.engines.weights.sources import SourceError, step_dir_of

    preload_rank_imports(RANK_MODULES)
    target = Path(out).resolve()
    if target.exists() and any(target.iterdir()):
        print(f"reshard: out={out} exists and is not empty; choose a new directory",
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        step_dir = step_dir_of(Path(checkpoint))
        resume_point(step_dir)  # complete, readable metadata
        saved = saved_optimizer_format(step_dir)
    except NothingToConvert as exc:
        print(f"reshard: nothing to convert: {exc}", file=sys.stderr)
        return 0
    except (SourceError, CheckpointError, ValueError, OSError) as exc:
        print(f"reshard: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    partial = target.with_name(target.name + ".partial")
    job = conversion_job(step_dir, saved, argv, partial)
    if not in_distributed_launch():
        shutil.rmtree(partial, ignore_errors=True)  # an earlier conversion's debris
    code = run_ranks(job, functools.partial(reshard_rank, source=str(step_dir)),
                     command="reshard")
    if code == 0 and launch_rank() == 0:
        if target.exists():
            target.rmdir()  # empty (checked above)
        partial.rename(target)
    return code


def reshard_rank(rank: Rank, source: str) -> int:
    """One rank of the conversion: build the saved run's engine, load ``source``, save the same
    step in the model-space format, then (rank 0) add the RNG files of ranks this world lacks."""
    from launcher.engines import engine_inputs, spec
    from launcher.parallel import collectives
    from launcher.runtime.checkpoint import CheckpointManager
    from launcher.runtime.resume import saved_record

    job, step_dir = rank.job, Path(source)
    engine = spec(job.cfg.engine.name).build(batch=job.plan.batch, model=job.cfg.model,
                                             **engine_inputs(job.cfg))
    resume, meta = resume_point(step_dir), read_meta(step_dir)
    say = (lambda kind, message, **_: rank.console.error(f"reshard: {message}")) \
        if rank.rank == 0 else None
    manager = CheckpointManager(job.run_dir / "checkpoints", engine.checkpoint_io, keep_last=0,
                                final_step=resume.step, record=saved_record(meta), report=say)
    manager.load(resume)
    if rank.stop.agree():
        rank.console.error(f"reshard: stopped by signal {rank.stop.signal_received} before "
                           f"the save; nothing written to {job.run_dir.with_suffix('')}")
        return rank.stopped_exit()
    final = manager.save(resume.step, consumed_samples=resume.consumed_samples,
                         config=meta["config"], plan=meta["plan"], background=False)
    if collectives.rank() == 0:
        for rng in sorted((step_dir / "rng").glob("rank_*.pt")):
            if not (final / "rng" / rng.name).exists():
                shutil.copy2(rng, final / "rng" / rng.name)
        target = job.run_dir.with_name(job.run_dir.name.removesuffix(".partial"))
        rank.console.error(f"reshard: {step_dir} converted to {TARGET_FORMAT} in {target}; "
                           f"resume at any layout with trainer.load={target}")
    collectives.barrier()
    return 0
