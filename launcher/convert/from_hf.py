"""``launcher.convert from_hf``: a Hugging Face model -> a trainwright checkpoint at a layout.

Every rank of the requested layout (``parallelism.*``, ``engine=``, ``cluster.*``) builds its
engine exactly as ``launcher.train`` does with ``trainer.init_from=<hf dir>`` (each rank reads
only its own slices of the HF tensors), then writes step 0 through the engine's checkpoint IO:
``<out>/checkpoints/step_0`` with a fresh optimizer and the model in ``trainwright.json``, and the
model's tokenizer (with its chat template) in ``step_0/tokenizer/``, so that launcher.evaluate
and launcher.generate on the result need no tokenizer setting. The
result resumes (``run.name``/``trainer.load``) or seeds runs (``trainer.init_from=<out>``).

The ranks write into ``<out>.partial`` (logs included), renamed to ``<out>`` once step 0 is
complete: an import that fails or is stopped (a stop signal ends it before the save, exit
128 + N) leaves no ``<out>``; the next import removes the ``.partial`` debris.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Sequence

from launcher.convert import RANK_MODULES_BY_COMMAND
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.launch.bootstrap import Rank, run_ranks
from launcher.launch.job import prepare
from launcher.launch.rank_preload import preload_rank_imports
from launcher.parallel.distributed import in_distributed_launch, launch_rank

RANK_MODULES = RANK_MODULES_BY_COMMAND["from_hf"]
"""What a rank of this command imports, imported for it before it starts (see there)."""


def run_import(hf: str, out: str, overrides: Sequence[str]) -> int:
    """Compose and plan the layout, refuse a non-empty ``out``, run the import on its ranks."""
    preload_rank_imports(RANK_MODULES)
    target = Path(out).resolve()
    if target.exists() and any(target.iterdir()):
        print(f"from_hf: out={out} exists and is not empty; choose a new directory",
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    partial = target.with_name(target.name + ".partial")
    argv = [*overrides, f"trainer.init_from={Path(hf).resolve()}",
            f"run.output_root={target.parent}", f"run.name={target.name}",
            "trainer.train_steps=1", "optimizer.warmup_steps=0", "logger=none"]
    job = prepare(argv, weights_key="trainer.init_from", run_dir=partial)
    if not in_distributed_launch():
        shutil.rmtree(partial, ignore_errors=True)  # an earlier import's debris
    code = run_ranks(job, import_rank, command="from_hf")
    if code == 0 and launch_rank() == 0:
        if target.exists():
            target.rmdir()  # empty (checked above)
        partial.rename(target)
    return code


def import_rank(rank: Rank) -> int:
    """One rank of the import: build the engine with the HF weights and save step 0 (unless a
    stop signal came first)."""
    from launcher.engines import engine_inputs, spec
    from launcher.engines.weights.sources import tokenizer_files
    from launcher.runtime import resume as resume_safety
    from launcher.runtime.checkpoint import CheckpointManager
    from launcher.runtime.rundir import redact

    job, plan = rank.job, rank.job.plan
    engine = spec(job.cfg.engine.name).build(batch=plan.batch, model=job.cfg.model,
                                             **engine_inputs(job.cfg))
    if rank.stop.agree():
        rank.console.error(f"from_hf: stopped by signal {rank.stop.signal_received} before "
                           f"the save; nothing written to {job.run_dir.with_suffix('')}")
        return rank.stopped_exit()
    manager = CheckpointManager(job.run_dir / "checkpoints", engine.checkpoint_io, keep_last=0,
                                final_step=0, record=resume_safety.run_record(job.cfg, plan))
    manager.save(0, consumed_samples=0, config=redact(job.config), plan=plan.to_dict(),
                 background=False, files=tokenizer_files(Path(job.cfg.trainer.init_from)))
    return 0
