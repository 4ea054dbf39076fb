"""``launcher.convert from_hf``: a Hugging Face model -> a trainwright checkpoint at a layout.

Every process of the requested layout (``parallelism.*``, ``engine=``, ``cluster.*``) builds its
engine exactly as ``launcher.train`` does with ``trainer.init_from=<hf dir>`` (each rank reads
only its own slices of the HF tensors), then writes step 0 through the engine's checkpoint IO:
``<out>/checkpoints/step_0`` with a fresh optimizer and the model in ``trainwright.json``. The
result resumes (``run.name``/``trainer.load``) or seeds runs (``trainer.init_from=<out>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def import_worker(argv: Sequence[str]) -> int:
    """One process of the conversion: build the engine with the HF weights and save step 0."""
    from launcher.engines import spec
    from launcher.parallel.distributed import destroy_distributed
    from launcher.runtime import checkpoint
    from launcher.runtime import resume as resume_safety
    from launcher.runtime.rundir import redact, to_plain
    from launcher.train import _engine_configs, start_worker

    w = start_worker(argv)
    try:
        cfg = w.cfg
        subs = _engine_configs(cfg)
        engine = spec(cfg.engine.name).build(w.plan, model=cfg.model, **subs)
        record = resume_safety.run_record(cfg, w.plan)
        manager = checkpoint.CheckpointManager(w.run_dir / "checkpoints", engine.checkpoint_io,
                                               keep_last=0, final_step=0, record=record)
        config = redact(to_plain(w.raw))
        manager.save(0, consumed_samples=0, config=config, plan=w.plan.to_dict(),
                     background=False)
        return 0
    finally:
        destroy_distributed()


def _entry(argv: list) -> None:
    code = import_worker(argv)
    if code:
        raise SystemExit(code)


def run_import(hf: str, out: str, overrides: Sequence[str]) -> int:
    """Compose the layout, check it, refuse a non-empty ``out``, and run the import world."""
    import sys
    import uuid

    from launcher.compose import compose_or_exit, to_object
    from launcher.convert.model_source import adopt_model
    from launcher.core.exits import CONFIG_ERROR_EXIT
    from launcher.launch.local import launch_local_world
    from launcher.plan import plan_or_exit

    target = Path(out).resolve()
    if target.exists() and any(target.iterdir()):
        print(f"from_hf: out={out} exists and is not empty; choose a new directory",
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    argv = [*overrides, f"trainer.init_from={Path(hf).resolve()}",
            f"run.output_root={target.parent}", f"run.name={target.name}",
            "trainer.train_steps=1", "optimizer.warmup_steps=0", "logger=none"]
    argv = adopt_model(argv, "trainer.init_from", str(Path(hf).resolve()))
    cfg = to_object(compose_or_exit(argv))
    plan_or_exit(cfg)
    nprocs = cfg.cluster.gpus_per_node * cfg.cluster.ranks_per_gpu
    if nprocs == 1:
        return import_worker(argv)
    launch_local_world(_entry, (argv,), nprocs, run_id=f"tw-{uuid.uuid4().hex[:8]}",
                       stop_signal=cfg.trainer.stop_signal)
    return 0



